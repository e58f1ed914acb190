"""Sums up Chrome traces from ``benchmarks/ddp_bench.py --profile DIR``, per rank: where the GPU's time
went during the profiled training steps.

    python benchmarks/ddp_profile.py DIR [DIR ...] [--json OUT]

GPU work is split by what issued it: NCCL kernels (by name: gradient all-reduce and the
BatchNorm-buffer broadcast, their time includes waiting for the other ranks), training (kernels and
copies launched by the main loop's thread or autograd's) and the pipeline (launched by any other
thread: DALI's). Per profiled step, in milliseconds:

- ``step``: GPU time from the first to the last training/NCCL event, divided by the steps;
- ``train``: the union of the training kernels and copies (the model's own work);
- ``nccl``: the union of NCCL kernels, and ``nccl_only`` the part of it with no training work
  beside it (waiting for a peer or for the network);
- ``pipeline``: the union of the pipeline's kernels, and ``pipeline_beside_train`` the part that ran
  at the same moment as training kernels (both share the SMs then);
- ``idle``: time with neither training nor NCCL work (the GPU waited for the CPU or for data).
"""

import argparse
import glob
import gzip
import json
import os

import _harness  # this script's folder is on the path


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Overlap of two sorted, merged span lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(path: str) -> dict:
    events = _load(path)["traceEvents"]
    # the CPU ranges; the profiler repeats each on the GPU's timeline (gpu_user_annotation)
    steps = [e for e in events if e.get("ph") == "X" and e.get("name") == "train_step"
             and e.get("cat") != "gpu_user_annotation"]
    if not steps:
        raise SystemExit(f"{path}: no 'train_step' ranges; was it written by ddp_bench.py --profile?")
    # The threads that run training: the main loop's and autograd's (they launch the model's work).
    training_threads = {e["tid"] for e in steps}
    training_threads |= {e["tid"] for e in events if e.get("ph") == "X"
                         and str(e.get("name", "")).startswith("autograd::engine")}
    launcher = {e["args"]["correlation"]: e["tid"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    train, nccl, pipeline = [], [], []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if "nccl" in e["name"].lower():
            nccl.append(span)
        elif launcher.get(e.get("args", {}).get("correlation")) in training_threads:
            train.append(span)
        else:
            pipeline.append(span)
    train_u, nccl_u, pipe_u = _union(train), _union(nccl), _union(pipeline)
    busy = _union(train_u + nccl_u)
    if not busy:
        raise SystemExit(f"{path}: no GPU kernels in the trace (a CPU run?)")
    window = busy[-1][1] - busy[0][0]
    n = len(steps)
    ms = 1e-3 / n  # trace times are microseconds; per step
    return {"trace": path, "steps": n,
            "step": round(window * ms, 2),
            "train": round(_length(train_u) * ms, 2),
            "nccl": round(_length(nccl_u) * ms, 2),
            "nccl_only": round((_length(nccl_u) - _intersection(nccl_u, train_u)) * ms, 2),
            "pipeline": round(_length(pipe_u) * ms, 2),
            "pipeline_beside_train": round(_intersection(pipe_u, train_u) * ms, 2),
            "idle": round((window - _length(busy)) * ms, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="--profile folders (or trace files)")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    paths = []
    for folder in args.folders:
        paths += sorted(glob.glob(os.path.join(folder, "rank*.trace.json*"))) \
            if os.path.isdir(folder) else [folder]
    rows = [summarize(p) for p in paths]
    columns = ["step", "train", "nccl", "nccl_only", "pipeline", "pipeline_beside_train", "idle"]
    print(f"{'trace':<48} " + " ".join(f"{c:>10}" for c in columns) + "   (ms per step)")
    for row in rows:
        print(f"{row['trace'][-48:]:<48} " + " ".join(f"{row[c]:>10}" for c in columns))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_harness.stamped(rows), f, indent=1)


if __name__ == "__main__":
    main()
