"""NVDEC clip decoder: the video pipeline's server-side decode on the GPU's NVDEC engines.

Each thread holds one session of the library that drives NVDEC (``nvdec_library``):
NVIDIA's PyNvVideoCodec, one decoder re-pointed at every clip, or TorchCodec, a decoder per clip
over its NVDEC decoder cache (:mod:`mmproxy.pipelines.video._nvdec_session`). A session decodes on the
thread's own CUDA stream, which is synchronized before the clip counts as done, so the pipeline
reads finished frames. docs/internals.md, ``mmproxy.pipelines.video._nvdec``, has the rest.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np
from mmproxy.pipelines.video._backlog import Backlog, paced
from mmproxy.pipelines.video._nvdec_session import Refused, Session
from mmproxy.pipelines.video._pynvvideocodec import PyNvSession, load_nvdec
from mmproxy.pipelines.video._torchcodec import TorchCodecSession, load_torchcodec

from mmproxy.errors import DamagedSampleError

__all__ = ["LIBRARY_CODECS", "NVDEC_CODECS", "NVDEC_LIBRARIES", "ClipDecoder", "check_library",
           "load_library", "load_nvdec", "nvdec_available"]

# What NVDEC decodes (MP4/MOV files; the worker sends anything else to PyAV)
NVDEC_CODECS = ("h264", "hevc", "vp8", "vp9", "av1")
# What each library is given: PyNvVideoCodec 2.2.4 returns other frames than those asked for in
# HEVC with B-frames (x265's defaults), from whole files and cut ones alike (the GPU test of cut
# clips), so its HEVC clips are PyAV's, in the worker
LIBRARY_CODECS = {"pynvvideocodec": ("h264", "vp8", "vp9", "av1"), "torchcodec": NVDEC_CODECS}
_CLOSE_TIMEOUT = 2.0  # seconds close() waits for the decode threads, in all
_FAILING = 8  # clips NVDEC refuses in a row (none decoded between) before it counts as failing
_PACE = 0.1  # weight of the latest clip in the decode threads' running time a clip
# The libraries that drive NVDEC, each a decode thread's session (pipelines/_nvdec_session.py's
# Session: pipelines/_pynvvideocodec.py, pipelines/_torchcodec.py)
NVDEC_LIBRARIES: dict[str, Callable[[int, Mapping[str, Any]], Session]] = {
    "pynvvideocodec": PyNvSession, "torchcodec": TorchCodecSession}


def check_library(library: str) -> None:
    """ValueError unless ``library`` is one of :data:`NVDEC_LIBRARIES`."""
    if library not in NVDEC_LIBRARIES:
        raise ValueError(f"nvdec_library must be one of {', '.join(map(repr, NVDEC_LIBRARIES))}, "
                         f"got {library!r}")


def load_library(library: str) -> None:
    """Loads ``library`` (of :data:`NVDEC_LIBRARIES`): a missing package or driver, or an unknown
    name, says so now rather than at the first clip."""
    check_library(library)
    (load_nvdec if library == "pynvvideocodec" else load_torchcodec)()


def nvdec_available(library: str = "pynvvideocodec") -> bool:
    """Whether ``library`` loads (PyNvVideoCodec: with the driver's video libraries; TorchCodec:
    with FFmpeg's)."""
    try:
        load_library(library)
    except (ImportError, RuntimeError):
        return False
    return True


class _Stage(enum.Enum):
    OPEN = "open"  # takes clips (its threads start at the first)
    CLOSED = "closed"  # closed: submit raises until start()


class _Crew:
    """The decode threads of one :meth:`ClipDecoder.start`, and the queue of their clips. The
    threads are daemon threads (a decode stuck in the driver never holds up the interpreter's
    exit); each frees its own decoder when it ends."""

    def __init__(self, count: int, serve: Callable[[_Crew], None]) -> None:
        self.queue: queue.SimpleQueue[tuple[Future[dict[str, Any]], dict[str, Any]] | None] = (
            queue.SimpleQueue())
        self.threads = [threading.Thread(target=serve, args=(self,), name=f"mmproxy-nvdec_{i}",
                                         daemon=True) for i in range(count)]
        for t in self.threads:
            t.start()

    def stop(self, timeout: float) -> list[str]:
        """Cancels the clips not started, lets the threads end after the clip each decodes, and
        waits up to ``timeout`` seconds in all for them; the names of those still running."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self.threads:
            self.queue.put(None)
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]


class ClipDecoder:
    """Decodes clips with NVDEC on ``threads`` threads of the server process (a
    :class:`~mmproxy.Prepare` stage, see the module docstring).

    A clip NVDEC refuses and PyAV decodes is PyAV's (a warning says so, once: PyAV on the
    server's threads is much slower); one that neither decodes is a
    :class:`~mmproxy.DamagedSampleError`. Without PyAV, a clip NVDEC refuses is damaged
    while NVDEC decodes others; once it has refused ``8`` clips in a row, NVDEC itself counts as
    failing: its error fails the run instead of dropping the clip. Any other error (CUDA out of
    memory, a driver error outside a decode) fails the run too.

    Args:
        input_name: The input that holds the encoded clip (or the frames a worker decoded); it
            becomes the pipeline's GPU input of the same name.
        frames: Frames per clip; None: every frame of the video.
        stride: Frames between two frames of a clip.
        device: The CUDA device.
        threads: Decode threads (each holds one session).
        options: More keyword arguments for the library's decoder: ``PyNvVideoCodec.SimpleDecoder``
            (``max_width``, ``max_height``, ``decoder_cache_size``) or TorchCodec's
            ``VideoDecoder`` (``seek_mode``, default ``"approximate"``).
        others: The pipeline's other inputs, passed on unchanged.
        library: The library that drives NVDEC, of :data:`NVDEC_LIBRARIES`.
        backlog: Where to publish the seconds of NVDEC work queued, for the workers that
            balance their clips by it (``cpu_share="auto"``), or None.
    """

    def __init__(self, input_name: str, frames: int | None, stride: int, device: int,
                 threads: int, options: Mapping[str, Any] | None, others: tuple[str, ...],
                 library: str = "pynvvideocodec", backlog: Backlog | None = None) -> None:
        if threads < 1:
            raise ValueError(f"decode threads must be at least 1, got {threads}")
        load_library(library)  # a missing package or driver says so now, not at the first clip
        self.library = library
        self.input_name, self.frames, self.stride = input_name, frames, stride
        self.device, self.threads, self.options = device, threads, dict(options or {})
        self.inputs = (input_name, "start", "at", *others)
        self._lock = threading.Lock()
        self._stage = _Stage.OPEN
        self._crew: _Crew | None = None
        self._refused_in_row = 0  # clips NVDEC refused since it last decoded one
        self._warned = False  # that PyAV decodes clips NVDEC refuses
        self.backlog = backlog
        self._queued = 0  # encoded clips submitted and not yet taken by a decode thread
        self.clips = {"nvdec": 0, "workers": 0}  # clips received: encoded, decoded in a worker
        self._pace = 0.0  # the decode threads' running time a clip, seconds

    def start(self) -> None:
        """Takes clips again after :meth:`close` (its threads start at the first)."""
        with self._lock:
            self._stage = _Stage.OPEN

    def submit(self, sample: dict[str, Any]) -> Future[dict[str, Any]]:
        """Starts decoding one sample's clip; the future gives the pipeline's inputs for it.
        Raises RuntimeError after :meth:`close`."""
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            if self._stage is _Stage.CLOSED:
                raise RuntimeError("the NVDEC clip decoder is closed (its server stopped); "
                                   "start the server again before sending it clips")
            if self._crew is None:
                self._crew = _Crew(self.threads, self._serve)
            self._crew.queue.put((future, sample))
            if np.ndim(sample[self.input_name]) == 1:
                self.clips["nvdec"] += 1
                self._queued += 1
                self._publish()
            else:
                self.clips["workers"] += 1
        return future

    def close(self) -> None:
        """Stops the threads: clips not started are cancelled, a clip being decoded finishes
        first; waits up to a few seconds for them (a warning names a thread still running: a
        decode stuck in the driver), and :meth:`submit` raises until :meth:`start`."""
        with self._lock:
            self._stage = _Stage.CLOSED
            crew, self._crew = self._crew, None
            self._queued = 0
            self._publish()
        if crew is None:
            return
        stuck = crew.stop(_CLOSE_TIMEOUT)
        if stuck:
            warnings.warn(f"NVDEC clip decoder: {', '.join(stuck)} still decoding {_CLOSE_TIMEOUT} s "
                          "after the stop (a call into the driver that does not return); left "
                          "running, it frees its decoder when it ends", RuntimeWarning, stacklevel=2)

    def _serve(self, crew: _Crew) -> None:
        """A decode thread: takes clips until the stop mark; frees its decoder at the end."""
        session: Session | None = None
        try:
            while (item := crew.queue.get()) is not None:
                future, sample = item
                encoded = np.ndim(sample[self.input_name]) == 1
                if encoded:
                    with self._lock:
                        self._queued = max(0, self._queued - 1)
                        self._publish()
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    if session is None:
                        session = NVDEC_LIBRARIES[self.library](self.device, self.options)
                    began = time.perf_counter()
                    result = self._prepare(session, sample)
                    if encoded:
                        self._paced(time.perf_counter() - began)
                    future.set_result(result)
                except BaseException as err:  # noqa: BLE001 - the future carries it to the runner
                    future.set_exception(err)
        finally:
            if session is not None:
                session.close()

    def _paced(self, seconds: float) -> None:
        """One clip took ``seconds`` on a decode thread: the running time a clip, and the
        backlog published with it."""
        with self._lock:
            self._pace = paced(self._pace, seconds, _PACE)
            self._publish()

    def _publish(self) -> None:
        """The seconds of NVDEC work queued for the decode threads, for the workers (called with
        the lock held). Only the clips submitted count (the runs the runner prepares ahead, two):
        a run still waiting in the server goes through the same queue whichever decoded its
        clips, so what the workers' decoding relieves is NVDEC's queue, not their wait."""
        if self.backlog is None:
            return
        try:
            self.backlog.publish(self._queued * self._pace / self.threads)
        except OSError as err:  # no page to be had (out of descriptors): every clip to NVDEC
            self.backlog = None
            warnings.warn(f"NVDEC clip decoder: cannot publish its backlog ({err}); the workers "
                          "read the last value it published", RuntimeWarning, stacklevel=2)

    def _prepare(self, session: Session, sample: dict[str, Any]) -> dict[str, Any]:
        import torch

        data = sample[self.input_name]
        out = {name: value for name, value in sample.items()
               if name not in ("start", "at", self.input_name)}
        with torch.cuda.stream(session.stream):
            if data.ndim == 4:  # frames the worker decoded: to the GPU as they are
                out[self.input_name] = session.to_device(data)
            else:
                out[self.input_name] = self._decode(session, data, int(sample["start"]),
                                                    sample["at"])
        session.stream.synchronize()
        return out

    def _decode(self, session: Session, data: np.ndarray, start: int, at: np.ndarray) -> Any:
        """The clip's frames on the GPU, by NVDEC, or by PyAV (on this thread) where NVDEC
        refuses the clip (a size or profile its engines lack, e.g. VP9 under 128 pixels); where
        PyAV fails too, the clip is damaged and both say why. ``at``: the frames to take, where
        the worker cut the clip to the packets they need (empty: the clip from ``start``)."""
        where = at.tolist() if len(at) else None
        try:
            frames = session.clip(data, start, self.frames, self.stride, where)
        except Refused as err:
            with self._lock:
                self._refused_in_row += 1
                failing = self._refused_in_row >= _FAILING
            return self._fallback(session, data, start, where, err, failing)
        with self._lock:
            self._refused_in_row = 0
        return frames

    def _fallback(self, session: Session, data: np.ndarray, start: int, at: list[int] | None,
                  refused: Refused, failing: bool) -> Any:
        """A clip NVDEC refused: PyAV's frames, or why it is damaged, or NVDEC's own failure."""
        # the messages count frames in the cut the worker sent, not in the video
        cut = "" if at is None else (f" (frames counted in the clip the worker cut from the "
                                     f"video, from the key frame before its frame {start})")
        try:
            from mmproxy.pipelines.video._pyav import decode_clip

            frames = decode_clip(data, start, self.frames, self.stride, at=at)
        except ImportError:
            if failing:
                raise RuntimeError(f"NVDEC refused the last {_FAILING} clips, the last with: "
                                   f"{refused} (NVDEC itself is failing, or the data is not video "
                                   "it decodes; install PyAV, pip install av, to decode the clips "
                                   "it refuses)") from refused
            raise DamagedSampleError(f"{refused}{cut}") from refused
        except ValueError as again:
            raise DamagedSampleError(f"{refused}; PyAV cannot decode it either: {again}{cut}"
                                     ) from again
        with self._lock:
            warn, self._warned = not self._warned, True
        if warn:
            warnings.warn(f"NVDEC clip decoder: NVDEC refused a clip ({refused}); PyAV decodes "
                          "the clips it refuses, on the server's decode threads, much slower "
                          "(said once)", RuntimeWarning, stacklevel=1)
        return session.to_device(frames)
