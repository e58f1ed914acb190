"""make-shards: the output folder and its overwrite, what each sample holds, the files left out
and why, and every format read back by the recipes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from cli_helpers import HINT, image_folder, solid
from conftest import cpu_image_server
from mmproxy.datasets import image_text_dataset, make_shards
from mmproxy.datasets.writer import OutputExistsError, Reason

import mmproxy
from mmproxy import cli
from mmproxy.testing import (
    audio_bytes,
    image_bytes,
    make_tokenizer,
    synth_image,
    synth_speech,
)

pytestmark = pytest.mark.timeout(240)


def members(shard):
    """{key: {ext: bytes}} of a shard, read with tarfile."""
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(shard) as tar:
        for m in tar:
            key, ext = m.name.split(".", 1)
            out.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return out


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
    import mmproxy.datasets.writer._folder as source_files

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
    (src / "dog_house" / "empty.txt").write_text("  \n")  # an empty caption: written empty
    written = make_shards(src, tmp_path / "out")
    assert written.samples == 6
    assert (written.captions_from_txt, written.captions_from_folder) == (3, 3)
    reasons = dict(written.left_out)
    assert set(reasons) == {"loose.png", "cat/anim.gif", "notes.txt", "dog_house/broken.jpg"}
    assert "no caption" in reasons["loose.png"]
    assert reasons["cat/anim.gif"] == "not an image file this writer reads (.gif)"
    assert "no image" in reasons["notes.txt"]
    assert reasons["dog_house/broken.jpg"] == ("holds none of the image formats this writer reads "
                                               "(it starts with b'not a jp')")
    summary = written.summary()
    assert "3 guessed from the class folder's name" in summary and "left out: 4 files" in summary
    assert "1 x not a format this writer reads (.gif 1; it reads .bmp .jpeg .jpg .png" in summary
    sources = {json.loads(r)["source"] for r in Path(written.manifest).read_text().splitlines()}
    assert sources == {"captioned.jpg", "cat/0.png", "cat/1.png", "dog_house/0.png",
                       "dog_house/1.png", "dog_house/empty.png"}
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
    with pytest.raises(FileNotFoundError, match="missing does not exist"):
        make_shards(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(NotADirectoryError, match="a.gif is a file, not a folder"):
        make_shards(tmp_path / "src" / "a.gif", tmp_path / "out")


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


def test_every_format_written_is_one_the_recipes_read_by_default():
    from mmproxy.datasets import recipes, writer

    for suffixes, exts in ((writer.IMAGE_SUFFIXES, recipes.IMAGE_EXTS),
                           (writer.AUDIO_SUFFIXES, recipes.AUDIO_EXTS)):
        read = set(exts.split(";"))
        assert set(suffixes.values()) <= read  # every extension written
        assert {s.lstrip(".") for s in suffixes} == read  # every suffix taken, and no other


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
