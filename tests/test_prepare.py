"""A pipeline's Prepare stage (mmproxy._prepare): the proxy sends the stage's inputs, the server
prepares every sample on the stage's threads before the feed; a sample the stage cannot prepare
is dropped and named (skip) or fails its run, and rows stay aligned, also when the pipeline then
drops another sample of the same run."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from nvidia.dali import fn, pipeline_def, types

import mmproxy
from mmproxy.testing import image_bytes

pytestmark = pytest.mark.timeout(120)

_JPEGS = {i: image_bytes(np.full((24, 32, 3), 40 * i, np.uint8)) for i in range(6)}


class _Jpegs:
    """A Prepare stage: a sample's number in, its JPEG out (-1: cannot be prepared; -2: bytes the
    pipeline's decoder refuses)."""

    inputs = ("n", "label")

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="test-prepare")
        self.threads: set[str] = set()
        self.closed = 0

    def submit(self, sample):
        return self.pool.submit(self._one, sample)

    def _one(self, sample):
        self.threads.add(threading.current_thread().name)
        n = int(sample["n"])
        if n == -1:
            raise ValueError("this sample cannot be prepared")
        data = b"\xff\xd8 not a jpeg" * 8 if n == -2 else _JPEGS[n]
        return {"image": np.frombuffer(data, np.uint8), "label": sample["label"]}

    def close(self) -> None:
        self.closed += 1


@pipeline_def
def _decode():
    image = fn.decoders.image(fn.external_source(name="image", no_copy=True, dtype=types.UINT8),
                              device="cpu")
    label = fn.external_source(name="label", no_copy=True)
    return fn.resize(image, size=(8, 8)), label


def _server():
    pipe = _decode(batch_size=8, num_threads=1, device_id=None)
    stage = _Jpegs()
    return mmproxy.DALIServer(mmproxy.SampleSeeded(pipe, None, prepare=stage), name="prepared"), stage


def _batch(server, numbers, skip):
    from torch.utils.data import default_collate

    samples = []
    for i, n in enumerate(numbers):
        with mmproxy.sample_key(f"s{i}", skip=skip):
            samples.append(server.proxy(np.array(n), label=np.array(i)))
    return default_collate(samples)


def test_the_proxy_sends_the_stage_inputs_and_the_stage_runs_on_its_threads():
    server, stage = _server()
    assert str(server.proxy.__signature__) == "(n, label)"
    with server:
        images, labels = server.produce_data(_batch(server, [0, 3, 5], skip=False))
    assert labels.tolist() == [0, 1, 2]
    assert [round(float(x.float().mean())) for x in images] == [0, 120, 200]
    assert stage.threads and all(t.startswith("test-prepare") for t in stage.threads)
    assert stage.closed == 1  # the server stopped the stage with itself


def test_samples_the_stage_or_the_pipeline_cannot_process_are_dropped_and_named():
    """s1 fails in the stage, s3 in the pipeline's decoder (found by the runner among the samples
    the stage prepared): both are dropped, and the rows left are those of s0, s2 and s4."""
    server, _ = _server()
    with server:
        loader = mmproxy.DataLoader(server, [_batch(server, [0, -1, 1, -2, 2], skip=True)],
                                    batch_size=None)
        ((images, labels),) = list(loader)
    assert labels.tolist() == [0, 2, 4]
    assert [round(float(x.float().mean())) for x in images] == [0, 40, 80]
    reasons = {r.key: r.reason for r in loader.skipped.records}
    assert sorted(reasons) == ["s1", "s3"]
    assert reasons["s1"] == ("could not be prepared in server 'prepared': this sample cannot be "
                             "prepared")
    assert reasons["s3"].startswith("pipeline failed in server 'prepared'")


def test_a_sample_that_cannot_be_prepared_fails_its_run_naming_it():
    server, _ = _server()
    with server:
        with pytest.raises(mmproxy.PipelineError,
                           match=r"cannot prepare sample s1 \(sample 1 of run .*\): this sample "
                                 r"cannot be prepared"):
            server.produce_data(_batch(server, [0, -1, 1], skip=False))
        images, labels = server.produce_data(_batch(server, [2], skip=False))  # still healthy
        assert labels.tolist() == [0]
