"""Fields of plain functions: an empty caption reaches its function (and the recipes' tokenizer),
and a dataset of text and labels only is read by mmproxy.DataLoader with no server."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import cpu_image_server
from mmproxy.datasets import MultiModalDataset, image_text_dataset

import mmproxy
from mmproxy.testing import image_bytes, make_tokenizer, write_tar

pytestmark = pytest.mark.timeout(120)

CAPTIONS = ["a cat", "a dog on a mat", "photo number one"]


def caption(i):
    """Samples 0-4 (the first batch of 5) and every third one after them have an empty caption."""
    return "" if i < 5 or i % 3 == 0 else CAPTIONS[i % len(CAPTIONS)]


def grey(i):
    return (i * 37) % 200 + 20


@pytest.fixture(scope="module")
def captioned(tmp_path_factory):
    """20 image-caption pairs in 2 shards, in order; the empty captions are empty members."""
    root = tmp_path_factory.mktemp("captions")
    for s in range(2):
        write_tar(root / f"c-{s:03d}.tar", [
            {"__key__": f"k{i:03d}", "jpg": image_bytes(np.full((24, 32, 3), grey(i), np.uint8)),
             "txt": caption(i), "cls": str(i)} for i in range(10 * s, 10 * s + 10)])
    return str(root / "c-{000..001}.tar")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"), CAPTIONS * 8)


@pytest.fixture(scope="module")
def image_server():
    with cpu_image_server(16, layout="HWC") as server:
        yield server


@pytest.mark.parametrize("padding", ["longest", "max_length"])
def test_an_empty_caption_is_a_row_of_padding_and_its_sample_is_kept(captioned, image_server,
                                                                      tokenizer_dir, padding):
    """Every sample with an empty caption arrives: its caption is a row of padding with an
    attention mask of zeros, and a batch of empty captions only still has one column."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ds = image_text_dataset(captioned, image_server, tokenizer_dir, batch_size=5, max_length=8,
                            padding=padding, shuffle_shards=False)
    batches = list(ds.loader(image_server, num_workers=0))
    keys = [k for b in batches for k in b["__key__"]]
    assert keys == [f"k{i:03d}" for i in range(20)]
    assert not any(b["__skipped__"] for b in batches)
    for b in batches:
        ids, mask = b["input_ids"], b["attention_mask"]
        assert ids.dtype == mask.dtype == torch.int64 and ids.shape == mask.shape
        assert ids.shape[0] == len(b["__key__"]) == len(b["image"]) and ids.shape[1] >= 1
        if padding == "max_length":
            assert ids.shape[1] == 8
        for row, row_mask, key, image in zip(ids, mask, b["__key__"], b["image"]):
            i = int(key[1:])
            assert abs(image.float().mean().item() - grey(i)) < 4  # the row is this sample's
            text = tok.decode(row[row_mask == 1])
            assert text.replace(" ", "") == caption(i).replace(" ", "")
            if not caption(i):
                assert not row_mask.any() and bool((row == tok.pad_token_id).all())
    if padding == "longest":
        assert batches[0]["input_ids"].shape == (5, 1)  # every caption of it empty


def test_empty_bytes_reach_a_function_but_an_empty_server_field_is_a_bad_sample(tmp_path,
                                                                                image_server):
    """A plain function's field gets ``b""``; a server field's empty file is still refused by the
    header checks (the image server never sees it)."""
    samples = [{"__key__": f"k{i}", "jpg": image_bytes(np.full((24, 32, 3), grey(i), np.uint8)),
                "txt": "" if i % 2 else f"caption {i}"} for i in range(6)]
    samples[4]["jpg"] = b""
    write_tar(tmp_path / "e-000.tar", samples)
    ds = MultiModalDataset(str(tmp_path / "e-000.tar"),
                           {"image": ("jpg", image_server.proxy), "text": ("txt", repr)},
                           batch_size=6, on_error="skip", max_skipped=None)
    loader = ds.loader(image_server, num_workers=0)
    (batch,) = list(loader)
    assert batch["__key__"] == ["k0", "k1", "k2", "k3", "k5"]
    assert batch["text"] == ["b'caption 0'", "b''", "b'caption 2'", "b''", "b''"]
    (record,) = loader.skipped.records
    assert (record.key, record.reason) == ("k4", "bad header: field 'jpg' is empty")
    strict = MultiModalDataset(str(tmp_path / "e-000.tar"), {"image": ("jpg", image_server.proxy)},
                               batch_size=6)
    with pytest.raises(mmproxy.SampleError, match="sample 'k4': bad header: field 'jpg' is empty"):
        list(strict.loader(image_server, num_workers=0))


def _labels(b: bytes) -> int:
    return int(b)


@pytest.fixture(scope="module")
def text_only(tmp_path_factory):
    """Text and labels, no server field: 2 shards of 6 samples; sample 7's label is no number."""
    root = tmp_path_factory.mktemp("text")
    for s in range(2):
        write_tar(root / f"t-{s:03d}.tar", [
            {"__key__": f"t{i:02d}", "txt": f"line {i}", "cls": "seven" if i == 7 else str(i)}
            for i in range(6 * s, 6 * s + 6)])
    return str(root / "t-{000..001}.tar")


def _text_dataset(urls, **kw):
    return MultiModalDataset(urls, {"text": ("txt", bytes.decode), "label": ("cls", _labels)},
                             batch_size=4, on_error="skip", max_skipped=None, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_with_no_server_field_is_read_by_mmproxy_dataloader(text_only, workers):
    """mmproxy.DataLoader refused a dataset whose fields are all plain functions ("needs at least
    one server"); with no server it yields the batches with their keys and reports the skips."""
    for loader in (_text_dataset(text_only, shuffle_buffer=4).loader(num_workers=workers),
                   mmproxy.DataLoader([], _text_dataset(text_only), batch_size=None,
                                      num_workers=workers)):
        for _ in range(2):  # two epochs
            batches = list(loader)
            keys = sorted(k for b in batches for k in b["__key__"])
            assert keys == [f"t{i:02d}" for i in range(12) if i != 7]
            for b in batches:
                assert b["text"] == [f"line {int(k[1:])}" for k in b["__key__"]]
                assert b["label"].tolist() == [int(k[1:]) for k in b["__key__"]]
            assert [r.key for r in loader.skipped.records] == ["t07"]
            assert "field function failed: field 'cls': ValueError" in loader.skipped.records[0].reason
    assert loader.servers == []


def test_a_loader_without_the_server_of_a_field_is_refused_when_made(text_only, image_server):
    ds = MultiModalDataset(text_only, {"image": ("txt", image_server.proxy)}, batch_size=4)
    with pytest.raises(ValueError, match=r"field 'image' goes through server 'image', which the "
                                         r"loader was not given \(it has \[\]\)"):
        ds.loader(num_workers=0)


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("batch_size", [None, 1])
def test_a_plain_torch_dataloader_is_told_to_use_mmproxy_dataloader(text_only, workers, batch_size):
    """A plain torch DataLoader yielded the worker's records as batches of their own (holding
    only "__skipped__" and "__shards_tried__": KeyError on "__key__") and judged no skip limit:
    it raises at its first batch, saying which loader reads the dataset. Iterating the dataset
    itself still gives a worker's items."""
    ds = _text_dataset(text_only, shuffle_shards=False)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers)
    with pytest.raises(TypeError, match=r"MultiModalDataset is read by mmproxy\.DataLoader, not "
                                        r"torch\.utils\.data\.DataLoader .*dataset\.loader\("):
        next(iter(loader))
    items = list(ds)
    assert [k for item in items for k in item.get("__key__", [])] == [
        f"t{i:02d}" for i in range(12) if i != 7]
    assert [r.key for item in items for r in item["__skipped__"]] == ["t07"]
