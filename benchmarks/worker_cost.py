"""A worker's CPU cost per sample: shard reading alone, and the whole dataset path (header check,
proxy call, collate, packing into shared memory) with the send to the server stubbed out.

    python benchmarks/worker_cost.py --kind image --data-dir /tmp/bench

Uses the bench's shards (`mmproxy bench --data-dir DIR` writes them); runs in one process.
"""

from __future__ import annotations

import argparse
import glob
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["image", "audio"], default="image")
    parser.add_argument("--data-dir", default="/tmp/bench")
    parser.add_argument("--repeat", type=int, default=3)
    a = parser.parse_args()

    from mmproxy.datasets import MultiModalDataset
    from mmproxy.datasets.shards import read_local_tar
    from nvidia.dali import fn, pipeline_def, types

    import mmproxy
    from mmproxy import _transport
    from mmproxy import proxy as _proxy

    paths = sorted(glob.glob(f"{a.data_dir}/{a.kind}-*/{a.kind}-*.tar"))
    if not paths:
        raise SystemExit(f"no {a.kind} shards under {a.data_dir}: run `mmproxy bench` first")
    ext, batch = ("jpg", 256) if a.kind == "image" else ("wav", 64)

    @pipeline_def(batch_size=batch, num_threads=1, device_id=None)
    def pipe():  # type: ignore[no-untyped-def]
        return fn.external_source(name="data", no_copy=True, dtype=types.UINT8)

    server = mmproxy.DALIServer(pipe(), name="cost")
    _proxy._local_servers.clear()  # make the proxy pack as in a worker ...
    _transport.send = lambda path, fds, name: None  # ... and drop the batch instead of sending it
    ds = MultiModalDataset(paths, {"x": (ext, server.proxy)}, batch_size=batch, shuffle_buffer=256,
                           keep_keys=False)
    best_read = best_all = float("inf")
    n = 0
    for _ in range(a.repeat):
        start, n = time.perf_counter(), 0
        for path in paths:
            n += sum(1 for _ in read_local_tar(path))
        best_read = min(best_read, (time.perf_counter() - start) / n)
        start = time.perf_counter()
        for _ in ds:
            pass
        best_all = min(best_all, (time.perf_counter() - start) / n)
    print(f"{a.kind}: {n} samples; shard reading {best_read * 1e6:.1f} us/sample, "
          f"whole worker path {best_all * 1e6:.1f} us/sample")


if __name__ == "__main__":
    main()
