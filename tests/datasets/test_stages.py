"""Every stage of a dataset worker's chain saves and loads its own state.

One test runs over every stage (torchdata.nodes' save/load check, in this project's terms): take
N items from a stage, save its state, build the chain afresh, load the state into the same stage,
and the items that follow are exactly those of an uninterrupted run (content included), for every
N from 0 to past the end (so also in the middle of filling the shuffle buffer, while a batch is
half full, and at the last item).
"""

from __future__ import annotations

import pickle

import pytest
from mmproxy.datasets import MultiModalDataset, Source
from mmproxy.datasets.stages.fields import Processed
from mmproxy.datasets.stages.plan import Work
from mmproxy.datasets.stages.reader import Taken

import mmproxy
from mmproxy.skips import SkippedSample
from mmproxy.testing import write_tar

pytestmark = pytest.mark.timeout(120)

LIMIT = 150  # items at most (resampled and endless stages never end)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Source A: 3 good shards, one of samples without text, a damaged and an empty one; B: 1.
    The records pile up faster than a batch fills, so some go alone while a batch is half full
    (and then a state holds the addresses of that batch's samples)."""
    root = tmp_path_factory.mktemp("stages")
    for s in range(3):
        write_tar(root / f"a-{s}.tar", [{"__key__": f"a{s}-{k}", "txt": f"a {s} {k}"}
                                        for k in range(7)])
    write_tar(root / "a-3.tar", [{"__key__": f"a3-{k}", "cls": "1"} for k in range(5)])  # no .txt
    (root / "a-4.tar").write_bytes(b"not a tar" * 200)
    write_tar(root / "a-5.tar", [])
    write_tar(root / "b-0.tar", [{"__key__": f"b0-{k}", "txt": f"b {k}"} for k in range(4)])
    return [str(root / f"a-{s}.tar") for s in range(6)], [str(root / "b-0.tar")]


TEXT = {"text": ("txt", bytes.decode)}

CASES = {
    "one source": dict(shuffle_buffer=5),
    "no buffer, no partial batch": dict(shuffle_buffer=0, partial=False),
    "two sources, restart": dict(mixed=True, shuffle_buffer=3, on_exhausted="restart"),
    "two sources, epoch_length": dict(mixed=True, shuffle_buffer=3, epoch_length=6),
    "resampled": dict(shuffle_buffer=4, resampled=True, epoch_length=5),
    "batches that are not dicts": dict(shuffle_buffer=5, batch_transform=lambda batch: (
        batch["__key__"], batch["text"])),  # each followed by its records on their own
    # an elastic resume's chains: each source's first pass dealt (B's, nothing; or only a
    # shard read to its end), a state of it loaded into a chain built without it
    "dealt, none of B": dict(mixed=True, shuffle_buffer=3,
                             dealt=lambda a, b: [[Work(a[1], start=4), Work(a[4]), Work(a[0]),
                                                  Work(a[2], only=(1, 5))], []]),
    "dealt, B read to its end": dict(mixed=True, shuffle_buffer=3, epoch_length=6,
                                     dealt=lambda a, b: [[Work(a[2], start=2), Work(a[3]),
                                                          Work(a[0], start=6), Work(a[1])],
                                                         [Work(b[0], start=4)]]),
}


def _chain(shards, case, resumed=False):
    """The chain of worker 0 of 1 for a case; ``resumed``: as a resume builds it (a dealt
    first pass comes with the state)."""
    options = dict(CASES[case])
    dealt = options.pop("dealt", None)
    return _dataset(shards, **options)._chain(
        1, 0, 1, rank=0, world=1, dealt=None if dealt is None or resumed else dealt(*shards))


def _dataset(shards, mixed=False, **options):
    a, b = shards
    common = {"batch_size": 3, "seed": 9, "on_error": "skip", "max_skipped": None, **options}
    if mixed:
        return MultiModalDataset(sources=[Source(a, TEXT, 2, "A"), Source(b, TEXT, 1, "B")],
                                 **common)
    return MultiModalDataset(a, TEXT, **common)


# stage name -> where it sits in a chain
STAGES = {
    "shard plan": lambda c: c.batcher.fields.mixer.buffers[0].reader.plan,
    "shard reader": lambda c: c.batcher.fields.mixer.buffers[0].reader,
    "shuffle buffer": lambda c: c.batcher.fields.mixer.buffers[0],
    "source mixer": lambda c: c.batcher.fields.mixer,
    "fields": lambda c: c.batcher.fields,
    "batcher": lambda c: c.batcher,
    "position stamp": lambda c: c,
}


def _described(item):
    """An item as plain values, content included (bytes read while their shard is mapped)."""
    if isinstance(item, Taken):
        raw = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in item.raw.items()}
        return ("taken", item.url, item.index, raw)
    if isinstance(item, Processed):
        return ("processed", item.source, item.url, item.index, item.sample)
    if isinstance(item, (Work, SkippedSample)):
        return tuple(item)
    if isinstance(item, tuple):  # the mixer's (source, Taken)
        return tuple(_described(x) for x in item)
    return item  # a batch: lists of keys, texts and records


def _run(stage, limit):
    out = []
    while len(out) < limit:
        try:
            item = stage.next()
        except StopIteration:
            break
        out.append(_described(item))
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(STAGES))
def test_every_stage_resumes_where_its_state_was_saved(shards, name, case):
    where = STAGES[name]

    def build(resumed=False):
        return where(_chain(shards, case, resumed))

    whole = _run(build(), LIMIT)
    assert len(whole) > 3
    half_full: set[int] = set()
    for n in range(len(whole) + 1):  # 0, mid-buffer, the last item, past the end: every one
        stage = build()
        first = _run(stage, n)
        state = pickle.loads(pickle.dumps(stage.state_dict()))
        if (name == "shuffle buffer" and n == 3 and CASES[case]["shuffle_buffer"]
                and "dealt" not in CASES[case]):
            assert state["held"], "the state is saved while the buffer holds samples"
        if name == "batcher" and state["batch"]:
            half_full.add(n)
        again = build(resumed=True)
        again.reset(state)
        assert first + _run(again, LIMIT - n) == whole, f"after {n} items"
    if name == "batcher" and case == "one source":
        assert half_full, "some state is saved while a batch is being filled"


def test_the_chain_carries_records_of_damaged_shards_and_samples(shards):
    items = list(_dataset(shards, **CASES["one source"])._chain(1, 0, 1, rank=0, world=1))
    records = [r for batch in items for r in batch["__skipped__"]]
    assert sorted(r.reason.split(":")[0] for r in records) == [
        "empty shard", *["missing field 'txt' (the sample has ['cls'])"] * 5, "unreadable shard"]
    assert sum(len(batch.get("__key__", [])) for batch in items) == 21
    assert any(batch.keys() == {"__skipped__", "__shards_tried__"} for batch in items[:-1])  # records alone


def test_a_key_with_a_dot_is_said_in_the_missing_fields_record(tmp_path):
    """``clip.0.txt`` is field ``0.txt`` of sample ``clip`` (WebDataset's rule): the record of
    the missing ``txt`` says so and how to name the files."""
    import webdataset as wds

    path = str(tmp_path / "dotted.tar")
    with wds.TarWriter(path) as writer:  # the files as another tool writes them
        for i in range(3):
            writer.write({"__key__": f"clip.{i}", "txt": f"caption {i}"})
    ds = MultiModalDataset(path, {"text": ("txt", str)}, batch_size=2, on_error="skip",
                           max_skipped=None)
    [record] = [r for batch in ds._chain(1, 0, 1, rank=0, world=1) for r in batch["__skipped__"]]
    assert record.key == "clip"
    assert record.reason == (
        "missing field 'txt' (the sample has ['0.txt', '1.txt', '2.txt']): a sample's key ends "
        "at the first dot of its file names (WebDataset's rule), so files like 'clip.0.txt' are "
        "field '0.txt' of sample 'clip'; name them without a dot in the key (like "
        "'clip_0.txt'): 3 of its files end in '.txt', the files of 3 samples read as one")


def test_the_dotted_key_hint_renames_every_dot_of_the_key(tmp_path):
    import webdataset as wds

    path = str(tmp_path / "dotted.tar")
    with wds.TarWriter(path) as writer:
        writer.write({"__key__": "img.2024.01", "txt": "a caption"})
    ds = MultiModalDataset(path, {"text": ("txt", str)}, batch_size=2, on_error="skip",
                           max_skipped=None)
    [record] = [r for batch in ds._chain(1, 0, 1, rank=0, world=1) for r in batch["__skipped__"]]
    assert "files like 'img.2024.01.txt' are field '2024.01.txt' of sample 'img'" in record.reason
    assert record.reason.endswith("(like 'img_2024_01.txt'), or read the longer extension")


def test_the_dotted_key_hint_says_when_several_samples_were_read_as_one(tmp_path):
    """``img.2024.01.*`` and ``img.2024.02.*`` are all sample ``img``'s: reading the longer
    extension would take one of the two, so the hint says to rename, and why."""
    import webdataset as wds

    path = str(tmp_path / "dotted.tar")
    with wds.TarWriter(path) as writer:
        for day in ("01", "02"):
            writer.write({"__key__": f"img.2024.{day}", "txt": f"caption {day}"})
    ds = MultiModalDataset(path, {"text": ("txt", str)}, batch_size=2, on_error="skip",
                           max_skipped=None)
    [record] = [r for batch in ds._chain(1, 0, 1, rank=0, world=1) for r in batch["__skipped__"]]
    assert record.reason.endswith(
        "name them without a dot in the key (like 'img_2024_01.txt'): 2 of its files end in "
        "'.txt', the files of 2 samples read as one"), record.reason


@pytest.mark.parametrize("name", list(STAGES))
def test_a_stage_refuses_a_state_of_another_stage(shards, name):
    where = STAGES[name]
    chain = _dataset(shards, **CASES["one source"])._chain(1, 0, 1, rank=0, world=1)
    others = [where(chain).state_dict()]
    wrong = {**others[0], "version": 99}
    with pytest.raises(mmproxy.StateError, match="of version 99"):
        where(chain).reset(wrong)
    with pytest.raises(mmproxy.StateError, match=r"unknown keys \['surprise'\]"):
        where(chain).reset({**others[0], "surprise": 1})


@pytest.mark.parametrize("shards_entry", [None, "count and digest"])
def test_a_shard_plan_refuses_a_state_without_its_shards_and_seed(shards, shards_entry):
    plan = STAGES["shard plan"](_chain(shards, "one source"))
    state = plan.state_dict()
    state["shards"] = None if shards_entry is None else state["shards"][:2]
    with pytest.raises(mmproxy.StateError, match="not their count, digest and seed"):
        STAGES["shard plan"](_chain(shards, "one source")).reset(state)


def _stages_in(value):
    """The stages ``value`` holds: itself, or those of a list."""
    from mmproxy.datasets.stages._stage import Stage

    items = value if isinstance(value, list) else [value]
    return [v for v in items if isinstance(v, Stage)]


def test_every_stage_speaks_the_one_protocol_and_holds_only_its_source(shards):
    """Every stage is a :class:`Stage` (``next``, ``reset``, ``state_dict``, ``remaining``), has
    no other way to its items or its state, and holds no stage but its own source."""
    from mmproxy.datasets.stages._stage import Stage

    chain = _dataset(shards, mixed=True, shuffle_buffer=3)._chain(1, 0, 1, rank=0, world=1)
    stages = {name: where(chain) for name, where in STAGES.items()}
    sources = {"shard plan": [], "shard reader": ["shard plan"],
               "shuffle buffer": ["shard reader"], "source mixer": ["shuffle buffer"] * 2,
               "fields": ["source mixer"], "batcher": ["fields"], "position stamp": ["batcher"]}
    for name, stage in stages.items():
        assert isinstance(stage, Stage), name
        for old in ("take", "current", "advance", "restart", "load_state_dict"):
            assert not hasattr(stage, old), f"{name}.{old}"
        held = [s for value in vars(stage).values() for s in _stages_in(value)]
        assert sorted(type(s).NAME for s in held) == sorted(
            type(stages[n]).NAME for n in sources[name]), name
        assert held[:1] == [stages[n] for n in sources[name]][:1], name


SOURCE_STAGES = ["shard plan", "shard reader", "shuffle buffer"]  # the stages of many passes


@pytest.mark.parametrize("name", SOURCE_STAGES)
def test_a_reset_without_a_state_starts_the_next_pass_which_resumes_too(shards, name):
    """After the end of a pass, ``reset()`` starts the next one (the source's shards again, in
    their next order), and a state saved in it resumes there like any other."""
    where = STAGES[name]

    def build():
        return where(_dataset(shards, **CASES["one source"])._chain(1, 0, 1, rank=0, world=1))

    stage = build()
    first = _run(stage, LIMIT)
    assert _run(stage, LIMIT) == []  # the pass stays over
    stage.reset()
    second = _run(stage, 4)
    state = pickle.loads(pickle.dumps(stage.state_dict()))
    second += _run(stage, LIMIT)
    assert len(second) == len(first)
    assert sorted(map(repr, second)) == sorted(map(repr, first)) and second != first
    again = build()
    again.reset(state)
    assert second[:4] + _run(again, LIMIT) == second


@pytest.mark.parametrize("name", [name for name in STAGES if name not in SOURCE_STAGES])
def test_the_stages_from_the_mixer_on_have_one_pass_per_epoch(shards, name):
    """The mixer decides when the epoch ends: it and the stages after it have no next pass
    (their draws and counts would start again while the buffers move on)."""
    stage = STAGES[name](_chain(shards, "one source"))
    _run(stage, LIMIT)
    with pytest.raises(mmproxy.StateError, match="has one pass per epoch"):
        stage.reset()


@pytest.mark.parametrize("kind", ["integers", "random"])
def test_draws_made_in_blocks_are_the_draws_made_one_at_a_time(kind):
    """The buffer's and the mixer's draws come a block at a time: the same values as drawing
    each alone, and at every point the state a saved state holds is the one-at-a-time
    generator's (so states saved either way resume to the same draws)."""
    from mmproxy.datasets.stages._stage import Draws, generator

    def many(g, count):
        return g.integers(5, size=count) if kind == "integers" else g.random(count)

    def one(g):
        return int(g.integers(5)) if kind == "integers" else g.random()

    alone, draws = generator(9, 1), Draws(generator(9, 1), many, block=4)
    for _ in range(11):  # across block boundaries
        assert draws.state == alone.bit_generator.state
        assert draws() == one(alone)
    resumed = Draws(generator(0), many, block=4)
    resumed.state = draws.state
    assert [resumed() for _ in range(6)] == [one(alone) for _ in range(6)]
    assert one(resumed.settle()) == one(alone)  # a draw of another kind, where the last left it
    assert resumed.state == alone.bit_generator.state


def test_the_shuffle_buffer_draws_one_index_per_sample_in_order(shards):
    """The buffer's order is that of one ``integers(len(held))`` draw per sample from its
    generator (its order before the draws came in blocks), and its saved generator state is
    that draw-by-draw generator's after each sample, as states saved before hold it."""
    from mmproxy.datasets.stages._stage import generator

    def fresh():
        return _dataset(shards, shuffle_buffer=5)._chain(0, 0, 1).batcher.fields.mixer.buffers[0]

    buffer, reader = fresh(), fresh().reader  # the buffer, and a reader of its own to check it
    lay = buffer.layout
    rng = generator(lay.seed, lay.epoch, buffer.source, lay.rank, lay.worker, buffer.pass_, 1)
    held: list[Taken] = []
    while True:
        while len(held) < 5 and (got := next(reader, None)) is not None:
            if isinstance(got, Taken):
                held.append(got)
        if not held:
            break
        j = int(rng.integers(len(held)))
        held[j], held[-1] = held[-1], held[j]
        want = held.pop()
        got = buffer.next()
        while isinstance(got, SkippedSample):
            got = buffer.next()
        assert (got.url, got.index) == (want.url, want.index)
        assert buffer.state_dict()[buffer.RNG] == rng.bit_generator.state
    with pytest.raises(StopIteration):
        buffer.next()
