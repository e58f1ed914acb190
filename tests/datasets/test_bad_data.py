"""Damaged data: header checks that keep crashing files from DALI, damaged samples skipped with
the batches aligned, rows of dropped samples removed from every field, and the engine error
paths."""

# ruff: noqa: F811 - the fixtures imported from the helpers are the tests' parameters

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
from conftest import cpu, double_pipe
from datasets_helpers import _color, _jpeg, good_shard, image_server  # noqa: F401 - fixtures
from faults import huge_png
from mmproxy.datasets import MultiModalDataset
from mmproxy.pipelines import audio_pipeline, image_eval_pipeline
from nvidia.dali import fn, pipeline_def, types

import mmproxy
from mmproxy.testing import audio_bytes, damage_jpeg, synth_speech, write_tar

pytestmark = pytest.mark.timeout(180)


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
