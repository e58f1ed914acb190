"""Resume: exact and elastic resumes over workers and ranks, the skip counts across them, and the
states that are refused."""

# ruff: noqa: F811 - the fixtures imported from the helpers are the tests' parameters

from __future__ import annotations

import collections
import itertools
import json
import pickle
import subprocess
import sys
import textwrap

import braceexpand
import pytest
import torch
from mmproxy.datasets import MultiModalDataset, Source
from mmproxy.pipelines import image_train_pipeline
from resume_helpers import (
    BATCH,
    PER_SHARD,
    SHARDS,
    _image,
    server,  # noqa: F401 - fixtures
)

import mmproxy
from mmproxy.testing import write_tar

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    for s in range(SHARDS):
        write_tar(root / f"r-{s:02d}.tar",
                  [{"__key__": f"k{s * PER_SHARD + k:03d}", "jpg": _image(s * PER_SHARD + k),
                    "txt": f"t{s * PER_SHARD + k}"} for k in range(PER_SHARD)])
    return str(root / "r-{00..05}.tar")


def _dataset(shards, server, **kw):
    options = {"batch_size": BATCH, "seed": 7, "shuffle_buffer": 8, **kw}
    return MultiModalDataset(shards, {"image": ("jpg", server.proxy),
                                      "text": ("txt", bytes.decode)}, **options)


def _record(batch):
    return list(batch["__key__"]), batch["image"].clone()


def _same(a, b):
    assert [keys for keys, _ in a] == [keys for keys, _ in b]
    for (keys, x), (_, y) in zip(a, b):
        assert torch.equal(x, y), f"batch {keys}: augmentation differs"


def _epochs(loader, epochs, stop_after=None):
    """Batches of ``epochs`` epochs; with ``stop_after``, the state after that many batches of
    the first epoch (and the batches until then)."""
    out = []
    for _ in range(epochs):
        for batch in loader:
            out.append(_record(batch))
            if stop_after is not None and len(out) == stop_after:
                return out, pickle.loads(pickle.dumps(loader.state_dict()))
    return out, None


CASES = {
    "0 workers": dict(num_workers=0),
    "2 workers": dict(num_workers=2),
    "2 persistent workers": dict(num_workers=2, persistent_workers=True),
    "3 workers, no buffer": dict(num_workers=3, data=dict(shuffle_buffer=0)),
    "epoch_length": dict(num_workers=2, data=dict(epoch_length=5)),
    "resampled": dict(num_workers=2, data=dict(resampled=True, epoch_length=6)),
    "no shard shuffle, 1 worker": dict(num_workers=1, data=dict(shuffle_shards=False)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("where", ["mid-epoch", "epoch boundary"])
def test_resume_repeats_the_uninterrupted_run(shards, server, case, where):
    opts = dict(CASES[case])
    data = opts.pop("data", {})
    whole, _ = _epochs(_dataset(shards, server, **data).loader(server, **opts), 2)
    per_epoch = len(whole) // 2
    k = per_epoch if where == "epoch boundary" else per_epoch // 2 + 1
    before, state = _epochs(_dataset(shards, server, **data).loader(server, **opts), 1, k)
    assert state is not None and len(pickle.dumps(state)) < 20_000
    resumed_loader = _dataset(shards, server, **data).loader(server, **opts)
    resumed_loader.load_state_dict(state)
    after, _ = _epochs(resumed_loader, 2)  # the rest of epoch 1 (nothing at its end), epoch 2
    _same(before + after, whole)


def test_resume_in_a_new_process(shards, server, tmp_path):
    """A state saved here, loaded by a fresh Python process that builds the loader the same way."""
    whole, _ = _epochs(_dataset(shards, server).loader(server, num_workers=2), 1)
    before, state = _epochs(_dataset(shards, server).loader(server, num_workers=2), 1, 5)
    torch.save(state, tmp_path / "state.pt")
    script = textwrap.dedent(f"""
        import json, torch, mmproxy
        from mmproxy.datasets import MultiModalDataset, Source
        from mmproxy.pipelines import image_train_pipeline
        pipe = image_train_pipeline(batch_size={BATCH}, size=16, dtype="uint8", device="cpu",
                                    num_threads=1, scale=(0.2, 1.0), sample_seeded=True)
        with mmproxy.DALIServer(pipe, name="train") as server:
            ds = MultiModalDataset({shards!r}, {{"image": ("jpg", server.proxy),
                                   "text": ("txt", bytes.decode)}}, batch_size={BATCH}, seed=7,
                                   shuffle_buffer=8)
            loader = ds.loader(server, num_workers=2)
            loader.load_state_dict(torch.load({str(tmp_path / "state.pt")!r}, weights_only=False))
            out = [(list(b["__key__"]), b["image"].flatten().tolist()) for b in loader]
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180, check=True)
    after = [(keys, torch.tensor(pixels, dtype=torch.uint8).reshape(-1, 3, 16, 16))
             for keys, pixels in json.loads(done.stdout.strip().splitlines()[-1])]
    _same(before + after, whole)


def test_resume_with_two_servers(shards, server):
    """Two servers (a second image view at another size): both outputs repeat."""
    pipe = image_train_pipeline(batch_size=BATCH, size=8, dtype="uint8", device="cpu",
                                num_threads=1, sample_seeded=True)
    with mmproxy.DALIServer(pipe, name="small") as small:
        def build():
            ds = MultiModalDataset(shards, {"image": ("jpg", server.proxy),
                                            "small": ("jpg", small.proxy)},
                                   batch_size=BATCH, seed=3, shuffle_buffer=8)
            return ds.loader([server, small], num_workers=2)

        def run(loader, stop=None):
            out = []
            for batch in loader:
                out.append((list(batch["__key__"]), batch["image"].clone(), batch["small"].clone()))
                if stop and len(out) == stop:
                    return out, loader.state_dict()
            return out, None

        whole, _ = run(build())
        before, state = run(build(), 4)
        resumed = build()
        resumed.load_state_dict(state)
        after, _ = run(resumed)
    assert [b[0] for b in before + after] == [b[0] for b in whole]
    for x, y in zip(before + after, whole):
        assert torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])


def _keys(loader, stop=None):
    keys = []
    for n, batch in enumerate(loader, 1):
        keys += batch["__key__"]
        if stop and n == stop:
            return keys, loader.state_dict()
    return keys, None


ALL_KEYS = [f"k{i:03d}" for i in range(SHARDS * PER_SHARD)]


@pytest.mark.parametrize("workers,resumed_workers", [(2, 3), (3, 1), (0, 2)])
def test_elastic_workers_deliver_every_remaining_sample_once(shards, server, workers,
                                                             resumed_workers):
    before, state = _keys(_dataset(shards, server).loader(server, num_workers=workers), 5)
    loader = _dataset(shards, server).loader(server, num_workers=resumed_workers)
    loader.load_state_dict(state)
    after, _ = _keys(loader)
    assert not set(before) & set(after)
    assert collections.Counter(before + after) == collections.Counter(ALL_KEYS)


@pytest.fixture
def as_rank(monkeypatch):
    """Makes this process rank ``rank`` of ``world`` (RANK / WORLD_SIZE, as torchrun sets them);
    ``as_rank(None)`` makes it a single process again."""
    def set_rank(rank, world=None):
        if rank is None:
            monkeypatch.delenv("RANK")
            monkeypatch.delenv("WORLD_SIZE")
        else:
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", str(world))
    return set_rank


@pytest.mark.parametrize("world,new_world", [(2, 3), (2, 2), (3, 1)])
def test_ranks_resume_exactly_or_elastically(shards, server, as_rank, world, new_world):
    """Ranks simulated one after the other (RANK / WORLD_SIZE), 1 worker each."""
    saved, before = [], {}
    for rank in range(world):
        as_rank(rank, world)
        before[rank], state = _keys(_dataset(shards, server).loader(server, num_workers=1), 2)
        saved.append(state)
    after = {}
    for rank in range(new_world):
        as_rank(rank, new_world)
        loader = _dataset(shards, server).loader(server, num_workers=1)
        loader.load_state_dict(saved)
        after[rank] = _keys(loader)[0]
    delivered = [k for keys in (*before.values(), *after.values()) for k in keys]
    assert collections.Counter(delivered) == collections.Counter(ALL_KEYS)
    if world == new_world:  # exact: each rank continues its own samples in its own order
        for rank in range(world):
            as_rank(rank, world)
            whole = _keys(_dataset(shards, server).loader(server, num_workers=1))[0]
            assert before[rank] + after[rank] == whole


def test_elastic_resume_needs_every_rank(shards, server, as_rank):
    as_rank(0, 2)
    _, state = _keys(_dataset(shards, server).loader(server, num_workers=1), 1)
    as_rank(None)
    loader = _dataset(shards, server).loader(server, num_workers=2)
    with pytest.raises(ValueError, match="states of all 2 ranks"):
        loader.load_state_dict([state])
        next(iter(loader))


def test_resuming_late_processes_only_what_it_delivers(shards, server):
    """Skipped samples are passed over: no field function, nothing sent to a server."""
    calls = collections.Counter()

    def text(data):
        calls[data.decode()] += 1
        return data.decode()

    def build():
        return MultiModalDataset(shards, {"image": ("jpg", server.proxy), "text": ("txt", text)},
                                 batch_size=BATCH, seed=7, shuffle_buffer=8).loader(server,
                                                                                  num_workers=0)

    _, state = _keys(build(), 13)  # 52 of 60 samples
    calls.clear()
    before = server.samples
    loader = build()
    loader.load_state_dict(state)
    first = next(iter(loader))
    assert len(first["__key__"]) == BATCH
    assert sum(calls.values()) == BATCH
    assert server.samples - before == BATCH


def test_state_of_a_finished_epoch_starts_the_next(shards, server):
    loader = _dataset(shards, server).loader(server, num_workers=1)
    first, _ = _keys(loader)
    state = loader.state_dict()
    assert state["done"] and state["epoch"] == 1
    resumed = _dataset(shards, server).loader(server, num_workers=1)
    resumed.load_state_dict(state)
    again, _ = _keys(resumed)
    assert sorted(again) == ALL_KEYS and again != first  # epoch 2 is reshuffled
    second, _ = _keys(loader)
    assert again == second


def test_state_from_another_loader_kind_is_refused(shards, server):
    loader = _dataset(shards, server).loader(server, num_workers=0)
    with pytest.raises(ValueError, match="not a state"):
        loader.load_state_dict({"epoch": 1})


def test_a_state_saved_right_after_loading_one_is_that_state(shards, server):
    """A checkpoint written after load_state_dict, before the first step, resumes the same."""
    whole, _ = _keys(_dataset(shards, server).loader(server, num_workers=2))
    before, state = _keys(_dataset(shards, server).loader(server, num_workers=2), 3)
    loaded = _dataset(shards, server).loader(server, num_workers=2)
    loaded.load_state_dict(state)
    again = loaded.state_dict()
    assert again["epoch"] == state["epoch"] and again["batches"] == 3 and not again["done"]
    resumed = _dataset(shards, server).loader(server, num_workers=2)
    resumed.load_state_dict(again)
    assert before + _keys(resumed)[0] == whole


def test_an_unreadable_shard_is_reported_once_across_a_resume(shards, server, tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"this is not a tar file" * 100)
    urls = expand_brace(shards)
    urls.insert(2, str(bad))  # worker 0 reads it between two good shards

    def build():
        return MultiModalDataset(urls, {"text": ("txt", bytes.decode)}, batch_size=1,
                                 shuffle_shards=False, on_error="skip", max_skipped=None
                                 ).loader(server, num_workers=2)

    whole = build()
    keys, _ = _keys(whole)
    assert whole.skipped.skipped == 1
    for k in range(1, len(keys)):  # wherever the state is saved
        before, state = _keys(build(), k)
        resumed = build()
        resumed.load_state_dict(state)
        after, _ = _keys(resumed)
        assert before + after == keys and resumed.skipped.skipped == 1, k


def expand_brace(pattern):
    from mmproxy.datasets.shards import expand

    return expand(pattern)


def test_elastic_states_load_with_torch_weights_only(shards, server, tmp_path):
    _, state = _keys(_dataset(shards, server).loader(server, num_workers=2), 3)
    loader = _dataset(shards, server).loader(server, num_workers=3)
    loader.load_state_dict(state)
    torch.save(loader.state_dict(), tmp_path / "elastic.pt")
    assert torch.load(tmp_path / "elastic.pt", weights_only=True)["workers"] == 3


def test_resampling_only_empty_shards_fails_instead_of_spinning(server, tmp_path):
    write_tar(tmp_path / "empty-0.tar", [{"__key__": "x", "txt": ""}][:0])
    ds = MultiModalDataset(str(tmp_path / "empty-0.tar"), {"text": ("txt", bytes.decode)},
                           batch_size=2, resampled=True, epoch_length=2)
    with pytest.raises(mmproxy.ShardError, match="held no samples"):
        for _ in ds.loader(server, num_workers=0):
            pass


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """400 samples in 8 shards: 150 lack their .txt, 50 hold text that is not UTF-8."""
    root = tmp_path_factory.mktemp("damaged")
    for s in range(8):
        samples = []
        for k in range(50):
            i = s * 50 + k
            sample = {"__key__": f"d{i:03d}", "cls": b"0", "txt": f"t{i}".encode()}
            if i % 8 in (0, 3, 6):
                del sample["txt"]
            elif i % 8 == 1:
                sample["txt"] = b"\xff\xfe"
            samples.append(sample)
        write_tar(root / f"d-{s}.tar", samples)
    return str(root / "d-{0..7}.tar")


@pytest.mark.parametrize("workers,resumed_workers", [(2, 3), (0, 2)])
def test_elastic_resume_keeps_the_skip_counts(damaged, server, workers, resumed_workers):
    """More than 100 samples skipped before the save: the merged report's counts per kind
    are still those of the uninterrupted run."""
    def build(num_workers):
        return MultiModalDataset(damaged, {"text": ("txt", bytes.decode)}, batch_size=4, seed=1,
                                 shuffle_buffer=8, on_error="skip", max_skipped=0.9
                                 ).loader(server, num_workers=num_workers)

    whole = build(workers)
    keys, _ = _keys(whole)
    expected = {"missing field": 150, "field function failed": 50}
    assert len(keys) == 200 and dict(whole.skipped.by_kind) == expected
    before, state = _keys(build(workers), 40)  # 160 of 200 delivered
    assert state["report"]["skipped"] > 100
    resumed = build(resumed_workers)
    resumed.load_state_dict(state)
    after, _ = _keys(resumed)
    assert sorted(before + after) == sorted(keys)
    report = resumed.skipped
    assert (dict(report.by_kind), report.skipped, report.delivered) == (expected, 200, 200)
    assert sum(report.by_kind.values()) == report.skipped
    assert {r.reason.split(" ")[0] for r in report.records} == {"missing", "field"}


def test_elastic_resume_over_ranks_counts_each_skip_once(damaged, server, as_rank):
    """2 ranks saved mid-epoch, resumed as 3: the old ranks' counts go to new rank 0 only, so the
    new ranks' reports add up to the uninterrupted run's (not to 3 copies of the old counts)."""
    def build():
        return MultiModalDataset(damaged, {"text": ("txt", bytes.decode)}, batch_size=4, seed=1,
                                 shuffle_buffer=8, on_error="skip", max_skipped=0.9
                                 ).loader(server, num_workers=1)

    saved = []
    for rank in range(2):
        as_rank(rank, 2)
        saved.append(_keys(build(), 15)[1])
    reports = []
    for rank in range(3):
        as_rank(rank, 3)
        loader = build()
        loader.load_state_dict(saved)
        _keys(loader)
        reports.append(loader.skipped)
    assert sum(r.skipped for r in reports) == 200 and sum(r.delivered for r in reports) == 200
    by_kind = collections.Counter()
    for r in reports:
        by_kind.update(r.by_kind)
    assert dict(by_kind) == {"missing field": 150, "field function failed": 50}


@pytest.fixture(scope="module")
def small_mix(tmp_path_factory):
    """Source A: 4 shards of 10 samples; B: 4 shards of 3 (it runs out of work items first)."""
    root = tmp_path_factory.mktemp("small_mix")
    for source, samples in (("a", 10), ("b", 3)):
        for s in range(4):
            keys = [f"{source}{s}-{k}" for k in range(samples)]
            write_tar(root / f"{source}-{s}.tar", [{"__key__": k, "txt": k} for k in keys])
    return str(root / "a-{0..3}.tar"), str(root / "b-{0..3}.tar")


def _mix(small_mix, **kw):
    text = {"text": ("txt", bytes.decode)}
    return MultiModalDataset(sources=[Source(small_mix[0], text, 1, "A"),
                                      Source(small_mix[1], text, 1, "B")],
                             batch_size=2, seed=3, **kw)


@pytest.mark.parametrize("data", [{}, {"epoch_length": 14}])
def test_elastic_resume_deals_some_workers_nothing_of_a_source(small_mix, data):
    """After 10 batches of 2 workers B has 2 work items left for 3 new workers: the one dealt
    none of B mixes A alone, and no sample comes twice."""
    loader = _mix(small_mix, **data).loader(num_workers=2)
    before, state = _keys(loader, 10)
    resumed = _mix(small_mix, **data).loader(num_workers=3)
    resumed.load_state_dict(state)
    after, _ = _keys(resumed)
    assert after
    if data:  # the sources restart to fill the quota: samples may come again
        assert len(before + after) == 2 * 14
    else:
        assert len(set(before + after)) == len(before + after)


def test_elastic_resume_of_a_mix_from_every_position(small_mix):
    """Saved after every batch (so also where a shard reader has given the last sample of its
    item, and its state still holds the item), resharded to 3 workers: each new worker reads
    what it was dealt, maybe nothing of a source, and no sample comes twice."""
    from mmproxy.datasets.stages.position import PositionStamp

    from mmproxy.state import LoaderState

    ds = _mix(small_mix, shuffle_buffer=0)
    batches = len(list(ds._chain(1, 0, 1, rank=0, world=1)))
    for n in range(1, batches):
        chain = ds._chain(1, 0, 1, rank=0, world=1)
        before = [k for _ in range(n) for k in next(chain)["__key__"]]
        saved = LoaderState(epoch=1, done=False, batches=n, positions={0: chain.state_dict()})
        after = []
        for state in ds.reshard([saved], rank=0, world=1, workers=3):
            resumed = ds._chain(*PositionStamp.where(state), rank=0, world=1)
            resumed.reset(state)
            after += [k for batch in resumed for k in batch["__key__"]]
        assert after and len(set(before + after)) == len(before + after), f"after {n} batches"


def test_two_loaders_without_workers_resume_each_their_own(shards, server, tmp_path):
    """num_workers=0 loaders of one epoch, used alternately (e.g. two datasets in one loop):
    each resumes from its own state."""
    write_tar(tmp_path / "o-0.tar", [{"__key__": f"o{i:02d}", "txt": f"o{i}"} for i in range(30)])
    write_tar(tmp_path / "o-1.tar", [{"__key__": f"o{i:02d}", "txt": f"o{i}"}
                                      for i in range(30, 50)])

    def build():
        other = MultiModalDataset(str(tmp_path / "o-{0..1}.tar"), {"text": ("txt", bytes.decode)},
                                  batch_size=3, seed=4, shuffle_buffer=5)
        return (_dataset(shards, server).loader(server, num_workers=0),
                other.loader(server, num_workers=0))

    def run(a, b, stop=None):
        out_a, out_b = [], []
        # both iterators exist before either's first batch
        for batch_a, batch_b in itertools.zip_longest(a, b):
            for out, batch in ((out_a, batch_a), (out_b, batch_b)):
                if batch is not None:
                    out.append(list(batch["__key__"]))
            if stop and len(out_a) == stop:
                return out_a, out_b, (a.state_dict(), b.state_dict())
        return out_a, out_b, None

    whole_a, whole_b, _ = run(*build())
    assert (len(whole_a), len(whole_b)) == (15, 17)
    before_a, before_b, (state_a, state_b) = run(*build(), 6)
    a, b = build()
    a.load_state_dict(state_a)
    b.load_state_dict(state_b)
    after_a, after_b, _ = run(a, b)
    assert (before_a + after_a, before_b + after_b) == (whole_a, whole_b)


@pytest.mark.parametrize("workers", [2, 3])  # the same workers (exact), others (elastic)
def test_a_state_saved_with_another_seed_is_refused(shards, server, workers):
    """The seed orders each epoch's shards and samples: a position saved under one seed points
    elsewhere under another (resumed, some samples came twice and others not at all)."""
    _, state = _epochs(_dataset(shards, server).loader(server, num_workers=2), 1, 3)
    loader = _dataset(shards, server, seed=8).loader(server, num_workers=workers)
    loader.load_state_dict(state)
    with pytest.raises(mmproxy.StateError, match=r"saved by a dataset of seed=7, and this one's "
                                                 r"seed is 8.*resume with seed=7"):
        next(iter(loader))


@pytest.mark.parametrize("workers", [2, 3])  # the same workers (exact), others (elastic)
def test_a_state_of_other_shards_is_refused(shards, server, workers):
    """A saved position points into the shards it was saved over: on other shards (fewer, or
    the same under other names) it would read a mix of both sets, silently."""
    _, state = _epochs(_dataset(shards, server).loader(server, num_workers=2), 1, 3)
    fewer = shards.replace("{00..05}", "{00..04}")
    for other in (fewer, [p.replace("/r-", "/./r-") for p in braceexpand.braceexpand(shards)]):
        loader = _dataset(other, server).loader(server, num_workers=workers)
        loader.load_state_dict(state)
        with pytest.raises(mmproxy.StateError, match="saved by a dataset over other shards"):
            next(iter(loader))
