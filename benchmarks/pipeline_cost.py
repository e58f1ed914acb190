"""A pipeline alone, and what each part of mmproxy's path around it costs: the bench's WAV clips
through the bench's audio graph (decode, to the GPU, resample to 16 kHz, pad), or with ``--kind
image`` its JPEGs through the image training graph (decode a random window on the GPU, resize,
flip, normalize)

- behind DALI's shard reader;
- behind an external source fed as mmproxy's server feeds it (a ``TensorListCPU`` of views of
  the bytes, ``no_copy``, two runs in flight): the samples copied out of their shards, or views
  of the shards' mappings (in shard order, or shuffled);
- behind a :class:`mmproxy.DALIServer` fed by its proxy in this process (the server's runner,
  run table and the batches' resolution, no transport), and with the runs sent by a forked
  process as a loader's worker sends them (the transport and the server's listener too; runs
  of at most 64 samples);

for audio each with the 16-bit decode made float32 on the GPU (the default) and, behind the
reader and the plain external source, the decoder's float32 output (``full_precision=True``);
and, for the limits, the reader alone and each decode alone (its output left on the CPU). No
dataset, no DataLoader. The first pipeline built carries the process's warm-up into its early
epochs. On a GPU machine:

    python benchmarks/pipeline_cost.py --clips 4096 --json audio-pipeline-cost.json
    python benchmarks/pipeline_cost.py --batch 256 --only "16-bit"   # larger runs, 16-bit only
    python benchmarks/pipeline_cost.py --clips 16384 --only "served,sent"
    python benchmarks/pipeline_cost.py --clips 16384 --only sent --ahead 30   # as a loader's 15x2
    python benchmarks/pipeline_cost.py --kind image --samples 16384 --only "reader,fed,served"
"""

from __future__ import annotations

import argparse
import json
import tarfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import _harness  # this script's folder is on the path

THREADS, EPOCHS = 8, 4


def _clips(paths: list[str], ext: str) -> list[Any]:
    import numpy as np

    out = []
    for path in paths:
        with tarfile.open(path) as tar:
            out += [np.frombuffer(tar.extractfile(m).read(), np.uint8)  # type: ignore[union-attr]
                    for m in tar if m.name.endswith("." + ext)]
    return out


def _shuffled(clips: list[Any]) -> list[Any]:
    import random

    random.Random(0).shuffle(clips)
    return clips


def _graph(full_precision: bool) -> Callable[[Any], Any]:
    from mmproxy.pipelines import audio_graph

    return lambda encoded: audio_graph(encoded, gpu=True, sample_rate=16000, pad_to_longest=True,
                                       full_precision=full_precision)[0]


def _image_graph() -> Callable[[Any], Any]:
    from mmproxy.pipelines.image import image_train_graph

    return lambda encoded: image_train_graph(encoded, gpu=True)


def _decode_only(dtype: str) -> Callable[[Any], Any]:
    from nvidia.dali import fn, types

    return lambda encoded: fn.decoders.audio(encoded, dtype=getattr(types, dtype), downmix=True)[0]


def _time_reader(paths: list[str], graph: Callable[[Any], Any], n: int, batch: int,
                 ext: str = "wav") -> list[int]:
    """Samples a second of each epoch, the pipeline behind DALI's reader."""
    import torch
    from nvidia.dali import fn, pipeline_def

    @pipeline_def
    def pipe() -> Any:
        return graph(fn.readers.webdataset(paths=paths, ext=[ext], random_shuffle=True,
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
    """Samples a second of each epoch, the pipeline fed as mmproxy's server feeds it."""
    import torch
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.backend import TensorCPU, TensorListCPU

    @pipeline_def
    def pipe() -> Any:
        return graph(fn.external_source(name="data", no_copy=True, dtype=types.UINT8))

    p = pipe(batch_size=batch, num_threads=THREADS, device_id=0, prefetch_queue_depth=2)
    p.build()
    rates = []
    try:
        for _ in range(EPOCHS):
            start, inflight = time.perf_counter(), 0
            for k in range(0, len(clips), batch):
                p.feed_input("data", TensorListCPU([TensorCPU(a) for a in clips[k:k + batch]],
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


def _runs(proxy: Any, clips: list[Any], batch: int) -> Iterator[str]:
    """Sends the clips to ``proxy``'s server ``batch`` at a time, as they are asked for; yields
    each run's id."""
    for k in range(0, len(clips), batch):
        yield proxy.run([None] * len(clips[k:k + batch]), [(a,) for a in clips[k:k + batch]])


def _epoch_rate(server: Any, runs: Iterator[str], clips: int, device_id: int | None) -> int:
    """Samples a second of one epoch: the runs ``runs`` gives (sent as it is iterated, within the
    timing) resolved three behind the newest, as a loader's main loop resolves its batches."""
    from collections import deque

    import torch

    from mmproxy.refs import DALIOutputBatchRef

    start, pending = time.perf_counter(), deque()
    for run in runs:
        pending.append(DALIOutputBatchRef(server.uid, "data", run, 0))
        if len(pending) > 3:
            server.produce_data(pending.popleft())
    while pending:
        server.produce_data(pending.popleft())
    if device_id is not None:
        torch.cuda.synchronize()
    return round(clips / (time.perf_counter() - start))


def _time_served(clips: list[Any], graph: Callable[[Any], Any], batch: int,
                 device_id: int | None = 0) -> list[int]:
    """Samples a second of each epoch, the pipeline behind a :class:`mmproxy.DALIServer` fed by its
    proxy in this process (no workers, no transport): the server's runner thread, its run table
    and the batches' resolution, three runs ahead of the one resolved."""
    from mmproxy.pipelines import external_pipeline

    import mmproxy

    pipe = external_pipeline(graph, input_name="data", batch_size=batch, num_threads=THREADS,
                             device_id=device_id, prefetch_queue_depth=2)
    with mmproxy.DALIServer(pipe, name="data") as server:
        return [_epoch_rate(server, _runs(server.proxy, clips, batch), len(clips), device_id)
                for _ in range(EPOCHS)]


def _time_sent(clips: list[Any], graph: Callable[[Any], Any], batch: int,
               device_id: int | None = 0, ahead: int = 0) -> list[int]:
    """:func:`_time_served` with the runs sent by a forked process, as a loader's worker sends
    them (packed, the clips by reference to their shards' registered mappings, received by the
    server's listener thread); one process forked before the first epoch (from a frozen heap)
    sends every epoch's runs, as a persistent worker does, and the parent resolves them as they
    come. With ``ahead``, the sender stays at most that many runs ahead of those the parent has
    received, as a loader's workers stay within their prefetch (0: as fast as it can)."""
    import gc
    from multiprocessing import get_context

    from mmproxy.pipelines import external_pipeline

    import mmproxy
    from mmproxy._wire import transport as _transport

    if batch >= _transport._MAX_FDS:  # a run's clips may lie in as many shards
        raise SystemExit(f"--batch {batch}: the runs sent from a forked process take at most "
                         f"{_transport._MAX_FDS - 1} clips")
    pipe = external_pipeline(graph, input_name="data", batch_size=batch, num_threads=THREADS,
                             device_id=device_id, prefetch_queue_depth=2)
    rates = []
    with mmproxy.DALIServer(pipe, name="data") as server:
        proxy = server.proxy

        def send_all(go: Any, conn: Any) -> None:
            for _ in range(EPOCHS):
                go.recv()  # the parent's clock has started
                runs = -(-len(clips) // batch)
                for k, run in enumerate(_runs(proxy, clips, batch)):
                    conn.send(run)
                    if ahead and ahead <= k + 1 < runs:
                        go.recv()  # the parent has received one more: send the next
            conn.close()

        gc.collect()  # the heap frozen before the fork, as mmproxy.DataLoader does (freeze_gc)
        gc.freeze()
        fork = get_context("fork")
        receive, send = fork.Pipe(duplex=False)
        wait, go = fork.Pipe(duplex=False)
        child = fork.Process(target=send_all, args=(wait, send), daemon=True)
        child.start()
        send.close()

        def received() -> Iterator[str]:
            go.send(True)
            runs = -(-len(clips) // batch)
            for k in range(runs):
                run = receive.recv()
                if ahead and k + ahead < runs:  # the sender may send one more
                    go.send(True)
                yield run

        try:
            rates = [_epoch_rate(server, received(), len(clips), device_id) for _ in range(EPOCHS)]
        finally:
            child.join(timeout=60)
            if child.is_alive():  # an error here left it waiting for the next epoch
                child.kill()
            gc.unfreeze()
    return rates


def _transport_fds() -> int:
    from mmproxy._wire import transport as _transport

    return _transport._MAX_FDS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=["audio", "image"], default="audio")
    parser.add_argument("--samples", "--clips", dest="samples", type=int, default=4096,
                        help="clips or images (written once)")
    parser.add_argument("--data-dir", default="/tmp/bench", help="the bench's shards (written once)")
    parser.add_argument("--batch", type=int, default=None, help="samples a pipeline run (default: "
                        "the bench's batch, 64 clips or 256 images)")
    parser.add_argument("--only", help="run only the measurements whose names contain one of "
                        "these (comma-separated)")
    parser.add_argument("--ahead", type=int, default=0, help="the forked sender stays at most "
                        "this many runs ahead of the runs the parent has received (which resolves "
                        "them three behind, so up to this plus 3 wait in the server; a loader: "
                        "workers x prefetch_factor, e.g. 30); 0: as fast as it can")
    parser.add_argument("--json", help="where to write the results")
    args = parser.parse_args()
    if args.ahead < 0:
        parser.error(f"--ahead must be 0 or more, got {args.ahead}")
    audio = args.kind == "audio"
    b = args.batch or (64 if audio else 256)
    ext = "wav" if audio else "jpg"

    from mmproxy.apps.bench.shards import write_shards

    paths = write_shards(args.data_dir, args.kind, args.samples, 15)
    clips = _clips(paths, ext)
    n = len(clips)
    if audio:
        runs = {
            "reader, float32 decode": lambda: _time_reader(paths, _graph(True), n, b),
            "reader, 16-bit decode": lambda: _time_reader(paths, _graph(False), n, b),
            "fed, float32 decode": lambda: _time_fed(clips, _graph(True), b),
            "fed, 16-bit decode": lambda: _time_fed(clips, _graph(False), b),
            "served in this process, 16-bit decode": lambda: _time_served(
                _shuffled(_harness.mapped_samples(paths, ext)), _graph(False), b),
            "sent from a forked process, 16-bit decode": lambda: _time_sent(
                _shuffled(_harness.mapped_samples(paths, ext)), _graph(False), b, ahead=args.ahead),
            "fed from the shards' mappings, 16-bit decode": lambda: _time_fed(
                _harness.mapped_samples(paths, ext), _graph(False), b),
            "fed from the shards' mappings, shuffled, 16-bit decode": lambda: _time_fed(
                _shuffled(_harness.mapped_samples(paths, ext)), _graph(False), b),
            "reader alone (bytes out)": lambda: _time_reader(paths, lambda x: x, n, b),
            "reader, float32 decode alone (CPU out)": lambda: _time_reader(
                paths, _decode_only("FLOAT"), n, b),
            "reader, 16-bit decode alone (CPU out)": lambda: _time_reader(
                paths, _decode_only("INT16"), n, b),
        }
    else:
        runs = {
            "reader": lambda: _time_reader(paths, _image_graph(), n, b, ext),
            "fed": lambda: _time_fed(clips, _image_graph(), b),
            "fed from the shards' mappings, shuffled": lambda: _time_fed(
                _shuffled(_harness.mapped_samples(paths, ext)), _image_graph(), b),
            "served in this process": lambda: _time_served(
                _shuffled(_harness.mapped_samples(paths, ext)), _image_graph(), b),
            "reader alone (bytes out)": lambda: _time_reader(paths, lambda x: x, n, b, ext),
        }
        if b < _transport_fds():  # a run's samples may lie in as many shards as it holds
            runs["sent from a forked process"] = lambda: _time_sent(
                _shuffled(_harness.mapped_samples(paths, ext)), _image_graph(), b, ahead=args.ahead)
    results: dict[str, Any] = {"kind": args.kind, "samples": n, "batch": b, "threads": THREADS,
                               "ahead": args.ahead}
    for name, run in runs.items():
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        rates = run()
        results[name] = {"epochs": rates, "after_the_first": sorted(rates[1:])}
        print(f"{name:42s} {'clips' if audio else 'images'}/s, epochs 2-{EPOCHS}: {rates[1:]} "
              f"(first {rates[0]})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_harness.stamped(results), f, indent=1)


if __name__ == "__main__":
    main()
