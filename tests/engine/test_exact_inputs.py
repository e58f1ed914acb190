"""What crosses between DataLoader workers and servers: inputs exactly as given, references collated.

Every input reaches the pipeline with the shape (0-d and empty dimensions included), element type
and values it was given, whether the server is in the same process (``num_workers=0``) or the call
is made in a worker (fork, spawn); big-endian arrays arrive as the same values in native order
(DALI's ``feed_input`` would read their bytes as native ones). Sample references collated by
webdataset's default ``collation_fn`` fail at once with a message naming the collation to use.
"""

from __future__ import annotations

import copy
import pickle
import time

import numpy as np
import pytest
import torch
import webdataset as wds
from conftest import cpu, decode_pipe, double_pipe
from datasets_for_tests import EXACT_CASES, ExactInputs, ImageAndLabel, grid
from nvidia.dali import fn, pipeline_def
from torch.utils.data import default_collate

import mmproxy
from mmproxy.testing import image_bytes, synth_image, write_tar

pytestmark = pytest.mark.timeout(120)

CASES = list(EXACT_CASES)
PATHS = [pytest.param(0, None, id="in-process"), pytest.param(2, "fork", id="fork"),
         pytest.param(2, "spawn", id="spawn")]


@pipeline_def
def echo_pipe(names):
    return tuple(fn.external_source(name=n, no_copy=True) for n in names)


@pipeline_def
def echo_one_pipe():
    return fn.external_source(name="x", no_copy=True)


def expected(value):
    """The array a proxy argument stands for, in native byte order and C order."""
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, (bytes, bytearray)):
        return np.frombuffer(value, np.uint8).copy()
    if isinstance(value, torch.Tensor):
        value = value.numpy()
    array = np.array(value)
    return array.astype(array.dtype.newbyteorder("="))


def check(case, output, indices):
    assert isinstance(output, torch.Tensor), (case, type(output))
    for row, i in zip(output, indices.tolist()):
        want = torch.from_numpy(expected(EXACT_CASES[case](i)))
        assert (row.shape, row.dtype) == (want.shape, want.dtype), (case, i)
        assert torch.equal(row, want), (case, i, row, want)


@pytest.fixture(scope="module")
def echo_server():
    names = [f"x{k}" for k in range(len(CASES))]
    with mmproxy.DALIServer(cpu(echo_pipe, names=names), name="echo") as server:
        yield server


@pytest.mark.parametrize(("workers", "context"), PATHS)
def test_every_input_arrives_exactly_as_given(echo_server, workers, context):
    # One server for every path (the fixture is shared), so the paths also follow each other.
    loader = mmproxy.DataLoader(echo_server, ExactInputs(echo_server.proxy, CASES), batch_size=8,
                                num_workers=workers, multiprocessing_context=context)
    seen = 0
    for outputs, i in loader:
        for case, output in zip(CASES, outputs):
            check(case, output, i)
        seen += len(i)
    assert seen == 16


def test_zero_d_inputs_keep_their_shape_in_process_and_through_workers():
    # The in-process path gave DALI 0-d samples and the workers 1-d ones: DALI then failed the
    # pipeline ("number of dimensions ... has changed from previous iteration").
    with mmproxy.DALIServer(cpu(echo_one_pipe), name="scalar") as server:
        dataset = ExactInputs(server.proxy, ["0-d"])
        for workers, context in [(0, None), (2, "fork"), (0, None), (2, "spawn")]:
            loader = mmproxy.DataLoader(server, dataset, batch_size=4, num_workers=workers,
                                        multiprocessing_context=context)
            for x, i in loader:
                assert x.shape == (len(i),)
                torch.testing.assert_close(x, i.float() * 0.5)
        assert server.state is mmproxy.ServerState.RUNNING


def test_big_endian_arrives_as_its_values_in_native_order(double_server):
    big = [grid(i, (2, 3), ">f4") for i in range(4)]
    out = double_server.produce_data(default_collate([double_server.proxy(a) for a in big]))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.from_numpy(2 * np.stack(big).astype(np.float32)))


@pytest.mark.parametrize("value", [
    np.zeros(3, np.complex64), np.array(["text"]), np.array([object()]),
    np.zeros(3, np.longdouble), np.zeros(3, "datetime64[s]"), torch.zeros(3, dtype=torch.bfloat16),
    [[1, 2], [3]], np.zeros(2, [("a", "f4"), ("b", "i4")])],
    ids=["complex", "unicode", "object", "longdouble", "datetime", "bfloat16", "ragged",
         "structured"])
def test_inputs_dali_cannot_take_are_refused_by_the_call(double_server, value):
    if isinstance(value, np.ndarray) and value.dtype == np.float64:
        pytest.skip("long double is float64 on this platform")
    with pytest.raises(mmproxy.ProxyArgumentError, match=r"'double', input 'x'"):
        double_server.proxy(value)


# -- webdataset's .batched() ----------------------------------------------------------------------


@pytest.fixture
def png_shards(tmp_path):
    urls = []
    for s in range(2):
        path = tmp_path / f"png-{s}.tar"
        write_tar(path, [{"__key__": f"{s}-{i:03d}", "cls": 10 * s + i,
                          "png": image_bytes(synth_image(10 * s + i, 16, 24), "PNG")}
                         for i in range(6)])
        urls.append(str(path))
    return urls


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_webdataset_batched_with_mmproxy_collate(png_shards, context):
    with mmproxy.DALIServer(cpu(decode_pipe, batch_size=4), name="png") as server:
        pipeline = (wds.WebDataset(png_shards, shardshuffle=False)
                    .map(ImageAndLabel(server.proxy))
                    .batched(4, collation_fn=mmproxy.Collate([server])))
        loader = mmproxy.DataLoader(server, pipeline, batch_size=None, num_workers=2,
                                    multiprocessing_context=context)
        labels = []
        for images, cls in loader:
            assert isinstance(images, torch.Tensor) and images.shape == (len(cls), 16, 24, 3)
            for image, c in zip(images, cls.tolist()):
                assert torch.equal(image, torch.from_numpy(synth_image(c, 16, 24)))
            labels += cls.tolist()
        assert sorted(labels) == list(range(6)) + list(range(10, 16))


def first_batch_error(loader, match):
    """The CollateError of the loader's first batch, which must come at once."""
    it = iter(loader)
    start = time.perf_counter()
    try:
        with pytest.raises(mmproxy.CollateError, match=match) as info:
            next(it)
        assert time.perf_counter() - start < 10
    finally:
        it.close()  # left to the garbage collector, torch's shutdown of the workers takes 10 s
    return info.value


@pytest.mark.parametrize("bare", [False, True], ids=["tuples", "bare references"])
def test_webdataset_default_collation_fails_at_once_naming_the_fix(png_shards, bare):
    with mmproxy.DALIServer(cpu(decode_pipe, batch_size=4), name="png") as server:
        pipeline = (wds.WebDataset(png_shards, shardshuffle=False)
                    .map(ImageAndLabel(server.proxy, bare=bare)).batched(4))
        loader = mmproxy.DataLoader(server, pipeline, batch_size=None, num_workers=2)
        error = first_batch_error(loader, r"collation_fn=mmproxy\.Collate\(\)")
        assert "default_collate" in str(error)


def test_a_sample_reference_is_not_pickled_but_copies_as_itself(double_server):
    ref = double_server.proxy(np.zeros(3, np.float32))
    with pytest.raises(mmproxy.CollateError, match=r"uncollated DALI sample reference.*'double'"):
        pickle.dumps({"image": [ref]})
    assert copy.copy(ref) is ref and copy.deepcopy([ref])[0] is ref
    with pytest.raises(mmproxy.CollateError, match=r"cannot be iterated or unpacked.*1 output"):
        image, label = ref


def test_uncollated_references_leaving_a_torch_worker_fail_at_once(double_server):
    # batch_size=None: torch collates nothing, and the worker's result queue pickles the batch in
    # a feeder thread, where an error would only be printed; it is raised in the main process.
    samples = ExactInputs(double_server.proxy, ["dtype float32"], n=4)
    loader = mmproxy.DataLoader(double_server, samples, batch_size=None, num_workers=1)
    first_batch_error(loader, r"uncollated DALI sample reference.*'double'")


def test_a_run_reaches_dali_as_one_tensor_list_sharing_the_samples_memory():
    """The server feeds each input as one TensorListCPU whose samples are the arrays themselves
    (no copy: a run's bytes stay in the shard or memfd mapping), 0-d and empty samples included,
    and the outputs are those of the samples given; samples DALI cannot hold in one list are fed
    as the list, so that DALI's own error names them. (A run of more samples than the pipeline's
    batch size never gets here: the run table fails it, tests/test_runs.py.)"""
    from nvidia.dali.backend import TensorListCPU

    from mmproxy._server.dali import Pipe, _tensor_list

    pipe = Pipe(cpu(double_pipe, batch_size=4), "t")
    fed = []
    feed_input = pipe.pipeline.feed_input
    pipe.pipeline.feed_input = lambda name, data, **kw: (fed.append(data), feed_input(name, data, **kw))
    buffer = np.arange(40, dtype=np.float32)
    samples = [buffer[0:10], buffer[10:10], buffer[20:40]]
    pipe.feed([samples])
    (out,), _ = pipe.outputs(set())
    assert isinstance(fed[0], TensorListCPU)
    assert [fed[0][i].data_ptr() for i in (0, 2)] == [a.ctypes.data for a in (samples[0], samples[2])]
    assert [o.tolist() for o in out] == [(2 * a).tolist() for a in samples]
    pipe.feed([samples], rows=[2, 0])
    (out,), _ = pipe.outputs(set())
    assert [o.tolist() for o in out] == [(2 * samples[i]).tolist() for i in (2, 0)]
    scalars = _tensor_list([np.array(1.5, np.float32), np.array(2.5, np.float32)])
    assert [tuple(s) for s in scalars.shape()] == [(), ()]
    mixed = [np.zeros(3, np.uint8), np.zeros((3, 2), np.uint8)]
    assert _tensor_list(mixed) == mixed
    pipe.close()


def test_samples_that_are_not_numpy_arrays_are_fed_as_the_list_without_being_formatted():
    """A prepare stage's frames (torch tensors, on the GPU in the NVDEC video pipeline) are fed
    as the list: offered to DALI's TensorCPU they would be formatted into its TypeError, the
    whole tensor summarized and printed, with the GIL held, at every run."""
    from mmproxy._server.dali import _tensor_list

    formatted = []

    class Watched(torch.Tensor):
        def __repr__(self, *args, **kwargs):
            formatted.append(1)
            return super().__repr__(*args, **kwargs)

        __format__ = __str__ = __repr__  # type: ignore[assignment]

    frames = [torch.zeros(2, 4, 4, 3, dtype=torch.uint8).as_subclass(Watched) for _ in range(3)]
    assert repr(frames[0]) and formatted == [1]  # the watch works
    formatted.clear()
    fed = _tensor_list(frames)
    assert fed == frames and formatted == []
