"""SPDL loader: the bench's ``spdl`` and ``spdl-gpu`` systems, the shards through a thread
pipeline of SPDL (``spdl.pipeline``) that decodes with SPDL's media library (``spdl.io``).
docs/internals.md, ``mmproxy.apps.bench.spdl_loader``, has the rest.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mmproxy.apps.bench.spdl_decode import Normalize, NvjpegImage, SpdlAudio, SpdlImage
from mmproxy.apps.bench.timing import time_epochs
from mmproxy.apps.bench.workers import call_named, named_fields, pad_collate

if TYPE_CHECKING:
    from mmproxy.apps.bench.systems import Setup

__all__ = ["run_spdl", "running", "spdl_missing"]

_ITEM_TIMEOUT_S = 600.0  # the longest wait for one batch: past it the pipeline is taken as hung
_POLL_S = 0.5  # how often a wait for a batch looks for a failed stage


def spdl_missing(gpu_decode: bool = False) -> str | None:
    """Why SPDL cannot run here ("not run: ..."), or None when it can: not installed, none of
    its FFmpeg builds loads (with the system's FFmpeg or PyAV's), or (``gpu_decode``) its CUDA
    build does not load or has no nvJPEG."""
    try:
        import spdl.io
        import spdl.io.utils
        import spdl.pipeline  # noqa: F401
    except ImportError as err:
        return f"not run: SPDL is not installed ({err}; pip install spdl, mmproxy's [spdl] extra)"
    from mmproxy.apps.bench.spdl_ffmpeg import load_cuda_build, load_ffmpeg

    try:
        load_ffmpeg()
    except (RuntimeError, OSError) as err:
        return (f"not run: {err}; install FFmpeg's libraries (Debian 12: apt-get install "
                "libavcodec59 libavformat59 libavfilter8 libavdevice59) or PyAV, whose bundled "
                "FFmpeg SPDL can use (pip install av)")
    if gpu_decode:
        import torch  # its CUDA runtime first: SPDL's CUDA build links the same library

        if not torch.cuda.is_available():
            return "not run: spdl-gpu decodes on a GPU, and there is none"
        try:
            load_cuda_build()
        except (RuntimeError, OSError) as err:
            return f"not run: SPDL's CUDA build does not load: {err}"
        if not spdl.io.utils.built_with_nvjpeg():
            return "not run: SPDL's CUDA build has no nvJPEG"
    return None


class _Rebatch:
    """An SPDL ``Aggregator``: shards' lists of samples in, lists of full batches out (one list per
    shard that completes any); the epoch's last, partial batch at its end."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.held: list[Any] = []

    def accumulate(self, samples: list[Any]) -> list[list[Any]] | None:
        self.held.extend(samples)
        full = len(self.held) - len(self.held) % self.size
        if not full:
            return None
        batches = [self.held[i:i + self.size] for i in range(0, full, self.size)]
        del self.held[:full]
        return batches

    def flush(self) -> list[list[Any]] | None:
        rest, self.held = self.held, []
        return [rest] if rest else None


class _FirstError:
    """Stage ops that keep the first exception any of them raised (SPDL's pipeline logs a failed
    stage and ends the epoch; its iterator does not carry the stage's exception)."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def wrap(self, op: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(item: Any) -> Any:
            try:
                return op(item)
            except BaseException as err:
                with self.lock:
                    self.error = self.error or err
                raise

        return run


class _Batch:
    """A batch of (where, bytes) decoded sample by sample (each error names its sample), then
    collated."""

    def __init__(self, decode: Any, collate: Any) -> None:
        self.decode, self.collate = decode, collate

    def __call__(self, samples: list[tuple[str, bytes]]) -> Any:
        return self.collate([call_named(self.decode, where, data) for where, data in samples])


@contextlib.contextmanager
def running(setup: Setup, gpu_decode: bool = False,
            errors: _FirstError | None = None) -> Iterator[Any]:
    """The workload's SPDL pipeline (module docstring; ``gpu_decode``: ``spdl-gpu``'s), started,
    its stages' first error kept in ``errors``; stopped, and its GPU thread ended, on the way
    out. Iterate ``pipeline.get_iterator(timeout=...)`` once an epoch."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="spdl-to-gpu") as gpu_thread:
        pipeline = _pipeline(setup, gpu_decode, errors or _FirstError(), gpu_thread)
        with pipeline.auto_stop():
            yield pipeline


def _pipeline(setup: Setup, gpu_decode: bool, errors: _FirstError, gpu_thread: Any) -> Any:
    from spdl.pipeline import PipelineBuilder
    from spdl.pipeline.defs import Aggregator

    Aggregator.register(_Rebatch)  # its interface (accumulate, flush), without importing SPDL early
    decoders = max(1, setup.args.workers)
    readers = max(1, min(decoders // 4, len(setup.paths)))
    decode: Any
    collate: Callable[[list[Any]], Any]
    if setup.modality == "audio":
        decode, collate = SpdlAudio(), pad_collate
    else:
        decode = NvjpegImage(setup.device_id or 0) if gpu_decode else SpdlImage()
        collate = decode.collate
        if not setup.gpu:  # on a GPU: normalized there, after the copy (or the decode there)
            normalize = Normalize()
            collate = lambda frames: normalize(decode.collate(frames))  # noqa: E731
    ext = setup.ext

    def read(path: str) -> list[tuple[str, bytes]]:
        return list(named_fields([path], ext))

    rebatch: Any = _Rebatch(setup.batch)
    builder: Any = (
        PipelineBuilder[str, Any]().add_source(setup.paths, continuous=True)
        .pipe(errors.wrap(read), concurrency=readers, name="read")
        .aggregate(rebatch).disaggregate()
        .pipe(errors.wrap(_Batch(decode, collate)), concurrency=decoders, name="decode"))
    if setup.gpu:
        builder = builder.pipe(errors.wrap(_ToGpu(setup.modality == "image", gpu_decode)),
                               executor=gpu_thread, name="to_gpu")
    return builder.add_sink(3).build(num_threads=decoders + readers, max_failures=0)


class _ToGpu:
    """The batch onto the GPU (SPDL's ``transfer_tensor_h2d``: pinned, on its own stream; already
    there for ``spdl-gpu``); images normalized there."""

    def __init__(self, images: bool, on_gpu: bool) -> None:
        self.normalize = Normalize() if images else None
        self.on_gpu = on_gpu

    def __call__(self, batch: Any) -> Any:
        import spdl.io

        if not self.on_gpu:
            batch = spdl.io.transfer_tensor_h2d(batch)
        return self.normalize(batch) if self.normalize else batch


def run_spdl(setup: Setup, gpu_decode: bool = False) -> dict[str, Any]:
    """The ``spdl`` system (``gpu_decode``: ``spdl-gpu``) on the workload, timed by
    :func:`~mmproxy.apps.bench.timing.time_epochs`, with whose FFmpeg it decoded (``ffmpeg``);
    "not run" with the reason where SPDL or its FFmpeg (or, for ``spdl-gpu``, its CUDA build)
    cannot run."""
    missing = spdl_missing(gpu_decode)
    if missing:
        return {"error": missing}
    import logging

    import torch

    from mmproxy.apps.bench.spdl_ffmpeg import load_ffmpeg

    errors = _FirstError()
    intra_op, log = torch.get_num_threads(), logging.getLogger("spdl")
    level = log.level
    torch.set_num_threads(1)  # as in a DataLoader worker: the pipeline's tasks are the parallelism
    log.setLevel(logging.CRITICAL)  # a failed stage's traceback, logged by each layer: raised below
    try:
        with running(setup, gpu_decode, errors) as pipeline:
            result = time_epochs(lambda: _epoch(pipeline, errors), setup.args.epochs, setup.gpu)
        return {**result, "ffmpeg": load_ffmpeg()}
    except Exception:
        if errors.error is not None:  # the stage's own error, naming the sample
            raise errors.error from None
        raise
    finally:
        torch.set_num_threads(intra_op)
        log.setLevel(level)


def _epoch(pipeline: Any, errors: _FirstError) -> Iterator[Any]:
    """One epoch's batches. The wait for each looks for a failed stage every ``_POLL_S`` and
    raises its error: after a stage fails, SPDL's pipeline may stop without ending the epoch, and
    its iterator would wait for a batch that never comes."""
    batches = pipeline.get_iterator(timeout=_POLL_S)
    waited = 0.0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (TimeoutError, queue.Empty):  # SPDL's timeout: nothing yet
            if errors.error is not None:
                raise errors.error from None
            waited += _POLL_S
            if waited >= _ITEM_TIMEOUT_S:
                raise TimeoutError(f"SPDL's pipeline gave no batch in {_ITEM_TIMEOUT_S:g} s; "
                                   "no stage failed") from None
            continue
        waited = 0.0
        yield batch
