"""Systems: the table of what the bench compares, and how each one loads a workload.
docs/internals.md, ``mmproxy.apps.bench.systems``, has the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from mmproxy.apps.bench.pipes import (
    FRAMES,
    RESIZE,
    SIZE,
    STRIDE,
    proxied_pipeline,
    reader_pipeline,
    recipe_pipeline,
)
from mmproxy.apps.bench.shards import write_shards
from mmproxy.apps.bench.timing import time_epochs
from mmproxy.apps.bench.workers import (
    ProxyCall,
    TinySamples,
    TorchImage,
    TorchVideo,
    WdsSamples,
    pad_collate,
    torch_audio,
)

__all__ = ["SYSTEMS", "Setup", "System", "WORKLOADS", "select"]

WORKLOADS = ("image", "audio", "image-text", "video", "machinery")


@dataclasses.dataclass(frozen=True)
class Setup:
    """One workload as every system gets it.

    Args:
        args: The ``mmproxy bench`` command line.
        workload: One of :data:`WORKLOADS`.
        paths: The shards.
        folder: Where the bench's shards are written.
        gpu: Whether the pipelines run on the GPU.
        device_id: The GPU, or None.
        batch: Samples per batch.
        tokenizer: For image-text: the captions' tokenizer.
        field: The heavy field's extension in your own shards (``--data``); None for the
            bench's own (jpg or wav).
    """

    args: argparse.Namespace
    workload: str
    paths: list[str]
    folder: Path
    gpu: bool
    device_id: int | None
    batch: int
    tokenizer: Any = None
    field: str | None = None

    @property
    def modality(self) -> str:
        """The heavy field: "audio" or "video" for those workloads, else "image"."""
        return self.workload if self.workload in ("audio", "video") else "image"

    @property
    def ext(self) -> str:
        return self.field or {"audio": "wav", "video": "mp4"}.get(self.modality, "jpg")


@dataclasses.dataclass(frozen=True)
class System:
    """A row of the table: a name, the workloads it runs, and how."""

    name: str
    workloads: frozenset[str]
    run: Callable[[Setup], dict[str, Any]]
    needs_damage: bool = False
    has_workers: bool = True  # DataLoader workers (--worker-cpus moves them)
    dali_without_checks: bool = False  # DALI decodes the files with no header check first


def select(workload: str, names: list[str], damage: float) -> list[System]:
    """The systems of ``names`` that run ``workload``, in order; mmproxy-damaged right after
    mmproxy when there is ``damage``. Unknown names are a ValueError."""
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    if damage and "mmproxy" in names and "mmproxy-damaged" not in names:
        names = [*names]
        names.insert(names.index("mmproxy") + 1, "mmproxy-damaged")
    return [SYSTEMS[name] for name in names
            if workload in SYSTEMS[name].workloads and (damage or not SYSTEMS[name].needs_damage)]


def _on_device(batch: Any, gpu: bool) -> Any:
    if not gpu:
        return batch
    if isinstance(batch, tuple):
        return tuple(x.cuda(non_blocking=True) for x in batch)
    return batch.cuda(non_blocking=True)


def worker_init(setup: Setup, then: Any = None) -> Any:
    """The workers' ``worker_init_fn``: onto ``--worker-cpus`` first, when given."""
    from mmproxy.apps.bench.cpu import PinWorker
    from mmproxy.apps.bench.remote import cpu_list

    cores = cpu_list(getattr(setup.args, "worker_cpus", None))
    return then if cores is None else PinWorker(cores, then)


def _stop_workers(loader: Any) -> None:
    """Stops a DataLoader's persistent workers now. After a failed epoch its iterator is held by
    the error's traceback, and the collector that frees it at exit waited ~10 s for the workers
    (a 3 s bench took 13 s to exit)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def _torch(setup: Setup, decoder: str) -> dict[str, Any]:
    import torch

    transform: Callable[[bytes], Any] = (
        TorchImage(decoder) if setup.modality == "image" else torch_audio
        if setup.modality == "audio" else TorchVideo(FRAMES, STRIDE, SIZE, RESIZE))
    loader = torch.utils.data.DataLoader(
        WdsSamples(setup.paths, setup.ext, transform), batch_size=setup.batch,
        num_workers=setup.args.workers, collate_fn=pad_collate if setup.modality == "audio" else None,
        pin_memory=setup.gpu, persistent_workers=setup.args.workers > 0,
        worker_init_fn=worker_init(setup))
    try:
        return time_epochs(lambda: (_on_device(b, setup.gpu) for b in loader), setup.args.epochs,
                           setup.gpu)
    finally:
        _stop_workers(loader)


def reader_batches(setup: Setup, prefetch: int = 2) -> Any:
    """DALI's reader through DALI's own iterator: an iterable of epochs' batches (tensors)."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    reader = DALIGenericIterator(reader_pipeline(setup, prefetch), ["data"], reader_name="reader",
                                 auto_reset=True, last_batch_policy=LastBatchPolicy.PARTIAL)
    return lambda: (b[0]["data"] for b in reader)


def _is_gzip(path: str) -> bool:
    if "://" in path:
        return path.endswith((".gz", ".tgz"))
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _dali_reader(setup: Setup, prefetch: int = 2) -> dict[str, Any]:
    if setup.modality == "video" and not setup.gpu:
        return {"error": "not run: DALI decodes H.264 on a GPU only (its CPU video decoder has "
                "no H.264)"}
    compressed = [p for p in setup.paths if _is_gzip(p)]
    if compressed:
        return {"error": f"not run: DALI's webdataset reader reads plain tars only, and "
                f"{len(compressed)} of the shards are gzip (e.g. {compressed[0]})"}
    before = gpu_memory_used(setup)
    batches = reader_batches(setup, prefetch)
    result = time_epochs(batches, setup.args.epochs, setup.gpu)
    result["pipelines"] = 1  # as DALI's users run the reader
    result["gpu_memory_mib"] = _grown(before, gpu_memory_used(setup))  # the reader still alive
    del batches
    return result


def _dali_graph(setup: Setup) -> dict[str, Any]:
    import queue
    import tarfile
    import threading

    import numpy as np
    import torch
    from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

    from mmproxy.server import auto_pipelines

    a = setup.args
    before = gpu_memory_used(setup)
    count = auto_pipelines(setup.device_id, a.threads) if a.pipelines == "auto" else a.pipelines
    pipes = [proxied_pipeline(setup) for _ in range(count)]  # the workload's graph, as the reader's
    for pipe in pipes:
        pipe.build()
    data = []
    for path in setup.paths:
        with tarfile.open(path) as tar:
            data += [np.frombuffer(tar.extractfile(m).read(), np.uint8)  # type: ignore[union-attr]
                     for m in tar if m.isfile() and m.name.rsplit(".", 1)[-1] == setup.ext]
    batches = [data[i:i + setup.batch] for i in range(0, len(data), setup.batch)]
    started = [False] * count

    depth = pipes[0].prefetch_queue_depth
    if len(batches) < count * depth:
        return {"error": f"not run: {len(batches)} batches fill fewer than {count} pipelines' "
                f"first runs of {depth}"}

    def feed(k: int, done: queue.Queue[Any]) -> None:
        """Pipeline ``k``'s share of an epoch's batches, ``depth`` of them in flight, each run's
        outputs copied into torch tensors as DALI's own iterator copies them."""
        pipe, pending = pipes[k], list[int]()
        device = torch.device("cuda", setup.device_id or 0) if setup.gpu else torch.device("cpu")
        stream = torch.cuda.Stream(device) if setup.gpu else None

        def take() -> None:
            for output in pipe.outputs():
                dense = output.as_tensor()
                tensor = torch.empty(dense.shape(), dtype=to_torch_type[dense.dtype], device=device)
                feed_ndarray(dense, tensor, cuda_stream=stream)
            done.put(pending.pop(0))

        try:
            for batch in batches[k::count]:
                pipe.feed_input("data", batch)
                pending.append(len(batch))
                if not started[k]:  # DALI's first run takes a whole queue's inputs
                    if len(pending) == depth:
                        pipe.schedule_run()
                        started[k] = True
                    continue
                if len(pending) > depth:
                    take()
                pipe.schedule_run()
            while pending:
                take()
        except BaseException as err:  # noqa: BLE001 - raised in the main thread
            done.put(err)
        finally:
            done.put(None)

    def epoch() -> Any:
        done: queue.Queue[Any] = queue.Queue()
        threads = [threading.Thread(target=feed, args=(k, done), daemon=True) for k in range(count)]
        for t in threads:
            t.start()
        ended = 0
        while ended < count:
            item = done.get()
            if item is None:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield np.empty((item, 0))
        for t in threads:
            t.join()

    try:
        result = time_epochs(epoch, a.epochs, setup.gpu)
        result["pipelines"] = count
        result["gpu_memory_mib"] = _grown(before, gpu_memory_used(setup))
        return result
    finally:
        for pipe in pipes:
            pipe._shutdown()  # now, not when the collector finds them


def _dali_proxy(setup: Setup, seed_setting: bool = False) -> dict[str, Any]:
    from nvidia.dali.plugin.pytorch.experimental import proxy as dali_proxy

    a = setup.args
    prefetch = 2 * a.workers if seed_setting else None  # what DALI's proxy page sets
    with dali_proxy.DALIServer(proxied_pipeline(setup, prefetch)) as server:
        data = (TinySamples(server.proxy, a.samples) if setup.workload == "machinery"
                else WdsSamples(setup.paths, setup.ext, ProxyCall(server.proxy)))
        loader = dali_proxy.DataLoader(server, data, batch_size=setup.batch, num_workers=a.workers,
                                       persistent_workers=a.workers > 0,
                                       worker_init_fn=worker_init(setup))
        try:
            return time_epochs(lambda: loader, a.epochs, setup.gpu)
        finally:
            _stop_workers(loader)


def _spdl(setup: Setup, gpu_decode: bool = False) -> dict[str, Any]:
    from mmproxy.apps.bench.spdl_loader import run_spdl

    return run_spdl(setup, gpu_decode)


def _decode(data: bytes) -> str:
    return data.decode()


def _mmproxy(setup: Setup, worker_init_fn: Any = None, **options: Any) -> dict[str, Any]:
    import mmproxy
    from mmproxy.apps.bench.report import error_line
    from mmproxy.datasets import MultiModalDataset, Tokenize
    from mmproxy.errors import SkipLimitError

    a = setup.args
    before = gpu_memory_used(setup)
    pipe, pad = recipe_pipeline(setup)
    server = mmproxy.DALIServer(pipe, name=setup.workload, pad=pad, pipelines=a.pipelines)
    with server:
        loader: Any
        if setup.workload == "machinery":
            loader = mmproxy.DataLoader(server, TinySamples(server.proxy, a.samples),
                                        batch_size=setup.batch, num_workers=a.workers,
                                        persistent_workers=a.workers > 0,
                                        worker_init_fn=worker_init(setup))
        else:
            fields: dict[str, Any] = {setup.modality: (setup.ext, server.proxy)}
            transform = None
            if setup.workload == "image-text":
                fields["text"] = ("txt", _decode)
                transform = Tokenize(setup.tokenizer, 32, "longest")
            dataset = MultiModalDataset(setup.paths, fields, batch_size=setup.batch,
                                        shuffle_buffer=256, keep_keys=False,
                                        batch_transform=transform, prefetch_next_epoch=a.next_epoch,
                                        on_error="skip", max_skipped=a.max_skipped, **options)
            loader = dataset.loader(server, num_workers=a.workers, persistent_workers=a.workers > 0,
                                    worker_init_fn=worker_init(setup, worker_init_fn))
        try:
            result = time_epochs(lambda: loader, a.epochs, setup.gpu, server)
        except SkipLimitError as err:  # damaged data: said so, with what was found
            return {"error": error_line(err), "damaged": err.counted}
        report = loader.skipped  # the last epoch's: what bad data cost, next to the rate
        result["skipped"] = {"samples": report.samples_skipped, "shards": report.shards}
        result["pipelines"] = server.pipelines
        result["gpu_memory_mib"] = _grown(before, gpu_memory_used(setup))
        return result


def gpu_memory_used(setup: Setup) -> float | None:
    """MiB in use on the bench's GPU, or None: what DALI's and PyTorch's pools hold but do not
    use is given back first, so that a system's figure does not depend on the systems before it."""
    if not setup.gpu:
        return None
    import gc

    import torch
    from nvidia.dali import backend

    gc.collect()  # a dropped system's pipelines and tensors
    torch.cuda.synchronize(setup.device_id)
    torch.cuda.empty_cache()
    backend.ReleaseUnusedMemory()  # type: ignore[attr-defined]
    free, total = torch.cuda.mem_get_info(setup.device_id)
    return (total - free) / 2**20


def _grown(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else round(after - before, 1)


def _mmproxy_damaged(setup: Setup) -> dict[str, Any]:
    a = setup.args
    paths = write_shards(setup.folder, "image", a.samples, a.workers, a.damage, a.damage_kind)
    return _mmproxy(dataclasses.replace(setup, paths=paths))


def _remote(name: str, setup: Setup) -> dict[str, Any]:
    """mmproxy on the shards served by a local HTTP or S3 server process."""
    import tempfile

    from mmproxy.apps.bench.remote import SpreadEndpoints, cpu_list, s3_processes, serving
    from mmproxy.datasets.remote import RemoteOptions

    s3 = name == "mmproxy-s3"
    with serving("s3" if s3 else "http", setup.paths,
                 s3_processes(setup.args.workers) if s3 else 1,
                 cpu_list(getattr(setup.args, "server_cpus", None))) as urls, \
            tempfile.TemporaryDirectory(prefix="mmproxy-cache-") as cache:
        remote = RemoteOptions(cache_dir=cache if name == "mmproxy-cached" else None)
        return _mmproxy(dataclasses.replace(setup, paths=urls), remote=remote,
                        worker_init_fn=SpreadEndpoints())


SYSTEMS: dict[str, System] = {system.name: system for system in (
    System("mmproxy", frozenset(WORKLOADS), _mmproxy),
    System("mmproxy-damaged", frozenset({"image"}), _mmproxy_damaged, needs_damage=True),
    System("torch", frozenset({"image", "audio", "video"}), partial(_torch, decoder="pil")),
    System("torch-tensor", frozenset({"image"}), partial(_torch, decoder="tensor")),
    System("dali-proxy", frozenset({"image", "audio", "machinery"}), _dali_proxy,
           dali_without_checks=True),
    System("dali-proxy-seed", frozenset({"image", "audio", "machinery"}),
           partial(_dali_proxy, seed_setting=True), dali_without_checks=True),
    System("dali-reader", frozenset({"image", "audio", "image-text", "video"}), _dali_reader,
           has_workers=False, dali_without_checks=True),
    System("dali-graph", frozenset({"image", "audio", "image-text"}), _dali_graph,
           has_workers=False, dali_without_checks=True),
    System("spdl", frozenset({"image", "audio"}), _spdl, has_workers=False),
    System("spdl-gpu", frozenset({"image"}), partial(_spdl, gpu_decode=True), has_workers=False),
    *(System(name, frozenset({"image", "audio", "image-text"}), partial(_remote, name))
      for name in ("mmproxy-http", "mmproxy-s3", "mmproxy-cached")),
)}
