"""Soak: many epochs with early breaks and server restarts; fails if memory, fds or threads grow.

Run: python benchmarks/soak.py --epochs 200
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch
from nvidia.dali import fn, pipeline_def

import mmproxy


@pipeline_def
def double():
    return fn.external_source(name="x", no_copy=True) * 2


class Data(torch.utils.data.Dataset):
    def __init__(self, proxy, n):
        self.proxy, self.n = proxy, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.proxy(np.full((1024,), i, np.float32)), i


def state():
    me = psutil.Process()
    return {"rss_mb": me.memory_info().rss / 2**20, "fds": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(), "shm": len(list(Path("/dev/shm").iterdir()))}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rss-bound-mb", type=float, default=50)
    args = parser.parse_args()
    server = mmproxy.DALIServer(double(batch_size=16, num_threads=1, device_id=None), name="soak")
    server.start_thread()
    loader = mmproxy.DataLoader(server, Data(server.proxy, 256), batch_size=16,
                                num_workers=args.workers, persistent_workers=True)
    first = None
    start = time.perf_counter()
    for epoch in range(args.epochs):
        for k, (x, i) in enumerate(loader):
            if not torch.equal(x[:, 0], i.float() * 2):
                print(f"epoch {epoch}: a batch was paired with other inputs")
                return 1
            if epoch % 2 and k == 3:
                break
        if epoch % 50 == 49:  # restart the server now and then
            server.stop_thread()
            server.start_thread()
        if epoch % 10 == 9:
            gc.collect()
            now = state()
            first = first or now
            print(f"epoch {epoch + 1}: {now}  ({time.perf_counter() - start:.0f} s)", flush=True)
            if (now["rss_mb"] - first["rss_mb"] > args.rss_bound_mb or now["fds"] > first["fds"] + 4
                    or now["threads"] > first["threads"] or now["shm"] > first["shm"]):
                print(f"soak: growth past the bounds: first {first}, now {now}")
                return 1
    server.stop_thread()
    print("soak: flat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
