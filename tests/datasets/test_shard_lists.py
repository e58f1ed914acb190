"""Shard lists as users write them: ``~`` for the home folder, in a path and in a glob."""

from __future__ import annotations

from mmproxy.datasets.shards import expand


def test_a_home_folder_is_expanded_in_paths_and_globs(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("s-0.tar", "s-1.tar"):
        (tmp_path / name).write_bytes(b"")
    assert expand("~/s-*.tar") == [str(tmp_path / "s-0.tar"), str(tmp_path / "s-1.tar")]
    assert expand(["~/s-1.tar"]) == [str(tmp_path / "s-1.tar")]
    assert expand("~/s-{0..1}.tar") == [str(tmp_path / "s-0.tar"), str(tmp_path / "s-1.tar")]
