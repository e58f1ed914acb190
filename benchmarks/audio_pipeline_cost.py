"""The GPU audio pipeline alone, where its time goes: the bench's WAV clips through the bench's
audio graph (decode, to the GPU, resample to 16 kHz, pad) behind DALI's shard reader and behind an
external source fed the way mmproxy's server feeds it (a ``TensorListCPU`` of views of the bytes,
``no_copy``, two runs in flight), each with the decoder's float32 output (``full_precision=True``)
and its 16-bit output made float32 on the GPU (the default); and, for the limits, the reader
alone and each decode alone (its output left on the CPU). No loader, no workers. The first
pipeline built (the float32 graph behind the reader) carries the process's warm-up into its
early epochs. On a GPU machine:

    python benchmarks/audio_pipeline_cost.py --clips 4096 --json audio-pipeline-cost.json
    python benchmarks/audio_pipeline_cost.py --batch 256 --only "16-bit"   # larger runs, 16-bit only
"""

from __future__ import annotations

import argparse
import json
import tarfile
import time
from collections.abc import Callable
from typing import Any

THREADS, EPOCHS = 8, 4


def _clips(paths: list[str]) -> list[Any]:
    import numpy as np

    out = []
    for path in paths:
        with tarfile.open(path) as tar:
            out += [np.frombuffer(tar.extractfile(m).read(), np.uint8)  # type: ignore[union-attr]
                    for m in tar if m.name.endswith(".wav")]
    return out


def _graph(full_precision: bool) -> Callable[[Any], Any]:
    from mmproxy.pipelines import audio_graph

    return lambda encoded: audio_graph(encoded, gpu=True, sample_rate=16000, pad_to_longest=True,
                                       full_precision=full_precision)[0]


def _decode_only(dtype: str) -> Callable[[Any], Any]:
    from nvidia.dali import fn, types

    return lambda encoded: fn.decoders.audio(encoded, dtype=getattr(types, dtype), downmix=True)[0]


def _time_reader(paths: list[str], graph: Callable[[Any], Any], n: int, batch: int) -> list[int]:
    """Clips a second of each epoch, the pipeline behind DALI's reader."""
    import torch
    from nvidia.dali import fn, pipeline_def

    @pipeline_def
    def pipe() -> Any:
        return graph(fn.readers.webdataset(paths=paths, ext=["wav"], random_shuffle=True,
                                           initial_fill=256, name="reader"))

    p = pipe(batch_size=batch, num_threads=THREADS, device_id=0, prefetch_queue_depth=2)
    p.build()
    rates = []
    try:
        for _ in range(EPOCHS):
            start = time.perf_counter()
            for _ in range(-(-n // batch)):
                p.run()
            torch.cuda.synchronize()
            rates.append(round(n / (time.perf_counter() - start)))
    finally:
        p._shutdown()
    return rates


def _time_fed(clips: list[Any], graph: Callable[[Any], Any], batch: int) -> list[int]:
    """Clips a second of each epoch, the pipeline fed as mmproxy's server feeds it."""
    import torch
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.backend import TensorCPU, TensorListCPU

    @pipeline_def
    def pipe() -> Any:
        return graph(fn.external_source(name="audio", no_copy=True, dtype=types.UINT8))

    p = pipe(batch_size=batch, num_threads=THREADS, device_id=0, prefetch_queue_depth=2)
    p.build()
    rates = []
    try:
        for _ in range(EPOCHS):
            start, inflight = time.perf_counter(), 0
            for k in range(0, len(clips), batch):
                p.feed_input("audio", TensorListCPU([TensorCPU(a) for a in clips[k:k + batch]],
                                                    contiguous=False))
                p._run_once()
                inflight += 1
                if inflight == 2:
                    p.outputs()
                    inflight -= 1
            for _ in range(inflight):
                p.outputs()
            torch.cuda.synchronize()
            rates.append(round(len(clips) / (time.perf_counter() - start)))
    finally:
        p._shutdown()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=4096)
    parser.add_argument("--data-dir", default="/tmp/bench", help="the bench's shards (written once)")
    parser.add_argument("--batch", type=int, default=64, help="clips a pipeline run (default 64, "
                        "the bench's audio batch)")
    parser.add_argument("--only", help="run only the measurements whose names contain this")
    parser.add_argument("--json", help="where to write the results")
    args = parser.parse_args()
    b = args.batch

    from mmproxy.apps.bench.shards import write_shards

    paths = write_shards(args.data_dir, "audio", args.clips, 15)
    clips = _clips(paths)
    runs = {
        "reader, float32 decode": lambda: _time_reader(paths, _graph(True), len(clips), b),
        "reader, 16-bit decode": lambda: _time_reader(paths, _graph(False), len(clips), b),
        "fed, float32 decode": lambda: _time_fed(clips, _graph(True), b),
        "fed, 16-bit decode": lambda: _time_fed(clips, _graph(False), b),
        "reader alone (bytes out)": lambda: _time_reader(paths, lambda x: x, len(clips), b),
        "reader, float32 decode alone (CPU out)": lambda: _time_reader(
            paths, _decode_only("FLOAT"), len(clips), b),
        "reader, 16-bit decode alone (CPU out)": lambda: _time_reader(
            paths, _decode_only("INT16"), len(clips), b),
    }
    results: dict[str, Any] = {"clips": len(clips), "batch": b, "threads": THREADS}
    for name, run in runs.items():
        if args.only and args.only not in name:
            continue
        rates = run()
        results[name] = {"epochs": rates, "after_the_first": sorted(rates[1:])}
        print(f"{name:42s} clips/s, epochs 2-{EPOCHS}: {rates[1:]} (first {rates[0]})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
