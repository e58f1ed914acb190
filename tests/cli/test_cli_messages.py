"""The command line's words for a user's mistakes: a pattern the shell expanded, and video shards
on CPU without PyAV (what to install, not the library's ``decoder=`` argument)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mmproxy import cli
from mmproxy.testing import synth_video, video_bytes, write_tar

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
    """``--data dir/*.tar`` unquoted (the shell expands it into several paths): each command
    says what happened and what to write, not argparse's "unrecognized arguments"."""
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


# -- video on CPU without PyAV -------------------------------------------------------------------

BLOCK = "import sys; sys.modules['av'] = None; from mmproxy.cli import main; sys.exit(main(sys.argv[1:]))"


def _demo(args, broken=None):
    """``mmproxy demo ARGS`` in a process where ``import av`` fails: not installed, or (``broken``:
    a folder with an ``av.py`` that raises) installed but failing to import."""
    env = dict(os.environ)
    if broken is None:
        command = [sys.executable, "-c", BLOCK, "demo", *args]
    else:
        (broken / "av.py").write_text("raise ImportError('libavcodec.so.61: cannot open shared "
                                      "object file')\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(broken), env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "mmproxy.cli", "demo", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=100)


@pytest.fixture(scope="module")
def h264_shards(tmp_path_factory):
    pytest.importorskip("av")  # to write the clips
    root = tmp_path_factory.mktemp("h264")
    write_tar(root / "v-000.tar", [{"__key__": f"v{i}", "mp4": video_bytes(synth_video(i, 12, 48, 64)),
                                    "cls": str(i)} for i in range(2)])
    return str(root)


def test_the_video_demo_without_pyav_says_what_to_install(h264_shards, tmp_path):
    """The demo on H.264 shards on CPU without PyAV skipped every sample, each saying "use
    video_pipeline(decoder='pyav')", an argument a command line user cannot give: it refuses the
    shards at once with the pip install that adds PyAV."""
    args = ["--data", h264_shards, "--device", "cpu", "--workers", "1", "--quiet"]
    for broken, why in ((None, "is not installed"),
                        (tmp_path, "cannot be imported (libavcodec.so.61: cannot open shared "
                                   "object file)")):
        done = _demo(args, broken)
        assert done.returncode == 1, done.stderr
        assert done.stderr.splitlines()[0] == (
            f"mmproxy demo: error: the first video of {h264_shards}/v-000.tar is H264, which "
            "DALI's CPU video decoder does not read (it reads VP8, VP9, MJPEG); the demo decodes "
            f"the others on CPU with PyAV, which {why}: pip install av (mmproxy's [video] extra); "
            "or run on a GPU")
        assert "decoder=" not in done.stdout + done.stderr


def test_the_synthetic_video_demo_without_pyav_says_what_to_install(tmp_path):
    done = _demo(["--video", "--device", "cpu"])
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "mmproxy demo: error: --video needs av, which is not installed: pip install av (mmproxy's "
        "[video] extra)")
    done = _demo(["--video", "--device", "cpu"], tmp_path)  # found, but failing to import
    assert done.returncode == 1
    assert done.stderr.splitlines()[0] == (
        "mmproxy demo: error: --video needs av, which cannot be imported (libavcodec.so.61: "
        "cannot open shared object file): pip install av (mmproxy's [video] extra)")


def test_vp9_shards_run_on_cpu_without_pyav_and_the_demo_says_which_codecs_it_reads(tmp_path):
    av = pytest.importorskip("av")
    if "libvpx-vp9" not in av.codecs_available:
        pytest.skip("this PyAV has no VP9 encoder")
    write_tar(tmp_path / "w-000.tar", [
        {"__key__": f"w{i}", "webm": video_bytes(synth_video(i, 12, 48, 64), "libvpx-vp9", "webm"),
         "cls": str(i)} for i in range(4)])
    done = _demo(["--data", str(tmp_path), "--device", "cpu", "--workers", "1", "--batch-size", "4",
                  "--quiet"])
    assert done.returncode == 0, done.stderr
    assert ("mmproxy demo: videos decoded by DALI's CPU decoder, which reads VP8, VP9, MJPEG only; "
            "PyAV, for the others, is not installed: pip install av (mmproxy's [video] extra)"
            ) in done.stdout.splitlines()
    assert "  skipped 0 samples" in done.stdout.splitlines()
