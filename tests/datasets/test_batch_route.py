"""The batch route of MultiModalDataset's server fields: one run per field made by the batcher,
with the batches, augmentation, skip records and resume of the per-sample route (a reference per
proxy call, collated), and none of its per-sample objects."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
import torch
from mmproxy.datasets import Field, MultiModalDataset, Source
from mmproxy.pipelines import image_eval_pipeline, image_train_pipeline

import mmproxy
from mmproxy.proxy import DALIProxy
from mmproxy.testing import image_bytes, write_tar

pytestmark = pytest.mark.timeout(240)

BATCH = 6
BAD_HEADER, MISSING, UNDECODABLE = "a003", "a009", "a014"


def _image(i: int, fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(i)
    h, w = 24 + i % 4 * 8, 32 + i % 3 * 8  # sizes vary, so crop windows do too
    return image_bytes(rng.integers(0, 255, (h, w, 3), dtype=np.uint8), fmt)


def _undecodable(i: int) -> bytes:
    """A JPEG whose frame header declares 7 colour components: it passes every header check and
    only the decoder can tell."""
    data = bytearray(_image(i))
    data[data.find(b"\xff\xc0") + 9] = 7
    return bytes(data)


def _sample(source: str, i: int) -> dict[str, object]:
    key = f"{source}{i:03d}"
    sample: dict[str, object] = {"__key__": key, "txt": f"{source} caption {i}", "cls": i}
    if key == BAD_HEADER:
        sample["jpg"] = _image(i)[:100]  # cut short: the header checks see it
    elif key == UNDECODABLE:
        sample["jpg"] = _undecodable(i)  # only the server's decoder sees it
    elif key != MISSING:
        sample["jpg" if source == "a" else "png"] = _image(i, "JPEG" if source == "a" else "PNG")
    return sample


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Source a: 3 shards of 8 JPEGs (one with a bad header, one missing, one undecodable);
    source b: 2 shards of 6 PNGs."""
    root = tmp_path_factory.mktemp("route")
    for s in range(3):
        write_tar(root / f"a-{s}.tar", [_sample("a", s * 8 + k) for k in range(8)])
    for s in range(2):
        write_tar(root / f"b-{s}.tar", [_sample("b", s * 6 + k) for k in range(6)])
    return str(root / "a-{0..2}.tar"), str(root / "b-{0..1}.tar")


@pytest.fixture(scope="module")
def servers():
    """Two servers: the training pipeline with crops drawn from each sample's seed, and an
    evaluation pipeline at another size."""
    train = mmproxy.DALIServer(image_train_pipeline(
        batch_size=BATCH, size=16, dtype="uint8", device="cpu", num_threads=1, scale=(0.2, 1.0),
        sample_seeded=True), name="train")
    small = mmproxy.DALIServer(image_eval_pipeline(
        batch_size=BATCH, size=8, dtype="uint8", device="cpu", num_threads=1), name="small")
    with train, small:
        yield train, small


def _dataset(shards, servers, **kw):
    train, small = servers
    fields = {"image": ("jpg;png", train.proxy), "small": ("jpg;png", small.proxy),
              "text": ("txt", bytes.decode), "label": ("cls", int)}
    return MultiModalDataset(sources=[Source(shards[0], fields, name="a"),
                                      Source(shards[1], fields, weight=0.5, name="b")],
                             batch_size=BATCH, seed=5, shuffle_buffer=8, on_error="skip",
                             max_skipped=0.5, **kw)


def _record(batch):
    return (list(batch), list(batch["__key__"]), list(batch["__url__"]), list(batch["__source__"]),
            list(batch["text"]), batch["label"].tolist(), batch["image"].clone(),
            batch["small"].clone(), sorted(batch["__skipped__"]))


def _epoch(loader, stop=None):
    out = []
    for batch in loader:
        out.append(_record(batch))
        if stop is not None and len(out) == stop:
            return out, pickle.loads(pickle.dumps(loader.state_dict()))
    return out, None


def _same(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a[:6] == b[:6] and a[8] == b[8]
        assert torch.equal(a[6], b[6]) and torch.equal(a[7], b[7]), f"batch {a[1]}: outputs differ"


@pytest.mark.parametrize("workers", [0, 2])
def test_the_batch_route_gives_the_batches_of_the_per_sample_route(shards, servers, workers):
    batched = _dataset(shards, servers)
    per_sample = _dataset(shards, servers, collate=mmproxy.Collate())  # a collate given: per sample
    assert batched._batched == {"image", "small"} and not per_sample._batched
    got, _ = _epoch(batched.loader(list(servers), num_workers=workers))
    expected, _ = _epoch(per_sample.loader(list(servers), num_workers=workers))
    _same(got, expected)
    assert got[0][0] == ["__key__", "__url__", "image", "small", "text", "label", "__source__",
                         "__skipped__"]  # the same dict, in the same order
    for _, keys, _, _, _, labels, image, small, _ in got:  # rows aligned after the server's drop
        assert len(keys) == len(labels) == image.shape[0] == small.shape[0]
        assert [int(k[1:]) for k in keys] == labels
    records = {r.key: r for batch in got for r in batch[8]}
    assert sorted(records) == [BAD_HEADER, MISSING, UNDECODABLE]
    assert records[BAD_HEADER].reason.startswith("bad header")
    assert records[MISSING].reason.startswith("missing field")
    assert records[UNDECODABLE].reason.startswith("pipeline failed in server 'train'")
    assert all(r.shard.endswith(f"a-{int(k[1:]) // 8}.tar") for k, r in records.items())
    keys = [k for batch in got for k in batch[1]]
    assert len(keys) == len(set(keys)) > 24  # the epoch ends when source b runs out


def test_the_batch_route_makes_no_proxy_call_per_sample(shards, servers, monkeypatch):
    """The batch route's fields make no call (a call is an object per sample and a reference
    per output); a collate of the user's, or a function around a proxy, still calls."""
    calls = []
    call = DALIProxy.__call__

    def counted(self, *args, **kwargs):
        calls.append(self.server_name)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(DALIProxy, "__call__", counted)
    got, _ = _epoch(_dataset(shards, servers).loader(list(servers), num_workers=0))
    assert calls == [] and sum(len(b[1]) for b in got) > 24
    per_sample, _ = _epoch(_dataset(shards, servers, collate=mmproxy.Collate()).loader(
        list(servers), num_workers=0))
    sent = sum(len(b[1]) for b in per_sample) + sum(
        r.key == UNDECODABLE for b in per_sample for r in b[8])
    assert len(calls) == 2 * sent  # each sample that passes the checks, once per server field

    train, small = servers
    wrapped = MultiModalDataset(shards[0], {"image": Field(
        "jpg", lambda data: train.proxy(data), server=True)}, batch_size=BATCH, on_error="skip",
        max_skipped=0.5)
    assert not wrapped._batched
    calls.clear()
    assert sum(len(batch["image"]) for batch in wrapped.loader(train, num_workers=0)) == 21
    assert calls == ["train"] * 22


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_route_resumed_mid_epoch_repeats_the_run(shards, servers, workers):
    whole, _ = _epoch(_dataset(shards, servers).loader(list(servers), num_workers=workers))
    before, state = _epoch(_dataset(shards, servers).loader(list(servers), num_workers=workers),
                           stop=len(whole) // 2)
    resumed = _dataset(shards, servers).loader(list(servers), num_workers=workers)
    resumed.load_state_dict(state)
    after, _ = _epoch(resumed)
    _same(before + after, whole)


def test_a_pipeline_failure_names_the_one_bad_sample_on_both_routes(servers, tmp_path):
    write_tar(tmp_path / "h-000.tar", [{"__key__": f"h{i:02d}", "jpg": _undecodable(i)
                                        if i == 4 else _image(i)} for i in range(BATCH)])
    train, _ = servers
    messages = []
    for collate in (None, mmproxy.Collate()):
        ds = MultiModalDataset(str(tmp_path / "h-000.tar"), {"image": ("jpg", train.proxy)},
                               batch_size=BATCH, collate=collate)
        with pytest.raises(mmproxy.PipelineError) as raised:
            list(ds.loader(train, num_workers=2))
        messages.append(re.sub(r"run [0-9a-f.:]+", "run N", str(raised.value)))
    assert "cannot process sample " in messages[0] and "h-000.tar:h04 " in messages[0]
    assert messages[0] == messages[1]
    assert train.state is mmproxy.ServerState.RUNNING


def test_the_field_stage_draws_each_samples_own_seed():
    from mmproxy.datasets.stages.fields import SampleSeeds, sample_seed

    seeds = SampleSeeds(7, 3, ["a", "b"])
    for source, name in enumerate(["a", "b"]):
        for key in ["k000", "", "caf\u00e9/0001", "x" * 300]:
            assert seeds(source, key) == sample_seed(7, 3, name, key)


def test_the_collate_finds_references_past_the_lists_it_passes_over(servers):
    """Collate's checks pass over a dict's tensors and lists of plain values in bulk, and still
    find a reference anywhere else: in a list beside strings, in a nested dict, in a tuple."""
    train, small = servers
    ref = mmproxy.DALIOutputBatchRef(small.uid, small.name, "run", 0)
    collate = mmproxy.Collate([train], inner=lambda samples: samples[0])
    assert collate([{"key": ["a", "b"], "n": [1, 2.5, None], "x": torch.zeros(2)}])["n"][1] == 2.5
    for hidden in (["a", ref], {"deep": {"er": ref}}, ("a", ref)):
        with pytest.raises(mmproxy.CollateError, match="server 'small', which this collate was not"):
            collate([{"key": ["a", "b"], "x": hidden}])
    sample_ref = train.proxy(_image(1))
    with pytest.raises(mmproxy.CollateError, match="left 1 DALI sample references uncollated"):
        collate([{"key": ["a"], "x": ["b", sample_ref]}])


def test_a_pipeline_of_two_outputs_gives_the_per_sample_routes_list(tmp_path):
    """A field of a two-output pipeline is a list of two batch references, as default_collate
    makes of a field of tuples: one run, both outputs."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=BATCH, num_threads=1, device_id=None)
    def decode_and_shape():
        data = fn.external_source(name="data", no_copy=True, dtype=types.UINT8)
        image = fn.decoders.image(data, output_type=types.RGB)
        return fn.resize(image, size=[8, 8]), image.shape(dtype=types.INT64)

    write_tar(tmp_path / "t-0.tar", [{"__key__": f"t{i:02d}", "jpg": _image(i)} for i in range(10)])
    with mmproxy.DALIServer(decode_and_shape(), name="two") as two:
        got = []
        for collate in (None, mmproxy.Collate()):
            ds = MultiModalDataset(str(tmp_path / "t-0.tar"), {"image": ("jpg", two.proxy)},
                                   batch_size=BATCH, collate=collate)
            assert bool(ds._batched) == (collate is None)
            got.append([b["image"] for b in ds.loader(two, num_workers=0)])
    for (pixels, sizes), (same_pixels, same_sizes) in zip(*got):
        assert torch.equal(pixels, same_pixels) and torch.equal(sizes, same_sizes)
    assert [s.tolist() for _, s in got[0]][0][0] == [24, 32, 3]


def _run_in_child(proxy, keys, samples, answers):
    try:
        proxy.run(keys, samples)
        answers.put("sent")
    except mmproxy.ProxyArgumentError as err:
        answers.put(str(err))


def test_a_run_whose_keys_or_inputs_do_not_match_its_samples_is_refused_at_the_call(servers):
    """DALIProxy.run checks its arguments where it is called: sent, such a run would make the
    server's listener take the memfd for a damaged one and fail the whole server."""
    import multiprocessing

    from mmproxy._context import SampleId

    _, small = servers
    one = small.proxy.sample_inputs(np.frombuffer(_image(1), np.uint8))
    keys = [SampleId("k0"), SampleId("k1")]
    for bad_keys, samples in ((keys, [one] * 3), (keys, [one, one + one])):
        with pytest.raises(mmproxy.ProxyArgumentError, match="server 'small': a run of 2 keys"):
            small.proxy.run(bad_keys, samples)
    fork = multiprocessing.get_context("fork")
    answers = fork.Queue()
    child = fork.Process(target=_run_in_child, args=(small.proxy, keys, [one] * 3, answers))
    child.start()
    child.join(60)
    assert "one key per sample" in answers.get(timeout=10)
    assert small.state is mmproxy.ServerState.RUNNING
    run = small.proxy.run(keys, [one, one])  # the server still takes and runs runs
    out = small.produce_data(mmproxy.DALIOutputBatchRef(small.uid, small.name, run, 0))
    assert out.shape[0] == 2


def test_the_sample_is_named_only_where_a_field_function_reads_it():
    """Per sample, the field stage names the sample (``sample_key``) around its fields only
    when a function may read it: a batch-route proxy that draws from the seed or checks its
    inputs, or any function of the user's (which may call a proxy); each then sees the sample."""
    from mmproxy.datasets.stages.fields import SampleFields, _plan, parse_field
    from mmproxy.datasets.stages.reader import Taken

    from mmproxy import _context
    from mmproxy.skips import ErrorPolicy

    plain = DALIProxy("s", "uid", ("data",), 1, "unused")
    drawing = image_train_pipeline(batch_size=2, device="cpu", sample_seeded=True).sample_random
    seeded = DALIProxy("t", "uid2", ("data", *drawing.names), 1, "unused", sample_random=drawing)
    seen = []

    def label(data: bytes) -> int:
        seen.append(_context.current_key())
        return int(data)

    fields = {"image": parse_field("image", ("jpg", plain))}
    assert not _plan(fields, {"image"}).named
    assert _plan({"image": parse_field("image", ("jpg", seeded))}, {"image"}).named
    assert _plan(fields, set()).named  # a proxy call of the per-sample route
    both = {**fields, "label": parse_field("label", ("cls", label))}
    assert _plan(both, {"image"}).named
    sample = {"__key__": "k", "__url__": "u.tar", "jpg": _image(0), "cls": b"3"}
    apply = SampleFields([("s", both)], seed=5, epoch=1, mixed=False, keep_keys=False,
                         max_pixels=2**26, policy=ErrorPolicy("skip", None),
                         batched=frozenset({"image"}))
    out = apply(0, Taken("u.tar", 0, sample)).sample
    assert out["label"] == 3 and seen == [_context.SampleId("k", "u.tar", True,
                                                           apply.seeds(0, "k"))]
    assert _context.current_key() is None
