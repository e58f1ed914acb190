"""Helpers the tests of this folder share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from mmproxy.testing import (
    image_bytes,
)

ROOT = Path(__file__).resolve().parents[2]


HINT = "(run with --debug for the traceback)"


def solid(value, fmt="PNG"):
    return image_bytes(np.full((24, 32, 3), value, np.uint8), fmt)


def run_cli(args, tmp_path, timeout=200):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "mmproxy.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def image_folder(root, per_class=3):
    for c, name in enumerate(("cat", "dog_house")):
        (root / name).mkdir(parents=True)
        for k in range(per_class):
            (root / name / f"{k}.png").write_bytes(solid(40 * c + 10 * k + 20))
    return root
