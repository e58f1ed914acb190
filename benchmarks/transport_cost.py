"""The transport's CPU per run: a worker packing a run of the bench's samples (their addresses
found among the registered shard mappings, the header written to a memfd) and the server
unpacking it (the shards' mappings found again, one view per sample), in shard order or drawn
from every shard (shuffled), as a shuffle buffer spanning many shards gives them.

    python benchmarks/transport_cost.py --kind audio --samples 4096     # runs of 64 clips
    python benchmarks/transport_cost.py --kind image --samples 2048 --batch 64

Uses the bench's shards under ``--data-dir`` (written once); one process, no server running (the
unpacking is the listener's :func:`mmproxy._wire.transport.unpack`, timed apart from the receive).

With ``--handover`` it measures the other way a batch travels: the main process's CPU to take a
DataLoader worker's batch holding one tensor (a batch's labels: ``--batch`` int64) as torch hands
it over (shared memory) and as an mmproxy worker does (inline, :func:`inline_small_tensors`).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import random
import time
from collections.abc import Iterator

import _harness  # this script's folder is on the path
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["audio", "image"], default="audio")
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64, help="samples a run (at most 64)")
    parser.add_argument("--data-dir", default="/tmp/bench")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the best is reported")
    parser.add_argument("--handover", action="store_true", help="time a worker's batch of "
                        "labels reaching the main process instead")
    a = parser.parse_args()
    if a.handover:
        for inline in (False, True):
            print(f"a worker's batch of {a.batch} labels, "
                  f"{'inline' if inline else 'as torch hands it over'}: "
                  f"{_handover(a.batch, inline) * 1e6:.0f} us of the main process's CPU", flush=True)
        return

    from mmproxy._wire import transport as _transport
    from mmproxy.apps.bench.shards import write_shards

    ext = "wav" if a.kind == "audio" else "jpg"
    paths = write_shards(a.data_dir, a.kind, a.samples, 15)
    samples = _harness.mapped_samples(paths, ext)
    shuffled = random.Random(0).sample(samples, len(samples))
    gc.collect()
    gc.freeze()
    for order, items in (("in shard order", samples), ("shuffled", shuffled)):
        runs = [items[k:k + a.batch] for k in range(0, len(items), a.batch)]
        best_pack = best_unpack = float("inf")
        files = 0
        for _ in range(a.repeat):
            start, packed = time.perf_counter(), []
            for k, run in enumerate(runs):
                fd, fds = _transport.pack(f"run{k}", None, [None] * len(run), [run])
                packed.append([fd, *(os.dup(f) for f in fds)])  # as the server receives them
            best_pack = min(best_pack, (time.perf_counter() - start) / len(runs))
            files = sum(len(p) - 1 for p in packed) / len(runs)
            start = time.perf_counter()
            requests = [_transport.unpack(fds) for fds in packed]
            best_unpack = min(best_unpack, (time.perf_counter() - start) / len(runs))
            del requests
            for fds in packed:
                for fd in fds:
                    os.close(fd)
        print(f"{a.kind}, runs of {a.batch}, {order}: {files:.1f} shards a run; pack "
              f"{best_pack * 1e6:.0f} us a run, unpack {best_unpack * 1e6:.0f} us a run", flush=True)


class _Labels(torch.utils.data.IterableDataset):
    """Label batches (``torch.arange``), as many as the loader takes."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield torch.arange(self.batch)


def _handover(batch: int, inline: bool, batches: int = 400) -> float:
    """The main thread's CPU seconds a batch, taken once the workers' queue is full."""
    from mmproxy._loader.workers import inline_small_tensors

    loader = torch.utils.data.DataLoader(
        _Labels(batch), batch_size=None, num_workers=2, prefetch_factor=batches,
        worker_init_fn=(lambda _: inline_small_tensors()) if inline else None)
    it = iter(loader)
    next(it)
    time.sleep(3)
    start = time.thread_time()
    for _ in itertools.islice(it, batches // 2):
        pass
    return (time.thread_time() - start) / (batches // 2)


if __name__ == "__main__":
    main()
