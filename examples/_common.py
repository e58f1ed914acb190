"""Helpers shared by the examples: tiny data when none is given, device choice."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import torch


def device_id() -> int | None:
    """The GPU for DALI (LOCAL_RANK under torchrun), or None for CPU operators."""
    return int(os.environ.get("LOCAL_RANK", 0)) if torch.cuda.is_available() else None


def tiny_image_folder(n_per_class: int = 8) -> str:
    """An ImageFolder tree of synthetic JPEGs (two classes), for running the examples anywhere.

    The folder is removed when the example exits.
    """
    from mmproxy.testing import image_bytes, synth_image

    root = Path(tempfile.mkdtemp(prefix="mmproxy-example-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for c, name in enumerate(("circles", "stripes")):
        (root / name).mkdir()
        for i in range(n_per_class):
            (root / name / f"{i}.jpg").write_bytes(image_bytes(synth_image(100 * c + i)))
    return str(root)


def demo_shards(samples: int) -> str:
    """The demo's synthetic multi-modal shards (image, caption, audio, label), made once."""
    from mmproxy.cli import _cache_dir, make_demo_shards

    return make_demo_shards(_cache_dir() / "demo" / f"shards-{samples}", samples, per_shard=16)
