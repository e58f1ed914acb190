"""PyNvVideoCodec's NVDEC decoding as a decode thread's session (``nvdec_library="pynvvideocodec"``,
the default). docs/internals.md, ``mmproxy.pipelines.video._pynvvideocodec``, has the rest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from mmproxy.pipelines.video._nvdec_session import (
    Refused,
    decode_frames,
    not_the_clip,
    readonly_tensor,
    said,
)

from mmproxy.errors import install_hint

__all__ = ["PyNvSession", "load_nvdec"]

_INSTALL = install_hint("PyNvVideoCodec")


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


class PyNvSession:
    """One decode thread's PyNvVideoCodec state: its CUDA stream, its decoder, its two memory
    files (module docstring)."""

    LIBRARY = "PyNvVideoCodec"

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

    def write(self, data: np.ndarray) -> str:
        """Writes a clip's bytes into the next memory file, and says its path. Alternating
        between two files gives each clip a path of its own, so re-pointing never finds the
        previous clip's source."""
        path = self.files[self.turn].write(data)
        self.turn ^= 1
        return path

    def point(self, path: str) -> Any:
        """The decoder, pointed at the video in ``path``."""
        if self.decoder is None:
            self.decoder = self.nvc.SimpleDecoder(
                path, gpu_id=self.device, use_device_memory=True,
                cuda_stream=self.stream.cuda_stream,
                output_color_type=self.nvc.OutputColorType.RGB, **self.options)
        else:
            self.decoder.reconfigure_decoder(path)
        return self.decoder

    def clip(self, data: np.ndarray, start: int, frames: int | None, stride: int,
             at: Sequence[int] | None = None) -> Any:
        """The clip's frames ``[T, H, W, 3]`` (uint8 RGB, on the GPU; :func:`clip_indices`, or
        the frames ``at``). A clip the re-pointed decoder refuses is tried once more on a fresh
        decoder (a new session) before it counts as :class:`Refused`."""
        fresh = self.decoder is None
        try:
            return self._frames(data, start, frames, stride, at)
        except Refused:  # a re-pointed session may refuse a clip a fresh one decodes
            if fresh:
                raise
            self.decoder = None
        return self._frames(data, start, frames, stride, at)

    def _frames(self, data: np.ndarray, start: int, frames: int | None, stride: int,
                at: Sequence[int] | None) -> Any:
        import torch

        path = self.write(data)
        try:
            decoder = self.point(path)
            total = len(decoder)
        except Exception as err:  # noqa: BLE001 - PyNvVideoCodec raises RuntimeError, Exception
            self.decoder = None
            if not_the_clip(err):
                raise
            raise Refused(f"NVDEC cannot open the video: {said(err)}") from err
        if total < 1:
            raise Refused("NVDEC finds no frames in the video")
        wanted, unique, got = decode_frames("NVDEC", total, start, frames, stride,
                                            decoder.get_batch_frames_by_index, at)
        frame_of = dict(zip(unique, got))
        return torch.stack([torch.from_dlpack(frame_of[i]) for i in wanted])

    def to_device(self, frames: np.ndarray) -> Any:
        """Frames in host memory, copied to the GPU (on the current stream)."""
        return readonly_tensor(frames).to(f"cuda:{self.device}")

    def close(self) -> None:
        self.decoder = None
        for f in self.files:
            f.close()
