"""What mmproxy costs the training process a batch: the main process's CPU time per batch behind
a pipeline that does next to nothing (the encoded clips' shapes, on the CPU), so that
what is left is mmproxy's own work there: torch's loader taking the workers' batches, the
server's listener receiving runs, its runner feeding them and converting outputs, and the
batches' resolution. The bench's audio shards, runs of 64 clips, shuffled as the bench reads them.

    python benchmarks/main_cost.py --data-dir /tmp/bench               # audio field only
    python benchmarks/main_cost.py --labels --keys                     # as the README's recipe
    PYTHONPATH=/tmp/before-site-X python benchmarks/main_cost.py ...   # another commit's code

Prints the median of the epochs after the first two: CPU milliseconds of the main process (all
its threads) and wall milliseconds, per batch.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="/tmp/bench")
    parser.add_argument("--samples", type=int, default=4096, help="clips (written once)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--labels", action="store_true", help="a label field (a tensor a batch)")
    parser.add_argument("--keys", action="store_true", help="keep the samples' keys and URLs")
    a = parser.parse_args()

    from mmproxy.datasets import MultiModalDataset
    from nvidia.dali import fn, pipeline_def, types

    import mmproxy
    from mmproxy.apps.bench.shards import write_shards

    @pipeline_def(batch_size=a.batch, num_threads=1, device_id=None, prefetch_queue_depth=2)
    def shapes() -> object:
        return fn.external_source(name="data", no_copy=True, dtype=types.UINT8).shape()

    paths = write_shards(a.data_dir, "audio", a.samples, 15)
    server = mmproxy.DALIServer(shapes(), name="audio")
    fields: dict[str, object] = {"audio": ("wav", server.proxy)}
    if a.labels:
        fields["label"] = ("cls", int)
    with server:
        dataset = MultiModalDataset(paths, fields, batch_size=a.batch, shuffle_buffer=256,
                                    keep_keys=a.keys)
        loader = dataset.loader(server, num_workers=a.workers, persistent_workers=True)
        cpu, wall = [], []
        for _ in range(a.epochs):
            start, used, n = time.perf_counter(), time.process_time(), 0
            for _ in loader:
                n += 1
            wall.append((time.perf_counter() - start) / n * 1e3)
            cpu.append((time.process_time() - used) / n * 1e3)
    print(f"{a.batch} clips a batch, {a.workers} workers, labels {a.labels}, keys {a.keys}: "
          f"main process {statistics.median(cpu[2:]):.3f} ms of CPU a batch, "
          f"{statistics.median(wall[2:]):.3f} ms wall (epochs 3-{a.epochs}: "
          f"{[round(c, 3) for c in cpu[2:]]})", flush=True)


if __name__ == "__main__":
    main()
