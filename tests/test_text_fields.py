"""Fields of plain functions: an empty caption reaches its function (and the recipes' tokenizer),
where an empty file of a server field is a bad sample."""

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
    """An empty caption ended the epoch ("bad header: field 'txt' is empty") before the
    tokenizer saw it. Now every sample arrives; an empty caption is a row of padding with an
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
