"""NVDEC sessions: one decode thread's state, for each library that drives NVDEC, and what the
libraries' sessions share.
docs/internals.md, ``mmproxy.pipelines.video._nvdec_session``, has the rest.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["Refused", "Session", "clip_indices", "decode_frames", "not_the_clip",
           "readonly_tensor", "said"]

_FILTERS = threading.Lock()  # held by a decode thread while it changes the warning filters


class Session(Protocol):
    """A decode thread's state for one library that drives NVDEC (module docstring)."""

    stream: Any  # the thread's CUDA stream: the clip decoder syncs it before a clip counts done

    def clip(self, data: np.ndarray, start: int, frames: int | None, stride: int,
             at: Sequence[int] | None = None) -> Any:
        """The clip's frames ``[T, H, W, 3]``, uint8 RGB on the GPU (:func:`clip_indices`, or
        the frames ``at`` where given); raises :class:`Refused` where the library does not
        decode the clip."""

    def to_device(self, frames: np.ndarray) -> Any:
        """Frames in host memory (``[T, H, W, 3]``) copied to the GPU, on the current stream."""

    def close(self) -> None:
        """Frees what the session holds (called on its own thread)."""


class Refused(Exception):
    """NVDEC did not decode a clip: it raised, or gave fewer frames than the clip needs. The
    clip may be damaged, or NVDEC may be failing; the clip decoder tells which."""


def clip_indices(total: int, start: int, frames: int | None, stride: int) -> list[int]:
    """The frames of a clip of a ``total``-frame video: ``frames`` from ``start`` at ``stride``,
    the last frame repeated past the video's end; None: every frame."""
    if frames is None:
        return list(range(total))
    if start < 0:
        raise ValueError(f"clip start {start} is before the video's first frame")
    return [min(start + i * stride, total - 1) for i in range(frames)]


def not_the_clip(err: BaseException) -> BaseException | None:
    """``err`` itself where it is the GPU's failure, not the clip's (CUDA out of memory, a CUDA
    or driver error): that fails the run instead of refusing the clip; else None."""
    import torch

    if isinstance(err, (torch.OutOfMemoryError, torch.AcceleratorError)) or "CUDA error" in str(err):
        return err
    return None


def decode_frames(who: str, total: int, start: int, frames: int | None, stride: int,
                  get: Callable[[list[int]], Sequence[Any]], at: Sequence[int] | None = None
                  ) -> tuple[list[int], list[int], Any]:
    """The clip's frame indices (:func:`clip_indices`, or ``at`` where given: a clip the worker
    cut to the packets its frames need), the distinct ones sorted, and what ``get`` decoded for
    those; :class:`Refused`, naming ``who`` decoded, where ``get`` raises or gives fewer
    frames, or ``at`` names a frame past the video's end."""
    wanted = [int(i) for i in at] if at is not None else clip_indices(total, start, frames,
                                                                      stride)
    unique = sorted(set(wanted))
    if unique[-1] >= total:
        raise Refused(f"{who} finds {total:,} frames in the video, the clip needs frame "
                      f"{unique[-1]}: the video is damaged")
    try:
        got = get(unique)
    except Exception as err:  # noqa: BLE001 - the libraries raise RuntimeError, Exception
        if not_the_clip(err):
            raise
        raise Refused(f"{who} cannot decode frames {unique[0]}-{unique[-1]} of the {total:,} in "
                      f"the video: {said(err)}") from err
    if len(got) != len(unique):
        raise Refused(f"{who} decoded {len(got)} of the {len(unique)} frames the clip needs "
                      f"({unique[0]}-{unique[-1]} of {total:,}): the video is damaged")
    return wanted, unique, got


def said(err: BaseException) -> str:
    """A library's error message on one line, cut to 300 characters."""
    text = " ".join(str(err).split())
    return text[:300] or type(err).__name__


def readonly_tensor(array: np.ndarray) -> Any:
    """A torch tensor over ``array``'s memory (no copy), read-only memory included (torch only
    reads it)."""
    import torch

    if array.flags.writeable:
        return torch.from_numpy(array)
    # The warning filters are the process's: one thread at a time changes and restores them,
    # so none restores another's change
    with _FILTERS, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)
