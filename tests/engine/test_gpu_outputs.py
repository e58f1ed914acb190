"""GPU outputs of samples of different shapes: one copy of the output, then views or padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nvidia.dali import fn, pipeline_def, types
from torch.utils.data import default_collate

import mmproxy

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pipeline_def
def _to_gpu():
    x = fn.external_source(name="x", no_copy=True, dtype=types.FLOAT)
    return x.gpu() * 2


def _samples(ndim):
    rng = np.random.default_rng(ndim)
    shapes = [(int(n),) if ndim == 1 else (3, int(n)) for n in rng.integers(0, 50, 7)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("ndim", [1, 2])
def test_ragged_gpu_outputs_padded_and_as_lists(ndim):
    samples = _samples(ndim)
    pipe = _to_gpu(batch_size=8, num_threads=1, device_id=0)
    with mmproxy.DALIServer(pipe, pad=[0]) as padded:
        out = padded.produce_data(default_collate([padded.proxy(x) for x in samples]))
    assert isinstance(out, mmproxy.PaddedBatch) and out.data.is_cuda
    assert out.data.shape == (7, *np.max([s.shape for s in samples], axis=0))
    for row, (x, length) in enumerate(zip(samples, out.lengths.tolist())):
        assert length == (x.shape[0] if ndim == 1 else list(x.shape))  # 2-D: each shape
        region = (row, *(slice(0, n) for n in x.shape))
        assert torch.equal(out.data[region].cpu(), torch.from_numpy(x) * 2)
        assert out.data[row].abs().sum().item() == pytest.approx(np.abs(x * 2).sum(), rel=1e-5)
    pipe = _to_gpu(batch_size=8, num_threads=1, device_id=0)
    with mmproxy.DALIServer(pipe) as ragged:
        rows = ragged.produce_data(default_collate([ragged.proxy(x) for x in samples]))
    assert [tuple(r.shape) for r in rows] == [x.shape for x in samples]
    for r, x in zip(rows, samples):
        assert torch.equal(r.cpu(), torch.from_numpy(x) * 2)


def test_padded_1d_gpu_outputs_stay_right_run_after_run():
    # each run's offsets travel to the GPU from pinned memory, queued on the runner's stream:
    # a block reused before its copy ran would pad a run with another run's offsets
    rng = np.random.default_rng(0)
    pipe = _to_gpu(batch_size=8, num_threads=1, device_id=0, prefetch_queue_depth=2)
    with mmproxy.DALIServer(pipe, pad=[0]) as server:
        batches = [[rng.standard_normal(int(n)).astype(np.float32) for n in rng.integers(1, 4000, 8)]
                   for _ in range(40)]
        refs = [default_collate([server.proxy(x) for x in samples]) for samples in batches]
        for samples, ref in zip(batches, refs):
            out = server.produce_data(ref)
            assert out.lengths.tolist() == [len(x) for x in samples]
            for row, x in enumerate(samples):
                assert torch.equal(out.data[row, :len(x)].cpu(), torch.from_numpy(x) * 2)
                assert not out.data[row, len(x):].any()
