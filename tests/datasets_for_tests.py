"""Datasets used by the tests (module level, so spawn and forkserver workers can import them)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def vec(i, n=3):
    return np.full((n,), float(i), dtype=np.float32)


class AddDataset(torch.utils.data.Dataset):
    def __init__(self, proxy, n=32):
        self.proxy, self.n = proxy, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s, d = self.proxy(vec(i), vec(1))
        return s, d, i


class TwoServerDataset(torch.utils.data.Dataset):
    """Each sample goes through two servers; the double server is called twice (two views)."""

    def __init__(self, add_proxy, double_proxy, n=32):
        self.add, self.double, self.n = add_proxy, double_proxy, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s, _ = self.add(vec(i), vec(1))
        return {"sum": s, "view1": self.double(vec(i)), "view2": self.double(vec(i + 1000)),
                "label": i}


class VarLenDataset(torch.utils.data.Dataset):
    def __init__(self, proxy, n=16):
        self.proxy, self.n = proxy, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.proxy(vec(i, n=1 + i % 5)), i


class ShuffledStream(torch.utils.data.IterableDataset):
    """Calls the proxy, then shuffles and drops samples (like a WebDataset shuffle buffer)."""

    def __init__(self, proxy, n=40, seed=0):
        self.proxy, self.n, self.seed = proxy, n, seed

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        rng = random.Random(self.seed + wid)
        buffer = []
        for i in range(wid, self.n, nw):
            buffer.append((self.proxy(vec(i)), i))
            if len(buffer) >= 6:
                yield buffer.pop(rng.randrange(len(buffer)))
                if rng.random() < 0.3:
                    buffer.pop(rng.randrange(len(buffer)))  # dropped after the proxy call
        rng.shuffle(buffer)
        yield from buffer


class NoisyDataset(torch.utils.data.Dataset):
    def __init__(self, proxy, n=32):
        self.proxy, self.n = proxy, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.proxy(vec(i, 1)), i


class DyingDataset(torch.utils.data.Dataset):
    def __init__(self, proxy, die_at=5):
        self.proxy, self.die_at = proxy, die_at

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == self.die_at:
            os._exit(3)
        return self.proxy(vec(i)), i


class BytesDataset(torch.utils.data.Dataset):
    def __init__(self, proxy, items):
        self.proxy, self.items = proxy, items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        import mmproxy

        with mmproxy.sample_key(f"sample-{i:03d}"):
            return self.proxy(np.frombuffer(self.items[i], np.uint8)), i
