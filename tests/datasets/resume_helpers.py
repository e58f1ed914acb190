"""Helpers and fixtures the resume tests share: the shards, the server, a sample image."""

from __future__ import annotations

import numpy as np
import pytest
from mmproxy.pipelines import image_train_pipeline

import mmproxy
from mmproxy.testing import image_bytes

SHARDS, PER_SHARD, BATCH = 6, 10, 4


def _image(i: int) -> bytes:
    rng = np.random.default_rng(i)
    h, w = 24 + i % 4 * 8, 32 + i % 3 * 8  # sizes vary, so crop windows do too
    return image_bytes(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def server():
    pipe = image_train_pipeline(batch_size=BATCH, size=16, dtype="uint8", device="cpu",
                                num_threads=1, scale=(0.2, 1.0), sample_seeded=True)
    with mmproxy.DALIServer(pipe, name="train") as srv:
        yield srv
