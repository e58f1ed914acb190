"""Choosing where a ready pipeline runs: GPU when there is one, CPU operators otherwise."""

from __future__ import annotations

from typing import Literal

Device = Literal["auto", "gpu", "cpu"]


def resolve_device(device: Device, device_id: int | None) -> tuple[bool, int | None]:
    """Returns (use_gpu, device_id) for ``device`` ('auto' picks the GPU when CUDA is there)."""
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
