"""TorchCodec's NVDEC decoding as a decode thread's session (``nvdec_library="torchcodec"``).

TorchCodec loads the system's FFmpeg shared libraries (majors 4 to 9) when it is imported;
without them it imports but decodes nothing, and :func:`load_torchcodec` says so.
docs/internals.md, ``mmproxy.pipelines.video._torchcodec``, has the rest.
"""

from __future__ import annotations

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

__all__ = ["TorchCodecSession", "load_torchcodec"]

_INSTALL = install_hint("torchcodec")


def load_torchcodec() -> Any:
    """The ``torchcodec.decoders`` module; ImportError naming the extra when TorchCodec is
    missing, RuntimeError when it has no FFmpeg to decode with."""
    try:
        import torchcodec
        import torchcodec.decoders
    except ImportError:
        raise ImportError(f"nvdec_library='torchcodec' needs TorchCodec: {_INSTALL}") from None
    if torchcodec.ffmpeg_major_version is None:
        raise RuntimeError(
            "nvdec_library='torchcodec': TorchCodec is installed but loads none of the FFmpeg "
            "versions it supports (4 to 9): install FFmpeg's shared libraries (e.g. apt install "
            "ffmpeg, or conda install ffmpeg), or use nvdec_library='pynvvideocodec'")
    return torchcodec.decoders


class TorchCodecSession:
    """One decode thread's TorchCodec state: its CUDA stream and the decoder options (module
    docstring). ``device`` None decodes on the CPU (TorchCodec's FFmpeg decoder)."""

    LIBRARY = "TorchCodec"

    def __init__(self, device: int | None, options: Mapping[str, Any]) -> None:
        import torch

        self.decoders = load_torchcodec()
        self.device = device
        self.stream: Any = None
        if device is not None:
            torch.cuda.set_device(device)
            self.stream = torch.cuda.Stream(device)
        # the frame count and frame places from the container's header, as the worker's clip
        # draw reads them; "exact" scans every packet of the clip first
        self.options = {"seek_mode": "approximate", **options}

    def clip(self, data: np.ndarray, start: int, frames: int | None, stride: int,
             at: Sequence[int] | None = None) -> Any:
        """The clip's frames ``[T, H, W, 3]`` (uint8 RGB, on the session's device):
        ``frames`` from ``start`` at ``stride``, the last repeated past the video's end (or
        the frames ``at``)."""
        where = "cpu" if self.device is None else f"cuda:{self.device}"
        try:
            decoder = self.decoders.VideoDecoder(readonly_tensor(data), device=where,
                                                 dimension_order="NHWC", **self.options)
            total = decoder.metadata.num_frames
        except Exception as err:  # noqa: BLE001 - TorchCodec raises RuntimeError, ValueError
            if not_the_clip(err):
                raise
            raise Refused(f"TorchCodec cannot open the video: {said(err)}") from err
        if self.device is not None:
            self._on_nvdec(decoder)
        if not total:
            raise Refused("TorchCodec finds no frames in the video")
        wanted, unique, got = decode_frames("TorchCodec", total, start, frames, stride,
                                            lambda indices: decoder.get_frames_at(indices).data,
                                            at)
        if wanted != unique:  # frames repeated past the video's end
            place = {index: k for k, index in enumerate(unique)}
            got = got[[place[i] for i in wanted]]
        got = got.contiguous()
        if self.stream is not None:  # done before the decoder goes back to TorchCodec's cache
            self.stream.synchronize()
        return got

    @staticmethod
    def _on_nvdec(decoder: Any) -> None:
        """Refuses a clip TorchCodec would decode on the CPU rather than on NVDEC (a codec, size
        or chroma format NVDEC lacks: TorchCodec's single FFmpeg thread would decode it, slowly
        and silently), so that PyAV decodes it and says so; a machine where TorchCodec cannot
        reach NVDEC at all fails the run."""
        fallback = decoder.cpu_fallback
        if not fallback:
            return
        if "nvcuvid" in str(fallback).lower():
            raise RuntimeError(f"nvdec_library='torchcodec': TorchCodec cannot use NVDEC here "
                               f"({fallback}): the NVIDIA driver's video library (libnvcuvid) "
                               "is missing, or the container lacks the driver's video "
                               "capability (NVIDIA_DRIVER_CAPABILITIES=compute,utility,video)")
        raise Refused(f"TorchCodec cannot decode the video on NVDEC ({fallback})")

    def to_device(self, frames: np.ndarray) -> Any:
        """Frames in host memory, copied to the session's device (on the current stream)."""
        tensor = readonly_tensor(frames)
        return tensor if self.device is None else tensor.to(f"cuda:{self.device}")

    def close(self) -> None:
        """Nothing to free: each clip's decoder goes with the clip."""
