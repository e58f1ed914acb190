"""Real-world data and user mistakes: damaged files never end a run, a run that reads nothing
never looks like success, skip records are never lost, and the engine's error paths are prompt.

Every damaged file is made here, of the kinds web-scale corpora hold: truncated JPEGs and PNGs,
garbage after a valid header, a broken Huffman table, a WAV with a broken ``fmt `` chunk, an OGG
cut in half, an image whose header declares a huge size.
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from conftest import cpu, cpu_image_server, double_pipe
from faults import huge_png
from mmproxy.datasets import MultiModalDataset
from mmproxy.pipelines import audio_pipeline, image_eval_pipeline
from nvidia.dali import fn, pipeline_def, types

import mmproxy
from mmproxy.testing import audio_bytes, damage_jpeg, image_bytes, synth_speech, write_tar

pytestmark = pytest.mark.timeout(180)


def _color(i):
    return (i * 37) % 200 + 20


def _jpeg(i, fmt="JPEG"):
    return image_bytes(np.full((40, 56, 3), _color(i), np.uint8), fmt)


def _wav(i):
    return audio_bytes(synth_speech(i, 0.1 + 0.01 * i), 16000, "WAV")


def _undecodable(i):
    """A JPEG whose frame header declares 7 colour components: it passes every header check and
    only the decoder can tell."""
    data = bytearray(_jpeg(i))
    sof = data.find(b"\xff\xc0")
    data[sof + 9] = 7
    return bytes(data)


def _damaged_images(i):
    """Damage that a header check catches, and damage only the decoder sees."""
    good = _jpeg(i)
    return {
        "truncated-jpg": ("jpg", good[: len(good) // 3]),
        "truncated-png": ("png", _jpeg(i, "PNG")[:-40]),
        "undecodable": ("jpg", _undecodable(i)),
        "broken-huffman-table": ("jpg", damage_jpeg(good, "corrupt")),
        "huge-declared-size": ("png", huge_png()),
    }


def _damaged_audio(i):
    good, ogg = _wav(i), audio_bytes(synth_speech(i, 0.5), 16000, "OGG")
    broken_fmt = bytearray(good)
    broken_fmt[20:36] = b"\xff" * 16
    return {"wav-broken-fmt": ("wav", bytes(broken_fmt)), "ogg-cut-in-half": ("ogg", ogg[: len(ogg) // 2]),
            "wav-garbage-after-riff": ("wav", good[:12] + np.random.default_rng(i).bytes(300))}


@pytest.fixture(scope="module")
def damaged_shards(tmp_path_factory):
    """Two shards of 16 samples (image, audio, label); samples 3-7 have damaged images and
    samples 10-12 damaged audio; the others are clean."""
    root = tmp_path_factory.mktemp("damaged")
    images = list(_damaged_images(0).values())
    audio = list(_damaged_audio(0).values())
    samples = []
    for i in range(32):
        ext, img = images[i - 3] if 3 <= i < 8 else ("jpg", _jpeg(i))
        aext, sound = audio[i - 10] if 10 <= i < 13 else ("wav", _wav(i))
        samples.append({"__key__": f"s{i:03d}", ext: img, aext: sound, "cls": str(i)})
    write_tar(root / "d-000.tar", samples[:16])
    write_tar(root / "d-001.tar", samples[16:])
    return str(root / "d-{000..001}.tar")


BAD = {3, 4, 5, 6, 7, 10, 11, 12}


def test_header_checks_catch_the_damage_that_crashes_dali_and_pass_good_files():
    """benchmarks/dali_decoder_crash.py: DALI 2.4's decoders can kill the process on some of
    these in a batch of 64; the workers' header checks must stop every one of them."""
    import io

    from mmproxy.datasets.checks import check_header
    from PIL import Image

    jpeg, png = _jpeg(1), _jpeg(1, "PNG")
    damaged = {"truncated": ("jpg", jpeg[: len(jpeg) // 3]), "no end marker": ("jpg", jpeg[:-2]),
               "huffman table": ("jpg", damage_jpeg(jpeg, "corrupt")),
               "garbage after header": ("jpg", damage_jpeg(jpeg, "garbage")),
               "not an image": ("jpg", b"hello world " * 100), "truncated png": ("png", png[:-30]),
               "wav cut in half": ("wav", _wav(1)[: len(_wav(1)) // 2]), **_damaged_audio(1)}
    for name, (ext, data) in damaged.items():
        assert check_header(ext, memoryview(data)), name
    assert re.fullmatch(r"is truncated \(its data chunk declares \d+ bytes, \d+ follow\)",
                        check_header("wav", damaged["wav cut in half"][1]))
    good = [("jpg", jpeg), ("png", png), ("wav", _wav(1)), ("jpg", jpeg + b"\0" * 64)]
    for mode, kw in [("L", {}), ("RGB", {"progressive": True, "optimize": True}),
                     ("RGB", {"exif": b"Exif\0\0" + b"x" * 5000, "quality": 20})]:
        buf = io.BytesIO()
        Image.fromarray(np.full((30, 40, 3), 90, np.uint8)).convert(mode).save(buf, "JPEG", **kw)
        good.append(("jpg", buf.getvalue()))
    for ext, data in good:
        assert check_header(ext, memoryview(data)) is None


def _tiff(i, mode="RGB"):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((40, 56, 3), _color(i), np.uint8)).convert(mode).save(buf, "TIFF")
    return buf.getvalue()


def _ff00_jpeg(i):
    """A JPEG with a stuffed zero (FF 00 00 02) between its header's segments, as in a photo of
    Pillow's tests that crashed DALI 2.4's CPU decoder."""
    jpeg = _jpeg(i)
    frame = jpeg.find(b"\xff\xc0")
    return jpeg[:frame] + b"\xff\x00\x00\x02" + jpeg[frame:]


@pytest.mark.timeout(240)
def test_tiffs_and_jpegs_that_crashed_dalis_decoder_are_skipped_by_name(tmp_path):
    """Real files from Pillow's and scikit-image's test images crashed the whole process in
    DALI 2.4's CPU decoder (a batch of 32 holding one): TIFFs of 32- and 64-bit samples, and a
    JPEG with a stuffed zero in its header. The header checks name them; the TIFFs DALI reads
    (8 and 16 bits, grey, palette, RGB) pass and decode."""
    bad_tiffs = {3: "I", 9: "F", 17: "I", 25: "F"}  # 32-bit integers, 32-bit floats
    samples = []
    for i in range(40):
        if i in bad_tiffs:
            field = ("tif", _tiff(i, bad_tiffs[i]))
        elif i == 30:
            field = ("jpg", _ff00_jpeg(i))
        else:
            field = [("jpg", _jpeg(i)), ("png", _jpeg(i, "PNG")), ("tif", _tiff(i)),
                     ("tif", _tiff(i, "L")), ("tif", _tiff(i, "I;16"))][i % 5]
        samples.append({"__key__": f"t{i:03d}", field[0]: field[1], "cls": str(i).encode()})
    write_tar(tmp_path / "t-000.tar", samples)
    image = mmproxy.DALIServer(image_eval_pipeline(batch_size=32, size=16, dtype="uint8",
                                                   layout="HWC", device="cpu", num_threads=1),
                               name="image")
    with image:
        ds = MultiModalDataset(str(tmp_path / "t-000.tar"), {"image": ("jpg;png;tif", image.proxy),
                                                             "label": ("cls", int)},
                               batch_size=32, on_error="skip", max_skipped=0.5)
        labels, records = [], []
        for batch in ds.loader(image, num_workers=0):
            assert batch["image"].shape[0] == len(batch["label"])
            labels += batch["label"].tolist()
            records += batch["__skipped__"]
    bad = {*bad_tiffs, 30}
    assert sorted(labels) == sorted(set(range(40)) - bad)
    by_key = {r.key: r.reason for r in records}
    assert sorted(by_key) == sorted(f"t{i:03d}" for i in bad)
    for i in bad_tiffs:
        assert by_key[f"t{i:03d}"] == ("bad header: field 'tif' is a TIFF variant DALI does not "
                                       "read (32-bit samples)")
    assert "malformed header" in by_key["t030"]


def _servers():
    image = mmproxy.DALIServer(image_eval_pipeline(batch_size=8, size=16, dtype="uint8", layout="HWC",
                                                   device="cpu", num_threads=1), name="image")
    audio = mmproxy.DALIServer(audio_pipeline(batch_size=8, device="cpu", num_threads=1),
                               name="audio", pad=[0])
    return image, audio


def _dataset(urls, image, audio, **kw):
    return MultiModalDataset(urls, {"image": ("jpg;png", image.proxy), "audio": ("wav;ogg", audio.proxy),
                                    "label": ("cls", int)}, batch_size=8, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_damaged_files_are_skipped_and_the_batches_stay_aligned(damaged_shards, workers):
    image, audio = _servers()
    with image, audio:
        ds = _dataset(damaged_shards, image, audio, on_error="skip", max_skipped=0.5)
        loader = ds.loader([image, audio], num_workers=workers)
        labels, records = [], []
        for batch in loader:
            n = len(batch["label"])
            assert batch["image"].shape[0] == batch["audio"][0].data.shape[0] == n == len(batch["__key__"])
            for img, label, key in zip(batch["image"], batch["label"].tolist(), batch["__key__"]):
                assert key == f"s{label:03d}"  # every field of a row is the same sample
                assert abs(img.float().mean().item() - _color(label)) < 4
            for length, label in zip(batch["audio"][0].lengths.tolist(), batch["label"].tolist()):
                assert abs(length - round((0.1 + 0.01 * label) * 16000)) <= 2
            labels += batch["label"].tolist()
            records += batch["__skipped__"]
        assert sorted(labels) == sorted(set(range(32)) - BAD)  # every good sample exactly once
        assert sorted(int(r.key[1:]) for r in records) == sorted(BAD)
        assert all(r.shard.endswith("d-000.tar") for r in records)
        by_key = {r.key: r.reason for r in records}
        assert "truncated" in by_key["s003"] and "truncated" in by_key["s004"]
        assert by_key["s005"].startswith("pipeline failed in server 'image'")  # found by the server
        assert "Huffman" in by_key["s006"]  # a broken table never reaches the decoder
        assert "100000x100000" in by_key["s007"]
        assert by_key["s010"].startswith("bad header") and "fmt" in by_key["s010"]
        assert "truncated" in by_key["s011"]  # an OGG cut in half would decode to nothing
        assert loader.skipped.skipped == 8 and loader.skipped.delivered == 24
        assert image.state is audio.state is mmproxy.ServerState.RUNNING


@pytest.mark.parametrize("workers", [0, 2])
def test_raise_mode_names_the_bad_sample_itself(damaged_shards, workers, tmp_path):
    image, audio = _servers()
    with image, audio:
        ds = _dataset(damaged_shards, image, audio, shuffle_shards=False)
        with pytest.raises(mmproxy.SampleError, match=r"d-000\.tar, sample 's003'.*truncated"):
            list(ds.loader([image, audio], num_workers=workers))
        # a decode failure the header checks cannot see names its own sample, not the batch's
        write_tar(tmp_path / "h-000.tar", [{"__key__": f"h{i:02d}", "jpg": _undecodable(i)
                                            if i == 5 else _jpeg(i)} for i in range(8)])
        only_decoder = MultiModalDataset(str(tmp_path / "h-000.tar"), {"image": ("jpg", image.proxy)},
                                         batch_size=8)
        with pytest.raises(mmproxy.PipelineError,
                           match=r"'image'.*cannot process sample .*h-000\.tar:h05 "):
            list(only_decoder.loader(image, num_workers=workers))
        assert image.state is mmproxy.ServerState.RUNNING


def _custom_decode(executor, batch_size=8):
    kw = {"exec_dynamic": True} if executor == "dynamic" else (
        {"exec_dynamic": False} if executor == "async" else
        {"exec_dynamic": False, "exec_pipelined": False, "exec_async": False})

    @pipeline_def(**kw)
    def pipe():
        x = fn.external_source(name="x", no_copy=True, dtype=types.UINT8)
        img = fn.decoders.image(x, output_type=types.RGB)
        return fn.resize(img, size=[8, 8]), img.shape(dtype=types.INT64)  # two outputs

    return pipe(batch_size=batch_size, num_threads=1, device_id=None)


@pytest.mark.parametrize("executor", ["dynamic", "async", "sync"])
def test_a_users_own_pipeline_with_every_executor_keeps_going(executor, tmp_path):
    """Samples the decoder cannot read are found in a user's own two-output pipeline; the
    classic executors need their pipeline rebuilt after an error, the dynamic one does not."""
    bad = {2, 9, 10}
    items = [_undecodable(i) if i in bad else _jpeg(i) for i in range(16)]
    write_tar(tmp_path / "u-000.tar", [{"__key__": f"u{i:02d}", "jpg": b, "cls": str(i)}
                                       for i, b in enumerate(items)])
    server = mmproxy.DALIServer(lambda: _custom_decode(executor), name=f"own-{executor}")
    with server:
        ds = MultiModalDataset(str(tmp_path / "u-000.tar"),
                               {"small": ("jpg", server.proxy), "label": ("cls", int)},
                               batch_size=8, on_error="skip", max_skipped=0.5)
        start = time.perf_counter()
        labels = []
        for batch in ds.loader(server, num_workers=0):
            small, shapes = batch["small"]
            assert small.shape[0] == shapes.shape[0] == len(batch["label"])  # both outputs aligned
            assert shapes[:, :2].tolist() == [[40, 56]] * len(batch["label"])
            labels += batch["label"].tolist()
        assert sorted(labels) == sorted(set(range(16)) - bad)
        assert time.perf_counter() - start < 60


# -- a run that reads nothing fails loudly, quickly, in words -----------------------------------

@pytest.fixture(scope="module")
def good_shard(tmp_path_factory):
    root = tmp_path_factory.mktemp("good")
    write_tar(root / "g-000.tar", [{"__key__": f"g{i:02d}", "jpg": _jpeg(i), "cls": str(i)}
                                   for i in range(12)])
    return root


@pytest.fixture(scope="module")
def image_server():
    with cpu_image_server(16) as server:
        yield server


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

    from mmproxy.skips import SkippedSample

    write_tar(tmp_path / "whole.tar", [{"__key__": f"k{i}", "bin": bytes(5000)} for i in range(4)])
    (tmp_path / "cut.tar").write_bytes((tmp_path / "whole.tar").read_bytes()[:7000])
    # the command's end is seen before the end of its output (which a child holds a while)
    failed, cut = "pipe:sleep 1 & exit 3", f"pipe:cat {tmp_path / 'cut.tar'}"
    with pytest.raises(mmproxy.ShardError) as raised:
        list(TarReader("raise", RemoteOptions(cache_dir=None))(Work(failed)))
    assert str(raised.value) == f"shard {failed}: cannot be read: the command exited with status 3"
    read = TarReader("skip", RemoteOptions(cache_dir=None))
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


# -- engine error paths (issue: nothing mmproxy leaves behind breaks the program) ----------------

def _boom(x):
    raise ValueError("user function failed")


@pipeline_def(exec_pipelined=False, exec_async=False)
def _sync_raising():
    x = fn.external_source(name="x", no_copy=True, dtype=types.FLOAT)
    return fn.python_function(x, function=_boom)


@pipeline_def
def _raising():
    x = fn.external_source(name="x", no_copy=True, dtype=types.FLOAT)
    return fn.python_function(x, function=_boom)


class _Floats(torch.utils.data.Dataset):
    def __init__(self, proxy):
        self.proxy = proxy

    def __len__(self):
        return 400

    def __getitem__(self, i):
        return self.proxy(np.full((3,), i, np.float32)), i


@pytest.mark.parametrize("pipe", [_sync_raising, _raising], ids=["classic-sync", "default"])
def test_a_pipeline_error_arrives_at_once_and_the_workers_go(pipe):
    server = mmproxy.DALIServer(pipe(batch_size=4, num_threads=1, device_id=None), name="raising")
    with server:
        gc.collect()  # earlier tests' iterators
        before = len(psutil.Process().children())
        start = time.perf_counter()
        with pytest.raises(mmproxy.PipelineError, match="user function failed"):
            for _ in mmproxy.DataLoader(server, _Floats(server.proxy), batch_size=4, num_workers=2):
                pass
        assert time.perf_counter() - start < 10  # not the server's 300 s wait timeout
        deadline = time.perf_counter() + 2
        while len(psutil.Process().children()) > before and time.perf_counter() < deadline:
            time.sleep(0.02)
        assert len(psutil.Process().children()) <= before  # the workers are gone within ~1 s


def test_a_reference_to_a_dropped_run_raises_at_once():
    with mmproxy.DALIServer(cpu(double_pipe), name="double") as server:
        loader = mmproxy.DataLoader(server, _Floats(server.proxy), batch_size=4, num_workers=0)
        old = iter(loader)
        kept = old._step()  # a batch of epoch 1, not yet resolved
        iter(loader)  # epoch 2 starts: the runs of epoch 1 are dropped
        start = time.perf_counter()
        with pytest.raises(mmproxy.RunDroppedError, match=r"'double': run .* dropped: .*epoch 1 of "
                           r"loader .*started epoch 2"):
            server.produce_data(kept)
        assert time.perf_counter() - start < 1
        assert all(r.state is not mmproxy.server.RunState.PENDING for r in server._runs.values())


def test_nothing_mmproxy_made_is_left_for_the_cyclic_collector():
    """The root of "a plain fork DataLoader dies after mmproxy": objects in garbage cycles are
    freed by whichever process collects them, a forked child included. No tensor, DALI or
    mmproxy object may be among them (on a GPU they hold CUDA memory, events and pipelines).
    A fresh interpreter, so that other tests' leftovers do not count."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fork_leftovers.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu"], capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "tensors, CUDA, DALI or mmproxy objects: 0" in done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("check", [[], ["--then-fork"]], ids=["no-leftovers", "plain-fork-loader-after"])
def test_a_plain_fork_dataloader_runs_after_an_mmproxy_gpu_loader(check):
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fork_leftovers.py"
    done = subprocess.run([sys.executable, str(script), "--device", "gpu", *check],
                          capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert ("ok" if check else "objects: 0") in done.stdout


def test_webdataset_batched_with_its_default_collation_fails_at_once_in_process(good_shard, image_server):
    import webdataset as wds

    def call(sample):
        return image_server.proxy(np.frombuffer(sample["jpg"], np.uint8)), int(sample["cls"])

    pipeline = wds.WebDataset(str(good_shard / "g-000.tar"), shardshuffle=False).map(call).batched(4)
    with pytest.raises(mmproxy.CollateError, match=r"collation_fn=mmproxy.Collate\(\)"):
        list(mmproxy.DataLoader(image_server, pipeline, batch_size=None, num_workers=0))


# -- found in review: dropping rows in every kind of batch, and executors with workers ------------

def _one_bad_at_the_end(tmp_path, n=9):
    """A shard whose last sample (alone in the last batch of 8) only the decoder can refuse."""
    write_tar(tmp_path / "z-000.tar", [{"__key__": f"z{i:02d}", "jpg": _undecodable(i) if i == n - 1
                                        else _jpeg(i), "wav": _wav(i), "cls": str(i)} for i in range(n)])
    return str(tmp_path / "z-000.tar")


def test_a_batch_whose_every_sample_is_dropped_is_skipped_with_two_servers(tmp_path):
    image, audio = _servers()
    with image, audio:
        ds = _dataset(_one_bad_at_the_end(tmp_path), image, audio, on_error="skip", max_skipped=0.5,
                      shuffle_shards=False)
        loader = ds.loader([image, audio], num_workers=0)
        labels = [x for b in loader for x in b["label"].tolist()]
        assert sorted(labels) == list(range(8))
        assert [r.key for r in loader.skipped.records] == ["z08"]


class _Tokens:
    """A batch transform that adds a per-sample list of variable-length tensors."""

    def __call__(self, batch):
        batch["tokens"] = [torch.arange(int(x) % 3 + 1) + int(x) for x in batch["label"]]
        return batch


def test_per_sample_lists_lose_the_rows_of_dropped_samples(tmp_path):
    write_tar(tmp_path / "t-000.tar", [{"__key__": f"t{i:02d}", "jpg": _undecodable(i) if i == 2
                                        else _jpeg(i), "cls": str(i)} for i in range(4)])
    with mmproxy.DALIServer(image_eval_pipeline(batch_size=8, size=16, device="cpu", num_threads=1),
                            name="image") as server:
        fields = {"x": ("jpg", server.proxy), "label": ("cls", int)}
        ds = MultiModalDataset(str(tmp_path / "t-000.tar"), fields, batch_size=4, on_error="skip",
                               max_skipped=0.5, batch_transform=_Tokens())
        (batch,) = list(ds.loader(server, num_workers=0))
        assert batch["label"].tolist() == [0, 1, 3]
        assert [t[0].item() for t in batch["tokens"]] == [0, 1, 3]  # whole items, none cut
        assert [len(t) for t in batch["tokens"]] == [1, 2, 1]


def test_resolving_one_server_of_a_batch_with_dropped_rows_says_why():
    from torch.utils.data import default_collate

    image, audio = _servers()
    with image, audio:
        samples = []
        for i in range(3):
            with mmproxy.sample_key(f"s{i}", skip=True):
                jpeg = _undecodable(i) if i == 1 else _jpeg(i)
                samples.append((image.proxy(np.frombuffer(jpeg, np.uint8)),
                                audio.proxy(np.frombuffer(_wav(i), np.uint8)), i))
        batch = default_collate(samples)
        with pytest.raises(mmproxy.PipelineError,
                           match=r"s1: pipeline failed.*\['audio'\] that are not resolved"):
            image.produce_data(batch)
        both = mmproxy.DataLoader([image, audio], [batch], batch_size=None)
        (out,) = list(both)
        assert out[2].tolist() == [0, 2] and out[0].shape[0] == 2 and out[1][0].data.shape[0] == 2


@pipeline_def(exec_pipelined=False, exec_async=False)
def _sync_double():
    x = fn.external_source(name="x", no_copy=True, dtype=types.FLOAT)
    return x * 2


def test_the_classic_synchronous_executor_with_workers_on_clean_data():
    server = mmproxy.DALIServer(_sync_double(batch_size=4, num_threads=1, device_id=None), name="sync",
                                timeout=30)
    with server:
        for _ in range(3):
            values = [v for x, _ in mmproxy.DataLoader(server, _Floats(server.proxy), batch_size=4,
                                                       num_workers=2) for v in x[:, 0].tolist()]
            assert sorted(values) == [2.0 * i for i in range(400)]


def test_header_checks_accept_unusual_but_decodable_files():
    import struct

    from mmproxy.datasets.checks import check_header

    wav = _wav(3)
    listed = b"LIST" + struct.pack("<I", 70_000) + b"x" * 70_000  # metadata before 'fmt '
    long_header = wav[:4] + struct.pack("<I", len(wav) - 8 + len(listed)) + wav[8:12] + listed + wav[12:]
    at = wav.find(b"fmt ")
    gsm = bytearray(wav)
    gsm[at + 8:at + 10], gsm[at + 22:at + 24] = struct.pack("<H", 0x31), b"\0\0"  # GSM 6.10: 0 bits
    tag, channels, rate, rate2, align, bits = struct.unpack("<HHIIHH", wav[at + 8:at + 24])
    body = wav[wav.find(b"data") + 8:]
    rifx = (b"RIFX" + struct.pack(">I", 36 + len(body)) + b"WAVE" + b"fmt " + struct.pack(">I", 16)
            + struct.pack(">HHIIHH", tag, channels, rate, rate2, align, bits) + b"data"
            + struct.pack(">I", len(body)) + body)
    at_data = wav.find(b"data")
    streamed = wav[:at_data + 4] + b"\xff\xff\xff\xff" + wav[at_data + 8:]  # size not known
    for ext, data in [("wav", long_header), ("wav", bytes(gsm)), ("wav", rifx), ("wav", streamed),
                      ("jpg", _jpeg(3, "PNG"))]:  # a PNG named .jpg: decoders go by the bytes
        assert check_header(ext, memoryview(data)) is None


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
