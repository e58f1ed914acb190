"""NVDEC sessions: PyNvVideoCodec loaded with errors that say what is missing, and one decode
thread's session (its CUDA stream, its decoder re-pointed at each clip, its memory files).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["Slot", "load_nvdec", "nvdec_available"]

_INSTALL = "pip install 'mmproxy[nvdec]'"
_FILTERS = threading.Lock()  # held by a decode thread while it changes the warning filters


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


class Slot:
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

    def to_device(self, frames: np.ndarray) -> Any:
        """Frames in host memory, copied to the GPU (on the current stream)."""
        import torch

        if frames.flags.writeable:
            return torch.from_numpy(frames).to(f"cuda:{self.device}")
        # read-only shared memory: torch only reads it. The warning filters are the process's:
        # one thread at a time changes and restores them, so none restores another's change
        with _FILTERS, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(frames)
        return tensor.to(f"cuda:{self.device}")

    def close(self) -> None:
        self.decoder = None
        for f in self.files:
            f.close()
