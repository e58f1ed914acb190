"""Mixing sources: weights and seeds, sources that run out, resumes of a mix, and the checks on
what the sources give."""

# ruff: noqa: F811 - the fixtures imported from the helpers are the tests' parameters

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from mmproxy.datasets import MultiModalDataset, Source
from resume_helpers import (
    BATCH,
    _image,
    server,  # noqa: F401 - fixtures
)

import mmproxy
from mmproxy.testing import image_bytes, write_tar

pytestmark = pytest.mark.timeout(240)


# -- mixing -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_sources(tmp_path_factory):
    """Two sources of different shapes: .txt captions in A, .json metadata in B."""
    root = tmp_path_factory.mktemp("mix")
    for s in range(8):
        write_tar(root / f"a-{s}.tar", [{"__key__": f"a{s}-{k:04d}", "txt": f"a {s} {k}"}
                                        for k in range(1000)])
        write_tar(root / f"b-{s}.tar", [{"__key__": f"b{s}-{k:04d}",
                                         "json": json.dumps({"caption": f"b {s} {k}"})}
                                        for k in range(250)])
    return str(root / "a-{0..7}.tar"), str(root / "b-{0..7}.tar")


def _caption(data):
    return json.loads(data)["caption"]


def _mixed(text_sources, weights=(3, 1), **kw):
    a, b = text_sources
    sources = [Source(a, {"text": ("txt", bytes.decode)}, weights[0], "A"),
               Source(b, {"text": ("json", _caption)}, weights[1], "B")]
    return MultiModalDataset(sources=sources, batch_size=50, **{"seed": 5, "shuffle_buffer": 100,
                                                                **kw})


def _sources(loader, limit=None):
    out = []
    for batch in loader:
        assert all(t.startswith(s.lower()) for t, s in zip(batch["text"], batch["__source__"]))
        out += batch["__source__"]
        if limit and len(out) >= limit:
            break
    return out


def test_mixing_follows_the_weights_and_the_seed(text_sources, server):
    drawn = _sources(_mixed(text_sources).loader(server, num_workers=2), 10_000)[:10_000]
    share = drawn.count("A") / len(drawn)
    assert abs(share - 0.75) <= 0.02, share
    again = _sources(_mixed(text_sources).loader(server, num_workers=2), 10_000)[:10_000]
    assert again == drawn
    other = _sources(_mixed(text_sources, seed=6).loader(server, num_workers=2), 10_000)[:10_000]
    assert other != drawn


def test_a_source_that_runs_out_stops_or_restarts(text_sources, server):
    # B holds 2,000 samples; at weight 1:1 it runs out after about 4,000 samples.
    stopped = _sources(_mixed(text_sources, (1, 1)).loader(server, num_workers=1))
    assert stopped.count("B") <= 2000 and len(stopped) < 4500
    restarted = _sources(_mixed(text_sources, (1, 1), on_exhausted="restart").loader(
        server, num_workers=1))
    assert restarted.count("A") >= 8000 and restarted.count("B") > 2000  # B went round again


def test_mixing_resumes_exactly_and_with_epoch_length(text_sources, server):
    def build():
        return _mixed(text_sources, epoch_length=30).loader(server, num_workers=2)

    def run(loader, stop=None):
        out = []
        for batch in loader:
            out.append(list(zip(batch["__source__"], batch["text"])))
            if stop and len(out) == stop:
                return out, loader.state_dict()
        return out, None

    whole, _ = run(build())
    assert len(whole) == 30
    before, state = run(build(), 11)
    loader = build()
    loader.load_state_dict(state)
    after, _ = run(loader)
    assert before + after == whole


def test_sources_must_give_the_same_fields(text_sources):
    a, b = text_sources
    with pytest.raises(ValueError, match="same fields"):
        MultiModalDataset(sources=[Source(a, {"text": ("txt", bytes.decode)}),
                                   Source(b, {"caption": ("json", _caption)})], batch_size=4)
    with pytest.raises(TypeError, match="either urls and fields, or sources"):
        MultiModalDataset(a, {"text": ("txt", bytes.decode)}, batch_size=4,
                          sources=[Source(b, {"text": ("json", _caption)})])
    for weight in (-1, 0):  # a weight-0 source would never finish a pass under "restart"
        with pytest.raises(ValueError, match="weights must be positive"):
            MultiModalDataset(sources=[Source(a, {"text": ("txt", bytes.decode)}, weight)],
                              batch_size=4)


def test_a_dataset_without_positions_is_not_resumed_silently(add_server):
    from datasets_for_tests import AddDataset

    loader = mmproxy.DataLoader(add_server, AddDataset(add_server.proxy), batch_size=4)
    it = iter(loader)
    next(it)
    with pytest.raises(TypeError, match="cannot resume it mid-epoch") as caught:
        loader.state_dict()
    assert str(caught.value).startswith("AddDataset does not say where its workers stand")
    for _ in it:
        pass
    assert loader.state_dict()["done"]


def test_a_map_style_dataset_is_named_as_the_user_made_it(add_server):
    """The loader's view of a map-style dataset (which names samples in messages) keeps the
    dataset's attributes, for reading and for setting, and messages name the dataset's type."""
    from datasets_for_tests import AddDataset

    from mmproxy.state import LoaderState

    dataset = AddDataset(add_server.proxy, n=8)
    loader = mmproxy.DataLoader(add_server, dataset, batch_size=4)
    assert loader.dataset.n == 8 and loader.dataset.proxy is dataset.proxy
    loader.dataset.n = 4  # set on the user's dataset, which its own methods read
    assert dataset.n == 4 and len(loader) == 1
    assert [b[2].tolist() for b in loader] == [[0, 1, 2, 3]]
    del loader.dataset.n
    assert not hasattr(dataset, "n")
    dataset.n = 8
    elsewhere = LoaderState(1, False, workers=2, batches=1, positions={0: {}, 1: {}}).to_dict()
    loader.load_state_dict(elsewhere)
    with pytest.raises(ValueError, match="and AddDataset cannot redistribute its samples"):
        iter(loader)


def test_mixing_sources_of_different_formats_through_one_server(tmp_path, server):
    """Source A: .jpg images with .txt captions; source B: .webp images with .json metadata."""
    for s in range(2):
        write_tar(tmp_path / f"a-{s}.tar", [{"__key__": f"a{s}-{k}", "jpg": _image(k),
                                              "txt": f"a caption {k}"} for k in range(8)])
        write_tar(tmp_path / f"b-{s}.tar", [
            {"__key__": f"b{s}-{k}", "webp": image_bytes(np.full((20, 30, 3), k * 9, np.uint8),
                                                         "WEBP"),
             "json": json.dumps({"caption": f"b caption {k}", "width": 30})} for k in range(8)])
    sources = [Source(str(tmp_path / "a-{0..1}.tar"), {"image": ("jpg", server.proxy),
                                                      "text": ("txt", bytes.decode)}, 1, "A"),
               Source(str(tmp_path / "b-{0..1}.tar"), {"image": ("webp", server.proxy),
                                                      "text": ("json", _caption)}, 1, "B")]
    ds = MultiModalDataset(sources=sources, batch_size=BATCH, on_exhausted="restart", seed=2)
    seen = collections.Counter()
    for batch in ds.loader(server, num_workers=2):
        assert batch["image"].shape[1:] == (3, 16, 16)
        for source, text, key in zip(batch["__source__"], batch["text"], batch["__key__"]):
            assert text.startswith(f"{source.lower()} caption") and key.startswith(source.lower())
            seen[source] += 1
    assert seen["A"] >= 16 and seen["B"] >= 16


def test_a_source_with_a_wrong_path_fails_instead_of_vanishing(text_sources, server, tmp_path):
    a, _ = text_sources
    sources = [Source(a, {"text": ("txt", bytes.decode)}),
               Source(str(tmp_path / "typo-{0..3}.tar"), {"text": ("json", _caption)}, name="B")]
    with pytest.raises(FileNotFoundError, match=r"\(4 of the 4 that the urls of source 'B' names"):
        MultiModalDataset(sources=sources, batch_size=50, on_error="skip")
    for i in range(4):  # there, but not tars
        (tmp_path / f"typo-{i}.tar").write_text("not a tar\n" * 100)
    ds = MultiModalDataset(sources=sources, batch_size=50, on_error="skip")
    with pytest.raises(mmproxy.ShardError, match="source 1's shards hold no samples"):
        for _ in ds.loader(server, num_workers=2):
            pass


def test_mixing_needs_shards_of_every_source_for_every_worker(text_sources, server):
    a, b = text_sources
    sources = [Source(a, {"text": ("txt", bytes.decode)}),
               Source(b.replace("{0..7}", "0"), {"text": ("json", _caption)}, name="B")]
    ds = MultiModalDataset(sources=sources, batch_size=50)
    with pytest.raises(mmproxy.ShardError, match="1 shards of source 'B' for 2 workers"):
        ds.loader(server, num_workers=2)
