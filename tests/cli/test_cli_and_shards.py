"""make-shards (what it writes, refuses and reports), the CLI's errors, demo --data, tokenizers."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchaudio
from conftest import cpu_image_server
from mmproxy.datasets import Tokenize, image_text_dataset, load_tokenizer, make_shards
from mmproxy.datasets.writer import OutputExistsError, Reason, WrittenShards

import mmproxy
from mmproxy import cli
from mmproxy.testing import (
    audio_bytes,
    image_bytes,
    make_tokenizer,
    synth_image,
    synth_speech,
    write_tar,
)

ROOT = Path(__file__).resolve().parents[2]
HINT = "(run with --debug for the traceback)"
pytestmark = pytest.mark.timeout(240)


def solid(value, fmt="PNG"):
    return image_bytes(np.full((24, 32, 3), value, np.uint8), fmt)


def members(shard):
    """{key: {ext: bytes}} of a shard, read with tarfile."""
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(shard) as tar:
        for m in tar:
            key, ext = m.name.split(".", 1)
            out.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return out


def run_cli(args, tmp_path, timeout=200):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "mmproxy.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def image_folder(root, per_class=3):
    for c, name in enumerate(("cat", "dog_house")):
        (root / name).mkdir(parents=True)
        for k in range(per_class):
            (root / name / f"{k}.png").write_bytes(solid(40 * c + 10 * k + 20))
    return root


# make-shards: the output folder ------------------------------------------------------------


def test_an_output_folder_inside_the_source_that_holds_its_files_is_refused(tmp_path):
    """An output folder that is one of the source's class folders: its images would be left out
    (a whole class missing from the set and from classes.json), so it is refused; an empty
    output folder inside the source is fine (it is not read)."""
    src = image_folder(tmp_path / "src")
    with pytest.raises(ValueError, match=r"the output folder .*dog_house is inside the source "
                                         r"folder and holds 3 image file\(s\) of it \(e\.g\. "
                                         r"dog_house/0\.png\)"):
        make_shards(src, src / "dog_house")
    assert not list((src / "dog_house").glob("*.tar"))
    written = make_shards(src, src / "shards")
    assert sorted(json.loads((src / "shards" / "classes.json").read_text())) == ["cat", "dog_house"]
    assert written and all("/shards/" in p for p in written)


def test_a_folder_with_shards_is_refused_and_overwrite_replaces_exactly_them(tmp_path):
    src, out = image_folder(tmp_path / "src", per_class=2), tmp_path / "out"
    first = make_shards(src, out, max_count=1)
    assert [Path(p).name for p in first] == [f"shard-00000{i}.tar" for i in range(4)]
    (out / "notes.txt").write_text("not a shard")  # not ours to touch
    with pytest.raises(OutputExistsError,
                       match=r"already holds a shard set \(6 files: .*\); pass overwrite=True"):
        make_shards(src, out, max_count=4)
    assert len(list(out.glob("shard-*.tar"))) == 4  # refused before touching anything

    again = make_shards(src, out, max_count=4, overwrite=True)
    assert list(again) == [str(out / "shard-000000.tar")]  # exactly what was written
    assert sorted(p.name for p in out.iterdir()) == ["classes.json", "manifest.jsonl",
                                                     "notes.txt", "shard-000000.tar"]
    assert len(members(again[0])) == again.samples == 4
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 4


def test_overwrite_with_another_prefix_replaces_the_old_set(tmp_path):
    """The old set's shards stayed beside the new ones while classes.json and manifest.jsonl
    described only the new set: a run on the folder read both, the old with the wrong labels."""
    src, out = image_folder(tmp_path / "src", per_class=2), tmp_path / "out"
    make_shards(src, out, max_count=1, prefix="old")
    (src / "bird").mkdir()  # another class: the old set's labels no longer hold
    (src / "bird" / "0.png").write_bytes(solid(5))
    new = make_shards(src, out, max_count=10, prefix="new", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["classes.json", "manifest.jsonl",
                                                     "new-000000.tar"]
    assert list(new) == [str(out / "new-000000.tar")] and new.samples == 5

    # .tar files no set written there names are refused, overwrite or not, and named
    (out / "mine.tar").write_bytes(b"someone's shard")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match=r"holds 1 \.tar file\(s\) of no shard set "
                           r"written there \(mine\.tar: .*move them away"):
            make_shards(src, out, prefix="new", overwrite=overwrite)
    assert sorted(p.name for p in out.iterdir()) == ["classes.json", "manifest.jsonl",
                                                     "mine.tar", "new-000000.tar"]


def test_an_interrupted_or_failed_make_shards_leaves_the_old_set_and_no_parts(tmp_path,
                                                                             monkeypatch):
    import mmproxy.datasets.writer._source_files as source_files

    src, out = image_folder(tmp_path / "src", per_class=3), tmp_path / "out"
    make_shards(src, out, max_count=2)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []

    def interrupted(ext, data):
        calls.append(ext)
        if len(calls) == 4:  # inside the second new shard
            raise KeyboardInterrupt
        return None

    monkeypatch.setattr(source_files, "check_header", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make_shards(src, out, max_count=3, prefix="new", overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # a part file of a process that has ended is removed by the next run; another's stays
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    host = os.uname().nodename
    stale, alive = out / f"x-000000.tar.part-{host}-{dead}", out / f"x-000000.tar.part-{host}-1"
    stale.write_bytes(b"half"), alive.write_bytes(b"half")
    monkeypatch.undo()
    make_shards(src, out, overwrite=True)
    assert not stale.exists() and alive.exists()


def _contents(folder):
    """({name: a shard's members or a file's bytes}, the names of part files) of a folder."""
    found = {p.name: members(p) if p.suffix == ".tar" else p.read_bytes()
             for p in folder.iterdir() if ".part-" not in p.name}
    return found, sorted(p.name for p in folder.iterdir() if ".part-" in p.name)


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk-full", "interrupt"])
def test_a_failure_at_any_step_of_an_overwrite_leaves_the_old_set_or_the_new_one(
        tmp_path, monkeypatch, error):
    """The old set went first and classes.json and manifest.jsonl were written last, outside any
    handler: a failure there left the new shards with no lists and the old set gone."""
    import shutil

    import mmproxy.datasets.writer as writer

    src, old = image_folder(tmp_path / "src", per_class=3), tmp_path / "old"
    make_shards(src, old, max_count=2)  # three shards
    (src / "bird").mkdir()  # another class: another classes.json and manifest.jsonl
    (src / "bird" / "0.png").write_bytes(solid(5))
    make_shards(src, tmp_path / "new", max_count=4)  # two shards of the same names
    before, after = _contents(old)[0], _contents(tmp_path / "new")[0]
    assert len(before) == 5 and len(after) == 4 and before.keys() != after.keys()

    class Steps:
        """os for the writer, with its renames and removals counted: the ``at``-th one fails."""

        def __init__(self, at):
            self.at, self.count = at, 0

        def __getattr__(self, name):
            return getattr(os, name)

        def step(self):
            self.count += 1
            if self.count == self.at:
                raise error

        def replace(self, *args):
            self.step()
            os.replace(*args)

        def unlink(self, path):
            self.step()
            os.unlink(path)

    write_text = Path.write_text
    outcomes = set()
    for at in range(1, 100):
        out = tmp_path / f"out{at}"
        shutil.copytree(old, out)
        steps = Steps(at)

        def failing_write_text(path, *args, steps=steps, **kwargs):
            steps.step()
            return write_text(path, *args, **kwargs)

        monkeypatch.setattr(writer, "os", steps)
        monkeypatch.setattr(Path, "write_text", failing_write_text)
        try:
            make_shards(src, out, max_count=4, overwrite=True)
        except type(error):
            pass
        finally:
            monkeypatch.undo()
        found, parts = _contents(out)
        assert found in (before, after), f"a failure at step {at}: {sorted(found)}"
        assert not parts or found == after, parts  # an old file set aside and not yet removed
        outcomes.add("old" if found == before else "new")
        if steps.count < at:  # no failure: every step was tried
            break
    assert outcomes == {"old", "new"} and at > 10


def test_cli_refuses_then_overwrites_and_reports_the_count_written(tmp_path, capsys):
    src, out = image_folder(tmp_path / "src"), tmp_path / "out"
    assert cli.main(["make-shards", str(src), str(out), "--max-count", "2"]) == 0
    assert f"wrote 6 samples in 3 shards to {out}" in capsys.readouterr().out
    assert cli.main(["make-shards", str(src), str(out), "--max-count", "100"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"mmproxy make-shards: error: {out} already holds a shard set (5 files: "
                      "classes.json, manifest.jsonl, shard-000000.tar, ...); add --overwrite to "
                      "replace it, or write to an empty folder")
    assert err[1:] == [HINT]
    assert cli.main(["make-shards", str(src), str(out), "--max-count", "100", "--overwrite"]) == 0
    assert f"wrote 6 samples in 1 shard to {out}" in capsys.readouterr().out
    assert [p.name for p in out.glob("*.tar")] == ["shard-000000.tar"]


# make-shards: what a sample holds ----------------------------------------------------------


def test_each_sample_names_its_source_file_and_the_manifest_maps_keys_back(tmp_path):
    src, out = image_folder(tmp_path / "src"), tmp_path / "out"
    (src / "cat" / "1.txt").write_text("a cat with a caption\n")
    written = make_shards(src, out, max_count=4)
    manifest = [json.loads(line) for line in Path(written.manifest).read_text().splitlines()]
    assert len(manifest) == written.samples == 6
    classes = json.loads((out / "classes.json").read_text())
    assert classes == ["cat", "dog_house"]
    for row in manifest:  # key -> shard -> the very bytes of the source file
        sample = members(out / row["shard"])[row["key"]]
        assert sample["src"].decode() == row["source"]
        assert sample["png"] == (src / row["source"]).read_bytes()
        assert classes[int(sample["cls"])] == row["source"].split("/")[0]
    by_source = {row["source"]: row for row in manifest}
    assert by_source["cat/1.png"]["caption_from"] == "txt"
    assert members(out / by_source["cat/1.png"]["shard"])[by_source["cat/1.png"]["key"]]["txt"] \
        == b"a cat with a caption"
    dog = by_source["dog_house/0.png"]
    assert dog["caption_from"] == "folder"
    assert members(out / dog["shard"])[dog["key"]]["txt"] == b"dog house"


def test_left_out_and_guessed_files_are_reported(tmp_path):
    src = image_folder(tmp_path / "src", per_class=2)
    (src / "cat" / "0.txt").write_text("a cat")
    (src / "loose.png").write_bytes(solid(30))                       # no .txt, no class folder
    (src / "captioned.jpg").write_bytes(solid(50, "JPEG"))
    (src / "captioned.txt").write_text("\ufeffa loose image with a caption")  # a UTF-8 BOM
    (src / "cat" / "anim.gif").write_bytes(solid(60, "GIF"))         # a format not read
    (src / "notes.txt").write_text("no image beside me")
    (src / "dog_house" / "broken.jpg").write_bytes(b"not a jpeg at all")
    (src / "dog_house" / "empty.png").write_bytes(solid(70))
    (src / "dog_house" / "empty.txt").write_text("  \n")
    written = make_shards(src, tmp_path / "out")
    assert written.samples == 5
    assert (written.captions_from_txt, written.captions_from_folder) == (2, 3)
    reasons = dict(written.left_out)
    assert set(reasons) == {"loose.png", "cat/anim.gif", "notes.txt", "dog_house/broken.jpg",
                            "dog_house/empty.png"}
    assert "no caption" in reasons["loose.png"]
    assert reasons["cat/anim.gif"] == "not an image file this writer reads (.gif)"
    assert "no image" in reasons["notes.txt"]
    assert reasons["dog_house/broken.jpg"] == ("holds none of the image formats this writer reads "
                                               "(it starts with b'not a jp')")
    assert "empty" in reasons["dog_house/empty.png"]
    summary = written.summary()
    assert "3 guessed from the class folder's name" in summary and "left out: 5 files" in summary
    assert "1 x not a format this writer reads (.gif 1; it reads .bmp .jpeg .jpg .png" in summary
    sources = {json.loads(r)["source"] for r in Path(written.manifest).read_text().splitlines()}
    assert sources == {"captioned.jpg", "cat/0.png", "cat/1.png", "dog_house/0.png",
                       "dog_house/1.png"}
    captions = {s["src"]: s["txt"] for s in members(written[0]).values()}
    assert captions[b"captioned.jpg"] == b"a loose image with a caption"  # the BOM dropped


def test_the_report_groups_left_out_files_by_reason_with_examples_of_each(tmp_path):
    """603 left-out files were listed as their first 10, all .svg, hiding the empty, truncated
    and text-as-.jpg ones; and "... and 1 more" stood where the one file would fit."""
    src = tmp_path / "src"
    (src / "art").mkdir(parents=True)
    for i in range(600):
        (src / "art" / f"{i:03d}.svg").write_text("<svg/>")
    for name in ("a.xcf", "b.xcf", "c.xcf"):
        (src / "art" / name).write_bytes(b"gimp")
    (src / "art" / "good.png").write_bytes(solid(9))
    for name in ("e1.jpg", "e2.jpg", "e3.jpg", "e4.jpg"):  # four: all listed, no "and 1 more"
        (src / "art" / name).write_bytes(b"")
    jpeg = image_bytes(synth_image(1))
    (src / "art" / "cut.jpg").write_bytes(jpeg[:len(jpeg) // 2])
    (src / "art" / "readme.jpg").write_text("this is text")
    written = make_shards(src, tmp_path / "out")
    lines = written.summary().splitlines()
    at = lines.index("  left out: 609 files, by reason:")
    assert lines[at + 1:] == [
        "    603 x not a format this writer reads (.svg 600, .xcf 3; it reads .bmp .jpeg .jpg "
        ".png .tif .tiff .webp)",
        "      art/000.svg", "      art/001.svg", "      art/002.svg", "      ... and 600 more",
        "    4 x is empty",
        "      art/e1.jpg", "      art/e2.jpg", "      art/e3.jpg", "      art/e4.jpg",
        "    1 x is truncated (no end-of-image marker after its image data)",
        "      art/cut.jpg",
        "    1 x holds none of the image formats this writer reads (it starts with b'this is ')",
        "      art/readme.jpg",
        f"  every file left out, and why: {tmp_path / 'out' / 'left_out.jsonl'}",
        f"  manifest (key -> shard, source file): {tmp_path / 'out' / 'manifest.jsonl'}"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "left_out.jsonl").read_text().splitlines()]
    assert len(rows) == 609 and rows[-1] == {"source": "art/readme.jpg", "why": rows[-1]["why"],
                                             "reason": "content"}
    assert {r["source"] for r in rows} >= {"art/599.svg", "art/e4.jpg", "art/cut.jpg"}
    assert lines[:2] == [f"wrote 1 sample in 1 shard to {tmp_path / 'out'}",
                         f"  read them as: {tmp_path / 'out' / 'shard-000000.tar'}"]
    assert {item.reason for item in written.files_left_out} == {
        Reason.FORMAT, Reason.EMPTY, Reason.CONTENT, Reason.DAMAGED}


def test_a_file_is_stored_under_the_extension_of_its_content(tmp_path):
    """A PNG named .jpg was kept as "jpg" while a WAV named .flac was refused: one rule, the
    content decides, for images, audio and video alike."""
    src = tmp_path / "src"
    (src / "speech").mkdir(parents=True)
    wav = audio_bytes(synth_speech(1, 0.2), 16000)
    (src / "speech" / "a.flac").write_bytes(wav)
    (src / "speech" / "b.flac").write_bytes(audio_bytes(synth_speech(2, 0.2), 16000, "FLAC"))
    audio = make_shards(src, tmp_path / "audio", kind="audio-label")
    assert audio.samples == 2 and not audio.left_out
    assert audio.renamed == [("speech/a.flac", "wav")]
    by_src = {s["src"]: s for s in members(audio[0]).values()}
    assert by_src[b"speech/a.flac"]["wav"] == wav and "flac" in by_src[b"speech/b.flac"]
    assert "    speech/a.flac: WAV data, stored as .wav" in audio.summary().splitlines()

    images = tmp_path / "images"
    images.mkdir()
    (images / "p.jpg").write_bytes(solid(7, "PNG"))
    (images / "p.txt").write_text("a png in disguise")
    shards = make_shards(images, tmp_path / "img")
    assert shards.renamed == [("p.jpg", "png")]
    assert set(next(iter(members(shards[0]).values()))) == {"png", "txt", "src"}


def test_audio_needs_a_class_folder_and_other_files_are_left_out(tmp_path):
    src = tmp_path / "src"
    for name in ("no", "yes"):
        (src / name).mkdir(parents=True)
        (src / name / "a.flac").write_bytes(audio_bytes(synth_speech(1, 0.2), 16000, "FLAC"))
    (src / "yes" / "b.wav").write_bytes(audio_bytes(synth_speech(2, 0.2), 16000))
    (src / "top.wav").write_bytes(audio_bytes(synth_speech(3, 0.2), 16000))
    (src / "yes" / "c.mp3").write_bytes(b"ID3....")
    written = make_shards(src, tmp_path / "out", kind="audio-label")
    assert written.samples == 3 and written.captions_from_folder == 0
    assert dict(written.left_out).keys() == {"top.wav", "yes/c.mp3"}
    samples = members(written[0])
    assert sorted(s["src"].decode() for s in samples.values()) == ["no/a.flac", "yes/a.flac",
                                                                   "yes/b.wav"]
    assert all("txt" not in s and ("flac" in s or "wav" in s) for s in samples.values())


def test_an_empty_source_says_why_nothing_was_written(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.gif").write_bytes(solid(1, "GIF"))
    with pytest.raises(FileNotFoundError, match=r"no image files to write.*a\.gif: not an image"):
        make_shards(tmp_path / "src", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        make_shards(tmp_path / "missing", tmp_path / "out")


# make-shards: every format written is read by the recipes' defaults -------------------------


@pytest.fixture(scope="module")
def image_server():
    with cpu_image_server(16, layout="HWC") as server:
        yield server


def test_bmp_and_tiff_are_written_and_read_back_by_the_recipes(tmp_path, image_server):
    src = tmp_path / "src"
    src.mkdir()
    files = {"a.bmp": ("BMP", 30), "b.tif": ("TIFF", 90), "c.tiff": ("TIFF", 150),
             "d.jpeg": ("JPEG", 200), "e.png": ("PNG", 60), "f.webp": ("WEBP", 120)}
    for name, (fmt, value) in files.items():
        (src / name).write_bytes(solid(value, fmt))
        (src / name).with_suffix(".txt").write_text(f"picture {name}")
    written = make_shards(src, tmp_path / "out")
    assert written.samples == len(files) and not written.left_out
    exts = {k: set(v) - {"src", "txt"} for k, v in members(written[0]).items()}
    assert sorted(e for (e,) in exts.values()) == ["bmp", "jpg", "png", "tiff", "tiff", "webp"]

    tokenizer = make_tokenizer(tmp_path / "tok", [f"picture {n}" for n in files])
    source = {row["key"]: row["source"] for row in
              map(json.loads, Path(written.manifest).read_text().splitlines())}
    dataset = image_text_dataset(list(written), image_server, tokenizer, batch_size=3,
                                 shuffle_buffer=0)  # the recipe's default image extensions
    seen = {}
    for batch in dataset.loader(image_server, num_workers=1):
        assert batch["__skipped__"] == []
        for key, image in zip(batch["__key__"], batch["image"]):
            seen[source[key]] = image.float().mean().item()
    assert seen.keys() == files.keys()
    for name, (_, value) in files.items():
        assert abs(seen[name] - value) < 4, (name, seen[name], value)


# CLI errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("debug", [[], ["--debug"], ["--debug-after"]])
def test_cli_errors_are_one_line_with_a_hint_and_debug_gives_the_traceback(tmp_path, debug):
    args = ["make-shards", str(tmp_path / "missing"), str(tmp_path / "out")]
    if debug == ["--debug"]:
        args = ["--debug", *args]
    elif debug:
        args = [*args, "--debug"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    error = f"mmproxy make-shards: error: {tmp_path / 'missing'} is not a folder"
    if debug:
        assert lines[0] == "Traceback (most recent call last):" and "FileNotFoundError" in lines[-2]
        assert lines[-1] == error
    else:
        assert lines == [error, HINT]


def test_a_workers_error_and_a_skip_limit_read_as_the_other_cli_errors():
    """A worker's error (torch puts its traceback in the message) is its own line(s), its type
    without the module, and which worker; a skip limit keeps its summary, one kind of skip per
    line, after the one-line message, which names the CLI's option."""
    from mmproxy.errors import ShardError, SkipLimitError

    trace = ("Caught ShardError in DataLoader worker process 3.\nOriginal Traceback (most recent "
             "call last):\n  File \"x.py\", line 1, in f\n")
    worker = ShardError(trace + "mmproxy.errors.ShardError: shard /d/a.tar: cannot be read: bad")
    assert cli._one_line(worker) == ("ShardError: shard /d/a.tar: cannot be read: bad "
                                     "(in DataLoader worker process 3)")
    two_lines = ShardError(trace + "mmproxy.errors.ShardError: shard data.tar: first\nsecond line")
    assert cli._one_line(two_lines) == ("ShardError: shard data.tar: first second line "
                                        "(in DataLoader worker process 3)")
    limit = SkipLimitError("3 of 10 samples skipped (30.0%)", 0.1,
                           "epoch 1: 7 samples delivered, 3 samples skipped\n"
                           "  3 x bad header; first: /d/a.tar, sample 'k1': bad header")
    assert str(limit).splitlines()[0] == ("3 of 10 samples skipped (30.0%), more than "
                                          "max_skipped=10.0% (raise max_skipped to accept it):")
    assert cli._one_line(limit).splitlines() == [
        "3 of 10 samples skipped (30.0%), more than --max-skipped=10.0% (raise --max-skipped to "
        "accept it):",
        "  epoch 1: 7 samples delivered, 3 samples skipped",
        "    3 x bad header; first: /d/a.tar, sample 'k1': bad header"]
    again = pickle.loads(pickle.dumps(limit))  # as it crosses processes, fields and all
    assert (str(again), again.counted, again.limit) == (str(limit), limit.counted, 0.1)


def test_mmproxy_errors_interrupts_and_bugs(tmp_path, capsys, monkeypatch):
    import mmproxy.datasets as datasets

    def fail(exc):
        def make_shards(*args, **kwargs):
            raise exc
        monkeypatch.setattr(datasets, "make_shards", make_shards)

    args = ["make-shards", str(tmp_path), str(tmp_path / "out")]
    fail(mmproxy.ShardError("the first line\n  and the second"))
    assert cli.main(args) == 1
    assert capsys.readouterr().err.splitlines() == [
        "mmproxy make-shards: error: the first line and the second", HINT]

    worker = ("Caught ShardError in DataLoader worker process 1.\nOriginal Traceback (most recent "
              "call last):\n  File \"x.py\", line 1, in f\n    g()\nmmproxy.errors.ShardError: "
              "worker 1 of 2 gets no shards")
    fail(mmproxy.ShardError(worker))
    assert cli.main(args) == 1
    assert capsys.readouterr().err.splitlines()[0] == (
        "mmproxy make-shards: error: ShardError: worker 1 of 2 gets no shards "
        "(in DataLoader worker process 1)")

    fail(KeyboardInterrupt())
    assert cli.main(args) == 130
    assert capsys.readouterr().err.splitlines() == ["mmproxy make-shards: interrupted"]

    # a package an option needs, missing: what to install, in one line
    fail(ModuleNotFoundError("No module named 'av'", name="av"))
    assert cli.main(args) == 1
    assert capsys.readouterr().err.splitlines() == [
        "mmproxy make-shards: error: needs av, which is not installed: pip install av "
        "(mmproxy's [video] extra)", HINT]

    # not the user's doing: one line saying so too, the traceback with --debug
    fail(TypeError("a bug in mmproxy"))
    assert cli.main(args) == 1
    assert capsys.readouterr().err.splitlines() == [
        "mmproxy make-shards: error: TypeError: a bug in mmproxy (unexpected: please report it, "
        "with the traceback --debug prints)", HINT]
    assert cli.main([*args, "--debug"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "TypeError: a bug" in err


def test_argparse_errors_still_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["make-shards"])
    assert exit_info.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # a typo: the command's usage, which has --device
        cli.main(["demo", "--devcie", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mmproxy demo ") and "--device" in err
    assert err.rstrip().endswith("mmproxy demo: error: unrecognized arguments: --devcie cpu")


# demo --data ---------------------------------------------------------------------------------


def test_demo_on_image_only_shards_uses_the_image_server_and_says_audio_is_missing(tmp_path):
    """The fields line names every extension read (it said "image (png)", the first sample's,
    while the JPEGs were read too)."""
    src = image_folder(tmp_path / "src", per_class=5)
    (src / "cat" / "9.jpg").write_bytes(solid(90, "JPEG"))
    written = make_shards(src, tmp_path / "out", max_count=6)
    proc = run_cli(["demo", "--data", str(tmp_path / "out" / "shard-{000000..000001}.tar"),
                    "--batch-size", "4", "--workers", "2", "--device", "cpu"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "epoch 1/1" not in proc.stderr  # no progress bar in a pipe
    assert ("fields image (jpg/jpeg/png/webp/bmp/tif/tiff), text (txt/caption), label (cls); "
            "not in these shards: audio (no flac/wav/ogg)") in out
    counts = dict(re.findall(r"^  (\w+) +(\d+) samples +[\d.]+ samples/s", out, re.M))
    assert counts == {"image": "11", "text": "11", "label": "11"} and written.samples == 11
    assert "server 'audio'" not in out and "skipped 0 samples" in out


def test_demo_names_every_missing_shard_and_reports_an_unreadable_one(tmp_path):
    """A pattern naming shards that do not exist is refused before anything runs (not a run on
    part of the data); a shard cut short is reported as a shard, apart from skipped samples."""
    src = image_folder(tmp_path / "src", per_class=5)
    make_shards(src, tmp_path / "out", max_count=5)
    pattern = str(tmp_path / "out" / "shard-{000000..000003}.tar")
    proc = run_cli(["demo", "--data", pattern, "--quiet"], tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert re.search(r"error: no shard at .*shard-000002\.tar, .*shard-000003\.tar \(2 of the 4 "
                     r"that --data names\)", proc.stderr), proc.stderr
    shard = tmp_path / "out" / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:1500])  # cut inside its second header
    proc = run_cli(["demo", "--data", str(tmp_path / "out" / "shard-{000000..000001}.tar"),
                    "--quiet", "--batch-size", "4", "--workers", "2", "--device", "cpu",
                    "--on-error", "skip", "--max-skipped", "0.5"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "skipped 0 samples and 1 unreadable shard(s)" in proc.stdout, proc.stdout
    assert "the shard ends at byte 1500, inside the header at byte 1024" in proc.stdout
    assert re.search(r"epoch \d+: 5 samples delivered, 0 samples skipped and 1 unreadable shard\(s\)"
                     r".*\n  +1 x unreadable shard; first: .*shard-000001\.tar: unreadable shard",
                     proc.stdout), proc.stdout


def test_a_damaged_or_empty_first_shard_does_not_stop_the_demo(tmp_path):
    """The fields are read from the first shard that has a sample: a folder whose first shard (by
    name) is a 0-byte file and whose second holds no files runs, and reports both; when no shard
    has a sample, the error names what was wrong with each (up to three)."""
    src = image_folder(tmp_path / "src", per_class=5)
    make_shards(src, tmp_path / "out", max_count=5)
    (tmp_path / "out" / "a-broken.tar").write_bytes(b"")
    with tarfile.open(tmp_path / "out" / "b-none.tar", "w"):
        pass
    proc = run_cli(["demo", "--data", str(tmp_path / "out"), "--quiet", "--batch-size", "4",
                    "--workers", "2", "--device", "cpu", "--max-skipped", "0.5", "--epochs", "2"],
                   tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("skipped 0 samples and 2 unreadable and 2 empty shard(s) over 2 epochs (each epoch "
            "counts its own)") in proc.stdout, proc.stdout
    assert re.search(r"4 shard\(s\): \S+a-broken\.tar, \.\.\., \S+shard-000001\.tar", proc.stdout)
    assert re.search(r"\(from the first sample of \S+shard-000000\.tar\)", proc.stdout), proc.stdout
    assert "a-broken.tar: unreadable shard: ReadError: the file is 0 bytes long" in proc.stdout
    listed = proc.stdout.split("  skipped, each once (2):\n", 1)[1].splitlines()[:2]  # not 4
    assert [line.split(": ", 1)[0].rsplit("/", 1)[1] for line in listed] == ["a-broken.tar",
                                                                             "b-none.tar"]
    proc = run_cli(["demo", "--data", str(tmp_path / "out" / "[ab]-*.tar"), "--quiet"], tmp_path)
    assert proc.returncode == 1
    assert re.search(r"error: no sample to read the fields from in the first 2 shards: "
                     r".*a-broken\.tar cannot be read: the file is 0 bytes long .*; "
                     r".*b-none\.tar holds no samples", proc.stderr), proc.stderr


def test_demo_without_image_audio_or_video_fails_in_one_line(tmp_path):
    shard = tmp_path / "text-000.tar"
    with tarfile.open(shard, "w") as tar:
        for name in ("k0.txt", "k0.cls"):
            tar.add(__file__, arcname=name)
    proc = run_cli(["demo", "--data", str(shard), "--quiet"], tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == HINT and len(lines) == 2, proc.stderr
    assert re.match(r"mmproxy demo: error: the first sample of .*text-000\.tar has no image "
                    r"\(jpg;.*\), audio \(flac;wav;ogg\) or video \(mp4;.*\) field, only txt, cls",
                    lines[0])
    proc = run_cli(["demo", "--data", str(tmp_path / "none-{0..3}.tar")], tmp_path)
    assert proc.returncode == 1 and "error: no shard at" in proc.stderr and "none-0.tar" in proc.stderr
    assert "and 1 more (4 of the 4 that --data names)" in proc.stderr


def test_data_expands_as_the_datasets_do_and_still_refuses_missing_shards(tmp_path):
    """--data goes through the datasets' expand(): ``::`` lists and braces with a glob (which it
    used to take as one path, or glob without the braces); a folder whose name holds ``[``; and a
    pattern naming local shards that do not exist is still refused, before anything runs."""
    from mmproxy.apps.data import expand_data, first_sample_fields

    shards = {}
    for folder in ("a", "b", "run[1]"):
        (tmp_path / folder).mkdir()
        for k in range(2):
            shards[folder, k] = str(tmp_path / folder / f"s-{k}.tar")
            write_tar(shards[folder, k], [{"__key__": f"k{k}", "txt": "hello", "cls": 1}])
    assert expand_data(f"{shards['a', 1]}::{shards['b', 0]}") == [shards["a", 1], shards["b", 0]]
    assert expand_data(str(tmp_path / "{a,b}" / "*.tar")) == [
        shards["a", 0], shards["a", 1], shards["b", 0], shards["b", 1]]
    assert expand_data(str(tmp_path / "run[1]")) == [shards["run[1]", 0], shards["run[1]", 1]]
    assert expand_data(f"{tmp_path / 'a'}::{shards['b', 0]}") == [  # a folder among several
        shards["a", 0], shards["a", 1], shards["b", 0]]
    assert expand_data(str(tmp_path / "run[1]" / "*.tar")) == [shards["run[1]", 0], shards["run[1]", 1]]
    assert first_sample_fields(expand_data(str(tmp_path / "a" / "s-{0..1}.tar")))[1] == ["txt", "cls"]
    with pytest.raises(mmproxy.ShardError, match=r"no shard matches .*/c/\*\.tar"):
        expand_data(str(tmp_path / "c" / "*.tar"))
    named = f"{shards['a', 0]}::{tmp_path / 'b' / 's-{1..4}.tar'}"
    with pytest.raises(FileNotFoundError, match=r"^no shard at .*/b/s-2\.tar, .*/b/s-3\.tar, "
                       r".*/b/s-4\.tar \(3 of the 5 that --data names\)$"):
        first_sample_fields(expand_data(named))


# tokenizers ----------------------------------------------------------------------------------


def test_no_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="a tokenizer is needed.*folder of a saved one"):
        load_tokenizer(None)
    with pytest.raises(ValueError, match="a tokenizer is needed"):
        Tokenize(None, 16, "longest")
    with pytest.raises(ValueError, match="expected a transformers tokenizer.*got int"):
        Tokenize(3, 16, "longest")


def test_a_folder_without_a_tokenizer_and_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match=r"holds no tokenizer \(none of tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "sub" / "tok"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "tok")
    folder = make_tokenizer(tmp_path / "tok")
    for given in (folder, Path(folder)):
        assert Tokenize(given, 8, "longest")({"text": ["a red circle"]})["input_ids"].shape[0] == 1


def test_a_tokenizer_file_is_loaded_not_called_a_missing_folder(tmp_path):
    """``--tokenizer tok/tokenizer.json`` was "tokenizer folder ... does not exist"."""
    import shutil

    folder = Path(make_tokenizer(tmp_path / "tok"))
    for given in (str(folder / "tokenizer.json"), folder / "tokenizer.json"):
        tokenizer = load_tokenizer(given)  # its folder: the pad token of its config too
        assert tokenizer.pad_token == "[PAD]" and tokenizer("a red circle")["input_ids"]
    shutil.copy(folder / "tokenizer.json", tmp_path / "mine.json")  # a lone tokenizers file
    assert load_tokenizer(str(tmp_path / "mine.json"))("a red circle")["input_ids"]
    (tmp_path / "notes.md").write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.md' is a file, but not a tokenizer's"):
        load_tokenizer(str(tmp_path / "notes.md"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer file .*bad\.json' cannot be loaded"):
        load_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer file .*tokenizer\.json' does not exist"):
        load_tokenizer(str(tmp_path / "gone" / "tokenizer.json"))


NAME = "mmproxy-tests/no-such-tokenizer-7f3c"


def _fails_fast(match, limit=10.0):
    import transformers  # noqa: F401  (its import is not part of the wait)

    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=match) as info:
        load_tokenizer(NAME)
    elapsed = time.perf_counter() - start
    assert elapsed < limit, f"took {elapsed:.1f} s"
    assert "give the folder of a saved tokenizer" in str(info.value)
    return str(info.value)


def test_a_wrong_name_offline_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fails_fast(rf"tokenizer '{NAME}' is neither a local folder nor in the Hugging Face cache, "
                "and HF_HUB_OFFLINE", limit=5)


def test_a_wrong_name_fails_in_seconds_whether_or_not_there_is_a_network(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    _fails_fast(rf"tokenizer '{NAME}' is neither a local folder nor in the Hugging Face cache, "
                "nor downloadable")


def test_an_unreachable_or_silent_hub_fails_within_the_check_time(monkeypatch):
    import mmproxy.datasets.recipes as recipes
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "https_proxy", "HTTPS_PROXY",
                "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    _fails_fast(r"nor downloadable \(127\.0\.0\.1:9 cannot be reached")

    def silent(*args, **kwargs):
        time.sleep(30)
        raise TimeoutError("a server that never answers")

    monkeypatch.setattr(recipes.socket, "create_connection", silent)
    monkeypatch.setattr(recipes, "HUB_CHECK_SECONDS", 0.5)
    _fails_fast(r"127\.0\.0\.1:9 did not answer within 0\.5 s", limit=4)


def test_every_format_written_is_one_the_recipes_read_by_default():
    from mmproxy.datasets import recipes, writer

    for suffixes, exts in ((writer.IMAGE_SUFFIXES, recipes.IMAGE_EXTS),
                           (writer.AUDIO_SUFFIXES, recipes.AUDIO_EXTS)):
        read = set(exts.split(";"))
        assert set(suffixes.values()) <= read  # every extension written
        assert {s.lstrip(".") for s in suffixes} == read  # every suffix taken, and no other


def test_a_failed_bench_system_is_reported_by_dalis_own_reason(tmp_path):
    """A reference system that cannot run is one line in the bench's table: for DALI's errors
    the reason after its preamble ("Critical error when building pipeline:"), not the preamble."""
    from nvidia.dali import fn, pipeline_def

    from mmproxy.apps.bench.report import error_line

    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def reader():
        return fn.readers.webdataset(paths=[str(tmp_path / "gone.tar")], ext=["jpg"])

    with pytest.raises(RuntimeError) as info:
        reader().build()
    assert re.fullmatch(r"RuntimeError: fn\.readers\.webdataset: .*gone\.tar.*", error_line(info.value))
    assert error_line(ValueError("first\nsecond")) == "ValueError: first"


def test_bench_summary_lines_up_long_system_names(capsys):
    """Every system's rate starts in the same column, however long its name (an engine variant's
    name pushed its numbers out of line)."""
    from mmproxy.apps.bench.report import print_summary

    systems = {"mmproxy": {"samples_per_s": 100.0, "mmproxy_ratio": 1.0},
               "mmproxy-list-feed": {"samples_per_s": 95.0, "mmproxy_ratio": 1.05},
               "torch": {"error": "RuntimeError: failed"}}
    print_summary({"machine": {"gpu": None}, "results": {"image": {"systems": systems}}}, 2)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  image")]
    assert len(lines) == 3
    assert lines[0].index("100.0") + 1 == lines[1].index("95.0")  # right-aligned in one column
    assert lines[2].index("RuntimeError") == lines[0].index("mmproxy ") + len("mmproxy-list-feed") + 1


def test_bench_summary_says_when_an_epoch_is_too_short_to_time_and_when_mmproxy_failed(capsys):
    """Four batches an epoch: a DALI reader's rate was 352,295 samples/s (its first batches are
    ready before the clock starts), a ratio of 0.06 printed as if it meant something."""
    from mmproxy.apps.bench.report import print_summary

    short = {"samples": 64, "batch_size": 16, "systems": {
        "mmproxy": {"error": "SkipLimitError: ..."}, "dali-reader": {"samples_per_s": 352295.1}}}
    long = {"samples": 16384, "batch_size": 256, "systems": {
        "mmproxy": {"samples_per_s": 100.0, "mmproxy_ratio": 1.0}}}
    print_summary({"machine": {"gpu": None}, "results": {"image": short, "audio": long}}, 2)
    out = capsys.readouterr().out
    assert "352295.1 samples/s   mmproxy / this = n/a" in out
    notes = [line.split()[0] for line in out.splitlines() if "too few to time" in line]
    assert notes == ["image"] and "4 batches an epoch are too few" in out

    # the batches each system counted: 2 workers made 2 partial batches of 64 samples
    # where "64 / 64" gave "1 batch(es)"
    measured = {"samples": 64, "batch_size": 64, "systems": {
        "mmproxy": {"samples_per_s": 10.0, "samples": 64, "batches": 2}}}
    print_summary({"machine": {"gpu": None}, "results": {"image": measured}}, 1)
    out = capsys.readouterr().out
    assert "image      note: 2 batches an epoch are too few" in out
    assert "mmproxy bench (CPU, 1 worker): " in out  # not "1 workers"


def test_the_bench_says_each_systems_result_in_words():
    """It printed each system's raw result dict."""
    from mmproxy.apps.bench.report import system_line

    result = {"samples_per_s": 73.27, "epochs": [31.4, 73.3, 70.1], "samples": 16, "batches": 1,
              "skipped": {"samples": 2, "shards": 0}, "cpu_ms_per_batch": {"workers": 55.0}}
    assert system_line(result) == ("      73.3 samples/s (best epoch; epochs 31.4 (warm-up), "
                                   "73.3, 70.1); 16 samples in 1 batch an epoch; skipped 2 samples")
    assert system_line({"error": "not run: no GPU"}) == "not run: no GPU"


def test_the_bench_names_the_commit_from_the_checkouts_git_folder(tmp_path):
    """The commit measured is read from .git without running git: a branch's loose ref, a packed
    ref, a detached HEAD, a worktree's "gitdir:" file; nothing there gives ""."""
    from mmproxy.apps.bench.report import _git_head

    git = tmp_path / "a" / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("0123456789abcdef0123456789abcdef01234567\n")
    assert _git_head(str(git)) == "0123456789ab"
    (git / "refs" / "heads" / "main").unlink()
    (git / "packed-refs").write_text("# pack-refs with: peeled\n"
                                     "fedcba9876543210fedcba9876543210fedcba98 refs/heads/main\n")
    assert _git_head(str(git)) == "fedcba987654"
    (git / "HEAD").write_text("1111111111112222222222223333333333334444\n")
    assert _git_head(str(git)) == "111111111111"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / ".git").write_text(f"gitdir: {git}\n")
    assert _git_head(str(tmp_path / "b" / ".git")) == "111111111111"
    assert _git_head(str(tmp_path / "nowhere" / ".git")) == ""


def test_the_bench_reference_loaders_name_the_sample_they_stop_at(tmp_path):
    """The reference systems skip nothing, as a plain loader would not, but their error says which
    sample of which shard stopped them (a FLAC among WAVs was a bare KeyError: 'wav')."""
    from mmproxy.apps.bench.workers import WdsSamples
    from mmproxy.testing import write_tar

    shard = str(tmp_path / "a.tar")
    write_tar(shard, [{"__key__": "k0", "wav": b"RIFF", "cls": b"1"},
                      {"__key__": "k1", "flac": b"fLaC", "cls": b"2"}])
    with pytest.raises(ValueError, match=rf"sample 'k1' of {re.escape(shard)} has no 'wav' field "
                                         r"\(it has flac, cls\)"):
        list(WdsSamples([shard], "wav", len))

    def decode(data):
        raise OSError("cannot identify image file")

    with pytest.raises(RuntimeError, match=rf"sample 'k0' of {re.escape(shard)}: OSError: cannot "
                                           "identify image file"):
        list(WdsSamples([shard], "wav", decode))


def test_training_the_demo_tokenizer_prints_nothing(tmp_path, capfd):
    """The tokenizers trainer's progress bar wrote three blank lines into a first demo's log."""
    from mmproxy.testing import make_tokenizer

    make_tokenizer(tmp_path / "tok")
    assert capfd.readouterr().out == ""


def test_the_bench_pytorch_reference_decodes_every_audio_format_make_shards_writes(tmp_path):
    """It decoded with ``wave``: FLAC and OGG failed as "file does not start with RIFF id", as if
    the data were damaged. Stereo is downmixed, every rate resampled to 16 kHz."""
    from mmproxy.datasets.recipes import AUDIO_EXTS

    from mmproxy.apps.bench.workers import WdsSamples, torch_audio

    shard = str(tmp_path / "a.tar")
    clips = [("wav", 8000, 1), ("flac", 22050, 2), ("ogg", 48000, 1), ("flac", 44100, 1)]
    write_tar(shard, [{"__key__": f"k{i}", ext: audio_bytes(synth_speech(i, 0.5, rate, channels),
                                                            rate, ext.upper()), "cls": 1}
                      for i, (ext, rate, channels) in enumerate(clips)])
    decoded = list(WdsSamples([shard], AUDIO_EXTS, torch_audio))
    assert [x.shape for x in decoded] == [(8000,)] * 4
    for i, (x, (_, rate, channels)) in enumerate(zip(decoded, clips)):
        reference = torch.from_numpy(synth_speech(i, 0.5, rate, channels).reshape(-1, channels)
                                     .mean(axis=1))
        resampled = torchaudio.functional.resample(reference, rate, 16000)
        assert torch.corrcoef(torch.stack([x, resampled]))[0, 1] > 0.9


# interrupts ----------------------------------------------------------------------------------


def _interrupted_demo(tmp_path, cache, wait_for, delays, args=()):
    """Runs the demo in a session of its own, waits for a line of its output, then sends SIGINT
    to its whole process group (as a terminal's Ctrl-C does) after each of ``delays``."""
    import selectors

    env = dict(os.environ, XDG_CACHE_HOME=str(cache), CUDA_VISIBLE_DEVICES="",
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "mmproxy.cli", "demo", "--quiet",
                             "--samples", "256", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out, deadline = b"", time.monotonic() + 120
    with selectors.DefaultSelector() as sel:  # unbuffered reads: select sees every byte
        sel.register(proc.stdout, selectors.EVENT_READ)
        while wait_for.encode() not in out and time.monotonic() < deadline:
            if sel.select(timeout=1):
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
    assert wait_for.encode() in out, out
    for delay in delays:
        time.sleep(delay)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
    try:
        rest, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    # a Ctrl-C in the last moments of the interpreter's exit, once its handlers are gone, ends
    # the process by the signal: a shell shows 130 for both
    return (130 if proc.returncode == -signal.SIGINT else proc.returncode,
            (out + rest).decode(), err.decode())


@pytest.mark.parametrize("delays", [[0.0], [0.4], [1.5], [0.5, 0.05], [1.0, 0.4]])
def test_an_interrupt_while_the_demo_writes_its_set_ends_it_in_one_line(tmp_path, delays):
    """Ctrl-C while the demo writes its synthetic set (once, twice): exit code 130, one line, no
    traceback, no half-written shard left; a later run reuses the whole shards and writes the
    rest. A Ctrl-C was swallowed by a soundfile callback (the demo ran on, rc 0) and left
    demo-0000.tar.part-PID files."""
    cache = tmp_path / "cache"
    code, out, err = _interrupted_demo(tmp_path, cache, "writing 256 synthetic samples", delays)
    assert code == 130, (out, err)
    assert err.strip().splitlines() == ["mmproxy demo: interrupted"], err
    folder = cache / "mmproxy" / "demo"
    assert not [p for p in folder.rglob("*") if ".part-" in p.name]
    for shard in folder.rglob("*.tar"):  # every shard there is whole
        with tarfile.open(shard) as tar:
            assert len(tar.getnames()) == 4 * 64  # 64 samples of 4 fields


@pytest.mark.parametrize("delays", [[0.0], [1.0], [0.3, 0.3]])
def test_an_interrupt_while_the_demo_streams_ends_it_in_one_line(tmp_path, delays):
    cache = tmp_path / "cache"
    assert run_cli(["demo", "--samples", "256", "--quiet", "--epochs", "1"],
                   tmp_path).returncode == 0  # the set and the tokenizer, made once
    code, out, err = _interrupted_demo(tmp_path, cache, "pipelines", delays, ["--epochs", "50"])
    assert code == 130, (out, err)
    assert err.strip().splitlines() == ["mmproxy demo: interrupted"], err
    assert "Traceback" not in out


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # cffi's print
def test_an_interrupt_that_library_code_swallows_still_ends_with_130(capsys, monkeypatch):
    """A Ctrl-C raised inside a callback from C (here libsndfile writing to a Python file
    object) is printed by cffi and lost: the command ran on and the CLI exited 0."""
    import mmproxy.datasets as datasets
    import soundfile as sf

    class Interrupting:  # a file whose first write receives the Ctrl-C
        def __init__(self):
            self.data, self.interrupted = bytearray(), False

        def write(self, data):
            if not self.interrupted:
                self.interrupted = True
                signal.raise_signal(signal.SIGINT)
            self.data += data
            return len(data)

        def seek(self, offset, whence=0):
            return len(self.data)

        def tell(self):
            return len(self.data)

    def make_shards(*args, **kwargs):
        sf.write(Interrupting(), np.zeros(800, np.float32), 8000, format="WAV")
        return WrittenShards("image-text", [])  # it ran on to the end

    monkeypatch.setattr(datasets, "make_shards", make_shards)
    assert cli.main(["make-shards", "a", "b"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "mmproxy make-shards: interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


_DROPPED_IN_A_FORK_HOOK = """
import os, signal, sys, time
from mmproxy import cli

def command(args):
    fired = []
    def hook():  # a fork's hook in the parent: Python prints and drops what it raises
        if not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGINT)
            sum(range(1000))  # the handler runs here, inside the hook
    os.register_at_fork(after_in_parent=hook)
    pid = os.fork()  # as a DataLoader worker's start does
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    for _ in range(500):  # a long command: it must not run on for 10 s
        time.sleep(0.02)
    print("ran on", flush=True)

import argparse
parser = argparse.ArgumentParser()
parser.set_defaults(func=command, command="trial", command_parser=parser, debug=False)
cli.build_parser = lambda: parser
started = time.monotonic()
code = cli.main([])
print("code", code, "after", round(time.monotonic() - started, 1), flush=True)
"""


@pytest.mark.timeout(60)
def test_an_interrupt_that_lands_in_a_fork_hook_is_raised_again_at_once(tmp_path):
    """A Ctrl-C handled while the main thread ran a fork's ``register_at_fork`` hook (a
    DataLoader starting its workers) was printed as "Exception ignored" and lost: a demo of many
    epochs ran on for minutes. It is raised again once the hook is over."""
    script = tmp_path / "dropped.py"
    script.write_text(_DROPPED_IN_A_FORK_HOOK)
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=50)
    assert "ran on" not in done.stdout, (done.stdout, done.stderr)
    code, after = done.stdout.split()[1], float(done.stdout.split()[3])
    assert code == "130" and after < 5, done.stdout
    assert done.stderr.strip().splitlines() == ["mmproxy trial: interrupted"], done.stderr


_SWALLOWED_FOR_GOOD = """
import signal, time
from mmproxy import cli

def command(args):
    for i in range(100):  # library code that swallows it for good, and runs on
        try:
            if i == 0:
                signal.raise_signal(signal.SIGINT)
            sum(range(1000))
            time.sleep(0.1)
        except KeyboardInterrupt:
            pass
    print("ran on", flush=True)

import argparse
parser = argparse.ArgumentParser()
parser.set_defaults(func=command, command="trial", command_parser=parser, debug=False)
cli.build_parser = lambda: parser
cli.GRACE = 1.0
raise SystemExit(cli.main())
"""


@pytest.mark.timeout(60)
def test_a_command_that_runs_on_after_an_interrupt_is_stopped(tmp_path):
    """An interrupt that something swallowed without a trace (a bare ``except`` in library
    code) would leave a long command running: :data:`mmproxy.cli.GRACE` seconds after it, the
    process ends, saying so, with 130."""
    script = tmp_path / "swallowed.py"
    script.write_text(_SWALLOWED_FOR_GOOD)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 130 and "ran on" not in done.stdout, (done.stdout, done.stderr)
    assert time.monotonic() - started < 8
    assert done.stderr.strip().splitlines()[-1] == (
        "mmproxy trial: interrupted (the command went on for 1 s after the interrupt; stopped)")


def test_a_second_interrupt_while_the_program_exits_prints_no_traceback(tmp_path):
    """The first Ctrl-C ends the command; a second one while the interpreter exits (its atexit
    work: stopping workers, joining threads) printed a long traceback."""
    script = tmp_path / "prog.py"
    script.write_text(
        "import atexit, sys, time\n"
        "import mmproxy.datasets as datasets\n"
        "from mmproxy import cli\n"
        "atexit.register(time.sleep, 20)  # slow work at exit\n"
        "def make_shards(*args, **kwargs):\n"
        "    raise KeyboardInterrupt  # the first Ctrl-C\n"
        "datasets.make_shards = make_shards\n"
        "sys.argv = ['mmproxy', 'make-shards', 'a', 'b']\n"
        "sys.exit(cli.main())\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr.readline() == "mmproxy make-shards: interrupted\n"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        assert proc.wait(timeout=10) == 130
    finally:
        proc.kill()
    assert err == ""


# CLI texts -----------------------------------------------------------------------------------


def test_the_kind_suggested_fits_the_tree_and_is_worded_for_the_cli(tmp_path, capsys):
    """Videos in class folders (no captions): --kind video-label fits, not video-text; the CLI
    says --kind and --overwrite, the function kind= and overwrite=True."""
    from mmproxy.datasets.writer import NoMediaError

    src = tmp_path / "src"
    for label in ("cats", "dogs"):
        (src / label).mkdir(parents=True)
        (src / label / "0.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    with pytest.raises(NoMediaError, match=r"no image files to write .*; it holds video files: "
                       r"use kind='video-label'$"):
        make_shards(src, tmp_path / "out")
    assert cli.main(["make-shards", str(src), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.splitlines()[0].endswith(
        "; it holds video files: use --kind video-label")
    (src / "cats" / "0.txt").write_text("a cat")  # captions: the text kind
    assert cli.main(["make-shards", str(src), str(tmp_path / "out"), "--kind", "audio-label"]) == 1
    assert capsys.readouterr().err.splitlines()[0].endswith("use --kind video-text")


@pytest.mark.parametrize("args, message", [
    (["demo", "--epochs", "0"], "argument --epochs: must be at least 1, got 0"),
    (["demo", "--samples", "0"], "argument --samples: must be at least 1, got 0"),
    (["demo", "--workers", "-1"], "argument --workers: must be at least 0, got -1"),
    (["demo", "--max-skipped", "1.5"], "argument --max-skipped: must be from 0 to 1, got 1.5"),
    (["bench", "--runs", "two"], "argument --runs: expected a whole number, got 'two'"),
    (["make-shards", "a", "b", "--max-count", "0"], "argument --max-count: must be at least 1, "
     "got 0"),
    (["make-shards", "a", "b", "--max-size", "0"], "argument --max-size: must be more than 0, "
     "got 0"),
])
def test_values_out_of_range_are_refused_by_the_parser(args, message, capsys):
    """``--epochs 0`` ran nothing and passed; ``--samples 0`` named missing shards of a --data
    never given; make-shards said "max_count and max_size must be positive"."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"mmproxy {args[0]}: error: {message}"


def test_version_and_an_option_whose_package_is_missing(tmp_path, capsys, monkeypatch):
    """``--plot`` without matplotlib ran the whole bench, then a ModuleNotFoundError traceback."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"mmproxy {mmproxy.__version__}\n"

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    ran = []
    monkeypatch.setattr("mmproxy.apps.bench.run", lambda args: ran.append(args) or 0)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--plot", str(tmp_path / "p.png")])
    assert exit_info.value.code == 2 and not ran
    assert capsys.readouterr().err.splitlines()[-1] == (
        "mmproxy bench: error: --plot needs matplotlib, which is not installed: pip install "
        "matplotlib (mmproxy's [plot] extra)")


def test_the_demo_says_it_writes_its_set_only_when_it_does_and_shows_a_bar_with_a_total(tmp_path):
    """"writing 256 synthetic samples ... (once)" was printed on every run; the progress bar
    had no total and no epoch. Under a terminal it shows "epoch 1/2" and "64/64"."""
    import fcntl
    import pty
    import struct
    import termios

    args = ["demo", "--samples", "64", "--batch-size", "16", "--device", "cpu"]
    first = run_cli([*args, "--quiet"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "mmproxy demo: writing 64 synthetic samples" in first.stdout
    primary, secondary = pty.openpty()  # stderr a terminal: the bar is shown
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # its width
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([sys.executable, "-m", "mmproxy.cli", *args, "--epochs", "2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=secondary, text=True)
    os.close(secondary)
    bar = b""
    with contextlib.suppress(OSError):  # EIO once the child has closed its end
        while chunk := os.read(primary, 4096):
            bar += chunk
    os.close(primary)
    out = proc.communicate(timeout=200)[0]
    assert proc.returncode == 0, bar.decode(errors="replace")[-2000:]
    assert "writing" not in out  # the set is there: nothing is written
    text = bar.decode(errors="replace")
    assert re.search(r"epoch 1/2: 100%.*64/64", text) and re.search(r"epoch 2/2: 100%.*64/64",
                                                                      text), text[-2000:]


def test_a_cache_that_cannot_be_written_is_named_with_xdg_cache_home(tmp_path):
    """A read-only cache gave "[Errno 30] Read-only file system: ..." and nothing more."""
    (tmp_path / "file").write_text("not a folder")
    proc = subprocess.run([sys.executable, "-m", "mmproxy.cli", "demo", "--quiet"], cwd=ROOT,
                          env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "file" / "cache")),
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 1
    assert re.match(rf"mmproxy demo: error: cannot write to mmproxy's cache folder "
                    rf"{re.escape(str(tmp_path / 'file' / 'cache' / 'mmproxy'))}: .*Not a directory; "
                    r"that folder is \$XDG_CACHE_HOME/mmproxy \(XDG_CACHE_HOME=.*\): set "
                    "XDG_CACHE_HOME to a writable folder$", proc.stderr.splitlines()[0]), proc.stderr


def test_demo_captions_lose_a_byte_order_mark():
    from mmproxy.apps.demo import _text

    assert _text("\ufeffa caption \n".encode()) == "a caption"


# bench workloads -----------------------------------------------------------------------------


def _bench(tmp_path, *args):
    out = tmp_path / "bench.json"
    proc = run_cli(["bench", "--epochs", "2", "--workers", "1", "--device", "cpu", "--json",
                    str(out), "--data-dir", str(tmp_path / "data"), *args], tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())["results"]


def test_the_bench_has_a_video_workload(tmp_path):
    """mmproxy's video pipeline (PyAV in the workers on CPU) beside PyTorch workers decoding with
    PyAV; DALI's reader says why it does not run on CPU."""
    proc, results = _bench(tmp_path, "--workload", "video", "--samples", "128", "--batch-size",
                           "4", "--systems", "mmproxy,torch,dali-reader")
    systems = results["video"]["systems"]
    for name in ("mmproxy", "torch"):
        assert systems[name]["samples"] == 8 and systems[name]["samples_per_s"] > 0, systems[name]
    assert systems["dali-reader"]["error"].startswith("not run: DALI decodes H.264 on a GPU only")
    assert re.search(r"^\[video\] mmproxy +[\d.]+ samples/s \(best epoch; epochs ", proc.stdout,
                     re.M), proc.stdout


def test_the_bench_on_your_video_and_flac_shards(tmp_path):
    """``--data`` of videos said "name one with --field", then refused ``--field mp4``; the
    PyTorch reference failed on FLAC and OGG shards as if they were damaged."""
    from mmproxy.testing import synth_video, video_bytes

    clips = tmp_path / "clips" / "waves"
    clips.mkdir(parents=True)
    for i in range(4):
        (clips / f"{i}.mp4").write_bytes(video_bytes(synth_video(i, 40, 64, 96)))
    make_shards(tmp_path / "clips", tmp_path / "videos", kind="video-label", max_count=2)
    for field in ([], ["--field", "mp4"]):
        proc, results = _bench(tmp_path, "--data", str(tmp_path / "videos"), "--batch-size", "2",
                               "--systems", "mmproxy,torch", *field)
        video = results["video"]
        assert video["field"] == ("mp4" if field else "mp4;mov;webm;mkv;avi")
        assert {name: s["samples"] for name, s in video["systems"].items()} == {"mmproxy": 4,
                                                                               "torch": 4}
    speech = tmp_path / "speech"
    for label, fmt in (("yes", "FLAC"), ("no", "OGG")):
        (speech / label).mkdir(parents=True)
        for i in range(3):
            (speech / label / f"{i}.{fmt.lower()}").write_bytes(
                audio_bytes(synth_speech(i, 0.5, 22050), 22050, fmt))
    make_shards(speech, tmp_path / "audio", kind="audio-label")
    _, results = _bench(tmp_path, "--data", str(tmp_path / "audio"), "--batch-size", "2",
                        "--systems", "mmproxy,torch")
    assert {name: s.get("samples") for name, s in results["audio"]["systems"].items()} == {
        "mmproxy": 6, "torch": 6}
    # a --workload that is not what the shards hold is refused, not silently replaced
    proc = run_cli(["bench", "--data", str(tmp_path / "audio"), "--workload", "image", "--device",
                    "cpu"], tmp_path)
    assert proc.returncode == 1 and re.search(
        r"--workload image does not apply to --data: the bench loads one heavy field of your "
        r"shards, here '[a-z;]+' \(the audio workload\)", proc.stderr), proc.stderr


# decoder noise -------------------------------------------------------------------------------


def test_decoder_warnings_are_counted_and_every_other_line_goes_through(capfd):
    from mmproxy.apps.noise import DecoderWarnings

    with DecoderWarnings() as noise:
        os.write(2, b"Corrupt JPEG data: 2 extraneous bytes before marker 0xd9\n")
        print("a line of Python's own", file=sys.stderr)
        subprocess.run([sys.executable, "-c", "import os; os.write(2, b'Premature end of JPEG "
                        "file\\nSegmentation fault in a child\\n')"], check=True)
        os.write(2, b"Corrupt JPEG data: 2 extraneous bytes before marker 0xd9\n")
    err = capfd.readouterr().err
    assert err.splitlines() == ["a line of Python's own", "Segmentation fault in a child"]
    assert noise.counts == {"Corrupt JPEG data: N extraneous bytes before marker 0xN": 2,
                            "Premature end of JPEG file": 1}
    assert noise.summary() == [
        "decoder warnings kept off stderr (the files decoded): 3",
        "  2 x Corrupt JPEG data: N extraneous bytes before marker 0xN",
        "  1 x Premature end of JPEG file"]


def test_tiff_decoders_warnings_and_refusals_are_counted_apart(capfd):
    """libtiff's warnings, and DALI's decoders refusing a TIFF before the next one read it (in
    colour), printed hundreds of lines for a folder of real TIFFs."""
    from mmproxy.apps.noise import DecoderWarnings

    with DecoderWarnings() as noise:
        for _ in range(2):
            os.write(2, b'TIFFFetchNormalTag: Warning, IO error during reading of "Tag 42112"; '
                        b'tag ignored.\n')
            os.write(2, b"\x1b[0;31m[ERROR] \x1b[0m[libtiff_decoder] Planar TIFFs are not "
                        b"supported\n")
        os.write(2, b"TIFFFillStrip: Seek error at scanline 4294967295, strip 0.\n")
        os.write(2, b"[ERROR:0@4.648] global loadsave.cpp:1409 imdecode_ imdecode_(''): can't "
                    b"read data\n")
        os.write(2, b"[ WARN:3@4.764] global grfmt_tiff.cpp:122 TIFF_Warning TIFFReadDirectory: "
                    b"Unknown field with tag 42112\n")
        os.write(2, "\n".join(_NOT_NOISE).encode() + b"\n")
    assert capfd.readouterr().err.splitlines() == _NOT_NOISE
    assert noise.summary() == [
        "decoder warnings kept off stderr (the files decoded): 3",
        '  2 x TIFFFetchNormalTag: Warning, IO error during reading of "Tag N"; tag ignored.',
        "  1 x [ WARN:N@N.N] global grfmt_tiff.cpp:N TIFF_Warning TIFFReadDirectory: Unknown field "
        "with tag N",
        "decoder errors kept off stderr (a decoder refused a file and the next was tried; a file "
        "none reads fails its sample, by name): 4",
        "  2 x [ERROR] [libtiff_decoder] Planar TIFFs are not supported",
        "  1 x TIFFFillStrip: Seek error at scanline N, strip N.",
        "  1 x [ERROR:N@N.N] global loadsave.cpp:N imdecode_ imdecode_(''): can't read data"]


# lines like the decoders' that are not theirs: a user's log, exceptions, OpenCV reading a path,
# a GPU decoder failing (not a file refused)
_NOT_NOISE = [
    "train: Warning, loss is NaN at step 120",
    "RuntimeError: Warning, the pipeline was rebuilt",
    "TIFF: wrote 120 pages",
    "TIFFDecodeError: sample 000123 of shard-0003.tar",
    "[ WARN:0@0.5] global loadsave.cpp:248 findDecoder imread_('missing.jpg'): can't open/read file",
    "[ERROR] [nvjpeg_cuda_decoder] Could not allocate device memory",
    "[ERROR] something else"]


def test_decoder_warnings_past_a_pipe_buffer_are_counted_by_kind(capfd):
    """Counts of 3,000 distinct lines filled the result pipe: the filter blocked, no counts."""
    from mmproxy.apps.noise import DecoderWarnings

    start = time.monotonic()
    with DecoderWarnings() as noise:
        for i in range(3000):
            os.write(2, f"Corrupt JPEG data: {i} extraneous bytes before marker 0x{i:x}\n".encode())
        for i in range(150):  # kinds without numbers: a hundred apart, the others together
            name = "".join(chr(ord("a") + int(d)) for d in f"{i:03d}")
            os.write(2, f"libpng warning: {name}: unknown chunk\n".encode())
    assert time.monotonic() - start < 5
    assert capfd.readouterr().err == ""
    assert sum(noise.counts.values()) == 3150 and len(noise.counts) == 101
    assert noise.counts["Corrupt JPEG data: N extraneous bytes before marker 0xN"] == 3000
    assert noise.counts["other decoder warnings"] == 51


def test_the_decoder_warnings_filter_ends_quietly_when_no_one_reads_its_counts():
    read_end, write_end = os.pipe()
    os.close(read_end)  # the command stopped waiting
    proc = subprocess.run(
        [sys.executable, "-c", f"from mmproxy.apps.noise import _filter; _filter({write_end})"],
        input=b"Premature end of JPEG file\n", capture_output=True, pass_fds=(write_end,),
        cwd=ROOT, timeout=60)
    os.close(write_end)
    assert (proc.returncode, proc.stderr) == (0, b"")


def test_the_demo_summarises_decoder_noise_instead_of_printing_it(tmp_path):
    """"Corrupt JPEG data: ..." lines from DALI's decoder threads filled stderr."""
    jpeg = image_bytes(synth_image(3, 96, 128))
    scan = jpeg.index(b"\xff\xda")
    scan += 2 + int.from_bytes(jpeg[scan + 2:scan + 4], "big")
    # a marker at the start of the image data: it decodes, with a warning from libjpeg, however
    # little of it the random-crop decoder reads (a fault at the end is not always reached)
    noisy = jpeg[:scan] + b"\xff\xff\xff\xfe" + jpeg[scan + 4:]
    write_tar(tmp_path / "a.tar", [{"__key__": f"k{i}", "jpg": noisy, "cls": 1}
                                   for i in range(48)])
    proc = run_cli(["demo", "--data", str(tmp_path / "a.tar"), "--batch-size", "8",
                    "--workers", "1", "--device", "cpu", "--quiet"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Corrupt JPEG" not in proc.stderr, proc.stderr
    found = re.search(r"^  decoder warnings kept off stderr \(the files decoded\): (\d+)\n"
                      r"    (\d+) x Corrupt JPEG data: premature end of data segment$",
                      proc.stdout, re.M)
    assert found and found[1] == found[2], proc.stdout
    debug = run_cli(["demo", "--data", str(tmp_path / "a.tar"), "--batch-size", "8",
                     "--workers", "1", "--device", "cpu", "--quiet", "--debug"], tmp_path)
    assert "Corrupt JPEG data: " in debug.stderr  # --debug: every line, as it comes
    assert "decoder warnings" not in debug.stdout


@pytest.mark.timeout(300)
def test_the_bench_runs_its_systems_without_workers(tmp_path):
    """`mmproxy bench --workers 0` (the main process loads) runs mmproxy and PyTorch's loader;
    DALI's proxy, which needs workers, is reported by its own reason."""
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--device", "cpu", "--workers", "0", "--samples", "32", "--epochs", "2",
                     "--data-dir", str(tmp_path / "data"), "--systems", "mmproxy,torch,dali-proxy",
                     "--json", str(out)]) == 0
    systems = json.loads(out.read_text())["results"]["image"]["systems"]
    assert systems["mmproxy"]["samples"] == systems["torch"]["samples"] == 32
    assert "num_workers" in systems["dali-proxy"]["error"]


@pytest.mark.timeout(60)
def test_bench_stacks_finds_each_thread_group_where_it_spends_its_time():
    """--stacks: threads named ``spin_0``, ``spin_1`` busy in one function are one group whose
    most frequent frame is that function; without a GPU there is no NVML entry."""
    import threading
    import time

    from mmproxy.apps.bench.stacks import ThreadStacks

    done = threading.Event()

    def spin_here() -> None:
        while not done.is_set():
            sum(range(1000))

    threads = [threading.Thread(target=spin_here, name=f"spin_{i}") for i in range(2)]
    with ThreadStacks(gpu=False) as stacks:
        for t in threads:
            t.start()
        time.sleep(0.5)
        done.set()
        for t in threads:
            t.join()
    report = stacks.report()
    assert "nvml" not in report and "bench-stacks" not in report
    top = report["spin"]["top"]
    assert report["spin"]["samples"] >= 10 and top[0][0].endswith("spin_here"), top
    # on a machine without NVML (or a GPU), a GPU run still reports its frames, and says why not
    with ThreadStacks(gpu=True) as stacks:
        time.sleep(0.05)
    nvml = stacks.report()["nvml"]
    if not nvml["samples"]:
        assert nvml["status"].startswith(("not run:", "no readings")), nvml


@pytest.mark.timeout(60)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: map_batch runs inline")
def test_bench_cpu_counts_the_pipelines_threads_that_ended_between_snapshots():
    """A pipeline function's pool lives for one call (pipelines/audio.py, map_batch): its CPU still
    counts as the pipeline's (dali-threads), not lost; a thread of the bench's own ("bench-")
    counts in no group, and a named thread that ended before the snapshots nowhere."""
    import threading
    import time

    from mmproxy.pipelines.audio import map_batch

    from mmproxy.apps.bench.cpu import cpu_ms_per_batch, cpu_seconds

    def burn(_: int = 0) -> int:
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
        return 0

    gone = threading.Thread(target=burn, name="server-like")
    gone.start()
    gone.join()
    burnt, done = threading.Event(), threading.Event()

    def burn_and_stay() -> None:
        burn()
        burnt.set()
        done.wait(30)

    before = cpu_seconds()
    map_batch(burn, list(range(4)))  # 4 x 100 ms of CPU on threads that end with the call
    ours = threading.Thread(target=burn_and_stay, name="bench-test")  # alive at the snapshot
    ours.start()
    assert burnt.wait(30)
    after = cpu_seconds()
    done.set()
    ours.join()
    per_batch = cpu_ms_per_batch(before, after, 1)
    # the pools' own count is exact; the group also holds whatever other native threads of this
    # process (an earlier test's) ran meanwhile, so only its lower bound is exact
    pools = 1000 * (after["dali-threads", 0] - before["dali-threads", 0])
    assert 390 <= pools < 470 and per_batch["dali-threads"] >= 390, (pools, per_batch)
    assert per_batch["server-threads"] < 50 and per_batch["main-thread"] < 50, per_batch


def _wide_wav(bits: int) -> bytes:
    """A sound WAV header of ``bits``-bit integer samples (mono, 8 kHz) and a few frames."""
    import struct

    width = bits // 8
    data = bytes(width * 16)
    fmt = struct.pack("<HHIIHH", 1, 1, 8000, 8000 * width, width, bits)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


def test_every_file_left_out_is_listed_and_a_class_left_without_samples_is_named(tmp_path):
    """Of 7 files left out the summary named 3 ("... and 4 more", nowhere else), 40-bit WAVs
    DALI does not read were called damaged, and a class folder holding only those kept its
    label in classes.json without a word."""
    src = tmp_path / "src"
    for folder in ("speech", "wide"):
        (src / folder).mkdir(parents=True)
    (src / "speech" / "ok.wav").write_bytes(audio_bytes(synth_speech(1, 0.2), 16000))
    for i in range(6):
        (src / "wide" / f"w{i}.wav").write_bytes(_wide_wav(40))
    (src / "speech" / "cut.wav").write_bytes(audio_bytes(synth_speech(2, 0.2), 16000)[:30])
    written = make_shards(src, tmp_path / "out", kind="audio-label")
    assert written.samples == 1 and written.empty_classes == [("wide", 1)]
    assert json.loads((tmp_path / "out" / "classes.json").read_text()) == ["speech", "wide"]
    reasons = {item.path: item.reason for item in written.files_left_out}
    assert reasons.pop("speech/cut.wav") is Reason.DAMAGED
    assert set(reasons.values()) == {Reason.UNREAD} and len(reasons) == 6
    lines = written.summary().splitlines()
    assert "    6 x has 40-bit integer samples (DALI's decoder reads at most 32)" in lines
    assert ("  classes with no sample (all their files left out; no sample has their label): "
            "wide (1)") in lines
    listed = (tmp_path / "out" / "left_out.jsonl").read_text().splitlines()
    assert sorted(json.loads(row)["source"] for row in listed) == sorted(
        ["speech/cut.wav", *(f"wide/w{i}.wav" for i in range(6))])
    clean = tmp_path / "clean" / "speech"
    clean.mkdir(parents=True)
    (clean / "ok.wav").write_bytes((src / "speech" / "ok.wav").read_bytes())
    again = make_shards(clean.parent, tmp_path / "out", kind="audio-label", overwrite=True)
    assert again.samples == 1 and not again.left_out_file  # the old list went with its set
    assert not (tmp_path / "out" / "left_out.jsonl").exists()


def _caption(data):
    """A field function that fails on one sample's caption."""
    text = bytes(data).decode()
    if text == "broken":
        raise ValueError("this caption is not allowed")
    return text


def test_a_skip_summary_names_the_file_make_shards_made_the_sample_from(tmp_path, image_server):
    # A user sees "shard-000000.tar, sample '00000001'" and asks which of their files that is:
    # make-shards' manifest beside the shards says, and the summary names it
    src = tmp_path / "src" / "holiday"
    src.mkdir(parents=True)
    for name, caption in (("beach", "sand"), ("hotel", "broken"), ("pool", "water")):
        (src / f"{name}.jpg").write_bytes(solid(90, "JPEG"))
        (src / f"{name}.txt").write_text(caption)
    written = make_shards(tmp_path / "src", tmp_path / "out")
    ds = mmproxy.datasets.MultiModalDataset(
        written.pattern, {"image": ("jpg", image_server.proxy), "caption": ("txt", _caption)},
        batch_size=3, on_error="skip", max_skipped=0.5)
    loader = ds.loader(image_server, num_workers=0)
    assert [len(b["caption"]) for b in loader] == [2]
    summary = loader.skipped.summary()
    assert f"{written[0]}, sample '00000001' (file holiday/hotel.jpg): field function failed" in summary

    for foreign in ('not json, "key": "00000001"\n',  # manifests that are not make-shards' own
                    '{"key": "00000001", "shard": ["a"], "source": 3}\n',
                    '{"key": "00000001", "shard": "shard-000000.tar"}\n'):
        Path(written.manifest).write_text(foreign)
        loader = ds.loader(image_server, num_workers=0)
        list(loader)
        assert f"{written[0]}, sample '00000001': field function failed" in loader.skipped.summary()
