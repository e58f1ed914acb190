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
and, for the limits, the reader alone and each decode alone (its output left on the CPU). With
``--pipelines N`` the fed and served ones run N pipelines side by side (the reader stays one),
with ``--processes P`` the fed ones run in P processes at once. No
dataset, no DataLoader. The first pipeline built carries the process's warm-up into its early
epochs. On a GPU machine:

    python benchmarks/pipeline_cost.py --clips 4096 --json audio-pipeline-cost.json
    python benchmarks/pipeline_cost.py --batch 256 --only "16-bit"   # larger runs, 16-bit only
    python benchmarks/pipeline_cost.py --clips 16384 --only "served,sent"
    python benchmarks/pipeline_cost.py --clips 16384 --only sent --ahead 30   # as a loader's 15x2
    python benchmarks/pipeline_cost.py --kind image --samples 16384 --only "reader,fed,served"
    python benchmarks/pipeline_cost.py --clips 8192 --pipelines 2 --threads 7 --only "fed,served,sent"
    python benchmarks/pipeline_cost.py --kind image --only fed --processes 3 --pipelines 1 --threads 5
"""

from __future__ import annotations

import argparse
import json
import tarfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import _harness  # this script's folder is on the path

EPOCHS = 4
THREADS = 8  # DALI threads a pipeline (--threads)
PIPELINES = 1  # pipelines side by side (--pipelines): fed from as many threads, or one server's
PROCESSES = 1  # processes running the fed pipelines at once (--processes)
CORES: list[float] = []  # the CPU cores a fed epoch kept busy (this process's), epoch by epoch
DECODE, HW_LOAD = "roi", None  # images: the decode (--decode) and its hardware share


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
    """The image training graph; with ``--decode full``, the whole image decoded (where the
    GPU's hardware JPEG decoder takes its share, ``--hw-decoder-load``) and the window cut from
    it on the GPU, instead of the decoder's region-of-interest decode."""
    from mmproxy.pipelines.image import IMAGENET_MEAN, IMAGENET_STD, image_train_graph
    from nvidia.dali import fn, types

    if DECODE == "roi" and HW_LOAD is None:
        return lambda encoded: image_train_graph(encoded, gpu=True)
    load = {} if HW_LOAD is None else {"hw_decoder_load": HW_LOAD}

    def graph(encoded: Any) -> Any:
        if DECODE == "roi":
            images = fn.decoders.image_random_crop(
                encoded, device="mixed", output_type=types.RGB, random_area=[0.08, 1.0],
                random_aspect_ratio=[3 / 4, 4 / 3], **load)
        else:
            images = fn.random_resized_crop(
                fn.decoders.image(encoded, device="mixed", output_type=types.RGB, **load),
                size=[224, 224], random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3],
                antialias=True)
            return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                            mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD),
                                            mirror=fn.random.coin_flip(probability=0.5))
        return fn.crop_mirror_normalize(
            fn.resize(images, size=[224, 224], antialias=True), dtype=types.FLOAT,
            output_layout="CHW", mean=list(IMAGENET_MEAN), std=list(IMAGENET_STD),
            mirror=fn.random.coin_flip(probability=0.5))

    return graph


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


def _time_fed(clips: list[Any], graph: Callable[[Any], Any], batch: int,
              barrier: Any = None) -> list[int]:
    """Samples a second of each epoch, the pipeline fed as mmproxy's server feeds it; with
    ``PIPELINES`` > 1, that many copies side by side, each fed its share of the runs from a
    Python thread of its own (as a server's runners feed them)."""
    import threading

    import torch
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.backend import TensorCPU, TensorListCPU

    @pipeline_def
    def pipe() -> Any:
        return graph(fn.external_source(name="data", no_copy=True, dtype=types.UINT8))

    pipes = [pipe(batch_size=batch, num_threads=THREADS, device_id=0, prefetch_queue_depth=2,
                  seed=1234 + k) for k in range(PIPELINES)]
    for p in pipes:
        p.build()
    runs = [clips[k:k + batch] for k in range(0, len(clips), batch)]

    def feed(p: Any, share: list[list[Any]]) -> None:
        inflight = 0
        for run in share:
            p.feed_input("data", TensorListCPU([TensorCPU(a) for a in run], contiguous=False))
            p._run_once()
            inflight += 1
            if inflight == 2:
                p.outputs()
                inflight -= 1
        for _ in range(inflight):
            p.outputs()

    rates = []
    try:
        for _ in range(EPOCHS):
            if barrier is not None:  # the other processes' epochs start together with this one's
                barrier.wait()
            start, cpu = time.perf_counter(), time.process_time()
            threads = [threading.Thread(target=feed, args=(p, runs[k::PIPELINES]))
                       for k, p in enumerate(pipes)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            rates.append(round(len(clips) / seconds))
            CORES.append(round((time.process_time() - cpu) / seconds, 2))
    finally:
        for p in pipes:
            p._shutdown()
    return rates


def _fed_in_processes(clips: list[Any], graph: Callable[[Any], Any], batch: int) -> list[int]:
    """:func:`_time_fed` in ``PROCESSES`` forked processes at once, each with its share of the
    samples and its own pipelines, their epochs started together: the rate of every process's
    samples over the slowest one's epoch, whether more of the same graph fits on this GPU and
    these CPUs than one process's executors reach. Forked before anything starts CUDA here."""
    if PROCESSES == 1:
        return _time_fed(clips, graph, batch)
    from multiprocessing import get_context

    fork = get_context("fork")
    barrier, results = fork.Barrier(PROCESSES), fork.Queue()
    shares = [clips[k::PROCESSES] for k in range(PROCESSES)]

    def child(k: int) -> None:
        rates = _time_fed(shares[k], graph, batch, barrier)
        results.put(([len(shares[k]) / r for r in rates], CORES))  # each epoch's seconds

    children = [fork.Process(target=child, args=(k,), daemon=True) for k in range(PROCESSES)]
    for c in children:
        c.start()
    answers = [results.get(timeout=600) for _ in children]
    for c in children:
        c.join(timeout=60)
    seconds = [times for times, _ in answers]
    CORES.extend(round(sum(epoch), 2) for epoch in zip(*(cores for _, cores in answers)))
    return [round(len(clips) / max(epoch)) for epoch in zip(*seconds)]


def _runs(proxy: Any, clips: list[Any], batch: int) -> Iterator[str]:
    """Sends the clips to ``proxy``'s server ``batch`` at a time, as they are asked for; yields
    each run's id."""
    for k in range(0, len(clips), batch):
        yield proxy.run([None] * len(clips[k:k + batch]), [(a,) for a in clips[k:k + batch]])


def _epoch_rate(server: Any, runs: Iterator[str], clips: int, device_id: int | None) -> int:
    """Samples a second of one epoch: the runs ``runs`` gives (sent as it is iterated, within the
    timing) resolved three a pipeline behind the newest, as a loader's main loop resolves its
    batches."""
    from collections import deque

    import torch

    from mmproxy.refs import DALIOutputBatchRef

    start, pending = time.perf_counter(), deque()
    for run in runs:
        pending.append(DALIOutputBatchRef(server.uid, "data", run, 0))
        if len(pending) > 3 * PIPELINES:
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
    with mmproxy.DALIServer(pipe, name="data", pipelines=PIPELINES) as server:
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
    with mmproxy.DALIServer(pipe, name="data", pipelines=PIPELINES) as server:
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
    global THREADS, PIPELINES, PROCESSES, DECODE, HW_LOAD
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
    parser.add_argument("--threads", type=int, default=THREADS, help="DALI threads a pipeline")
    parser.add_argument("--pipelines", type=int, default=PIPELINES, help="pipelines side by side: "
                        "the fed ones from as many Python threads, the served ones one server's")
    parser.add_argument("--processes", type=int, default=PROCESSES, help="the fed pipelines in "
                        "this many processes at once (each its share of the samples)")
    parser.add_argument("--decode", choices=["roi", "full"], default=DECODE, help="images: decode "
                        "the crop's window only (DALI's image_random_crop) or the whole image, "
                        "then cut the window on the GPU")
    parser.add_argument("--hw-decoder-load", type=float, default=None, help="images: the share "
                        "of JPEGs for the GPU's hardware decoder (DALI's default when not given)")
    parser.add_argument("--json", help="where to write the results")
    args = parser.parse_args()
    DECODE, HW_LOAD = args.decode, args.hw_decoder_load
    THREADS, PIPELINES, PROCESSES = args.threads, args.pipelines, args.processes
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
            "fed, float32 decode": lambda: _fed_in_processes(clips, _graph(True), b),
            "fed, 16-bit decode": lambda: _fed_in_processes(clips, _graph(False), b),
            "served in this process, 16-bit decode": lambda: _time_served(
                _shuffled(_harness.mapped_samples(paths, ext)), _graph(False), b),
            "sent from a forked process, 16-bit decode": lambda: _time_sent(
                _shuffled(_harness.mapped_samples(paths, ext)), _graph(False), b, ahead=args.ahead),
            "fed from the shards' mappings, 16-bit decode": lambda: _fed_in_processes(
                _harness.mapped_samples(paths, ext), _graph(False), b),
            "fed from the shards' mappings, shuffled, 16-bit decode": lambda: _fed_in_processes(
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
            "fed": lambda: _fed_in_processes(clips, _image_graph(), b),
            "fed from the shards' mappings, shuffled": lambda: _fed_in_processes(
                _shuffled(_harness.mapped_samples(paths, ext)), _image_graph(), b),
            "served in this process": lambda: _time_served(
                _shuffled(_harness.mapped_samples(paths, ext)), _image_graph(), b),
            "reader alone (bytes out)": lambda: _time_reader(paths, lambda x: x, n, b, ext),
        }
        if b < _transport_fds():  # a run's samples may lie in as many shards as it holds
            runs["sent from a forked process"] = lambda: _time_sent(
                _shuffled(_harness.mapped_samples(paths, ext)), _image_graph(), b, ahead=args.ahead)
    results: dict[str, Any] = {"kind": args.kind, "samples": n, "batch": b, "threads": THREADS,
                               "pipelines": PIPELINES, "processes": PROCESSES,
                               "decode": DECODE, "hw_decoder_load": HW_LOAD, "ahead": args.ahead}
    chosen = [name for name in runs
              if not args.only or any(part in name for part in args.only.split(","))]
    if PROCESSES > 1 and any(not name.startswith("fed") for name in chosen):
        parser.error("--processes forks before CUDA starts: choose only fed measurements "
                     "(--only fed)")
    for name, run in runs.items():
        if name not in chosen:
            continue
        CORES.clear()
        rates = run()
        results[name] = {"epochs": rates, "after_the_first": sorted(rates[1:])}
        if CORES:
            results[name]["cpu_cores_busy"] = list(CORES)
        print(f"{name:42s} {'clips' if audio else 'images'}/s, epochs 2-{EPOCHS}: {rates[1:]} "
              f"{f'(CPU cores busy {CORES[1:]}) ' if CORES else ''}"
              f"(first {rates[0]})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_harness.stamped(results), f, indent=1)


if __name__ == "__main__":
    main()
