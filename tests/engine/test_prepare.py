"""A pipeline's Prepare stage (mmproxy._server.prepare): the proxy sends the stage's inputs, the server
prepares every sample on the stage's threads before the feed; a sample the stage calls damaged
is dropped and named (skip) or fails its run, and rows stay aligned, also when the pipeline then
drops another sample of the same run; any other error of the stage fails its run, in skip mode
too."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from nvidia.dali import fn, pipeline_def, types

import mmproxy
from mmproxy._server.prepare import DamagedSampleError
from mmproxy.testing import image_bytes

pytestmark = pytest.mark.timeout(120)

_JPEGS = {i: image_bytes(np.full((24, 32, 3), 40 * i, np.uint8)) for i in range(6)}


class _Jpegs:
    """A Prepare stage: a sample's number in, its JPEG out (-1: a damaged sample; -2: bytes the
    pipeline's decoder refuses; -3: the stage itself fails)."""

    inputs = ("n", "label")

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="test-prepare")
        self.threads: set[str] = set()
        self.started = self.closed = 0

    def start(self) -> None:
        self.started += 1

    def submit(self, sample):
        return self.pool.submit(self._one, sample)

    def _one(self, sample):
        self.threads.add(threading.current_thread().name)
        n = int(sample["n"])
        if n == -1:
            raise DamagedSampleError("this sample cannot be prepared")
        if n == -3:
            raise RuntimeError("CUDA error: out of memory")
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
    assert (stage.started, stage.closed) == (1, 1)  # the server started and stopped the stage


def test_a_restarted_server_starts_its_stage_again():
    server, stage = _server()
    for _ in range(2):
        with server:
            _, labels = server.produce_data(_batch(server, [1, 2], skip=False))
        assert labels.tolist() == [0, 1]
    assert (stage.started, stage.closed) == (2, 2)


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


@pytest.mark.parametrize("numbers, skip, match", [
    ([0, -1, 1], False,
     r"cannot prepare sample s1 \(sample 1 of run .*\): this sample cannot be prepared"),
    # not a damaged sample (CUDA out of memory): the stage failing fails the run in skip mode too,
    # instead of its samples being dropped as damaged until the skip limit trips
    ([0, -3, 1], True, r"server 'prepared': the Prepare stage _Jpegs failed on sample s1 "
                       r"\(sample 1 of run .*\): RuntimeError: CUDA error: out of memory"),
], ids=["damaged", "stage-fails"])
def test_the_run_fails_naming_the_sample_and_the_server_stays_healthy(numbers, skip, match):
    server, _ = _server()
    with server:
        with pytest.raises(mmproxy.PipelineError, match=match):
            server.produce_data(_batch(server, numbers, skip=skip))
        images, labels = server.produce_data(_batch(server, [2], skip=False))
        assert labels.tolist() == [0]


class _Held(_Jpegs):
    """:class:`_Jpegs` whose samples wait until ``release`` is set; counts the samples handed
    to it."""

    def __init__(self) -> None:
        super().__init__()
        self.release, self.handed = threading.Event(), 0

    def submit(self, sample):
        self.handed += 1
        return self.pool.submit(self._held, sample)

    def _held(self, sample):
        self.release.wait(30)
        return self._one(sample)


def test_the_stage_is_handed_two_runs_ahead_of_the_runner_and_no_more():
    import time

    pipe = _decode(batch_size=8, num_threads=1, device_id=None)
    stage = _Held()
    server = mmproxy.DALIServer(mmproxy.SampleSeeded(pipe, None, prepare=stage), name="prepared")
    with server:
        batches = [_batch(server, [r, r + 1], skip=False) for r in range(5)]
        deadline = time.monotonic() + 10
        while stage.handed < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # a stage handed more runs would show it by now
        assert stage.handed == 4  # two runs of two samples, none done yet
        stage.release.set()
        got = [server.produce_data(b)[1].tolist() for b in batches]
    assert got == [[0, 1]] * 5
    assert stage.handed == 10
