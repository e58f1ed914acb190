"""The command line: errors in one line, interrupts ending with 130, the parser and the texts it prints."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest
from cli_helpers import HINT, ROOT, run_cli
from mmproxy.datasets import make_shards
from mmproxy.datasets.writer import WrittenShards

import mmproxy
from mmproxy import cli

pytestmark = pytest.mark.timeout(240)


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
    error = f"mmproxy make-shards: error: {tmp_path / 'missing'} does not exist"
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
