"""``--data`` of ``mmproxy demo`` (and ``bench``) on shards other tools wrote: a folder of gzip
shards taken as the datasets take it, and a tar not sorted by name (a sample's files apart, as GNU
tar writes ``*.jpg *.txt``) refused with the datasets' own diagnosis."""

from __future__ import annotations

import re
import subprocess
import tarfile

import numpy as np
import pytest
from cli_helpers import run_cli
from mmproxy.datasets import MultiModalDataset
from test_gzip_shards import write_tarfile_gz, write_webdataset

from mmproxy.apps.data import expand_data, first_sample_fields
from mmproxy.testing import image_bytes, write_tar

pytestmark = pytest.mark.timeout(240)


def sample(i):
    return {"__key__": f"k{i:02d}", "jpg": image_bytes(np.full((24, 32, 3), 20 + 9 * i, np.uint8),
                                                       "JPEG"),
            "txt": f"a caption {i}".encode(), "cls": str(i % 3).encode()}


def unsorted_shard(folder, name, count=4):
    """A shard as ``tar -cf NAME *.jpg *.txt`` writes it in ``folder``: every image, then every
    caption (``-z`` for a name ending in .gz)."""
    files = folder / "files"
    files.mkdir()
    for i in range(count):
        item = sample(i)
        (files / f"{item['__key__']}.jpg").write_bytes(item["jpg"])
        (files / f"{item['__key__']}.txt").write_bytes(item["txt"])
    flags = "-czf" if name.endswith(".gz") else "-cf"
    subprocess.run(f"tar {flags} ../{name} *.jpg *.txt", shell=True, cwd=files, check=True)
    return folder / name


@pytest.mark.parametrize("name", ["shard.tar", "shard.tar.gz"])
def test_a_first_sample_split_by_an_unsorted_tar_gets_the_datasets_diagnosis(tmp_path, name):
    """The probe refuses the first sample with the reason the datasets give the same sample
    (not its fields as if whole: "no image field, only txt" or a run of split samples)."""
    shard = str(unsorted_shard(tmp_path, name))
    with tarfile.open(shard) as tar:
        assert tar.getnames()[:2] == ["k00.jpg", "k01.jpg"]  # a sample's files apart
    dataset = MultiModalDataset(shard, {"image": ("jpg", bytes), "text": ("txt", bytes)},
                                batch_size=2, on_error="skip", max_skipped=None)
    records = [r for batch in dataset for r in batch["__skipped__"]]
    first = next(r for r in records if r.key == "k00")
    assert first.reason.startswith("split sample: its 'jpg' file(s) lie apart")
    with pytest.raises(ValueError) as err:
        first_sample_fields([shard])
    assert str(err.value) == f"the first sample of {shard}, 'k00', cannot be read: {first.reason}"


def test_demo_on_an_unsorted_tar_says_to_write_it_sorted_by_name(tmp_path):
    (tmp_path / "data").mkdir()
    unsorted_shard(tmp_path / "data", "shard.tar")
    proc = run_cli(["demo", "--data", str(tmp_path / "data"), "--quiet"], tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    first = proc.stderr.strip().splitlines()[0]
    assert re.fullmatch(r"mmproxy demo: error: the first sample of \S+/shard\.tar, 'k00', cannot "
                        r"be read: split sample: its 'jpg' file\(s\) lie apart from its other "
                        r"files in the tar, .*\(write the tar sorted by name, e\.g\. GNU tar "
                        r"--sort=name .*", first), first
    assert "has no image" not in proc.stderr


def gzip_folder(folder):
    """A .tar.gz by webdataset's TarWriter, a .tgz by tarfile, a plain .tar: 12 samples."""
    folder.mkdir()
    write_webdataset(folder / "a.tar.gz", [sample(i) for i in range(4)])
    write_tarfile_gz(folder / "b.tgz", [sample(i) for i in range(4, 8)])
    write_tar(folder / "c.tar", [sample(i) for i in range(8, 12)])
    return [str(folder / n) for n in ("a.tar.gz", "b.tgz", "c.tar")]


def test_data_folder_takes_the_shards_the_datasets_read(tmp_path):
    shards = gzip_folder(tmp_path / "data")
    assert expand_data(str(tmp_path / "data")) == shards
    first, exts = first_sample_fields(shards)
    assert first == shards[0] and sorted(exts) == ["cls", "jpg", "txt"]
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "x.tgz").write_bytes((tmp_path / "data" / "b.tgz").read_bytes())
    assert expand_data(f"{tmp_path / 'gz'}::{shards[2]}") == [str(tmp_path / "gz" / "x.tgz"),
                                                             shards[2]]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not a shard")
    with pytest.raises(FileNotFoundError, match=r"^no shard \(\.tar, \.tar\.gz or \.tgz file\) "
                       r"in the folder \S+/empty$"):
        expand_data(str(tmp_path / "empty"))


def test_demo_reads_every_sample_of_a_folder_of_gzip_shards(tmp_path):
    gzip_folder(tmp_path / "data")
    proc = run_cli(["demo", "--data", str(tmp_path / "data"), "--batch-size", "4",
                    "--workers", "2", "--device", "cpu"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    counts = dict(re.findall(r"^  (\w+) +(\d+) samples +[\d.]+ samples/s", proc.stdout, re.M))
    assert counts == {"image": "12", "text": "12", "label": "12"}, proc.stdout
    assert "3 shard(s)" in proc.stdout and "skipped 0 samples" in proc.stdout, proc.stdout
    # the captions of someone else's shards are tokenized by the demo's own tokenizer: said so
    assert "text tokenized by the demo's tiny tokenizer" in proc.stdout, proc.stdout
    assert "--tokenizer FOLDER" in proc.stdout, proc.stdout


@pytest.mark.parametrize("given", [["--samples", "64"], ["--video"], ["--samples", "8", "--video"]])
def test_demo_refuses_the_synthetic_sets_options_with_data(tmp_path, given):
    gzip_folder(tmp_path / "data")
    proc = run_cli(["demo", "--data", str(tmp_path / "data"), "--device", "cpu", *given], tmp_path)
    assert proc.returncode != 0
    named = " and ".join(g for g in given if g.startswith("--"))
    assert f"{named} shape" in proc.stderr and "with --data the demo reads every sample" in \
        proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_demo_takes_the_fields_of_the_first_sample_with_media(tmp_path):
    """Captions alone first (a set where some samples lost their image): the demo reads the
    fields of the first sample that has an image, and skips the samples without one."""
    (tmp_path / "data").mkdir()
    texts = [{"__key__": f"a{i}", "txt": b"no image", "cls": b"0"} for i in range(2)]
    write_tar(tmp_path / "data" / "s.tar", [*texts, *(sample(i) for i in range(25))])
    proc = run_cli(["demo", "--data", str(tmp_path / "data"), "--batch-size", "4",
                    "--workers", "1", "--device", "cpu"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "fields image (jpg" in proc.stdout and "from sample 'k00' of " in proc.stdout, proc.stdout
    counts = dict(re.findall(r"^  (\w+) +(\d+) samples +[\d.]+ samples/s", proc.stdout, re.M))
    assert counts["image"] == "25" and "skipped 2 samples" in proc.stdout, proc.stdout
    assert "sample 'a0': missing field 'jpg/jpeg" in proc.stdout, proc.stdout


def test_demo_searches_later_shards_for_media_and_refuses_a_set_without_naming_how_many(tmp_path):
    """The first shard's first 20 samples lack an image, the second shard has them: the demo
    reads the fields from the second; a set with no image in the samples searched is refused,
    saying how many samples of how many shards were read."""
    (tmp_path / "data").mkdir()
    texts = [{"__key__": f"a{i:02d}", "txt": b"no image"} for i in range(20)]
    write_tar(tmp_path / "data" / "s-0.tar", texts)
    write_tar(tmp_path / "data" / "s-1.tar", [sample(i) for i in range(20)])
    proc = run_cli(["demo", "--data", str(tmp_path / "data"), "--device", "cpu",
                    "--max-skipped", "0.6", "--workers", "1", "--batch-size", "4"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "from sample 'k00' of " in proc.stdout and "s-1.tar, the first with" in proc.stdout, \
        proc.stdout
    (tmp_path / "data" / "s-1.tar").unlink()
    write_tar(tmp_path / "data" / "s-1.tar", texts[:3])
    proc = run_cli(["demo", "--data", str(tmp_path / "data"), "--device", "cpu"], tmp_path)
    assert proc.returncode == 1
    assert "error: the first 19 samples of 2 shards from " in proc.stderr, proc.stderr
    assert "hold no field the demo's servers read (image (jpg/jpeg" in proc.stderr, proc.stderr
    assert "only txt: give --data shards of images, audio or videos" in proc.stderr, proc.stderr
