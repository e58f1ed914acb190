"""The command line's words for a user's mistakes: a pattern the shell expanded."""

from __future__ import annotations

import os

import pytest

from mmproxy import cli

pytestmark = pytest.mark.timeout(120)


def _files(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"x")
    return [str(folder / name) for name in names]


def _refused(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_pattern_the_shell_expanded_is_said_to_be_one(tmp_path, capsys):
    """``--data dir/*.tar`` unquoted gave argparse's "unrecognized arguments: dir/b.tar
    dir/c.tar"; each command now says what happened and what to write."""
    shards = _files(tmp_path / "shards", ["s-000.tar", "s-001.tar", "s-002.tar"])
    where = tmp_path / "shards"
    for command in ("demo", "bench"):
        assert _refused(capsys, [command, "--workers", "1", "--data", *shards]) == (
            f"mmproxy {command}: error: --data takes one argument; got 3 paths after it (the shell "
            f"expanded a pattern?): quote it, --data '{where}/s-*.tar', or name the folder, "
            f"--data {where}")
    assert _refused(capsys, ["demo", "--dat", *shards, "--quiet"]).endswith(
        f"quote it, --data '{where}/s-*.tar', or name the folder, --data {where}")
    gzipped = _files(tmp_path / "gz", ["a-000.tar.gz", "a-001.tar.gz"])
    assert _refused(capsys, ["bench", "--data", *gzipped]).endswith(
        f"--data '{tmp_path}/gz/a-*.tar.gz', or name the folder, --data {tmp_path}/gz")
    folders = [str(p) for p in (tmp_path / "d1", tmp_path / "d2")]
    for folder in folders:
        os.mkdir(folder)
    assert _refused(capsys, ["bench", "--data-dir", *folders]) == (
        "mmproxy bench: error: --data-dir takes one argument; got 2 paths after it (the shell "
        f"expanded a pattern?): quote it, --data-dir '{tmp_path}/d*'")
    images = _files(tmp_path / "photos", ["cat.jpg", "dog.jpg", "owl.jpg"])
    out = str(tmp_path / "out")
    for argv in (["make-shards", *images, out], ["make-shards", "--prefix", "p", *images, out]):
        assert _refused(capsys, argv) == (
            "mmproxy make-shards: error: the command takes 2 paths, SOURCE and OUTPUT; got 4 (the "
            f"shell expanded a pattern?): name the folder, mmproxy make-shards {tmp_path}/photos "
            f"{out}")


def test_other_leftover_words_keep_argparse_s_message(tmp_path, capsys):
    shard = _files(tmp_path, ["s-000.tar"])[0]
    assert _refused(capsys, ["demo", "--data", shard, "--devcie", "cpu"]) == (
        "mmproxy demo: error: unrecognized arguments: --devcie cpu")
    assert _refused(capsys, ["demo", "--data", shard, "stray"]) == (
        "mmproxy demo: error: unrecognized arguments: stray")  # not a path: no pattern
    assert _refused(capsys, ["make-shards", str(tmp_path), "out", "more"]) == (
        "mmproxy make-shards: error: unrecognized arguments: more")
