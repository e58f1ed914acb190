"""Helpers and fixtures the damaged-data tests share: small JPEGs, a good shard, an image server."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cpu_image_server

from mmproxy.testing import image_bytes, write_tar


def _color(i):
    return (i * 37) % 200 + 20


def _jpeg(i, fmt="JPEG"):
    return image_bytes(np.full((40, 56, 3), _color(i), np.uint8), fmt)


# -- a run that reads nothing fails loudly, quickly, in words -----------------------------------

@pytest.fixture(scope="module")
def good_shard(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    write_tar(root / "g-000.tar", [{"__key__": f"g{i:02d}", "jpg": _jpeg(i), "cls": str(i)}
                                   for i in range(12)])
    return root


@pytest.fixture(scope="module")
def image_server():
    with cpu_image_server(16) as server:
        yield server
