"""DALI alone, no mmproxy: the bench's image graph behind DALI's shard reader against the same
graph behind an ``external_source`` fed the way mmproxy's server feeds it, in one process, one
loop each. It tells whether the gap between mmproxy and the reader is DALI's external input
itself or mmproxy's engine around it.

Ways of feeding (``--feeds``, each timed over ``--iters`` batches after ``--warmup``):

- ``reader``: ``fn.readers.webdataset`` (the bench's ``dali-reader``);
- ``views``: one numpy view per JPEG into the shard's read-only mapping, fed as a Python list
  (what the server fed until session 10);
- ``tensorlist``: the same views wrapped in one ``TensorListCPU`` that shares their memory (what
  the server feeds now, ``mmproxy._dali._tensor_list``); building it is timed with the feed;
- ``contiguous``: the batch's JPEGs copied into one buffer beforehand, fed as one
  ``TensorListCPU`` (DALI's own layout; the copy is not timed);
- ``pinned``: the same buffer in page-locked memory (``TensorListCPU(..., is_pinned=True)``).

Each external feed keeps ``--depth`` runs in flight, as the server's runner does (feed, schedule,
take the oldest run's outputs). Prints images per second and the mean ``feed_input`` time.

    CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python benchmarks/feed_probe.py --data-dir /tmp/bench \\
        --samples 16384 --threads 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
from mmproxy.datasets.shards import read_local_tar
from mmproxy.pipelines import image_train_graph

from mmproxy._dali import _tensor_list
from mmproxy.apps.bench.shards import write_shards

FEEDS = ("reader", "views", "tensorlist", "contiguous", "pinned")


def jpeg_views(paths: list[str]) -> list[np.ndarray]:
    """One view per ``.jpg`` field of the shards, in order: views of each shard's read-only
    mapping, as the datasets read it (the mappings stay open while the views live)."""
    return [np.frombuffer(sample["jpg"], np.uint8) for path in paths
            for sample in read_local_tar(path, register=False) if "jpg" in sample]


def batches_of(views: list[np.ndarray], batch: int, feed: str) -> list[Any]:
    """Every full batch of ``views``, as ``feed`` hands it to DALI."""
    from nvidia.dali.backend import TensorCPU, TensorListCPU

    out: list[Any] = []
    for lo in range(0, len(views) - batch + 1, batch):
        part = views[lo:lo + batch]
        if feed in ("views", "tensorlist"):
            out.append(part)
            continue
        if feed == "contiguous":  # DALI copies the samples into one buffer of its own
            out.append(TensorListCPU([TensorCPU(v) for v in part]))
            continue
        import torch  # pinned: one page-locked buffer, each sample a pinned tensor viewing it

        sizes = [len(v) for v in part]
        offsets = np.cumsum([0, *sizes])
        flat = torch.empty(int(offsets[-1]), dtype=torch.uint8, pin_memory=True)
        array = flat.numpy()
        for v, a in zip(part, offsets):
            array[a:a + len(v)] = v
        tensors = [TensorCPU(array[a:b], "", True) for a, b in zip(offsets[:-1], offsets[1:])]
        out.append((tensors, flat))  # the buffer kept alive with its batch
    return out


def run_external(args: argparse.Namespace, batches: list[Any], feed: str) -> dict[str, float]:
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def
    def pipe() -> Any:
        data = fn.external_source(name="data", no_copy=True, dtype=types.UINT8)
        return image_train_graph(data, gpu=args.gpu, size=224)

    p = pipe(batch_size=args.batch, num_threads=args.threads, device_id=0 if args.gpu else None,
             prefetch_queue_depth=args.depth)
    p.build()
    inflight = 0
    fed = 0.0
    start = 0.0
    for i in range(args.warmup + args.iters):
        if i == args.warmup:
            start = time.perf_counter()
        data = batches[i % len(batches)]
        if feed == "pinned":
            data = data[0]
        t = time.perf_counter()
        p.feed_input("data", _tensor_list(data) if feed == "tensorlist" else data)
        if i >= args.warmup:
            fed += time.perf_counter() - t
        p._run_once()
        inflight += 1
        if inflight == args.depth:
            p.outputs()
            inflight -= 1
    for _ in range(inflight):
        p.outputs()
    seconds = time.perf_counter() - start
    p._shutdown()
    return {"img_per_s": args.iters * args.batch / seconds,
            "feed_ms": 1000 * fed / args.iters}


def run_reader(args: argparse.Namespace, paths: list[str]) -> dict[str, float]:
    from nvidia.dali import fn, pipeline_def

    @pipeline_def
    def pipe() -> Any:
        data = fn.readers.webdataset(paths=paths, ext=["jpg"], random_shuffle=True,
                                     initial_fill=256, missing_component_behavior="skip")
        return image_train_graph(data, gpu=args.gpu, size=224)

    p = pipe(batch_size=args.batch, num_threads=args.threads, device_id=0 if args.gpu else None)
    p.build()
    for _ in range(args.warmup):
        p.run()
    start = time.perf_counter()
    for _ in range(args.iters):
        p.run()
    seconds = time.perf_counter() - start
    p._shutdown()
    return {"img_per_s": args.iters * args.batch / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="/tmp/bench")
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2, help="runs in flight (external feeds)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="times each feed runs, interleaved")
    parser.add_argument("--feeds", default=",".join(FEEDS))
    parser.add_argument("--cpu", dest="gpu", action="store_false",
                        help="CPU operators (no pinned feed), to try the script without a GPU")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    paths = write_shards(args.data_dir, "image", args.samples, workers=1)
    feeds = [f for f in args.feeds.split(",") if args.gpu or f != "pinned"]
    views = jpeg_views(paths)
    prepared = {f: batches_of(views, args.batch, f) for f in feeds if f != "reader"}
    results: dict[str, list[dict[str, float]]] = {f: [] for f in feeds}
    for r in range(args.rounds):
        for f in feeds:
            res = run_reader(args, paths) if f == "reader" else run_external(args, prepared[f], f)
            results[f].append(res)
            print(f"round {r + 1} {f:11s} " + "  ".join(f"{k} {v:,.1f}" for k, v in res.items()),
                  flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
