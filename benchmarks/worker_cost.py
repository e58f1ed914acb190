"""A worker's CPU cost per sample: shard reading alone, the header checks alone, and the whole
dataset path (header check, proxy call, collate, packing into shared memory) with the send to
the server stubbed out.

    python benchmarks/worker_cost.py --kind image --data-dir /tmp/bench

Uses the bench's shards (`mmproxy bench --data-dir DIR` writes them); measures in one forked
process, where the proxy packs and sends as in a DataLoader worker.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time


def _measure(paths: list[str], ext: str, batch: int, proxy: object, repeat: int, conn: object) -> None:
    """In a forked child, where the server is not local and the proxy sends, as in a worker."""
    from mmproxy.datasets import MultiModalDataset, check_header
    from mmproxy.datasets.shards import read_local_tar

    from mmproxy import _transport

    _transport.send = lambda path, fds, name: None  # drop each batch instead of sending it
    ds = MultiModalDataset(paths, {"x": (ext, proxy)}, batch_size=batch, shuffle_buffer=256,
                           keep_keys=False)
    best_read = best_check = best_all = float("inf")
    n = 0
    for _ in range(repeat):
        start, n = time.perf_counter(), 0
        for path in paths:
            n += sum(1 for _ in read_local_tar(path))
        best_read = min(best_read, (time.perf_counter() - start) / n)
        fields = [sample[ext] for path in paths for sample in read_local_tar(path)]
        start = time.perf_counter()
        for field in fields:
            check_header(ext, field)
        best_check = min(best_check, (time.perf_counter() - start) / n)
        del fields
        start = time.perf_counter()
        for _ in ds:
            pass
        best_all = min(best_all, (time.perf_counter() - start) / n)
    conn.send((n, best_read, best_check, best_all))  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["image", "audio"], default="image")
    parser.add_argument("--data-dir", default="/tmp/bench")
    parser.add_argument("--repeat", type=int, default=3)
    a = parser.parse_args()

    from nvidia.dali import fn, pipeline_def, types

    import mmproxy
    from mmproxy.apps.bench.shards import written_shards

    paths = written_shards(a.data_dir, a.kind)
    if not paths:
        raise SystemExit(f"no {a.kind} shards under {a.data_dir}: run `mmproxy bench` first")
    ext, batch = ("jpg", 256) if a.kind == "image" else ("wav", 64)

    @pipeline_def(batch_size=batch, num_threads=1, device_id=None)
    def pipe():  # type: ignore[no-untyped-def]
        return fn.external_source(name="data", no_copy=True, dtype=types.UINT8)

    server = mmproxy.DALIServer(pipe(), name="cost")
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    worker = ctx.Process(target=_measure, args=(paths, ext, batch, server.proxy, a.repeat, child))
    worker.start()
    child.close()  # so that recv() raises EOFError if the worker dies
    try:
        n, best_read, best_check, best_all = parent.recv()
    except EOFError:
        raise SystemExit(f"the measuring process failed (exit code {worker.exitcode})") from None
    finally:
        worker.join(timeout=10)
    print(f"{a.kind}: {n} samples; shard reading {best_read * 1e6:.1f} us/sample, header checks "
          f"{best_check * 1e6:.1f}, whole worker path {best_all * 1e6:.1f} us/sample")


if __name__ == "__main__":
    main()
