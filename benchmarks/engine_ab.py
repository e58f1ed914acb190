"""``mmproxy bench`` with variants of one engine detail as extra systems, so that a change is
measured against the alternative in the same call, interleaved with the reference systems.

Variants (each is mmproxy with one thing changed):

- ``mmproxy-list-feed``: the server feeds DALI each input as a Python list of per-sample arrays
  (before session 10) instead of one ``TensorListCPU`` sharing their memory.
- ``mmproxy-depth4``: the pipeline keeps 4 runs in flight (``prefetch_queue_depth=4``) instead
  of ``--prefetch`` (2), so that DALI has more than one run queued while the server's runner
  takes a run's outputs and feeds the next.
- ``mmproxy-feed-ahead``: the server's runner feeds the next run's inputs before it waits for
  the outputs of the runs in flight, and schedules it the moment DALI gives a run's outputs up
  (``Runner(feed_ahead=True)``), so that DALI's wait for its next run is a ``_run_once``, as
  under DALI's own iterator, not the conversion, the hand-over and the ~0.8 ms feed.
- ``mmproxy-feed-ahead-depth4``: both of the above.
- ``mmproxy-nice``: the DataLoader workers run at nice 10 (``os.nice(10)`` as each starts), so
  that DALI's threads and the server's win a contended core; ``mmproxy-feed-ahead-nice`` with
  feed-ahead too.
- ``mmproxy-switch``: Python's thread switch interval at 0.2 ms instead of 5 ms, so that a thread
  waiting for the GIL (the runner, or a DALI thread releasing the inputs it was fed, which are
  Python objects) gets it sooner from a Python thread that holds it.
- ``mmproxy-copied-inputs``: DALI copies the inputs when they are fed (``external_source``
  ``no_copy=False``), so that no Python object outlives the feed inside DALI.
- ``dali-reader-depth4``: the reference with the same change, DALI's reader 4 runs deep instead of
  DALI's default (2): whether depth is what separates the two.
- ``dali-reader-beside-workers``: the reader, timed while mmproxy's workers, listener and runner
  load the same shards beside it, paced one batch per reader batch, for a server that only hands
  the bytes back: what the dataset side costs a pipeline that does not depend on it.
  ``dali-reader-beside-process``: the same with that dataset side in a process of its own, so
  that only the CPUs are shared, not the reader's process and its GIL.
- ``mmproxy-pinned-maps`` (GPU only): every shard the server maps is mapped once for the
  variant's run and page-locked with ``cudaHostRegister`` (read-only), and samples inside those
  mappings are fed as pinned, as a reader's output is, so DALI need not copy them into pinned
  memory before the decoder. (Session 10 measured an earlier form of it, on code that kept every
  mapping: 8% slower on the bench's images, no change on photographs; HISTORY.md.)

Every other argument is ``mmproxy bench``'s::

    CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python benchmarks/engine_ab.py --workload image \\
        --samples 16384 --workers 15 --threads 8 --epochs 5 --runs 3 \\
        --systems mmproxy,mmproxy-list-feed,dali-reader
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from mmproxy import _dali, _transport, cli
from mmproxy.apps.bench import systems


def _as_list(arrays: Any) -> Any:
    return list(arrays)


@contextlib.contextmanager
def _list_feed() -> Iterator[None]:
    kept = _dali._tensor_list
    _dali._tensor_list = _as_list
    try:
        yield
    finally:
        _dali._tensor_list = kept


@contextlib.contextmanager
def _pinned_maps() -> Iterator[None]:
    import mmap
    import os

    import torch
    from nvidia.dali.backend import TensorCPU, TensorListCPU

    cudart = torch.cuda.cudart()
    by_file: dict[tuple[int, int, int, int], mmap.mmap] = {}  # each shard mapped and locked once
    ranges: list[tuple[int, int]] = []  # (start, end) of the locked mappings, sorted
    map_file, tensor_list = _transport._map_file, _dali._tensor_list

    def pinned_map_file(fd: int) -> Any:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in by_file:
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            address = _transport._address(mapping)
            err = cudart.cudaHostRegister(address, len(mapping), 8)  # cudaHostRegisterReadOnly
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister failed: {cudart.cudaGetErrorString(err)}")
            by_file[key] = mapping
            bisect.insort(ranges, (address, address + len(mapping)))
        return by_file[key]

    def locked(a: Any) -> bool:
        address = a.__array_interface__["data"][0]
        i = bisect.bisect_right(ranges, (address, float("inf"))) - 1
        return i >= 0 and address + a.nbytes <= ranges[i][1]

    def pinned_list(arrays: Any) -> Any:  # a memfd's payloads are not locked: fed as they are
        return TensorListCPU([TensorCPU(a, "", locked(a)) for a in arrays],  # type: ignore[call-overload]
                             contiguous=False)

    _transport._map_file, _dali._tensor_list = pinned_map_file, pinned_list
    try:
        yield
    finally:
        _transport._map_file, _dali._tensor_list = map_file, tensor_list
        for start, _ in ranges:
            cudart.cudaHostUnregister(start)


@contextlib.contextmanager
def _feed_ahead() -> Iterator[None]:
    from mmproxy import server

    kept = server.Runner
    server.Runner = functools.partial(kept, feed_ahead=True)  # type: ignore[misc]
    try:
        yield
    finally:
        server.Runner = kept  # type: ignore[misc]


@contextlib.contextmanager
def _nice_workers() -> Iterator[None]:
    from mmproxy import loader

    kept = loader._WorkerInit.__call__

    def nice_then_init(self: Any, worker_id: int) -> None:
        os.nice(10)
        kept(self, worker_id)

    loader._WorkerInit.__call__ = nice_then_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        loader._WorkerInit.__call__ = kept  # type: ignore[method-assign]


@contextlib.contextmanager
def _feed_ahead_nice() -> Iterator[None]:
    with _feed_ahead(), _nice_workers():
        yield


@contextlib.contextmanager
def _short_switch() -> Iterator[None]:
    kept = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    try:
        yield
    finally:
        sys.setswitchinterval(kept)


@contextlib.contextmanager
def _copied_inputs() -> Iterator[None]:
    from nvidia.dali import fn

    kept = fn.external_source

    def copying(*args: Any, **kwargs: Any) -> Any:
        return kept(*args, **{**kwargs, "no_copy": False})

    fn.external_source = copying
    try:
        yield
    finally:
        fn.external_source = kept


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "mmproxy-switch": _short_switch,
    "mmproxy-copied-inputs": _copied_inputs,
    "mmproxy-nice": _nice_workers,
    "mmproxy-feed-ahead-nice": _feed_ahead_nice,
    "mmproxy-list-feed": _list_feed,
    "mmproxy-pinned-maps": _pinned_maps,
    "mmproxy-feed-ahead": _feed_ahead,
}


def _variant(run: Callable[[systems.Setup], dict[str, Any]],
             patch: Callable[[], contextlib.AbstractContextManager[None]] | None,
             setup: systems.Setup, prefetch: int | None = None) -> dict[str, Any]:
    """mmproxy's ``run`` under ``patch``, ``prefetch`` runs deep when given."""
    if prefetch is not None:
        setup = dataclasses.replace(setup, args=argparse.Namespace(**{**vars(setup.args),
                                                                       "prefetch": prefetch}))
    with patch() if patch is not None else contextlib.nullcontext():
        return run(setup)


def _beside_loader(paths: list[str], field: tuple[str, str], batch: int, workers: int) -> Any:
    """mmproxy's dataset side for the beside systems: workers, listener and runner, for a server
    whose pipeline only hands the bytes back (on the CPU, one thread)."""
    from mmproxy.datasets import MultiModalDataset
    from mmproxy.pipelines import external_pipeline

    import mmproxy

    server = mmproxy.DALIServer(external_pipeline(lambda data: data, input_name="data",
                                                  batch_size=batch, num_threads=1), name="beside")
    name, ext = field
    dataset = MultiModalDataset(paths, {name: (ext, server.proxy)}, batch_size=batch,
                                shuffle_buffer=256, keep_keys=False, on_error="skip")
    return server, dataset.loader(server, num_workers=workers, persistent_workers=True)


def _load_paced(loader: Any, pace: Any, stop: Any, ready: Any, loaded: Any) -> None:
    """Takes one batch of ``loader`` each time ``pace`` is released, until ``stop`` is set;
    sets ``ready`` once the first batch is in (the workers started); counts them in ``loaded``."""
    while not stop.is_set():
        for _ in loader:
            loaded.value += 1
            ready.set()
            while not pace.acquire(timeout=0.1):
                if stop.is_set():
                    return


def _beside_process(paths: list[str], field: tuple[str, str], batch: int, workers: int,
                    pace: Any, stop: Any, ready: Any, loaded: Any) -> None:
    server, loader = _beside_loader(paths, field, batch, workers)
    with server:
        _load_paced(loader, pace, stop, ready, loaded)
        systems._stop_workers(loader)


def _reader_beside_workers(setup: systems.Setup, process: bool = False) -> dict[str, Any]:
    """DALI's reader, timed while mmproxy's dataset side (:func:`_beside_loader`) loads the
    same shards with the same workers beside it, one batch per reader batch: in this process
    (its listener, runner and loader threads share the reader's process and GIL), or with
    ``process`` in a process of its own (only the CPUs are shared)."""
    import multiprocessing
    import threading

    from mmproxy.apps.bench import timing

    a = setup.args
    where: Any = multiprocessing.get_context("spawn") if process else threading
    pace, stop, ready = where.Semaphore(0), where.Event(), where.Event()
    loaded = multiprocessing.get_context("spawn").Value("q", 0)  # batches the dataset side took
    job = (setup.paths, (setup.modality, setup.ext), setup.batch, a.workers)
    epoch = systems.reader_batches(setup)

    def paced() -> Iterator[Any]:
        for batch in epoch():
            pace.release()
            yield batch

    with contextlib.ExitStack() as stack:
        if process:
            # not a daemon: it starts workers of its own (it is stopped below, or terminated)
            beside = where.Process(target=_beside_process, args=(*job, pace, stop, ready, loaded))
            stack.callback(_end, beside)
        else:
            server, loader = _beside_loader(*job)
            stack.enter_context(server)
            stack.callback(systems._stop_workers, loader)
            beside = threading.Thread(target=_load_paced, args=(loader, pace, stop, ready, loaded),
                                      daemon=True)
        beside.start()
        for _ in range(8):  # the first batches are on their way before the reader's clock starts
            pace.release()
        stack.callback(beside.join, 30)
        stack.callback(stop.set)
        for _ in range(300):  # a spawned process imports torch and DALI first
            if ready.wait(1):
                break
            if not beside.is_alive():
                raise RuntimeError("the dataset side beside the reader ended before its first batch")
        else:
            raise RuntimeError("the dataset side beside the reader delivered no batch in 300 s")
        before = loaded.value
        result = timing.time_epochs(paced, a.epochs, setup.gpu)
        if not beside.is_alive():  # the reader would have been timed with nothing beside it
            raise RuntimeError("the dataset side beside the reader ended while it was timed")
        result["beside_batches"] = loaded.value - before  # taken while the reader was timed
        return result


def _end(process: Any) -> None:
    """A beside process that did not stop in time: terminated, then killed, and reaped."""
    if process.is_alive():
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)


def register() -> None:
    mmproxy, reader = systems.SYSTEMS["mmproxy"], systems.SYSTEMS["dali-reader"]
    variant = functools.partial(_variant, mmproxy.run)
    variants = {name: functools.partial(variant, patch) for name, patch in VARIANTS.items()}
    variants["mmproxy-depth4"] = functools.partial(variant, None, prefetch=4)
    variants["mmproxy-feed-ahead-depth4"] = functools.partial(variant, _feed_ahead, prefetch=4)
    for name, run in variants.items():
        systems.SYSTEMS[name] = dataclasses.replace(mmproxy, name=name, run=run)
    systems.SYSTEMS["dali-reader-beside-workers"] = dataclasses.replace(
        reader, name="dali-reader-beside-workers", run=_reader_beside_workers)
    systems.SYSTEMS["dali-reader-beside-process"] = dataclasses.replace(
        reader, name="dali-reader-beside-process",
        run=functools.partial(_reader_beside_workers, process=True))
    systems.SYSTEMS["dali-reader-depth4"] = dataclasses.replace(
        reader, name="dali-reader-depth4", run=functools.partial(systems._dali_reader, prefetch=4))


if __name__ == "__main__":
    register()
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
