"""Time to the first sample of one large shard, local vs streamed over HTTP and S3 (and cached).

Writes one shard of ``--size-mb`` MB (45 KB members, like the bench's JPEGs), serves it from a
process of its own (the bench's HTTP server, then moto's S3 server), and reads it with
``mmproxy.datasets.shards.read_remote_tar``: the time to the first sample, and to the whole shard.
Streaming shows as a first sample in milliseconds while the whole shard takes seconds.

    python benchmarks/remote_first_sample.py --size-mb 512 \\
        --json benchmarks/results/cpu-2core/remote-first-sample.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _harness  # this script's folder is on the path
import numpy as np
from mmproxy.datasets.remote import RemoteOptions
from mmproxy.datasets.shards import read_local_tar, read_remote_tar

from mmproxy.apps.bench.remote import serving
from mmproxy.testing import write_tar


def timed(samples) -> dict[str, float]:
    start = time.perf_counter()
    first = None
    count = 0
    for _ in samples:
        count += 1
        if first is None:
            first = time.perf_counter() - start
    return {"first_sample_s": round(first or 0.0, 4), "whole_shard_s": round(time.perf_counter() - start, 3),
            "samples": count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    folder = Path(args.data_dir or tempfile.mkdtemp(prefix="mmproxy-big-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"big-{args.size_mb}mb.tar"
    if not path.exists():
        rng = np.random.default_rng(0)
        count = args.size_mb * 1_000_000 // 45_000
        write_tar(path, ({"__key__": f"{i:07d}", "jpg": rng.bytes(45_000)} for i in range(count)))
    out: dict[str, dict[str, float]] = {"local": timed(read_local_tar(str(path)))}
    print("local", out["local"], flush=True)
    for kind in ("http", "s3"):
        with serving(kind, [str(path)]) as [url], tempfile.TemporaryDirectory() as cache:
            out[kind] = timed(read_remote_tar(url, RemoteOptions()))
            print(kind, out[kind], flush=True)
            cached = RemoteOptions(cache_dir=cache)
            out[f"{kind}-cache-cold"] = timed(read_remote_tar(url, cached))
            out[f"{kind}-cache-warm"] = timed(read_remote_tar(url, cached))
            print(kind, "cache cold", out[f"{kind}-cache-cold"], "warm", out[f"{kind}-cache-warm"],
                  flush=True)
    _harness.write_json(args.json, args, False, {"size_mb": args.size_mb, "results": out})


if __name__ == "__main__":
    main()
