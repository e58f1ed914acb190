"""NVDEC clip decoder: the video pipeline's server-side decode with NVIDIA's PyNvVideoCodec.

With ``video_pipeline(decoder="nvdec")`` (or ``"mixed"``) the worker reads the container header
and draws the clip as for every decoder (start, crop, flip), then sends the encoded bytes (as the
heavy fields travel: by reference, no copy) and the start frame. In the server process this
stage (a :class:`~mmproxy._prepare.Prepare`) decodes each clip's frames into GPU memory before
the run is fed; DALI's GPU ``external_source`` takes them for the resize, crop, flip and
normalize::

    worker: header, draws, bytes ─> server: PreparedRuns ─> ClipDecoder.submit (per clip)
                                        [mmproxy-nvdec_0 .. _N threads: one decoder each]
                                        bytes -> memory file -> SimpleDecoder.reconfigure_decoder
                                        -> get_batch_frames_by_index -> torch [T, H, W, 3] uint8
                                  <─ all clips of the run decoded: the run is fed (GPU frames)

Each thread keeps one ``SimpleDecoder`` for its whole life and re-points it at every clip
(``reconfigure_decoder``): creating a decoder session costs far more than a clip's decode, and
re-pointing reuses the thread's cached sessions. Re-pointing takes a path, so each clip's bytes
are written once into one of the thread's two anonymous memory files (``memfd``: nothing on
disk, nothing left behind) and opened as ``/proc/self/fd/N``. The frames are copied out of the
decoder's surfaces (the decoder reuses them) on the thread's own CUDA stream, which is
synchronized before the clip counts as done, so the pipeline reads finished frames.

A clip the worker already decoded (``"mixed"``'s CPU share, or a codec NVDEC does not decode)
arrives as its frames and is only copied to the GPU. A clip NVDEC refuses (a size or profile its
engines lack) is decoded by PyAV on the same thread, when PyAV is installed; one that neither
decodes fails alone, with both decoders' messages: a skipped sample with ``on_error="skip"``.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["NVDEC_CODECS", "ClipDecoder", "load_nvdec", "nvdec_available"]

# What PyNvVideoCodec decodes on NVDEC (MP4/MOV files; the worker sends anything else to PyAV)
NVDEC_CODECS = ("h264", "hevc", "vp8", "vp9", "av1")
_INSTALL = "pip install 'mmproxy[nvdec]'"


def load_nvdec() -> Any:
    """The ``PyNvVideoCodec`` module; ImportError naming the extra when it is missing, RuntimeError
    saying so when it cannot load the NVIDIA driver's video libraries (no GPU or driver here)."""
    import logging

    log = logging.getLogger("PyNvVideoCodec")
    level, log.disabled = log.disabled, True  # its import logs a page of its own on failure
    try:
        import PyNvVideoCodec as nvc
    except ImportError:
        raise ImportError(f"decoder='nvdec' needs NVIDIA's PyNvVideoCodec: {_INSTALL}") from None
    except Exception as err:  # noqa: BLE001 - it raises RuntimeError, or OSError from the loader
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RuntimeError(
            "decoder='nvdec': PyNvVideoCodec is installed but cannot load the NVIDIA driver's "
            "video libraries (libnvcuvid, libnvidia-encode): there is no NVIDIA GPU or driver "
            "here, or the container was started without the driver's video capability "
            f"(NVIDIA_DRIVER_CAPABILITIES=compute,utility,video). PyNvVideoCodec said: {first}"
        ) from err
    finally:
        log.disabled = level
    return nvc


def nvdec_available() -> bool:
    """Whether PyNvVideoCodec imports and finds the driver's video libraries."""
    try:
        load_nvdec()
    except (ImportError, RuntimeError):
        return False
    return True


class _Memfile:
    """An anonymous memory file a decoder opens by path; rewritten for every clip."""

    def __init__(self, name: str) -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        self.path = f"/proc/self/fd/{self.fd}"

    def write(self, data: np.ndarray) -> str:
        os.ftruncate(self.fd, 0)
        view = np.ascontiguousarray(data).data.cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], done)
        return self.path

    def close(self) -> None:
        os.close(self.fd)


class _Slot:
    """One decode thread's state: its CUDA stream, its decoder, its two memory files."""

    def __init__(self, device: int, options: Mapping[str, Any]) -> None:
        import torch

        self.nvc = load_nvdec()
        torch.cuda.set_device(device)
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.files = [_Memfile("mmproxy-nvdec"), _Memfile("mmproxy-nvdec")]
        self.turn = 0
        self.decoder: Any = None
        self.options = dict(options)

    def open(self, data: np.ndarray) -> Any:
        """The decoder, pointed at ``data``. Alternating between two files gives each clip a path
        of its own, so re-pointing never finds the previous clip's source."""
        path = self.files[self.turn].write(data)
        self.turn ^= 1
        if self.decoder is None:
            self.decoder = self.nvc.SimpleDecoder(
                path, gpu_id=self.device, use_device_memory=True,
                cuda_stream=self.stream.cuda_stream,
                output_color_type=self.nvc.OutputColorType.RGB, **self.options)
        else:
            self.decoder.reconfigure_decoder(path)
        return self.decoder

    def close(self) -> None:
        self.decoder = None
        for f in self.files:
            f.close()


class ClipDecoder:
    """Decodes clips with NVDEC on ``threads`` threads of the server process (a
    :class:`~mmproxy._prepare.Prepare` stage, see the module docstring).

    Args:
        input_name: The input that holds the encoded clip (or the frames a worker decoded); it
            becomes the pipeline's GPU input of the same name.
        frames: Frames per clip; None: every frame of the video.
        stride: Frames between two frames of a clip.
        device: The CUDA device.
        threads: Decode threads (each holds one decoder and its sessions).
        options: More keyword arguments for ``PyNvVideoCodec.SimpleDecoder`` (``max_width``,
            ``max_height``, ``decoder_cache_size``).
        others: The pipeline's other inputs, passed on unchanged.
    """

    def __init__(self, input_name: str, frames: int | None, stride: int, device: int,
                 threads: int, options: Mapping[str, Any] | None, others: tuple[str, ...]) -> None:
        if threads < 1:
            raise ValueError(f"decode threads must be at least 1, got {threads}")
        load_nvdec()  # a missing package or driver says so now, not at the first clip
        self.input_name, self.frames, self.stride = input_name, frames, stride
        self.device, self.threads, self.options = device, threads, dict(options or {})
        self.inputs = (input_name, "start", *others)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._slots: list[_Slot] = []
        self._local = threading.local()

    def submit(self, sample: dict[str, Any]) -> Future[dict[str, Any]]:
        """Starts decoding one sample's clip; the future gives the pipeline's inputs for it."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="mmproxy-nvdec")
            return self._pool.submit(self._prepare, sample)

    def close(self) -> None:
        """Stops the threads (a clip being decoded finishes first) and frees their decoders;
        the next :meth:`submit` starts them again."""
        with self._lock:
            pool, self._pool = self._pool, None
            slots, self._slots = self._slots, []
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for slot in slots:
            slot.close()

    def _slot(self) -> _Slot:
        slot = getattr(self._local, "slot", None)
        if slot is None:
            slot = self._local.slot = _Slot(self.device, self.options)
            with self._lock:
                self._slots.append(slot)
        return slot

    def _prepare(self, sample: dict[str, Any]) -> dict[str, Any]:
        import torch

        slot = self._slot()
        data = sample[self.input_name]
        out = {name: value for name, value in sample.items() if name not in ("start", self.input_name)}
        with torch.cuda.stream(slot.stream):
            if data.ndim == 4:  # frames the worker decoded: to the GPU as they are
                with warnings.catch_warnings():  # read-only shared memory: torch only reads it
                    warnings.simplefilter("ignore", UserWarning)
                    out[self.input_name] = torch.from_numpy(data).to(f"cuda:{slot.device}")
            else:
                out[self.input_name] = self._decode(slot, data, int(sample["start"]))
        slot.stream.synchronize()
        return out

    def _decode(self, slot: _Slot, data: np.ndarray, start: int) -> Any:
        """The clip's frames on the GPU, by NVDEC, or by PyAV (on this thread) where NVDEC
        refuses the clip (a size or profile its engines lack, e.g. VP9 under 128 pixels); where
        PyAV fails too, the clip is damaged and both say why."""
        import torch

        try:
            return self._nvdec(slot, data, start)
        except ValueError as err:
            try:
                from mmproxy.pipelines._pyav import decode_clip

                frames = decode_clip(data, start, self.frames, self.stride)
            except ImportError:
                raise err from None
            except ValueError as again:
                raise ValueError(f"{err}; PyAV cannot decode it either: {again}") from again
            return torch.from_numpy(frames).to(f"cuda:{slot.device}")

    def _nvdec(self, slot: _Slot, data: np.ndarray, start: int) -> Any:
        """The clip's frames ``[T, H, W, 3]`` (uint8 RGB, on the GPU): ``frames`` frames from
        ``start`` at ``stride``, the last frame repeated past the video's end. A clip the
        thread's re-pointed decoder refuses is tried once more on a fresh decoder (a new
        session) before it counts as damaged."""
        fresh = slot.decoder is None
        try:
            return self._frames(slot, data, start)
        except ValueError:  # a re-pointed session may refuse a clip a fresh one decodes
            if fresh:
                raise
            slot.decoder = None
        return self._frames(slot, data, start)

    def _frames(self, slot: _Slot, data: np.ndarray, start: int) -> Any:
        import torch

        try:
            decoder = slot.open(data)
            total = len(decoder)
        except Exception as err:  # noqa: BLE001 - PyNvVideoCodec raises RuntimeError, Exception
            slot.decoder = None
            raise ValueError(f"NVDEC cannot open the video: {_said(err)}") from err
        if total < 1:
            raise ValueError("NVDEC finds no frames in the video")
        wanted = (list(range(total)) if self.frames is None else
                  [min(start + i * self.stride, total - 1) for i in range(self.frames)])
        unique = sorted(set(wanted))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # an index it would skip is an error here
                got = decoder.get_batch_frames_by_index(unique)
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"NVDEC cannot decode frames {unique[0]}-{unique[-1]} of the "
                             f"{total:,} in the video: {_said(err)}") from err
        if len(got) != len(unique):
            raise ValueError(f"NVDEC decoded {len(got)} of the {len(unique)} frames the clip "
                             f"needs ({unique[0]}-{unique[-1]} of {total:,}): the video is damaged")
        frame_of = dict(zip(unique, got))
        return torch.stack([torch.from_dlpack(frame_of[i]) for i in wanted])


def _said(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:300] or type(err).__name__
