"""The dataset layer: shards, proxies for heavy fields, text and labels in PyTorch."""

from __future__ import annotations

import os
import tarfile
import time

import numpy as np
import pytest
import torch
from conftest import cpu_image_server
from mmproxy.datasets import (
    MultiModalDataset,
    audio_label_dataset,
    image_text_dataset,
    make_shards,
)
from mmproxy.pipelines import audio_pipeline

import mmproxy
from mmproxy.testing import audio_bytes, image_bytes, make_tokenizer, synth_speech, write_tar

pytestmark = pytest.mark.timeout(180)

N_SHARDS, PER_SHARD = 4, 6


def color(i):
    return (i * 37) % 200 + 20


def image_sample(i):
    img = np.full((40, 56, 3), color(i), np.uint8)
    return {"__key__": f"s{i:04d}", "jpg": image_bytes(img), "txt": f"photo number {i}",
            "cls": str(i)}


@pytest.fixture(scope="module")
def image_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("img")
    for s in range(N_SHARDS):
        write_tar(root / f"img-{s:03d}.tar",
                  [image_sample(s * PER_SHARD + k) for k in range(PER_SHARD)])
    return str(root / "img-{000..003}.tar")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"),
                          [f"photo number {i}" for i in range(40)] + ["a cat"] * 4)


@pytest.fixture(scope="module")
def image_server():
    with cpu_image_server(32, layout="HWC") as server:
        yield server


@pytest.fixture(scope="module")
def audio_server():
    with mmproxy.DALIServer(audio_pipeline(batch_size=8, device="cpu", num_threads=1),
                            name="audio", pad=[0]) as server:
        yield server


def _check_image_batch(batch, tokenizer):
    labels = [int(k[1:]) for k in batch["__key__"]]
    for img, i in zip(batch["image"], labels):
        assert abs(img[..., 0].float().mean().item() - color(i)) < 4
    texts = tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
    assert [t.replace(" ", "") for t in texts] == [f"photonumber{i}" for i in labels]
    return labels


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_image_text_every_sample_once_per_epoch(image_shards, image_server, tokenizer_dir, workers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ds = image_text_dataset(image_shards, image_server, tokenizer_dir, batch_size=5,
                            shuffle_buffer=8)
    loader = ds.loader(image_server, num_workers=workers)
    orders = []
    for _ in range(2):
        seen = []
        for batch in loader:
            assert batch["input_ids"].dtype == torch.int64
            assert batch["attention_mask"].shape == batch["input_ids"].shape
            pad = batch["input_ids"][batch["attention_mask"] == 0]
            assert torch.all(pad == tok.pad_token_id)
            seen += _check_image_batch(batch, tok)
        assert sorted(seen) == list(range(N_SHARDS * PER_SHARD))
        orders.append(seen)
    assert orders[0] != orders[1]  # reshuffled every epoch


def _epoch_orders(shards, server, epochs, **kw):
    ds = MultiModalDataset(shards, {"image": ("jpg", server.proxy), "label": ("cls", int)},
                           batch_size=5, shuffle_buffer=8, **kw)
    loader = ds.loader(server, num_workers=2, persistent_workers=True)
    orders = []
    for _ in range(epochs):
        seen = []
        for batch in loader:
            for img, label in zip(batch["image"], batch["label"].tolist()):
                assert abs(img[..., 0].float().mean().item() - color(label)) < 4
            seen += batch["label"].tolist()
        orders.append(seen)
    return orders, loader


def test_next_epoch_prefetch_runs_ahead_and_changes_nothing(image_shards, image_server):
    """Persistent workers start the next epoch's first batch at the end of an epoch: the server
    runs it before the next epoch starts, and every epoch still holds the same batches."""
    before = image_server.samples
    ahead, loader = _epoch_orders(image_shards, image_server, 3)
    expected = 3 * N_SHARDS * PER_SHARD + 2 * 5  # and one batch of epoch 4 per worker
    for _ in range(100):
        if image_server.samples - before >= expected:
            break
        time.sleep(0.05)
    time.sleep(0.2)
    assert image_server.samples - before == expected
    plain, _ = _epoch_orders(image_shards, image_server, 3, prefetch_next_epoch=False)
    assert ahead == plain
    for seen in ahead:
        assert sorted(seen) == list(range(N_SHARDS * PER_SHARD))
    # Breaking out of an epoch, then starting the next one, still gives whole epochs.
    for k, _ in enumerate(loader):
        if k == 1:
            break
    assert sorted(x for b in loader for x in b["label"].tolist()) == list(range(N_SHARDS * PER_SHARD))


def test_fixed_length_padding(image_shards, image_server, tokenizer_dir):
    ds = image_text_dataset(image_shards, image_server, tokenizer_dir, batch_size=4,
                            padding="max_length", max_length=12)
    batch = next(iter(ds.loader(image_server, num_workers=0)))
    assert batch["input_ids"].shape == (4, 12)


def _rank_batches(shards, server, rank, world, **kw):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    try:
        ds = MultiModalDataset(shards, {"image": ("jpg", server.proxy), "label": ("cls", int)},
                               batch_size=3, **kw)
        return [b["label"].tolist() for b in ds.loader(server, num_workers=2)]
    finally:
        del os.environ["RANK"], os.environ["WORLD_SIZE"]


def test_two_ranks_are_disjoint_cover_the_data_and_match_in_length(image_shards, image_server):
    per_rank = [_rank_batches(image_shards, image_server, r, 2, epoch_length=4) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == 4
    flat = [[i for b in batches for i in b] for batches in per_rank]
    assert not set(flat[0]) & set(flat[1])
    assert sorted(flat[0] + flat[1]) == list(range(N_SHARDS * PER_SHARD))


def test_resampled_gives_every_rank_the_same_number_of_batches(image_shards, image_server):
    counts = [len(_rank_batches(image_shards, image_server, r, 2, resampled=True, epoch_length=5))
              for r in (0, 1)]
    assert counts == [5, 5]


def test_a_rank_without_shards_is_an_error(image_shards, image_server):
    with pytest.raises(mmproxy.ShardError, match="rank 4 of 5 gets no shards"):
        _rank_batches(image_shards, image_server, 4, 5)


@pytest.fixture(scope="module")
def bad_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    samples = [image_sample(i) for i in range(8)]
    samples[2]["jpg"] = b"\x00\x01garbage"  # fails the header check
    samples[4]["jpg"] = b""  # empty
    del samples[6]["jpg"]  # missing
    write_tar(root / "bad-000.tar", samples)
    return str(root / "bad-000.tar")


def test_bad_samples_raise_with_shard_and_key(bad_shards, image_server):
    ds = MultiModalDataset(bad_shards, {"image": ("jpg", image_server.proxy), "label": ("cls", int)},
                           batch_size=4)
    with pytest.raises(mmproxy.SampleError, match=r"bad-000\.tar, sample 's0002'.*JPG signature"):
        list(ds.loader(image_server, num_workers=0))


def test_bad_samples_skipped_counted_and_the_batch_still_made(bad_shards, image_server):
    ds = MultiModalDataset(bad_shards, {"image": ("jpg", image_server.proxy), "label": ("cls", int)},
                           batch_size=4, on_error="skip", max_skipped=0.5)
    labels, skipped = [], []
    for batch in ds.loader(image_server, num_workers=1):
        labels += batch["label"].tolist()
        skipped += batch["__skipped__"]
        for img, i in zip(batch["image"], batch["label"].tolist()):
            assert abs(img[..., 0].float().mean().item() - color(i)) < 4
    assert sorted(labels) == [0, 1, 3, 5, 7]
    assert sorted(r.key for r in skipped) == ["s0002", "s0004", "s0006"]
    reasons = {r.key: r.reason for r in skipped}
    assert "signature" in reasons["s0002"] and "empty" in reasons["s0004"]
    assert "missing" in reasons["s0006"]


@pytest.fixture(scope="module")
def audio_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("aud")
    samples = []
    for i in range(10):
        fmt = "WAV" if i % 2 else "FLAC"
        sig = synth_speech(i, 0.2 + 0.05 * i, rate=22050)
        samples.append({"__key__": f"a{i:03d}", fmt.lower(): audio_bytes(sig, 22050, fmt),
                        "cls": str(i % 3)})
    write_tar(root / "aud-000.tar", samples[:5])
    write_tar(root / "aud-001.tar", samples[5:])
    return str(root / "aud-{000..001}.tar")


def test_audio_label_padded_with_lengths(audio_shards, audio_server):
    ds = audio_label_dataset(audio_shards, audio_server, batch_size=4)
    seen = 0
    for batch in ds.loader(audio_server, num_workers=2):
        audio, lengths = batch["audio"], batch["audio_length"]
        assert isinstance(audio, mmproxy.PaddedBatch)
        idx = [int(k[1:]) for k in batch["__key__"]]
        expected = [round((0.2 + 0.05 * i) * 16000) for i in idx]
        assert all(abs(a - b) <= 2 for a, b in zip(lengths.tolist(), expected))
        assert torch.equal(audio.lengths, lengths)
        assert batch["label"].tolist() == [i % 3 for i in idx]
        seen += len(idx)
    assert seen == 10


def test_make_shards_from_an_image_folder(tmp_path):
    src = tmp_path / "src"
    for cls in ("cat", "dog"):
        (src / cls).mkdir(parents=True)
        for k in range(3):
            (src / cls / f"{k}.jpg").write_bytes(image_bytes(np.full((8, 8, 3), 9, np.uint8)))
    (src / "dog" / "1.txt").write_text("a very good dog")
    shards = make_shards(src, tmp_path / "out", max_count=4)
    assert len(shards) == 2
    import webdataset as wds

    samples = list(wds.WebDataset(shards, shardshuffle=False))
    assert len(samples) == 6
    assert sorted(int(s["cls"]) for s in samples) == [0, 0, 0, 1, 1, 1]
    assert b"a very good dog" in [s["txt"] for s in samples]


def test_truncated_shard_is_named_or_skipped(tmp_path, image_server):
    good = tmp_path / "good-000.tar"
    write_tar(good, [image_sample(i) for i in range(4)])
    cut = tmp_path / "cut-000.tar"
    data = good.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    fields = {"image": ("jpg", image_server.proxy), "label": ("cls", int)}
    ds = MultiModalDataset([str(cut)], fields, batch_size=4, shuffle_shards=False)
    with pytest.raises(mmproxy.ShardError, match=r"cut-000\.tar: cannot be read"):
        list(ds.loader(image_server, num_workers=0))
    ds = MultiModalDataset([str(cut), str(good)], fields, batch_size=4, shuffle_shards=False,
                           on_error="skip", max_skipped=0.5)
    batches = list(ds.loader(image_server, num_workers=0))
    from_good = sorted(k for b in batches for u, k in zip(b["__url__"], b["__key__"]) if u == str(good))
    assert from_good == [f"s{i:04d}" for i in range(4)]  # the good shard whole, after the cut one
    assert any("cut-000.tar" in r.shard for b in batches for r in b["__skipped__"])


def test_a_glob_of_local_shards_is_expanded_and_one_matching_nothing_is_an_error(image_shards):
    from mmproxy.datasets.shards import expand

    folder = os.path.dirname(image_shards)
    every = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".tar"))
    assert expand(os.path.join(folder, "*.tar")) == every and len(every) > 1
    assert expand([os.path.join(folder, "*.tar"), "s3://b/x-{0..1}.tar"]) == [
        *every, "s3://b/x-0.tar", "s3://b/x-1.tar"]  # remote URLs are not globbed
    with pytest.raises(mmproxy.ShardError, match=r"no shard matches .*/\*\.tgz \(no file there "
                       r"has a matching name\)$"):
        expand(os.path.join(folder, "*.tgz"))
    with pytest.raises(mmproxy.ShardError, match=r"no shard matches .*/nowhere/\*\.tar \(there "
                       r"is no folder .*/nowhere\)$"):
        expand(os.path.join(folder, "nowhere", "*.tar"))


def test_a_glob_keeps_regular_files_and_a_literal_bracket_in_a_name_is_taken_as_written(tmp_path):
    """A folder a glob matches is not a shard; a folder named ``run[1]`` can hold a glob (its
    ``[1]`` is not a pattern while the folder exists), and a file named with ``[`` is itself."""
    from mmproxy.datasets.shards import expand

    for folder in ("run[1]", "run1", "sub.tar"):
        (tmp_path / folder).mkdir()
    for path in ("run[1]/a-0.tar", "run[1]/a-1.tar", "run1/decoy.tar", "b[0].tar", "s-0.tar"):
        (tmp_path / path).write_bytes(b"")
    assert expand(str(tmp_path / "*.tar")) == [str(tmp_path / "b[0].tar"), str(tmp_path / "s-0.tar")]
    assert expand(str(tmp_path / "run[1]" / "*.tar")) == [
        str(tmp_path / "run[1]" / "a-0.tar"), str(tmp_path / "run[1]" / "a-1.tar")]
    assert expand(str(tmp_path / "run[0-9]" / "*.tar")) == [str(tmp_path / "run1" / "decoy.tar")]
    assert expand(str(tmp_path / "b[0].tar")) == [str(tmp_path / "b[0].tar")]
    assert expand(str(tmp_path / "[bs]-0.tar")) == [str(tmp_path / "s-0.tar")]
    with pytest.raises(mmproxy.ShardError, match=r"no shard matches .*/sub\* \(it matches "
                       r"1 folder\(s\), e\.g\. .*/sub\.tar; a shard is a \.tar, \.tar\.gz or \.tgz "
                       r"file: add /\*\.tar\)$"):
        expand(str(tmp_path / "sub*"))


def test_a_shard_cut_in_its_last_members_padding_reports_the_cut_without_that_sample(tmp_path,
                                                                                     image_server):
    """The member before the cut is whole, but the cut took what followed it (here the rest of
    its sample), so its sample is not delivered half; the samples before it are, then the error."""
    from mmproxy.datasets._tar import members
    from mmproxy.datasets.shards import read_local_tar

    shard = tmp_path / "p-000.tar"
    write_tar(shard, [{"__key__": f"k{i}", "jpg": b"jpeg", "cls": i} for i in range(2)])
    data = shard.read_bytes()
    name, offset, size = list(members(memoryview(data)))[2]
    assert name == "k1.jpg"
    shard.write_bytes(data[:offset + size + 100])  # inside k1.jpg's padding: k1.cls is gone
    got = []
    with pytest.raises(tarfile.ReadError, match=r"inside its last member's padding"):
        got.extend(read_local_tar(str(shard)))
    assert [(s["__key__"], sorted(k for k in s if not k.startswith("__"))) for s in got] == [
        ("k0", ["cls", "jpg"])]
    ds = MultiModalDataset([str(shard)], {"label": ("cls", int)}, batch_size=4, on_error="skip",
                           max_skipped=None)
    loader = ds.loader(image_server, num_workers=0)
    assert [k for b in loader for k in b["__key__"]] == ["k0"]
    assert loader.skipped.shards == 1 and loader.skipped.by_kind == {"unreadable shard": 1}


def test_batches_larger_than_the_servers_pipeline_takes_are_refused_by_the_loader(image_shards):
    """A dataset whose batches hold more samples than a server's pipeline takes is refused when
    its loader is made, naming the server and both sizes (before, every batch failed at run
    time)."""
    from mmproxy.pipelines import image_eval_pipeline

    pipe = image_eval_pipeline(batch_size=4, size=32, dtype="uint8", device="cpu", num_threads=1)
    with mmproxy.DALIServer(pipe, name="image") as small:
        dataset = MultiModalDataset(image_shards, {"image": ("jpg", small.proxy), "cls": int},
                                    batch_size=6)
        with pytest.raises(mmproxy.BatchSizeError,
                           match=r"server 'image'.* batches of 6 samples, more than the "
                                 r"pipeline's batch_size=4"):
            dataset.loader(small, num_workers=0)
        fits = MultiModalDataset(image_shards, {"image": ("jpg", small.proxy), "cls": int},
                                 batch_size=4)
        batch = next(iter(fits.loader(small, num_workers=0)))
        assert batch["image"].shape[0] == 4


def test_a_sample_whose_members_are_not_next_to_each_other_is_named_split(tmp_path):
    """A tar written from ``*.jpg *.cls`` (each sample's members apart): both parts of every
    such sample are "split sample" records whose reason says how to write the tar (the first
    part too, also when it raises); a sample whose members are together in the same shard is
    read."""
    import io

    path = tmp_path / "split-000.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in [("a.jpg", b"x"), ("b.jpg", b"y"), ("a.cls", b"0"), ("b.cls", b"1"),
                           ("c.jpg", b"z"), ("c.cls", b"2")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ds = MultiModalDataset(str(path), {"jpg": lambda b: len(b), "cls": int}, batch_size=4,
                           shuffle_buffer=0, partial=True, on_error="skip")
    batches = list(ds)
    assert [b["cls"].tolist() for b in batches if "cls" in b] == [[2]]
    records = [r for b in batches for r in b["__skipped__"]]
    assert sorted((r.key, r.kind.value) for r in records) == [
        ("a", "split sample"), ("a", "split sample"), ("b", "split sample"), ("b", "split sample")]
    reasons = sorted(r.reason for r in records if r.key == "a")
    assert reasons[0].startswith("split sample: its 'cls' file(s) lie apart from its other files")
    assert reasons[1].startswith("split sample: its 'jpg' file(s) lie apart")
    assert all("tar --sort=name" in r for r in reasons)
    strict = MultiModalDataset(str(path), {"jpg": lambda b: len(b), "cls": int}, batch_size=4,
                               shuffle_buffer=0, partial=True)
    with pytest.raises(mmproxy.SampleError, match="sample 'a': split sample: its 'jpg' file"):
        list(strict)


def test_a_sample_with_two_members_of_one_extension_is_a_bad_sample_named_in_its_record(tmp_path):
    """Two members with the same key and extension (a shard written twice into, or 'a.JPG'
    beside 'a.jpg'): which one is meant is unknown, so a field that reads that extension makes
    the sample a bad one, with a record; one that reads another extension is not affected."""
    import io

    path = tmp_path / "dup-000.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in [("s0.jpg", image_bytes(np.full((8, 8, 3), 9, np.uint8))),
                           ("s0.cls", b"0"), ("s0.JPG", image_bytes(np.zeros((8, 8, 3), np.uint8))),
                           ("s1.jpg", image_bytes(np.full((8, 8, 3), 7, np.uint8))), ("s1.cls", b"1")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    labels = MultiModalDataset(str(path), {"cls": int}, batch_size=2, shuffle_buffer=0, partial=True)
    assert [b["cls"].tolist() for b in labels] == [[0, 1]]  # the .cls members are single
    images = MultiModalDataset(str(path), {"jpg": lambda b: len(b), "cls": int}, batch_size=2,
                               shuffle_buffer=0, partial=True, on_error="skip")
    (batch,) = list(images)
    assert batch["cls"].tolist() == [1]
    (record,) = batch["__skipped__"]
    assert record.key == "s0" and record.kind is mmproxy.SkipKind.DUPLICATE_FIELD
    assert "duplicate field 'jpg': the shard holds more than one 'jpg' member" in record.reason


def test_a_loader_made_anew_for_an_epoch_warns_that_it_repeats_the_first(image_shards, image_server):
    # for epoch in range(n): for batch in dataset.loader(...) -- each loader begins at epoch 1:
    # the same order and draws every epoch, silently, where a torch DataLoader would reshuffle
    import warnings

    ds = MultiModalDataset(image_shards, {"image": ("jpg", image_server.proxy), "label": ("cls", int)},
                           batch_size=5, shuffle_buffer=8)

    def order(loader):
        return [x for b in loader for x in b["label"].tolist()]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one = ds.loader(image_server, num_workers=0)
        first, second = order(one), order(one)  # one loader, two epochs: no warning
        assert first != second and not caught
        again = order(ds.loader(image_server, num_workers=0))
    assert again == first  # what the warning is about
    assert [str(w.message) for w in caught] == [
        "another mmproxy.DataLoader over this dataset began its first epoch already: each loader "
        "numbers its epochs from 1, so this one repeats that epoch's order and random draws. Make "
        "the loader once and iterate it every epoch (or fix the dataset's epoch with "
        "dataset.set_epoch)"]
    assert caught[0].filename == __file__  # pointed at the loop that iterates the new loader
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        order(ds.loader(image_server, num_workers=0))  # said once a dataset
        fixed = MultiModalDataset(image_shards, {"image": ("jpg", image_server.proxy),
                                                 "label": ("cls", int)}, batch_size=5)
        for epoch in (1, 2):
            fixed.set_epoch(epoch)  # the user numbers the epochs: any loader is right
            order(fixed.loader(image_server, num_workers=0))
        in_order = MultiModalDataset(image_shards, {"image": ("jpg", image_server.proxy),
                                                    "label": ("cls", int)}, batch_size=5,
                                     shuffle_shards=False, shuffle_buffer=0)
        for _ in range(2):  # an evaluation set read in order: the same every time, by design
            order(in_order.loader(image_server, num_workers=0))
    assert not caught
