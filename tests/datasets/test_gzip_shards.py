"""Gzip-compressed shards (``.tar.gz``, ``.tgz``, or any shard holding a gzip stream), written
by webdataset's ``TarWriter`` and Python's ``tarfile``: read like their tar, locally, over HTTP
and S3 (real servers started here), listed by folders and S3 prefixes, resumed exactly; a cut or
corrupt stream named as such."""
# ruff: noqa: F811 - the fixtures imported from test_remote are the tests' parameters

from __future__ import annotations

import gzip
import io
import os
import pickle
import tarfile

import pytest
import torch
import webdataset as wds
from mmproxy.datasets import MultiModalDataset, image_text_dataset
from mmproxy.datasets.remote import RemoteOptions
from mmproxy.datasets.shards import expand, read_local_tar, read_remote_tar
from mmproxy.pipelines import image_train_pipeline
from remote_helpers import (  # noqa: F401 - fixtures
    CACHE_BYTES,
    FAST,
    aws,
    fresh_s3_state,
    image_server,
    run,
    same,
)

import mmproxy
from mmproxy.apps.bench.remote import ShardServer, s3_server
from mmproxy.testing import image_bytes, make_tokenizer, synth_image, write_tar

pytestmark = pytest.mark.timeout(180)

SHARDS, PER_SHARD = 4, 6


def samples(s):
    return [{"__key__": f"s{s}-{i}", "jpg": image_bytes(synth_image(s * 100 + i, 40, 48)),
             "cls": str(s * PER_SHARD + i).encode(), "txt": f"caption {s} {i}".encode()}
            for i in range(PER_SHARD)]


def tar_bytes(items):
    """A plain tar of ``items``, written by tarfile, in memory."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        add_members(tar, items)
    return out.getvalue()


def add_members(tar, items):
    for item in items:
        for ext, data in item.items():
            if not ext.startswith("__"):
                info = tarfile.TarInfo(f"{item['__key__']}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def write_webdataset(path, items):
    with wds.TarWriter(str(path)) as sink:  # compresses when the name ends in .gz
        for item in items:
            sink.write(item)


def write_tarfile_gz(path, items):
    with tarfile.open(path, "w:gz") as tar:
        add_members(tar, items)


def contents(reader):
    """[(key, {ext: bytes})] of samples, in order."""
    return [(s["__key__"], {k: bytes(v) for k, v in s.items() if not k.startswith("__")})
            for s in reader]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    for s in range(SHARDS):
        write_tar(root / f"r-{s}.tar", samples(s))
    return [str(root / f"r-{s}.tar") for s in range(SHARDS)]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The same samples: one shard by webdataset's TarWriter (.tar.gz), one by tarfile (.tgz),
    one plain .tar, one gzip stream named .tar."""
    root = tmp_path_factory.mktemp("mixed")
    write_webdataset(root / "r-0.tar.gz", samples(0))
    write_tarfile_gz(root / "r-1.tgz", samples(1))
    write_tar(root / "r-2.tar", samples(2))
    (root / "r-3.tar").write_bytes(gzip.compress(tar_bytes(samples(3))))
    return root


def mixed_urls(root):
    return [str(root / name) for name in ("r-0.tar.gz", "r-1.tgz", "r-2.tar", "r-3.tar")]


def test_gzip_shards_hold_their_tars_samples_byte_for_byte_as_webdataset_reads_them(tmp_path):
    """Keys and field bytes from a .tar.gz (TarWriter's), a .tgz (tarfile's), a .tar that is
    gzip inside and a .tar.gz that is a plain tar: the same as the tar uncompressed and as
    webdataset's reading of the same file; from a gzip of several members with zeros after them
    (what ``gzip -dc`` reads whole; webdataset, through tarfile, only its first member), the
    same as the tar uncompressed."""
    items = samples(0)
    write_tar(tmp_path / "plain.tar", items)
    expected = contents(read_local_tar(str(tmp_path / "plain.tar")))
    assert [key for key, _ in expected] == [item["__key__"] for item in items]
    whole = tar_bytes(items)
    half = len(whole) // 2
    write_webdataset(tmp_path / "a.tar.gz", items)
    write_tarfile_gz(tmp_path / "b.tgz", items)
    (tmp_path / "c.tar").write_bytes(gzip.compress(whole))
    (tmp_path / "d.tar.gz").write_bytes(whole)
    (tmp_path / "e.tar.gz").write_bytes(gzip.compress(whole[:half]) + gzip.compress(whole[half:])
                                        + bytes(4096))
    for name in ("a.tar.gz", "b.tgz", "c.tar", "d.tar.gz"):
        path = str(tmp_path / name)
        assert contents(read_local_tar(path)) == expected, name
        assert contents(wds.WebDataset(path, shardshuffle=False)) == expected, name
    assert contents(read_local_tar(str(tmp_path / "e.tar.gz"))) == expected


def test_a_gzip_shards_fields_are_views_of_a_registered_memfd_let_go_after_the_shard(tmp_path):
    """After decompression the zero-copy path holds: fields are views of one read-only mapping
    of an anonymous memory file, registered while the shard is read (so its members travel by
    reference) and let go once it is read (so its memory goes with its samples)."""
    from mmproxy._wire import mappings as _mappings

    write_webdataset(tmp_path / "a.tar.gz", samples(0))
    reading = read_local_tar(str(tmp_path / "a.tar.gz"))
    first = next(reading)
    mapping = first["jpg"].obj
    assert first["jpg"].readonly and all(s["jpg"].obj is mapping for s in [first, next(reading)])
    held = [fd for start, (end, fd, m, _) in _mappings.files.entries.items() if m is mapping]
    assert len(held) == 1 and os.readlink(f"/proc/self/fd/{held[0]}").startswith("/memfd:")
    assert mapping[:] == gzip.decompress((tmp_path / "a.tar.gz").read_bytes())
    assert os.fstat(held[0]).st_size == len(mapping)  # the memory it holds: the tar's size
    assert len(list(reading)) == PER_SHARD - 2
    assert not any(m is mapping for _, _, m, _ in _mappings.files.entries.values())


@pytest.mark.parametrize("workers", [0, 2])
def test_a_folder_mixing_tar_and_gzip_shards_reads_every_sample(plain, mixed, image_server,
                                                                workers):
    """A folder's shards are its .tar, .tar.gz and .tgz files; through MultiModalDataset and its
    workers they give the pixels of the same samples in plain tars, and no record."""
    from mmproxy.datasets.shards import folder_shards

    assert folder_shards(str(mixed)) == sorted(mixed_urls(mixed))
    assert sorted(expand(str(mixed / "*.{tar,tar.gz,tgz}"))) == sorted(mixed_urls(mixed))
    [expected], _ = run(plain, image_server, workers)
    [got], loader = run(folder_shards(str(mixed)), image_server, workers)
    assert len(expected) == SHARDS * PER_SHARD and same(got, expected)
    assert not loader.skipped.records


def test_the_image_text_recipe_reads_gzip_shards_in_workers(plain, mixed, image_server, tmp_path):
    tokenizer = make_tokenizer(tmp_path / "tok", [f"caption {s} {i}" for s in range(4)
                                                  for i in range(PER_SHARD)])

    def batches(urls):
        ds = image_text_dataset(urls, image_server, tokenizer, batch_size=4, shuffle_shards=False)
        return {key: (image.numpy().tobytes(), ids.tolist())
                for batch in ds.loader(image_server, num_workers=2)
                for key, image, ids in zip(batch["__key__"], batch["image"], batch["input_ids"])}

    expected = batches(plain)
    assert len(expected) == SHARDS * PER_SHARD
    assert batches(mixed_urls(mixed)) == expected


@pytest.fixture(scope="module")
def served(mixed):
    with ShardServer(mixed) as server:
        yield server


def test_gzip_shards_over_http_streamed_and_cached(plain, mixed, served, image_server, tmp_path):
    [expected], _ = run(plain, image_server, 2)
    urls = [f"{served.url}/{os.path.basename(u)}" for u in mixed_urls(mixed)]
    [got], loader = run(urls, image_server, 2)
    assert same(got, expected) and not loader.skipped.records
    cached = RemoteOptions(cache_dir=str(tmp_path / "cache"), cache_bytes=CACHE_BYTES, **FAST)
    for _ in range(2):  # downloaded into the cache, then read from it
        [got], loader = run(urls, image_server, 2, remote=cached)
        assert same(got, expected) and not loader.skipped.records
    assert served.requests["r-0.tar.gz"] == 2  # once streamed, once into the cache
    assert contents(read_remote_tar(urls[0], RemoteOptions(**FAST))) == contents(
        read_local_tar(plain[0]))


def test_an_s3_prefix_lists_gzip_shards_and_they_are_read(plain, mixed, image_server, aws):
    """``s3://BUCKET/`` names its .tar, .tar.gz and .tgz objects (as a local folder does), and
    they are read like the same samples in plain tars; a glob names what it matches."""
    paths = mixed_urls(mixed)
    # a bucket of its own: moto's servers in one process share their buckets
    with s3_server(paths, bucket="gzip-shards") as (urls, env):
        aws(env)
        import boto3

        boto3.client("s3").put_object(Bucket="gzip-shards", Key="notes.txt", Body=b"not a shard")
        assert expand("s3://gzip-shards/") == sorted(urls)
        assert expand("s3://gzip-shards/*.tar.gz") == ["s3://gzip-shards/r-0.tar.gz"]
        [expected], _ = run(plain, image_server, 2)
        [got], loader = run("s3://gzip-shards/", image_server, 2)
        assert same(got, expected) and not loader.skipped.records


def cut_or_corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "cut":
        del data[len(data) * 2 // 3:]
    else:
        data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["local", "http"])
@pytest.mark.parametrize("how", ["cut", "corrupt"])
def test_a_cut_or_corrupt_gzip_shard_is_named_and_said_to_be_so(tmp_path, image_server, where,
                                                               how):
    """The record and the error name the shard and say the gzip stream is cut short or corrupt
    (not a tar checksum); the other shards are read whole."""
    big = [{"__key__": f"b-{i:03d}", "jpg": image_bytes(synth_image(i, 64, 64)),
            "cls": str(i).encode()} for i in range(40)]
    write_webdataset(tmp_path / "bad.tar.gz", big)
    write_webdataset(tmp_path / "good.tar.gz", samples(1))
    cut_or_corrupt(tmp_path / "bad.tar.gz", how)
    with ShardServer(tmp_path) as server:
        base = str(tmp_path) if where == "local" else server.url
        urls = [f"{base}/bad.tar.gz", f"{base}/good.tar.gz"]
        [got], loader = run(urls, image_server, on_error="skip")
        [record] = loader.skipped.records
        words = "is cut short: it ends at byte" if how == "cut" else "is corrupt in its bytes"
        assert record.shard == urls[0] and f"the gzip stream {words}" in record.reason, record
        assert "checksum" not in record.reason and "damaged" not in record.reason
        assert {k for k in got if k.startswith("s1-")} == {f"s1-{i}" for i in range(PER_SHARD)}
        if how == "cut":  # the samples whole before the cut come out, as from a cut tar
            assert 0 < len([k for k in got if k.startswith("b-")]) < len(big)
        with pytest.raises(mmproxy.ShardError, match=f"shard {urls[0]}: cannot be read: "
                           f"ReadError: the gzip stream {words}"):
            run(urls[:1], image_server)


def test_other_compressions_are_named_not_called_damaged(tmp_path):
    items = samples(0)
    for mode, name in (("w:bz2", "bzip2"), ("w:xz", "xz")):
        path = tmp_path / f"a.tar.{name}"
        with tarfile.open(path, mode) as tar:
            add_members(tar, items)
        with pytest.raises(tarfile.ReadError, match=f"^the shard is compressed with {name}, which "
                           r"mmproxy does not read: decompress it to a \.tar, or compress it with "
                           r"gzip \(\.tar\.gz\)$"):
            list(read_local_tar(str(path)))


def test_a_gzip_stream_with_no_bytes_or_garbage_after_it_is_named(tmp_path):
    (tmp_path / "empty.tar.gz").write_bytes(gzip.compress(b""))
    with pytest.raises(tarfile.ReadError, match=r"^the gzip stream holds no bytes"):
        list(read_local_tar(str(tmp_path / "empty.tar.gz")))
    whole = tar_bytes(samples(0))
    (tmp_path / "tail.tar.gz").write_bytes(gzip.compress(whole) + b"not gzip")
    reading = read_local_tar(str(tmp_path / "tail.tar.gz"))
    assert len([next(reading) for _ in range(PER_SHARD)]) == PER_SHARD
    with pytest.raises(tarfile.ReadError, match=r"^the gzip stream is corrupt: its bytes [\d,]+ "
                       r"to [\d,]+, after its last whole member, are not gzip$"):
        next(reading)


def test_a_folder_of_gzip_shards_is_hinted_by_its_suffixes(mixed, tmp_path):
    """A folder named as a shard: the hint names the pattern of the shards it holds."""
    from mmproxy.datasets.shards import folder_shards

    (tmp_path / "gz").mkdir()
    write_webdataset(tmp_path / "gz" / "x.tar.gz", samples(0))
    fields = {"label": ("cls", int)}
    with pytest.raises(FileNotFoundError, match=r"is a folder: name its shards, e\.g\. "
                       r"\S+/gz/\*\.tar\.gz$"):
        MultiModalDataset([str(tmp_path / "gz")], fields, batch_size=2)
    with pytest.raises(FileNotFoundError, match=r"e\.g\. \S+/\*\.\{tar,tar\.gz,tgz\}$") as err:
        MultiModalDataset([str(mixed)], fields, batch_size=2)
    hinted = str(err.value).rsplit(" ", 1)[1]
    assert sorted(expand(hinted)) == sorted(mixed_urls(mixed)) == folder_shards(str(mixed))


@pytest.fixture(scope="module")
def train_server():
    pipe = image_train_pipeline(batch_size=4, size=16, dtype="uint8", device="cpu",
                                num_threads=1, scale=(0.2, 1.0), sample_seeded=True)
    with mmproxy.DALIServer(pipe, name="train") as server:
        yield server


def test_a_state_saved_over_gzip_shards_resumes_exactly(plain, mixed, train_server):
    """Samples are named by address (shard, index); a gzip shard's indices are its tar's, so a
    loader stopped inside one and resumed gives the rest of the epoch exactly, and in the order
    (and with the augmentation) the same samples in plain tars have."""
    def loader(urls):
        ds = MultiModalDataset(urls, {"image": ("jpg", train_server.proxy)}, batch_size=4,
                               seed=3, shuffle_buffer=5)
        return ds.loader(train_server, num_workers=2)

    def record(batch):
        return list(batch["__key__"]), batch["image"].clone()

    gz = [str(mixed / "r-0.tar.gz"), str(mixed / "r-1.tgz"), str(mixed / "r-3.tar")]
    whole = [record(b) for b in loader(gz)]
    assert sum(len(keys) for keys, _ in whole) == 3 * PER_SHARD
    flat = [record(b) for b in loader([plain[0], plain[1], plain[3]])]
    assert [keys for keys, _ in flat] == [keys for keys, _ in whole]
    first = loader(gz)
    seen = []
    for batch in first:
        seen.append(record(batch))
        if len(seen) == 2:
            state = pickle.loads(pickle.dumps(first.state_dict()))
            break
    resumed = loader(gz)
    resumed.load_state_dict(state)
    rest = [record(b) for b in resumed]
    assert [keys for keys, _ in seen + rest] == [keys for keys, _ in whole]
    for (_, x), (_, y) in zip(seen + rest, whole):
        assert torch.equal(x, y)
