"""make-shards' source folders as other tools write them: symbolic links (to folders, to files, to
nothing, back to a folder that holds them), special files, and suffixes in any case, against
torchvision's ImageFolder on the same tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from mmproxy.datasets import make_shards
from mmproxy.datasets.writer import NoMediaError, Reason
from torchvision.datasets import ImageFolder

from mmproxy import cli
from mmproxy.testing import image_bytes, image_folder, synth_image

ROOT = Path(__file__).resolve().parents[2]


def jpeg(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(image_bytes(synth_image(seed, 24, 32)))


def written(out: Path) -> dict[str, dict[str, str]]:
    """{source file: {field: text}} of every sample in the shards of ``out``, the image left out."""
    fields: dict[str, dict[str, str]] = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            by_key: dict[str, dict[str, str]] = {}
            for member in tar:
                key, ext = member.name.split(".", 1)
                data = tar.extractfile(member).read()
                if ext in ("src", "txt", "cls"):
                    by_key.setdefault(key, {})[ext] = data.decode()
        fields.update({sample.pop("src"): sample for sample in by_key.values()})
    return fields


def left_out_rows(out: Path) -> dict[str, tuple[str, str]]:
    """{source: (reason, why)} of ``left_out.jsonl``."""
    rows = [json.loads(line) for line in (out / "left_out.jsonl").read_text().splitlines()]
    return {row["source"]: (row["reason"], row["why"]) for row in rows}


def imagefolder_tree(tmp_path: Path) -> Path:
    """An ImageFolder tree whose classes and files are partly symbolic links: ``circles/``,
    ``diamonds -> ../elsewhere`` (a class folder that is a link), ``stripes/``; in them a
    link to a file outside, a link to a folder outside, an upper-case ``.JPEG`` and a link to
    nothing."""
    src = Path(image_folder(tmp_path / "src", per_class=2))
    for i in range(3):
        jpeg(tmp_path / "elsewhere" / f"d{i}.jpg", 10 + i)
    jpeg(tmp_path / "loose" / "one.jpg", 20)
    jpeg(tmp_path / "extra" / "deep" / "e0.jpg", 21)
    (src / "diamonds").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (src / "stripes" / "linked.jpg").symlink_to(Path("..", "..", "loose", "one.jpg"))
    (src / "circles" / "more").symlink_to(tmp_path / "extra", target_is_directory=True)
    jpeg(src / "circles" / "UPPER.JPEG", 22)
    (src / "stripes" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    return src


@pytest.mark.parametrize("via", ["make_shards", "cli"])
def test_classes_and_labels_are_imagefolders_with_linked_folders_and_files(tmp_path, via, capsys):
    """A class folder that is a symbolic link is a class with ImageFolder's label (cow 2, not 1);
    files through links are read and links to nothing are reported."""
    src, out = imagefolder_tree(tmp_path), tmp_path / "out"
    if via == "cli":
        assert cli.main(["make-shards", str(src), str(out)]) == 0
        summary = capsys.readouterr().out
    else:
        summary = make_shards(src, out).summary()
    reference = ImageFolder(str(src))
    assert json.loads((out / "classes.json").read_text()) == reference.classes == [
        "circles", "diamonds", "stripes"]
    # every sample ImageFolder can open, with its label; the link to nothing it lists is left out
    expected = {os.path.relpath(path, src): label for path, label in reference.samples
                if os.path.isfile(path)}
    assert "stripes/gone.jpg" not in expected
    assert "diamonds/d2.jpg" in expected and "circles/more/deep/e0.jpg" in expected
    assert {source: int(sample["cls"]) for source, sample in written(out).items()} == expected
    assert left_out_rows(out) == {"stripes/gone.jpg": (
        "dangling_link", f"a symbolic link to {tmp_path / 'nowhere.jpg'}, which does not exist")}
    assert "stripes/gone.jpg" in summary and "which does not exist" in summary


def test_links_to_nothing_loops_and_special_files_are_left_out_by_reason(tmp_path):
    """Read with the command: a link back to a folder that holds it is reported and not entered
    (ImageFolder's walk repeats the tree until the system refuses the path); a link to nothing,
    a link to itself and a FIFO are reported, none silently dropped."""
    src, out = tmp_path / "src", tmp_path / "out"
    jpeg(src / "ant" / "0.jpg", 1)
    jpeg(src / "cow" / "deeper" / "1.jpg", 2)
    (src / "ant" / "gone.jpg").symlink_to("missing.jpg")
    (src / "ant" / "self.jpg").symlink_to("self.jpg")
    (src / "cow" / "again").symlink_to("..", target_is_directory=True)
    (src / "cow" / "deeper" / "back").symlink_to("..", target_is_directory=True)
    os.mkfifo(src / "cow" / "pipe.jpg")  # read, it would block
    (src / "bee").symlink_to("cow", target_is_directory=True)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-m", "mmproxy.cli", "make-shards", str(src), str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr
    assert json.loads((out / "classes.json").read_text()) == ["ant", "bee", "cow"]
    assert {source: sample["cls"] for source, sample in written(out).items()} == {
        "ant/0.jpg": "0", "bee/deeper/1.jpg": "1", "cow/deeper/1.jpg": "2"}
    rows = left_out_rows(out)
    assert rows == {
        "ant/gone.jpg": ("dangling_link", "a symbolic link to missing.jpg, which does not exist"),
        "ant/self.jpg": ("dangling_link", "a symbolic link to self.jpg, which cannot be followed "
                         "(Too many levels of symbolic links)"),
        "bee/again": ("link_loop", "leads back to the source folder, which holds it: not "
                      "entered (a loop)"),
        "bee/deeper/back": ("link_loop", "leads back to the folder bee, which holds it: not "
                            "entered (a loop)"),
        "bee/pipe.jpg": ("not_a_file", Reason.NOT_A_FILE.value),
        "cow/again": ("link_loop", "leads back to the source folder, which holds it: not "
                      "entered (a loop)"),
        "cow/deeper/back": ("link_loop", "leads back to the folder cow, which holds it: not "
                            "entered (a loop)"),
        "cow/pipe.jpg": ("not_a_file", Reason.NOT_A_FILE.value)}
    lines = run.stdout.splitlines()
    assert "  left out: 8 files, by reason:" in lines
    assert f"    4 x {Reason.LINK_LOOP.value}" in lines and "      cow/deeper/back: leads back to " \
        "the folder cow, which holds it: not entered (a loop)" in lines
    assert f"    2 x {Reason.DANGLING_LINK.value}" in lines
    assert f"    2 x {Reason.NOT_A_FILE.value}" in lines


@pytest.mark.parametrize("caption", ["upper.TXT", "upper.Txt"])
@pytest.mark.parametrize("folder", ["", "ant/"], ids=["flat", "class-folder"])
def test_a_caption_is_paired_whatever_the_case_of_its_suffix(tmp_path, caption, folder):
    """``upper.JPEG`` + ``upper.TXT`` is a captioned sample (not "no caption", nor, in a class
    folder, captioned with the folder's name)."""
    src, out = tmp_path / "src", tmp_path / "out"
    jpeg(src / folder / "upper.JPEG", 3)
    (src / folder / caption).write_text("an upper-case caption")
    jpeg(src / "lower.Png.jpg", 4)
    (src / "lower.Png.txt").write_text("a caption of its own")
    (src / "NOTES.TXT").write_text("no image beside me")
    result = make_shards(src, out)
    assert written(out)[f"{folder}upper.JPEG"]["txt"] == "an upper-case caption"
    assert written(out)["lower.Png.jpg"]["txt"] == "a caption of its own"
    assert result.captions_from_txt == 2 and result.captions_from_folder == 0
    assert result.left_out == [("NOTES.TXT", "a caption with no image beside it")]
    rows = [json.loads(line) for line in Path(result.manifest).read_text().splitlines()]
    assert {row["source"]: row["caption_from"] for row in rows} == {
        f"{folder}upper.JPEG": "txt", "lower.Png.jpg": "txt"}


def test_captions_that_differ_only_in_case_leave_their_image_out_naming_both(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    jpeg(src / "a.jpg", 5)
    (src / "a.txt").write_text("one caption")
    (src / "a.TXT").write_text("another caption")
    jpeg(src / "b.jpg", 6)
    (src / "b.txt").write_text("b's caption")
    result = make_shards(src, out)
    assert set(written(out)) == {"b.jpg"}
    assert [tuple(item) for item in result.files_left_out] == [
        ("a.jpg", "it has 2 captions beside it (a.TXT, a.txt): keep one", Reason.CAPTION)]


def test_img2dataset_folders_linked_with_upper_case_and_dangling_captions(tmp_path):
    """img2dataset's layout (``00000/000000001.jpg`` + ``.txt`` + ``.json``), one shard folder
    a link whose caption is a ``.TXT``: a caption that is a link to nothing leaves its image out
    instead of captioning it with the folder's name."""
    src, out = tmp_path / "src", tmp_path / "out"
    for folder, key in (("00000", "000000000"), ("00000", "000000001"), ("moved", "000010000")):
        where = (src / folder) if folder != "moved" else tmp_path / folder
        jpeg(where / f"{key}.jpg", int(key))
        (where / f"{key}.json").write_text(json.dumps({"key": key}))
    (src / "00000" / "000000000.txt").write_text("the first caption")
    (src / "00000" / "000000001.txt").symlink_to(tmp_path / "captions" / "000000001.txt")
    (tmp_path / "moved" / "000010000.TXT").write_text("a moved caption")
    (src / "00001").symlink_to(tmp_path / "moved", target_is_directory=True)
    result = make_shards(src, out)
    assert written(out) == {"00000/000000000.jpg": {"txt": "the first caption", "cls": "0"},
                            "00001/000010000.jpg": {"txt": "a moved caption", "cls": "1"}}
    assert json.loads((out / "classes.json").read_text()) == ["00000", "00001"]
    missing = tmp_path / "captions" / "000000001.txt"
    assert {path: reason for path, (reason, _) in left_out_rows(out).items()} == {
        "00000/000000000.json": "format", "00000/000000001.jpg": "caption",
        "00000/000000001.json": "format", "00000/000000001.txt": "dangling_link",
        "00001/000010000.json": "format"}
    assert dict(result.left_out)["00000/000000001.jpg"] == (
        f"its caption 000000001.txt is a symbolic link to {missing}, which does not exist")


def test_the_kind_hint_sees_linked_folders_and_upper_case_captions(tmp_path):
    """Which kind a folder holds instead: files through a linked folder are seen, and videos
    with ``.TXT`` captions are captioned ones (video-text, not video-label)."""
    src = tmp_path / "src"
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.mp4").write_bytes(b"\0\0\0\x18ftypmp42")  # the hint reads names only
    (tmp_path / "clips" / "a.TXT").write_text("a clip's caption")
    src.mkdir()
    (src / "walks").symlink_to(tmp_path / "clips", target_is_directory=True)
    with pytest.raises(NoMediaError) as caught:
        make_shards(src, tmp_path / "out")
    assert caught.value.kind == "video-text"
    assert str(caught.value).endswith("it holds video files: use kind='video-text'")


def test_a_class_folder_with_no_image_keeps_its_label(tmp_path):
    """``a/``, ``b/`` holding only notes, ``c/``: classes are ImageFolder's (``allow_empty``), so
    c is 2 in the shards as there, and b is named as a class no sample has."""
    src, out = tmp_path / "src", tmp_path / "out"
    jpeg(src / "a" / "1.jpg", 1)
    (src / "b").mkdir()
    (src / "b" / "notes.md").write_text("nothing to see")
    jpeg(src / "c" / "1.jpg", 2)
    done = make_shards(src, out, kind="image-text")
    folder = ImageFolder(str(src), allow_empty=True)
    assert json.loads((out / "classes.json").read_text()) == folder.classes == ["a", "b", "c"]
    assert {src: int(s["cls"]) for src, s in written(out).items()} == {"a/1.jpg": 0, "c/1.jpg": 2}
    assert done.empty_classes == [("b", 1)]


def test_empty_captions_are_kept_and_numbered_folders_are_no_captions(tmp_path):
    """An empty ``.txt`` is an empty caption (web corpora hold them); in an img2dataset folder
    (``00000/000000001.jpg`` + ``.txt``) an image without its ``.txt`` is left out, not captioned
    "00000"; a class folder's name with letters is still the caption of an image without one."""
    src, out = tmp_path / "src", tmp_path / "out"
    for i in range(3):
        jpeg(src / "00000" / f"00000000{i}.jpg", i)
    (src / "00000" / "000000000.txt").write_text("a cat")
    (src / "00000" / "000000001.txt").write_text("")
    jpeg(src / "big_dogs" / "d.jpg", 9)
    make_shards(src, out, kind="image-text")
    captions = {src: s.get("txt") for src, s in written(out).items()}
    assert captions == {"00000/000000000.jpg": "a cat", "00000/000000001.jpg": "",
                        "big_dogs/d.jpg": "big dogs"}
    rows = left_out_rows(out)
    assert list(rows) == ["00000/000000002.jpg"]
    assert "its folder's name '00000' is no caption" in rows["00000/000000002.jpg"][1]
