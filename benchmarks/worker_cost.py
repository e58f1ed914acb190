"""A worker's CPU cost per sample: shard reading alone, the header checks alone, and the whole
dataset path (header check, the server fields' inputs, collate, packing into shared memory) with
the send to the server stubbed out; what the path costs beyond reading and checks is the rest.

    python benchmarks/worker_cost.py --kind image --data-dir /tmp/bench
    python benchmarks/worker_cost.py --kind image --pipeline train   # crops drawn per sample
    python benchmarks/worker_cost.py --kind audio --labels           # labels and keys as well
    python benchmarks/worker_cost.py --kind audio --profile 30       # the path's top functions
    python benchmarks/worker_cost.py --kind image --real             # the process's CPU, sends made

Uses the bench's shards (`mmproxy bench --data-dir DIR` writes them); measures in one forked
process, where the proxy packs and sends as in a DataLoader worker. The server's pipeline is a
bare external source, or with ``--pipeline train`` the image training pipeline whose proxy draws
each sample's crop window and flip from its seed.

With ``--real`` it measures what the worker process spends instead (user and system CPU time and
minor page faults from ``getrusage``, over ``--repeat`` epochs after two to warm up): the whole
dataset path with every batch sent to the running server, its collections of garbage and page
faults included, in a process forked from one whose heap was frozen first, as
:class:`mmproxy.DataLoader` does before its workers start (``freeze_gc``). It is the figure
closest to the GPU bench's ``cpu_ms_per_batch.workers``.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import resource
import time
from typing import Any


def _measure(paths: list[str], ext: str, batch: int, proxy: object, repeat: int, labels: bool,
             profile: int, conn: Any) -> None:
    """In a forked child, where the server is not local and the proxy sends, as in a worker."""
    import cProfile
    import io
    import pstats

    from mmproxy.datasets import MultiModalDataset, check_header
    from mmproxy.datasets.shards import read_local_tar

    from mmproxy._wire import transport as _transport

    _transport.send = lambda path, fds, name: None  # drop each batch instead of sending it
    fields: dict[str, Any] = {"x": (ext, proxy)}
    if labels:  # a field that stays in the worker, and the keys, as the recipes have
        fields["label"] = ("cls", int)
    ds = MultiModalDataset(paths, fields, batch_size=batch, shuffle_buffer=256, keep_keys=labels)
    best = [float("inf")] * 3
    n = 0
    for _ in range(repeat):
        start, n = time.perf_counter(), 0
        for path in paths:
            n += sum(1 for _ in read_local_tar(path))
        best[0] = min(best[0], (time.perf_counter() - start) / n)
        fields = [sample[ext] for path in paths for sample in read_local_tar(path)]
        start = time.perf_counter()
        for field in fields:
            check_header(ext, field)
        best[1] = min(best[1], (time.perf_counter() - start) / n)
        del fields
        start = time.perf_counter()
        for _ in ds:
            pass
        best[2] = min(best[2], (time.perf_counter() - start) / n)
    text = ""
    if profile:
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [None for _ in ds])
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(profile)
        text = out.getvalue()
    conn.send((n, *best, text))


def _measure_real(paths: list[str], ext: str, batch: int, proxy: object, repeat: int,
                  labels: bool, conn: Any) -> None:
    """In a forked child, the process's CPU time per sample, batches sent to the server."""
    from mmproxy.datasets import MultiModalDataset

    fields: dict[str, Any] = {"x": (ext, proxy)}
    if labels:
        fields["label"] = ("cls", int)
    ds = MultiModalDataset(paths, fields, batch_size=batch, shuffle_buffer=256, keep_keys=labels)
    for _ in range(2):
        for _ in ds:
            pass
    before, n = resource.getrusage(resource.RUSAGE_SELF), 0
    for _ in range(repeat):
        for got in ds:
            n += batch if "x" in got else 0  # (the bench's shards fill whole batches)
    after = resource.getrusage(resource.RUSAGE_SELF)
    conn.send((n, (after.ru_utime - before.ru_utime) / n, (after.ru_stime - before.ru_stime) / n,
               (after.ru_minflt - before.ru_minflt) / n))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["image", "audio"], default="image")
    parser.add_argument("--data-dir", default="/tmp/bench")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pipeline", choices=["external", "train"], default="external",
                        help="the server's pipeline: a bare external source, or (images) the "
                             "training pipeline, whose proxy draws crops per sample")
    parser.add_argument("--labels", action="store_true",
                        help="also a label field collated in the worker, and the keys")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the dataset path's N costliest functions (cProfile)")
    parser.add_argument("--real", action="store_true",
                        help="the worker process's CPU time per sample, with the sends to the "
                             "server made (see the module docstring)")
    a = parser.parse_args()

    from nvidia.dali import fn, pipeline_def, types

    import mmproxy
    from mmproxy.apps.bench.shards import written_shards

    paths = written_shards(a.data_dir, a.kind)
    if not paths:
        raise SystemExit(f"no {a.kind} shards under {a.data_dir}: run `mmproxy bench` first")
    ext, batch = ("jpg", 256) if a.kind == "image" else ("wav", 64)
    if a.pipeline == "train":
        if a.kind != "image":
            raise SystemExit("--pipeline train is the image training pipeline: use --kind image")
        from mmproxy.pipelines import image_train_pipeline

        pipeline = image_train_pipeline(batch_size=batch, device="cpu", num_threads=1,
                                        sample_seeded=True)
    else:
        @pipeline_def(batch_size=batch, num_threads=1, device_id=None)
        def pipe():  # type: ignore[no-untyped-def]
            return fn.external_source(name="data", no_copy=True, dtype=types.UINT8)

        pipeline = pipe()
    server = mmproxy.DALIServer(pipeline, name="cost")
    if a.real:
        with server:
            gc.collect()
            gc.freeze()  # what mmproxy.DataLoader does before its workers start
            n, user, system, faults = _in_child(_measure_real, paths, ext, batch, server.proxy,
                                                a.repeat, a.labels)
        print(f"{a.kind}: {n} samples; worker CPU {(user + system) * 1e6:.1f} us/sample (user "
              f"{user * 1e6:.1f}, system {system * 1e6:.1f}; {faults:.2f} page faults), batches "
              "sent to the server")
        return
    n, best_read, best_check, best_all, text = _in_child(
        _measure, paths, ext, batch, server.proxy, a.repeat, a.labels, a.profile)
    rest = best_all - best_read - best_check
    print(f"{a.kind}: {n} samples; shard reading {best_read * 1e6:.1f} us/sample, header checks "
          f"{best_check * 1e6:.1f}, whole worker path {best_all * 1e6:.1f} us/sample (the rest "
          f"{rest * 1e6:.1f})")
    if text:
        print(text)


def _in_child(target: Any, *args: Any) -> Any:
    """What ``target(*args, conn)`` sends back from a forked process."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    worker = ctx.Process(target=target, args=(*args, child))
    worker.start()
    child.close()  # so that recv() raises EOFError if the worker dies
    try:
        return parent.recv()
    except EOFError:
        raise SystemExit(f"the measuring process failed (exit code {worker.exitcode})") from None
    finally:
        worker.join(timeout=10)


if __name__ == "__main__":
    main()
