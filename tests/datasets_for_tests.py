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


# -- exact inputs (tests/test_exact_inputs.py) -----------------------------------------------------


def grid(i, shape, dtype):
    """Small values exact in every dtype (negative for signed ones), different for every i."""
    dtype = np.dtype(dtype)
    v = (np.arange(int(np.prod(shape))) * 3 + i) % 11 - 5
    if dtype.kind == "f":
        v = v * 0.75
    elif dtype.kind == "u":
        v = v + 5
    elif dtype.kind == "b":
        v = v > 0
    return v.reshape(shape).astype(dtype)


def read_only(a):
    a.flags.writeable = False
    return a


# What sample i passes to the proxy, by case; built in the worker (pickling a view for spawn would
# hand the worker a contiguous copy instead).
EXACT_CASES = {
    "0-d": lambda i: np.array(i * 0.5, np.float32),
    "shape (0,)": lambda i: np.zeros((0,), np.float32),
    "shape (3, 0)": lambda i: np.zeros((3, 0), np.int16),
    "shape (2, 3, 4)": lambda i: grid(i, (2, 3, 4), np.float32),
    **{f"dtype {d}": (lambda i, d=d: grid(i, (2, 3), d))
       for d in ("uint8", "int16", "float16", "float32", "float64", "int64", "bool")},
    "big-endian >f4": lambda i: grid(i, (2, 3), ">f4"),
    "big-endian >i2": lambda i: grid(i, (5,), ">i2"),
    "big-endian >f8 0-d": lambda i: np.array(i * 0.25, ">f8"),
    "strided a[::2]": lambda i: grid(i, (6, 5), np.float32)[::2],
    "transposed": lambda i: grid(i, (3, 5), np.int16).T,
    "Fortran order": lambda i: np.asfortranarray(grid(i, (3, 4, 2), np.float64)),
    "negative strides": lambda i: grid(i, (4, 6), np.float32)[::-1, ::-2],
    "big-endian transposed": lambda i: grid(i, (2, 3), ">i8").T,
    "read-only": lambda i: read_only(grid(i, (2, 3), np.uint8)),
    "memoryview of float32 (2, 3)": lambda i: memoryview(grid(i, (2, 3), np.float32)),
    "strided memoryview of bytes": lambda i: memoryview(bytes(range(i, i + 12)))[::3],
    "bytes": lambda i: bytes(range(i, i + 5)),
    "empty bytes": lambda i: b"",
    "bytearray": lambda i: bytearray(range(i, i + 5)),
    "str": lambda i: f"\u00e9-{i:02d}",
    "0-d tensor": lambda i: torch.tensor(float(i)),
    "transposed tensor": lambda i: torch.from_numpy(grid(i, (3, 2), np.float32)).T,
}


class ExactInputs(torch.utils.data.Dataset):
    """Sample i: the proxy's outputs for the inputs of ``cases`` (one per pipeline input), and i."""

    def __init__(self, proxy, cases, n=16):
        self.proxy, self.cases, self.n = proxy, list(cases), n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.proxy(*[EXACT_CASES[c](i) for c in self.cases]), i


class ImageAndLabel:
    """A webdataset map stage: the sample's PNG through the proxy, with its label (or alone)."""

    def __init__(self, proxy, bare=False):
        self.proxy, self.bare = proxy, bare

    def __call__(self, sample):
        image = self.proxy(sample["png"])
        return image if self.bare else (image, int(sample["cls"]))
