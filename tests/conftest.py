"""Shared fixtures: tiny CPU pipelines and servers; GPU tests skip without CUDA."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from nvidia.dali import fn, pipeline_def, types

import mmproxy


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pipeline_def
def add_sub_pipe():
    a = fn.external_source(name="a", no_copy=True)
    b = fn.external_source(name="b", no_copy=True)
    return a + b, a - b


@pipeline_def
def double_pipe():
    x = fn.external_source(name="x", no_copy=True)
    return x * 2


@pipeline_def
def noisy_pipe():
    x = fn.external_source(name="x", no_copy=True, dtype=types.FLOAT)
    return x + fn.random.uniform(range=[0.0, 1.0], shape=[1])


@pipeline_def
def decode_pipe():
    x = fn.external_source(name="x", no_copy=True, dtype=types.UINT8)
    return fn.decoders.image(x, output_type=types.RGB)


def cpu(pipe_fn, batch_size=8, **kw):
    return pipe_fn(batch_size=batch_size, num_threads=1, device_id=None, **kw)


@pytest.fixture
def add_server():
    with mmproxy.DALIServer(cpu(add_sub_pipe), name="addsub") as server:
        yield server


@pytest.fixture
def double_server():
    with mmproxy.DALIServer(cpu(double_pipe), name="double") as server:
        yield server


@contextlib.contextmanager
def cpu_image_server(size, **kw):
    """A running eval-pipeline image server on CPU threads (uint8 output, one thread)."""
    from mmproxy.pipelines import image_eval_pipeline

    pipe = image_eval_pipeline(batch_size=8, size=size, dtype="uint8", device="cpu", num_threads=1, **kw)
    with mmproxy.DALIServer(pipe, name="image") as server:
        yield server


def vec(i, n=3):
    return np.full((n,), float(i), dtype=np.float32)
