"""The engine: drop-in behaviour of DALI's proxy, and what goes past it."""

from __future__ import annotations

import collections
import gc
import importlib
import inspect
import threading
import time

import numpy as np
import pytest
import torch
from conftest import add_sub_pipe, cpu, decode_pipe, double_pipe, noisy_pipe, vec
from datasets_for_tests import (
    AddDataset,
    BytesDataset,
    DyingDataset,
    NoisyDataset,
    ShuffledStream,
    TwoServerDataset,
    VarLenDataset,
)
from nvidia.dali import fn, pipeline_def, types
from torch.utils.data import default_collate

import mmproxy
from mmproxy.testing import damage_jpeg, image_bytes, synth_image

pytestmark = pytest.mark.timeout(120)


def _public_modules() -> list[str]:
    """Every module of the library (mmproxy, its datasets and pipelines, and the apps behind the
    command line) without an underscore in its dotted name."""
    import pkgutil

    names = []
    for package in ("mmproxy", "mmproxy.datasets", "mmproxy.pipelines"):  # three folders
        names.append(package)
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            private = any(part.startswith("_") for part in info.name.split("."))
            if not private:
                names.append(info.name)
    return sorted(set(names))


def test_public_names_are_sorted_and_resolve():
    modules = _public_modules()
    assert {"mmproxy.protocols", "mmproxy.state", "mmproxy.datasets.checks",
            "mmproxy.pipelines.video", "mmproxy.apps", "mmproxy.apps.bench.systems"} <= set(modules)
    for module in modules:
        mod = importlib.import_module(module)
        assert isinstance(getattr(mod, "__all__", None), list), f"{module} has no __all__"
        assert mod.__all__ == sorted(mod.__all__), module
        assert len(set(mod.__all__)) == len(mod.__all__), module
        for name in mod.__all__:
            assert getattr(mod, name) is not None, f"{module}.{name}"
    for name, module in mmproxy._WHERE.items():  # the lazy top level gives each module's object
        assert getattr(mmproxy, name) is getattr(importlib.import_module(module), name), name
    assert sorted(mmproxy._WHERE) == mmproxy.__all__
    from mmproxy.errors import MmproxyError, StateError
    from mmproxy.proxy import SampleSeeded

    assert mmproxy.SampleSeeded is SampleSeeded and issubclass(mmproxy.StateError, MmproxyError)
    assert StateError is mmproxy.StateError


def test_manual_collate_positional_and_keyword(add_server):
    outs = []
    for i in range(8):
        a, b = vec(i), vec(2 * i)
        s, d = add_server.proxy(a, b) if i % 2 else add_server.proxy(b=b, a=a)
        outs.append((a, b, s, d))
    a, b, s, d = add_server.produce_data(default_collate(outs))
    torch.testing.assert_close(s, a + b)
    torch.testing.assert_close(d, a - b)


def test_wrong_arguments_name_the_signature(add_server):
    with pytest.raises(ValueError, match=r"addsub.*\(a, b\)"):
        add_server.proxy(vec(1))
    with pytest.raises(mmproxy.ProxyArgumentError, match="missing a required argument"):
        add_server.proxy(a=vec(1), c=vec(2))
    assert list(inspect.signature(add_server.proxy).parameters) == ["a", "b"]


def test_produce_data_replaces_inside_any_nesting(add_server, double_server):
    Pair = collections.namedtuple("Pair", "x y")

    class Holder:
        def __init__(self, value):
            self.value = value
            self.tag = "kept"

    s, d = zip(*[add_server.proxy(vec(i), vec(1)) for i in range(4)])
    bs, bd = default_collate(list(s)), default_collate(list(d))
    other = default_collate([double_server.proxy(vec(i)) for i in range(4)])
    cyclic = [bs]
    cyclic.append(cyclic)
    keys = ["a", "b", 3, None, 2.5]
    obj = {"pair": Pair(bs, 7), "holder": Holder(bd), "cyclic": cyclic, "other": other,
           "text": "hello", "keys": keys, "mixed": ("key", bs)}
    out = add_server.produce_data(obj)
    assert out["keys"] is keys  # a list of plain values is left as it is
    from mmproxy._loader import walk

    tensors = [torch.zeros(1), torch.ones(1)]  # unless plain values are what is looked for
    assert walk.collect(tensors, torch.Tensor) == tensors and walk.collect(keys, str) == ["a", "b"]
    assert out["mixed"][0] == "key" and isinstance(out["mixed"][1], torch.Tensor)
    assert isinstance(out["pair"], Pair) and out["pair"].y == 7
    torch.testing.assert_close(out["pair"].x[:, 0], torch.arange(4.0) + 1)
    torch.testing.assert_close(out["holder"].value[:, 0], torch.arange(4.0) - 1)
    assert out["holder"].tag == "kept"
    assert out["cyclic"][1] is out["cyclic"] and isinstance(out["cyclic"][0], torch.Tensor)
    assert isinstance(out["other"], mmproxy.DALIOutputBatchRef)  # another server's: untouched
    assert out["text"] == "hello"
    torch.testing.assert_close(double_server.produce_data(out)["other"][:, 0], torch.arange(4.0) * 2)


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver", None])
def test_loader_every_start_method_pairs_batches_with_inputs(add_server, context):
    workers = 0 if context is None else 2
    loader = mmproxy.DataLoader(add_server, AddDataset(add_server.proxy), batch_size=8,
                                num_workers=workers, multiprocessing_context=context, shuffle=True)
    for _ in range(2):
        seen = []
        for s, d, i in loader:
            torch.testing.assert_close(s[:, 0], i.float() + 1)
            torch.testing.assert_close(d[:, 0], i.float() - 1)
            seen += i.tolist()
        assert sorted(seen) == list(range(32))


class _Tensors(torch.utils.data.Dataset):
    """A sample with a server field, a small tensor of each kind and one over the inline size."""

    def __init__(self, proxy):
        self.proxy = proxy

    def __len__(self):
        return 8

    def __getitem__(self, i):
        small = {"int": torch.arange(3) + i, "bf16": torch.full((2, 2), i, dtype=torch.bfloat16),
                 "bool": torch.tensor([i % 2 == 0]), "view": torch.arange(10.0)[i:i + 2],
                 "t": torch.arange(6.0).view(2, 3).t() * i}
        return self.proxy(vec(i), vec(1))[0], small, torch.full((40_000,), i, dtype=torch.int64)


def test_worker_tensors_arrive_whole_small_ones_inline(add_server):
    loader = mmproxy.DataLoader(add_server, _Tensors(add_server.proxy), batch_size=4,
                                num_workers=2)
    seen = []
    for s, small, large in loader:
        rows = (s[:, 0] - 1).long()
        seen += rows.tolist()
        for k, i in enumerate(rows.tolist()):
            assert torch.equal(small["int"][k], torch.arange(3) + i)
            assert small["bf16"][k].dtype == torch.bfloat16 and small["bf16"][k].eq(i).all()
            assert bool(small["bool"][k]) == (i % 2 == 0)
            assert torch.equal(small["view"][k], torch.arange(10.0)[i:i + 2])
            assert torch.equal(small["t"][k], torch.arange(6.0).view(2, 3).t() * i)
            assert large[k].eq(i).all()
        # copied with the batch (no shared memory to fetch), writable; the large one shared
        assert not small["int"].is_shared() and not small["t"].is_shared()
        small["int"].add_(1)
        assert large.is_shared()
    assert sorted(seen) == list(range(8))


def test_tensors_the_inline_handover_cannot_describe_go_torch_s_way():
    import pickle
    import warnings
    from multiprocessing.reduction import ForkingPickler

    from mmproxy._loader.workers import inline_small_tensors

    inline_small_tensors()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    quantized = torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint8)
    for t in (nested, quantized):
        assert b"_inlined" not in bytes(ForkingPickler.dumps(t))
    conj = torch.randn(3, dtype=torch.complex64).conj()  # its bytes are resolved first
    assert b"_inlined" in bytes(ForkingPickler.dumps(conj))
    assert torch.equal(pickle.loads(ForkingPickler.dumps(conj)), conj)


def test_plain_torch_dataloader_then_produce_data(add_server):
    loader = torch.utils.data.DataLoader(AddDataset(add_server.proxy), batch_size=8, num_workers=2)
    for s, d, i in loader:
        s = add_server.produce_data(s)
        torch.testing.assert_close(s[:, 0], i.float() + 1)


def test_two_servers_in_one_loader_with_two_views(add_server, double_server):
    loader = mmproxy.DataLoader({"add": add_server, "double": double_server},
                                TwoServerDataset(add_server.proxy, double_server.proxy),
                                batch_size=8, num_workers=2)
    n = 0
    for batch in loader:
        i = batch["label"].float()
        torch.testing.assert_close(batch["sum"][:, 0], i + 1)
        torch.testing.assert_close(batch["view1"][:, 0], i * 2)
        torch.testing.assert_close(batch["view2"][:, 0], (i + 1000) * 2)
        n += len(i)
    assert n == 32


def test_own_produce_data_leaves_other_servers_refs_alone(add_server, double_server):
    batch = default_collate([TwoServerDataset(add_server.proxy, double_server.proxy)[i]
                             for i in range(4)])
    start = time.perf_counter()
    out = add_server.produce_data(batch)
    assert time.perf_counter() - start < 5
    assert isinstance(out["view1"], mmproxy.DALIOutputBatchRef)
    out = double_server.produce_data(out)
    torch.testing.assert_close(out["view1"][:, 0], torch.arange(4.0) * 2)


def test_produce_data_refuses_an_uncollated_proxy_output(add_server):
    """As mmproxy.DataLoader does: a proxy output that was never collated is an error, not
    something to hand back unchanged."""
    s, _ = add_server.proxy(vec(1), vec(2))
    with pytest.raises(mmproxy.CollateError, match="uncollated DALI sample reference"):
        add_server.produce_data({"a": s})


def test_variable_shapes_give_lists_or_padded_batches():
    with mmproxy.DALIServer(cpu(double_pipe)) as plain, \
            mmproxy.DALIServer(cpu(double_pipe), pad=True) as padded:
        for server in (plain, padded):
            loader = mmproxy.DataLoader(server, VarLenDataset(server.proxy), batch_size=8,
                                        num_workers=1)
            for x, i in loader:
                if server is plain:
                    assert isinstance(x, list) and [len(t) for t in x] == [1 + k % 5 for k in i]
                    for t, k in zip(x, i):
                        assert torch.all(t == 2 * k)
                else:
                    assert isinstance(x, mmproxy.PaddedBatch)
                    assert x.lengths.tolist() == [1 + k % 5 for k in i.tolist()]
                    assert x.data.shape == (len(i), max(x.lengths))
                    for row, n, k in zip(x.data, x.lengths, i):
                        assert torch.all(row[:n] == 2 * k) and torch.all(row[n:] == 0)


def test_shuffled_and_dropped_after_the_proxy_call(double_server):
    loader = mmproxy.DataLoader(double_server, ShuffledStream(double_server.proxy), batch_size=5,
                                num_workers=2)
    total = 0
    for x, i in loader:
        torch.testing.assert_close(x[:, 0], i.float() * 2)
        total += len(i)
    assert 0 < total < 40


def test_breaking_out_of_an_epoch_never_mixes_outputs(add_server):
    loader = mmproxy.DataLoader(add_server, AddDataset(add_server.proxy, n=64), batch_size=4,
                                num_workers=2, persistent_workers=True, prefetch_factor=4)
    for epoch in range(6):
        for k, (s, d, i) in enumerate(loader):
            torch.testing.assert_close(s[:, 0], i.float() + 1)
            if epoch % 2 == 0 and k == 2:
                break
    time.sleep(0.3)
    iter(loader)  # a new epoch drops whatever the abandoned ones left
    assert len(add_server._runs) <= 2 * 4


def test_batch_larger_than_pipeline_batch_size_raises_fast(add_server):
    loader = mmproxy.DataLoader(add_server, AddDataset(add_server.proxy), batch_size=16,
                                num_workers=2)
    gc.collect()
    start = time.perf_counter()
    with pytest.raises(mmproxy.BatchSizeError, match=r"'addsub': a batch of 16 samples "
                                                     r"\(run .*\) is larger than the pipeline's "
                                                     "batch_size=8"):
        next(iter(loader))
    assert time.perf_counter() - start < 10


def test_pipeline_error_names_the_sample_and_the_server_stays_healthy():
    good = [image_bytes(synth_image(i)) for i in range(3)]
    items = good + [damage_jpeg(good[0], "garbage")] + good  # only the decoder can tell
    with mmproxy.DALIServer(cpu(decode_pipe, batch_size=4), name="img") as server:
        loader = mmproxy.DataLoader(server, BytesDataset(server.proxy, items), batch_size=4,
                                    num_workers=1)
        start = time.perf_counter()
        with pytest.raises(mmproxy.PipelineError,
                           match=r"'img'.*cannot process sample sample-003 \(sample 3 of run"):
            for _ in loader:
                pass
        assert time.perf_counter() - start < 10
        assert server.state is mmproxy.ServerState.RUNNING  # one bad sample fails its batch only
        out = server.produce_data(default_collate([server.proxy(np.frombuffer(g, np.uint8))
                                                   for g in good]))
        assert out.shape[0] == 3


def _image_folder(root, damaged=None):
    """A torchvision ImageFolder of 8 JPEGs read as bytes; ``damaged(bytes)`` rewrites the 6th."""
    import torchvision

    from mmproxy.testing import image_folder

    image_folder(root, per_class=4)
    files = sorted(p for p in root.rglob("*.jpg"))
    if damaged is not None:
        files[5].write_bytes(damaged(files[5].read_bytes()))
    return files, lambda proxy, loader=_read_bytes: torchvision.datasets.ImageFolder(
        str(root), transform=proxy, loader=loader)


def _read_bytes(path):
    return np.fromfile(path, np.uint8)


def _decoded(path):
    return np.zeros((12, 16, 3), np.uint8)  # what a transform that decodes would hand over


@pytest.mark.parametrize("workers", [0, 2])
def test_a_map_style_datasets_sample_is_named_by_its_index_and_file(tmp_path, workers):
    """The seed's own path (ImageFolder(transform=server.proxy)): a sample the pipeline cannot
    process is named as the dataset gave it, with why in words."""
    files, folder = _image_folder(tmp_path, lambda data: damage_jpeg(data, "garbage"))
    with mmproxy.DALIServer(cpu(decode_pipe, batch_size=8), name="img") as server:
        dataset = folder(server.proxy)
        assert dataset.samples[5][0] == str(files[5])
        loader = mmproxy.DataLoader(server, dataset, batch_size=8, num_workers=workers)
        assert loader.dataset.classes == dataset.classes  # the loader's view keeps its attributes
        with pytest.raises(mmproxy.PipelineError) as caught:
            next(iter(loader))
    message = str(caught.value)
    assert f"cannot process sample index 5, file {files[5]} (sample 5 of run" in message
    assert "fn.decoders.image: the" in message and "nvImageCodec failure" not in message


def test_decoded_arrays_are_refused_at_the_proxy_call(tmp_path):
    _, folder = _image_folder(tmp_path)
    with mmproxy.DALIServer(cpu(decode_pipe, batch_size=8), name="img") as server:
        start = time.perf_counter()
        with pytest.raises(mmproxy.ProxyArgumentError,
                           match=r"'img', input 'x', sample index 0, file .*: the pipeline decodes "
                                 r"this input and expects encoded images .*uint8 array of shape "
                                 r"\(12, 16, 3\)"):
            next(iter(mmproxy.DataLoader(server, folder(server.proxy, _decoded), batch_size=8,
                                         num_workers=1)))
        assert time.perf_counter() - start < 10  # at the call, not after searching the batch
        with pytest.raises(mmproxy.ProxyArgumentError, match="got 5 bytes starting with b'hello'"):
            server.proxy(b"hello")
        out = server.produce_data(default_collate([server.proxy(_read_bytes(p)) for p in
                                                   sorted(tmp_path.rglob("*.jpg"))[:2]]))
        assert len(out) == 2


@pytest.mark.parametrize("line,words", [
    ("Failed to decode sample #0 : ", "the decoder could not decode the data (damaged, cut "
                                      "short, or a variant of its format DALI does not read"),
    ("nvImageCodec failure: '#4'", "not an image of a format the decoder reads (nvImageCodec "
                                   "status 4)"),
    ("nvImageCodec failure: '#3'", "the image data is damaged"),
    ("std::bad_alloc", "ran out of memory"),
    ('Error decoding file . Error: Assert on "ret == audio.shape[0]" failed',
     'the decoder could not decode the data: Assert on "ret == audio.shape[0]" failed'),
])
def test_pipeline_errors_are_said_in_words(line, words):
    from mmproxy._server.dali import summary

    text = ("Critical error in pipeline:\nError in CPU operator `nvidia.dali.fn.decoders.image`,\n"
            f"which was used in the pipeline definition with the following traceback:\n\n"
            f"encountered:\n\n{line}\nCurrent pipeline object is no longer valid.")
    said = summary(RuntimeError(text))
    assert said.startswith("fn.decoders.image: ") and words in said, said
    assert not said.rstrip().endswith(":")


class _SeededNoise:
    """Draws the pipeline's ``noise`` input from each sample's seed (a SampleRandom)."""

    names = ("noise",)

    def __call__(self, given, rng):
        return {"noise": np.array([rng.random()], np.float32)}


def test_sample_seeded_inputs_are_an_explicit_argument_of_the_server():
    """SampleSeeded hands the server a pipeline with the inputs its proxy draws per sample: the
    proxy takes only the others, and a sample's draw follows its seed, not its batch."""
    from mmproxy.worker import sample_key

    @pipeline_def
    def noisy():
        x = fn.external_source(name="x", no_copy=True, dtype=types.FLOAT)
        return x + fn.external_source(name="noise", no_copy=True, dtype=types.FLOAT)

    def outputs(order):
        seeded = mmproxy.SampleSeeded(lambda: cpu(noisy), _SeededNoise())
        with mmproxy.DALIServer(seeded, name="seeded") as server:
            assert list(inspect.signature(server.proxy).parameters) == ["x"]
            refs = []
            for i in order:
                with sample_key(f"s{i}", seed=100 + i):
                    refs.append(server.proxy(np.zeros(1, np.float32)))
            return dict(zip(order, server.produce_data(default_collate(refs))[:, 0].tolist()))

    a, b = outputs([0, 1, 2, 3]), outputs([3, 1])
    assert a[3] == b[3] and a[1] == b[1] and len(set(a.values())) == 4
    with pytest.raises(TypeError, match="expected an NVIDIA DALI pipeline.*got SampleSeeded"):
        mmproxy.DALIServer(lambda: mmproxy.SampleSeeded(cpu(noisy), _SeededNoise()))


def test_dead_worker_raises_in_the_main_loop(double_server):
    loader = mmproxy.DataLoader(double_server, DyingDataset(double_server.proxy), batch_size=4,
                                num_workers=2)
    gc.collect()
    it = iter(loader)
    start = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="exited unexpectedly"):
            for _ in it:
                pass
        assert time.perf_counter() - start < 15
    finally:
        it.close()


def test_stop_is_fast_and_idempotent_and_restartable():
    server = mmproxy.DALIServer(cpu(add_sub_pipe))
    server.start_thread()
    server.start_thread()
    start = time.perf_counter()
    server.stop_thread()
    assert time.perf_counter() - start < 0.5
    server.stop_thread()
    assert server.state is mmproxy.ServerState.STOPPED
    assert not [t for t in threading.enumerate() if t.name.startswith("mmproxy-")]
    with server:
        s, _ = server.produce_data(default_collate([server.proxy(vec(1), vec(2))]))
        assert s[0, 0] == 3


def test_using_a_stopped_server_says_so(add_server):
    ref = default_collate([add_server.proxy(vec(1), vec(2))[0]])
    add_server.stop_thread()
    with pytest.raises(mmproxy.ServerStateError, match="addsub.*stopped"):
        add_server.produce_data(ref)


def _noisy_outputs(workers):
    with mmproxy.DALIServer(cpu(noisy_pipe, seed=1234), deterministic=True) as server:
        loader = mmproxy.DataLoader(server, NoisyDataset(server.proxy), batch_size=4,
                                    num_workers=workers)
        return torch.cat([x[:, 0] - i for x, i in loader])


def test_deterministic_mode_repeats_exactly():
    first, second = _noisy_outputs(3), _noisy_outputs(3)
    assert torch.equal(first, second)
    assert first.unique().numel() > 16  # the noise is real


def test_collate_rejects_mixed_servers(add_server, double_server):
    refs = [add_server.proxy(vec(1), vec(1))[0], double_server.proxy(vec(1))]
    with pytest.raises(mmproxy.CollateError, match="different servers"):
        default_collate(refs)


def test_a_reference_of_a_server_not_given_is_one_rule_with_one_error(add_server, double_server):
    """A collate given its servers, and a loader given its servers, refuse a batch holding a
    reference of another server the same way: CollateError, naming it and the known ones."""
    samples = [TwoServerDataset(add_server.proxy, double_server.proxy)[i] for i in range(4)]
    with pytest.raises(mmproxy.CollateError, match=r"server 'double', which this collate was not "
                                                   r"given \(it has \['addsub'\]\)"):
        mmproxy.Collate([add_server])(samples)
    loader = mmproxy.DataLoader(add_server, TwoServerDataset(add_server.proxy, double_server.proxy),
                                batch_size=4)
    with pytest.raises(mmproxy.CollateError, match=r"server 'double', which this loader was not "
                                                   r"given \(it has \['addsub'\]\)"):
        next(iter(loader))


@pytest.mark.gpu
def test_gpu_outputs_are_ready_on_the_current_stream():
    from nvidia.dali import fn, pipeline_def

    @pipeline_def
    def gpu_pipe():
        x = fn.external_source(name="x", no_copy=True)
        return x.gpu() * 2

    with mmproxy.DALIServer(gpu_pipe(batch_size=8, num_threads=1, device_id=0)) as server:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for k in range(20):
                batch = default_collate([server.proxy(np.full((1 << 16,), k + j, np.float32))
                                         for j in range(8)])
                out = server.produce_data(batch)
                assert out.is_cuda
                expected = (torch.arange(8, device="cuda", dtype=torch.float32) + k) * 2
                assert torch.equal(out[:, -1], expected)


def test_a_run_that_never_arrives_times_out_with_a_named_error():
    with mmproxy.DALIServer(cpu(double_pipe), name="slow", timeout=0.3) as server:
        ghost = mmproxy.DALIOutputBatchRef(server.uid, server.name, "nobody:0", 0)
        start = time.perf_counter()
        with pytest.raises(mmproxy.WaitTimeoutError, match=r"'slow': run nobody:0 not ready"):
            server.produce_data([ghost])
        assert time.perf_counter() - start < 3


_FREEZE_SCRIPT = """
import gc, sys
sys.path.insert(0, {tests!r})
from conftest import add_sub_pipe, cpu
from datasets_for_tests import AddDataset
import mmproxy

with mmproxy.DALIServer(cpu(add_sub_pipe)) as server:
    loader = mmproxy.DataLoader(server, AddDataset(server.proxy, n=16), batch_size=4,
                                num_workers=1, freeze_gc={freeze})
    before = gc.get_freeze_count()
    for epoch in range(2):
        assert sum(len(batch[0]) for batch in loader) == 16
        print(epoch, before, gc.get_freeze_count(), flush=True)
"""


@pytest.mark.parametrize("freeze", [True, False])
def test_the_first_iteration_freezes_the_collectors_heap_unless_told_not_to(tmp_path, freeze):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "freeze.py"
    script.write_text(_FREEZE_SCRIPT.format(tests=str(Path(__file__).parents[1]), freeze=freeze))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    (e0, before, first), (e1, _, second) = (map(int, line.split()) for line in
                                            done.stdout.split("\n") if line)
    assert before == 0
    if freeze:  # once: the second epoch freezes nothing more
        assert first > 10_000 and second == first
    else:
        assert first == second == 0
