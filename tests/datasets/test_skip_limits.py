"""Runs that read too little fail in words: nothing read, too many samples or shards skipped,
shards counted as shards, skip records never lost, and the skip report."""

# ruff: noqa: F811 - the fixtures imported from the helpers are the tests' parameters

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from datasets_helpers import _color, _jpeg, good_shard, image_server  # noqa: F401 - fixtures
from mmproxy.datasets import MultiModalDataset

import mmproxy
from mmproxy.testing import write_tar

pytestmark = pytest.mark.timeout(180)


def _mistakes(root, proxy):
    """What a new user types (or finds): (urls, fields) pairs that read nothing."""
    good = str(root / "g-000.tar")
    (root / "notes.tar").write_text("not a tar, whatever its name says\n" * 40)
    (root / "gone.tar").write_bytes((root / "g-000.tar").read_bytes())
    return {
        "not a tar": ([str(root / "notes.tar")], {"x": ("jpg", proxy)}),
        "deleted after the dataset was made": ([str(root / "gone.tar")], {"x": ("jpg", proxy)}),
        "extension never present": ([good], {"x": ("jpeg", proxy)}),
        "field function always raises": ([good], {"x": ("jpg", proxy), "y": ("cls", bytes.fromhex)}),
    }


@pytest.mark.parametrize("mistake", ["not a tar", "deleted after the dataset was made",
                                     "extension never present", "field function always raises"])
@pytest.mark.parametrize("mode", ["plain", "resampled", "epoch_length"])
def test_a_run_that_reads_nothing_fails_within_seconds(good_shard, image_server, mistake, mode):
    urls, fields = _mistakes(good_shard, image_server.proxy)[mistake]
    extra = {"plain": {}, "resampled": {"resampled": True, "epoch_length": 5},
             "epoch_length": {"epoch_length": 5}}[mode]
    ds = MultiModalDataset(urls, fields, batch_size=4, on_error="skip", **extra)
    if mistake.startswith("deleted"):
        Path(urls[0]).unlink()
    start = time.perf_counter()
    with pytest.raises((mmproxy.EmptyEpochError, mmproxy.ShardError)) as info:
        for _ in ds.loader(image_server, num_workers=1 if mode == "epoch_length" else 2):
            pass
    assert time.perf_counter() - start < 30
    text = str(info.value)
    if isinstance(info.value, mmproxy.EmptyEpochError):
        assert "no sample could be used" in text and "skipped" in text
        kind = {"not a tar": "unreadable shard", "deleted after the dataset was made":
                "unreadable shard", "extension never present": "missing field",
                "field function always raises": "field function failed"}[mistake]
        assert kind in text
    if mistake.startswith("deleted"):
        assert "No such file or directory" in text


@pytest.mark.parametrize("mistake", ["missing path", "brace matching no file", "a directory",
                                     "most of a brace pattern missing"])
def test_local_shards_that_do_not_exist_are_refused_when_the_dataset_is_made(good_shard,
                                                                             image_server, mistake):
    """As the CLI's ``--data`` does: the first three missing, how many of how many, what named
    them; not an epoch on part of the data (or none of it)."""
    fields = {"x": ("jpg", image_server.proxy)}
    urls, match = {
        "missing path": ([str(good_shard / "no-such.tar")],
                         r"^no shard at \S+/no-such\.tar \(1 of the 1 that urls names\)$"),
        "brace matching no file": (str(good_shard / "g-{005..006}.tar"),
                                   r"^no shard at \S+/g-005\.tar, \S+/g-006\.tar \(2 of the 2 "),
        "a directory": ([str(good_shard)], r"\(1 of the 1 that urls names\); \S+ is a folder: "
                        r"name its shards, e\.g\. \S+/\*\.tar$"),
        "most of a brace pattern missing": (
            str(good_shard / "g-{000..019}.tar"),
            r"^no shard at \S+/g-001\.tar, \S+/g-002\.tar, \S+/g-003\.tar and 16 more \(19 of the 20 "
            r"that urls names\)$"),
    }[mistake]
    with pytest.raises(FileNotFoundError, match=match):
        MultiModalDataset(urls, fields, batch_size=4, on_error="skip")
    from mmproxy.datasets import Source, audio_label_dataset

    with pytest.raises(FileNotFoundError, match=match):  # the recipes make one
        audio_label_dataset(urls, image_server, batch_size=4)

    with pytest.raises(FileNotFoundError, match=r"that the urls of source 'b' names"):
        MultiModalDataset(sources=[Source(str(good_shard / "g-000.tar"), fields, name="a"),
                                   Source(urls, fields, name="b")], batch_size=4)


def test_raise_mode_names_an_unreadable_shard_in_words(good_shard, image_server):
    (good_shard / "nope.tar").write_bytes(b"")
    ds = MultiModalDataset([str(good_shard / "nope.tar")], {"x": ("jpg", image_server.proxy)},
                           batch_size=4)
    (good_shard / "nope.tar").unlink()  # gone since the dataset was made
    with pytest.raises(mmproxy.ShardError, match=r"nope\.tar: cannot be read: No such file or directory"):
        list(ds.loader(image_server, num_workers=0))


def test_a_pipe_shard_that_fails_is_named_once_in_words(tmp_path):
    """The error was wrapped twice and held the reprs of webdataset's objects (its command's
    arguments, its pipe's address); a pipe cut short gave two records of one shard."""
    from mmproxy.datasets.remote import RemoteOptions
    from mmproxy.datasets.stages.plan import Work
    from mmproxy.datasets.stages.reader import TarReader

    from mmproxy.skips import ErrorPolicy, SkippedSample

    write_tar(tmp_path / "whole.tar", [{"__key__": f"k{i}", "bin": bytes(5000)} for i in range(4)])
    (tmp_path / "cut.tar").write_bytes((tmp_path / "whole.tar").read_bytes()[:7000])
    # the command's end is seen before the end of its output (which a child holds a while)
    failed, cut = "pipe:sleep 1 & exit 3", f"pipe:cat {tmp_path / 'cut.tar'}"
    with pytest.raises(mmproxy.ShardError) as raised:
        list(TarReader(ErrorPolicy("raise"), RemoteOptions(cache_dir=None))(Work(failed)))
    assert str(raised.value) == f"shard {failed}: cannot be read: the command exited with status 3"
    read = TarReader(ErrorPolicy("skip"), RemoteOptions(cache_dir=None))
    got = [item.reason if isinstance(item, SkippedSample) else item[0]
           for url in (failed, cut) for item in read(Work(url))]
    assert got == ["unreadable shard: the command exited with status 3",
                   0, "unreadable shard: ReadError: unexpected end of data"]


def test_too_many_skipped_is_an_error_with_counts_and_reasons(tmp_path, image_server):
    samples = [{"__key__": f"t{i:02d}", "jpg": _jpeg(i)[:50] if i % 3 == 0 else _jpeg(i)}
               for i in range(30)]
    write_tar(tmp_path / "t-000.tar", samples)
    urls = str(tmp_path / "t-000.tar")
    ds = MultiModalDataset(urls, {"x": ("jpg", image_server.proxy)}, batch_size=4, on_error="skip")
    with pytest.raises(mmproxy.SkipLimitError, match=r"10 of 30 samples skipped \(33\.3%\), more than "
                       r"max_skipped=10\.0%(.|\n)*10 x bad header; first: .*t-000\.tar, sample 't00'"):
        list(ds.loader(image_server, num_workers=0))
    ds = MultiModalDataset(urls, {"x": ("jpg", image_server.proxy)}, batch_size=4, on_error="skip",
                           max_skipped=0.5)
    loader = ds.loader(image_server, num_workers=0)
    assert sum(len(b["__key__"]) for b in loader) == 20
    assert loader.skipped.skipped == 10 and loader.skipped.by_kind == {"bad header": 10}


# -- shards count as shards ------------------------------------------------------------------------

GOOD_SHARDS = (0, 2, 5, 7, 10, 12, 15, 17)  # 8 of 20, 4 for each of two workers (unshuffled)


def _mostly_unreadable(root, bad=None, per_shard=30):
    """20 shards of ``per_shard`` label-only samples; those not in GOOD_SHARDS (or those in
    ``bad``) are damaged: cut inside a header, or not a tar at all. Returns their pattern."""
    for s in range(20):
        path = root / f"m-{s:03d}.tar"
        write_tar(path, [{"__key__": f"m{s:02d}{i:02d}", "cls": str(i)} for i in range(per_shard)])
        if (s not in GOOD_SHARDS) if bad is None else (s in bad):
            path.write_bytes(path.read_bytes()[:700] if s % 2 else b"<html>404</html>" * 50)
    return str(root / "m-{000..019}.tar")


@pytest.mark.parametrize("mode", ["plain", "resampled", "epoch_length"])
def test_most_shards_unreadable_fails_the_epoch_though_few_samples_were_skipped(tmp_path,
                                                                               image_server, mode):
    """12 of 20 shards unreadable while the 8 others deliver 240 samples (12 records against 252
    would be under 10%): 60% of the shards gone is a SkipLimitError naming the share and the
    first shards with their reasons."""
    extra = {"plain": {}, "resampled": {"resampled": True, "epoch_length": 60},
             "epoch_length": {"epoch_length": 60}}[mode]
    ds = MultiModalDataset(_mostly_unreadable(tmp_path), {"label": ("cls", int)}, batch_size=4,
                           on_error="skip", shuffle_shards=False, **extra)
    with pytest.raises(mmproxy.SkipLimitError) as raised:
        for _ in ds.loader(image_server, num_workers=2):
            pass
    text = str(raised.value)
    share = re.match(r"^(\d+) unreadable shard\(s\) of the (\d+) tried this epoch \((\d+\.\d)%\), "
                     r"more than max_skipped=10\.0%", text)
    assert share is not None, text
    assert float(share[3]) > 30
    if mode == "plain":  # (with a quota a worker stops once it has its batches)
        assert share.groups() == ("12", "20", "60.0")
        assert "the first 3 of 12 shards:" in text
    assert re.search(r"\n    \S+/m-0\d\d\.tar: unreadable shard: ReadError: ", text), text


def test_a_few_unreadable_shards_pass_and_are_counted_against_the_shards_tried(tmp_path,
                                                                              image_server):
    """1 of 20 shards unreadable (5%) is under the 10% limit, in every epoch of persistent
    workers (whose next epoch's first batch is made ahead)."""
    ds = MultiModalDataset(_mostly_unreadable(tmp_path, bad={3}), {"label": ("cls", int)},
                           batch_size=4, on_error="skip")
    loader = ds.loader(image_server, num_workers=2, persistent_workers=True)
    for _ in range(2):
        assert sum(len(b["label"]) for b in loader) == 19 * 30
        report = loader.skipped
        assert (report.shards, report.shards_tried, report.samples_skipped) == (1, 20, 0)
        assert not any(k.startswith("__shards") for b in [report] for k in vars(b))


@pytest.mark.parametrize("resumed_workers", [2, 3])
def test_the_shards_tried_are_counted_once_across_a_resume(tmp_path, image_server,
                                                           resumed_workers):
    """Shards read again on resume (the one being read, the shuffle buffer's) are not tried
    again: the resumed epoch's report has the uninterrupted one's counts, exact or elastic."""
    urls = _mostly_unreadable(tmp_path, bad={3, 8}, per_shard=10)

    def build(workers):
        return MultiModalDataset(urls, {"label": ("cls", int)}, batch_size=4, shuffle_buffer=6,
                                 on_error="skip", max_skipped=0.2
                                 ).loader(image_server, num_workers=workers)

    whole = build(2)
    total = sum(len(b["label"]) for b in whole)
    assert (total, whole.skipped.shards, whole.skipped.shards_tried) == (180, 2, 20)
    for stop in (1, 7, 20):
        first = build(2)
        it = iter(first)
        seen = sum(len(next(it)["label"]) for _ in range(stop))
        state = first.state_dict()
        it.close()
        resumed = build(resumed_workers)
        resumed.load_state_dict(state)
        seen += sum(len(b["label"]) for b in resumed)
        report = resumed.skipped
        assert (seen, report.shards, report.shards_tried) == (180, 2, 20), stop


# -- skip records are never lost ------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("setting", [{"batch_size": 7}, {"batch_size": 4, "partial": False}])
def test_skip_records_at_the_end_of_a_shard_are_reported(tmp_path, image_server, workers, setting):
    for s in range(2):  # the last three samples of each shard are bad
        write_tar(tmp_path / f"e-{s:03d}.tar",
                  [{"__key__": f"e{s}{i:02d}", "jpg": b"not a jpeg" if i >= 9 else _jpeg(i)}
                   for i in range(12)])
    ds = MultiModalDataset(str(tmp_path / "e-{000..001}.tar"), {"x": ("jpg", image_server.proxy)},
                           on_error="skip", max_skipped=0.5, **setting)
    loader = ds.loader(image_server, num_workers=workers)
    in_batches = [r.key for b in loader for r in b["__skipped__"]]
    expected = sorted(f"e{s}{i:02d}" for s in range(2) for i in (9, 10, 11))
    assert sorted(r.key for r in loader.skipped.records) == expected
    assert set(in_batches) <= set(expected)  # those not in a batch came on their own


# -- fewer shards than workers ---------------------------------------------------------------------

def test_one_shard_with_the_default_two_workers(good_shard, image_server):
    ds = MultiModalDataset(str(good_shard / "g-000.tar"), {"x": ("jpg", image_server.proxy)},
                           batch_size=5)
    keys = [k for b in ds.loader(image_server) for k in b["__key__"]]
    assert sorted(keys) == [f"g{i:02d}" for i in range(12)]


def test_fewer_shards_than_workers_with_epoch_length_fails_before_any_batch(good_shard, image_server):
    ds = MultiModalDataset(str(good_shard / "g-000.tar"), {"x": ("jpg", image_server.proxy)},
                           batch_size=4, epoch_length=3)
    with pytest.raises(mmproxy.ShardError, match="1 shards for 2 workers.*at most 1"):
        ds.loader(image_server, num_workers=2)


def test_a_torch_batch_size_on_a_batching_dataset_says_what_to_do(good_shard, image_server):
    ds = MultiModalDataset(str(good_shard / "g-000.tar"), {"x": ("jpg", image_server.proxy)},
                           batch_size=4)
    with pytest.raises(ValueError, match="makes its own batches.*batch_size=None"):
        mmproxy.DataLoader(image_server, ds, batch_size=2)


def test_unreadable_shards_are_counted_apart_from_samples():
    """A shard record counts once in ``skipped`` and in ``shards``, never in the samples'
    fraction; the shards' share (of the shards tried) has its own check, whose message names the
    share and the first shards with their reasons; the counts survive a save and a merge."""
    from mmproxy.skips import SkipKind, SkippedSample, SkipReport

    report = SkipReport(epoch=1)
    report.add(8, [SkippedSample("s-0.tar", "k1", "bad header: x", SkipKind.BAD_HEADER),
                   SkippedSample("s-1.tar", "", "unreadable shard: cut", SkipKind.UNREADABLE_SHARD)],
               shards_tried=20)
    assert (report.delivered, report.skipped, report.shards, report.shards_tried) == (8, 2, 1, 20)
    assert report.summary().splitlines()[0] == (
        "epoch 1: 8 samples delivered, 1 samples skipped and 1 unreadable shard(s), their unread "
        "samples not counted")
    with pytest.raises(mmproxy.SkipLimitError, match=r"^1 of 9 samples skipped \(11\.1%\), more "
                       r"than max_skipped=10\.0%"):
        report.check(0.1, final=True)
    report.check(0.2, final=True)  # 1 of 9 samples, 1 of 20 shards: under 20%
    report.add(4, [SkippedSample(f"m-{i}.tar", "", f"unreadable shard: HTTP 404 ({i})",
                                 SkipKind.UNREADABLE_SHARD) for i in range(11)])
    with pytest.raises(mmproxy.SkipLimitError) as raised:
        report.check(0.2, final=True)
    assert str(raised.value).startswith("12 unreadable shard(s) of the 20 tried this epoch (60.0%), "
                                        "more than max_skipped=20.0%")
    assert raised.value.summary.splitlines()[-4:] == [
        "  the first 3 of 12 shards:", "    s-1.tar: unreadable shard: cut",
        "    m-0.tar: unreadable shard: HTTP 404 (0)", "    m-1.tar: unreadable shard: HTTP 404 (1)"]
    state = report.state_dict()
    assert SkipReport.from_state(state).shards == 12
    assert SkipReport.from_state(state).shards_tried == 20
    merged = SkipReport.merged([state, state], epoch=1)
    assert (merged.shards, merged.shards_tried) == (24, 40)
    del state["shards"], state["tried"]
    with pytest.raises(mmproxy.StateError, match=r"skip report state .*'shards'"):
        SkipReport.from_state(state)


def test_the_shards_share_is_judged_mid_epoch_every_100_shards_tried():
    """Before the epoch's end the share is judged only on 100 shards tried or more (damage is
    often clustered: the first 2 of 5 shards missing says little about the other 995)."""
    from mmproxy.skips import SHARD_CHECK_EVERY, SkipKind, SkippedSample, SkipReport

    lost = SkippedSample("s.tar", "", "unreadable shard: gone", SkipKind.UNREADABLE_SHARD)
    report = SkipReport()
    report.add(100, [lost, lost], shards_tried=5)
    report.check(0.1)  # 2 of 5, mid-epoch: not judged yet
    with pytest.raises(mmproxy.SkipLimitError, match=r"^2 unreadable shard\(s\) of the 5 tried"):
        report.check(0.1, final=True)
    report = SkipReport()
    report.add(1000, [lost] * 11, shards_tried=SHARD_CHECK_EVERY - 1)
    report.check(0.1)
    report.add(10, [], shards_tried=1)
    with pytest.raises(mmproxy.SkipLimitError, match=r"^11 unreadable shard\(s\) of the 100 tried"):
        report.check(0.1)


def test_skip_kinds_are_enum_members_that_survive_pickling_and_states():
    """A record's kind is a :class:`SkipKind`, the counts come from it (not from the reason's
    words), records cross processes pickled and through a report's state."""
    import pickle

    from mmproxy.skips import SkipKind, SkippedSample, SkipReport

    odd = SkippedSample("s.tar", "k", "bad header? no: the user's own words")  # a user's own
    assert odd.kind is SkipKind.OTHER
    assert pickle.loads(pickle.dumps(odd)) == odd and pickle.loads(pickle.dumps(odd)).kind is SkipKind.OTHER
    report = SkipReport()
    report.add(1, [odd, SkippedSample("s.tar", "j", "whatever", SkipKind.BAD_HEADER)])
    assert report.by_kind == {SkipKind.OTHER: 1, SkipKind.BAD_HEADER: 1} == {"other": 1, "bad header": 1}
    assert "1 x bad header; first: s.tar, sample 'j': whatever" in report.summary()
    assert mmproxy.SkipKind is SkipKind
    loaded = SkipReport.from_state(report.state_dict())
    assert [r.kind for r in loaded.records] == [SkipKind.OTHER, SkipKind.BAD_HEADER]
    assert loaded.by_kind == report.by_kind
    assert SkipReport.from_state(loaded.state_dict()).records == loaded.records


def test_an_empty_shard_is_reported_as_empty_not_as_unreadable(good_shard, image_server, tmp_path):
    """A shard holding no files counts in ``shards`` like an unreadable one, and the summary and
    the limit's message say which is which (they called both unreadable)."""
    from mmproxy.skips import SkipKind, SkippedSample, SkipReport

    empty, cut = tmp_path / "empty-000.tar", tmp_path / "cut-000.tar"
    empty.write_bytes(bytes(10240))  # a tar of no files: only the end-of-archive blocks
    cut.write_bytes((good_shard / "g-000.tar").read_bytes()[:1500])
    ds = MultiModalDataset([str(good_shard / "g-000.tar"), str(empty), str(cut)],
                           {"x": ("jpg", image_server.proxy)}, batch_size=4, shuffle_shards=False,
                           on_error="skip", max_skipped=None)
    loader = ds.loader(image_server, num_workers=0)
    assert sum(len(b["__key__"]) for b in loader) == 12
    report = loader.skipped
    assert (report.skipped, report.shards, report.empty_shards) == (2, 2, 1)
    assert report.summary().splitlines()[0] == (
        f"epoch {report.epoch}: 12 samples delivered, 0 samples skipped and 1 unreadable and 1 "
        "empty shard(s), their unread samples not counted")
    assert report.shards_tried == 3
    only_empty = SkipReport(epoch=3)
    only_empty.add(3, [SkippedSample(str(empty), "", "empty shard: it holds no files",
                                     SkipKind.EMPTY_SHARD)], shards_tried=4)
    assert "0 samples skipped and 1 empty shard(s)," in only_empty.summary()
    with pytest.raises(mmproxy.SkipLimitError, match=r"^1 empty shard\(s\) of the 4 tried this "
                       r"epoch \(25\.0%\)"):
        only_empty.check(0.1, final=True)
    merged = SkipReport.merged([report.state_dict(), only_empty.state_dict()], epoch=3)
    assert merged.shards_text() == "1 unreadable and 2 empty shard(s)"


def test_an_epoch_whose_every_shard_failed_says_so():
    """Nothing delivered because no shard could be read: the error says that and names them,
    instead of pointing at the field extensions and functions."""
    from mmproxy.skips import SkipKind, SkippedSample, SkipReport

    report = SkipReport(epoch=0)
    report.add(0, [SkippedSample(f"http://h/s-{i}.tar", "", "unreadable shard: no answer within "
                                 "10 s (gave up after 6 attempts)", SkipKind.UNREADABLE_SHARD)
                   for i in range(4)], shards_tried=4)
    with pytest.raises(mmproxy.EmptyEpochError) as raised:
        report.check(0.1, final=True)
    text = str(raised.value)
    assert text.startswith("no sample could be used (4 unreadable shard(s) tried, and none could "
                           "be read)")
    assert "http://h/s-0.tar: unreadable shard: no answer within 10 s" in text
    assert "field extensions" not in text


@pytest.mark.parametrize("kind, hint", [
    ("PIPELINE", "every sample read was skipped, for the reasons below"),
    ("BAD_HEADER", "every sample read was skipped, for the reasons below"),
    ("MISSING_FIELD", "check the shard paths, the field extensions and the field functions"),
])
def test_an_epoch_whose_every_sample_failed_points_at_the_reasons(kind, hint):
    """Every sample failed to decode (a new user's TIFFs): the error pointed at the shard paths
    and field extensions, which were right; it points at the reasons it lists."""
    from mmproxy.skips import SkipKind, SkippedSample, SkipReport

    report = SkipReport(epoch=0)
    report.add(0, [SkippedSample("a.tar", f"k{i}", f"{SkipKind[kind].value}: why {i}",
                                 SkipKind[kind]) for i in range(3)], shards_tried=1)
    with pytest.raises(mmproxy.EmptyEpochError) as raised:
        report.check(0.1, final=True)
    assert str(raised.value).startswith(f"no sample could be used ({hint}):")
    assert "a.tar, sample 'k0'" in str(raised.value)


def test_a_skip_summary_lists_the_first_records_of_each_kind_and_counts_the_rest():
    # A user whose files fail asks which: the summary (in SkipLimitError too) names the first
    # five of each kind, then how many more (the report's records hold up to 10,000).
    from mmproxy.skips import SkipKind, SkippedSample, SkipReport

    report = SkipReport()
    bad = [SkippedSample("a.tar", f"k{i}", f"failed {i}", SkipKind.PIPELINE) for i in range(7)]
    report.add(3, [*bad, SkippedSample("b.tar", "", "unreadable shard: cut",
                                       SkipKind.UNREADABLE_SHARD)])
    lines = report.summary().splitlines()
    assert lines[1] == "  7 x pipeline failed; first: a.tar, sample 'k0': failed 0"
    assert lines[2:7] == [f"    then a.tar, sample 'k{i}': failed {i}" for i in range(1, 5)] + [
        "    and 2 more"]
    assert lines[7] == "  1 x unreadable shard; first: b.tar: unreadable shard: cut"
    assert len(lines) == 8


def test_the_error_policy_and_the_batch_size_each_have_one_owner(good_shard):
    """The dataset's policy (``on_error``, ``max_skipped``) and its batching are made once and
    handed to the stages that use them: every stage and the loader read the same objects."""
    from mmproxy.skips import ErrorPolicy

    ds = MultiModalDataset(str(good_shard / "g-000.tar"), {"c": ("cls", bytes.decode)},
                           batch_size=3, on_error="skip", max_skipped=0.3)
    assert ds.policy == ErrorPolicy("skip", 0.3) and ds.policy.skip
    assert (ds.on_error, ds.max_skipped, ds.batch_size) == ("skip", 0.3, 3)
    chain = ds._chain(1, 0, 1, rank=0, world=1)
    batcher = chain.batcher
    assert batcher.batching is ds.batching and batcher.process.policy is ds.policy
    assert batcher.fields.fields.policy is ds.policy
    assert batcher.fields.mixer.buffers[0].reader.read.policy is ds.policy
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'skip', got 'drop'"):
        MultiModalDataset(str(good_shard / "g-000.tar"), {"c": ("cls", bytes.decode)},
                          batch_size=3, on_error="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_skipped is a fraction of the samples \(0-1\)"):
        ErrorPolicy("skip", 1.5)
