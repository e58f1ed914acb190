"""Device choice: where a pipeline runs, GPU when there is one, CPU operators otherwise.

The one place that decides it: the ready pipelines, the ``mmproxy`` commands and the examples all
ask :func:`resolve_device`.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["Device", "resolve_device"]

Device = Literal["auto", "gpu", "cpu"]


def resolve_device(device: Device = "auto", device_id: int | None = None) -> tuple[bool, int | None]:
    """Returns (use_gpu, device_id) for ``device``: 'auto' picks the GPU when CUDA is there,
    'gpu' insists on it (ValueError without CUDA), 'cpu' never uses it; ``device_id`` None means
    the current CUDA device. The id is None whenever use_gpu is False (DALI's CPU-only mode)."""
    if device not in ("auto", "gpu", "cpu"):
        raise ValueError(f"device must be 'auto', 'gpu' or 'cpu', got {device!r}")
    if device == "cpu":
        return False, None
    import torch

    available = torch.cuda.is_available()
    if device == "gpu" and not available:
        raise ValueError("device='gpu' was asked for, but CUDA is not available here")
    if not available:
        return False, None
    return True, torch.cuda.current_device() if device_id is None else device_id
