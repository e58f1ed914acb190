"""Reliability: fuzzed inputs, process faults, lifecycle, leaks, determinism, security.

The matrix of what each fault leads to is in docs/reliability.md.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cpu, double_pipe
from datasets_for_tests import AddDataset, NoisyDataset
from faults import (
    KillingDataset,
    RaisingDataset,
    corruptions,
    good_media,
    huge_png,
    snapshot,
)
from mmproxy.datasets import MultiModalDataset
from mmproxy.pipelines import audio_pipeline, image_eval_pipeline, image_train_pipeline

import mmproxy
from mmproxy.testing import image_bytes, synth_image, write_tar

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


# -- fuzzed inputs ----------------------------------------------------------------------------------

def _fuzz_shard(tmp_path, ext, payloads):
    samples = [{"__key__": f"k{i:03d}", ext: data, "cls": str(i)} for i, data in enumerate(payloads)]
    path = tmp_path / f"fuzz-{ext}.tar"
    write_tar(path, samples)
    return str(path)


@pytest.mark.parametrize("ext", ["jpg", "png", "wav", "flac", "ogg"])
def test_fuzzed_media_are_skipped_or_named_never_crash(tmp_path, ext):
    media = good_media()
    good = media[ext]
    bad = corruptions(good, seed=len(ext))
    wrong = media["wav" if ext in ("jpg", "png") else "jpg"]  # right extension, wrong content
    payloads = [good, *bad.values(), wrong, good]
    image = ext in ("jpg", "png")
    pipe = (image_eval_pipeline(batch_size=4, size=16, device="cpu", num_threads=1) if image
            else audio_pipeline(batch_size=4, device="cpu", num_threads=1))
    with mmproxy.DALIServer(pipe, name=f"fuzz-{ext}", pad=[] if image else [0]) as server:
        ds = MultiModalDataset(_fuzz_shard(tmp_path, ext, payloads),
                               {"x": (ext, server.proxy), "label": ("cls", int)}, batch_size=4,
                               on_error="skip", shuffle_shards=False, max_skipped=1.0)
        start = time.perf_counter()
        labels = []
        loader = ds.loader(server, num_workers=1)
        for batch in loader:
            labels += batch["label"].tolist()
        skipped = loader.skipped.records  # with the batches' records and those that came alone
        # everything either came back or was skipped with its key, exactly once; a corruption the
        # header check cannot see is found by the server, which runs the rest of the batch
        assert sorted(labels + [int(r.key[1:]) for r in skipped]) == list(range(len(payloads)))
        assert {"k002", "k004", "k005"} <= {r.key for r in skipped}  # header, empty, wrong
        assert server.state is mmproxy.ServerState.RUNNING
        assert time.perf_counter() - start < 60


def test_huge_declared_dimensions_never_reach_the_decoder(tmp_path):
    pipe = image_eval_pipeline(batch_size=4, size=16, device="cpu", num_threads=1)
    with mmproxy.DALIServer(pipe) as server:
        ds = MultiModalDataset(_fuzz_shard(tmp_path, "png", [huge_png(), good_media()["png"]]),
                               {"x": ("png", server.proxy)}, batch_size=4, on_error="skip",
                               max_skipped=0.5)
        batches = list(ds.loader(server, num_workers=0))
        assert sum(len(b["__key__"]) for b in batches) == 1
        (reason,) = [r.reason for b in batches for r in b["__skipped__"]]
        assert "100000x100000" in reason


def test_zero_length_audio_is_a_bad_sample(tmp_path):
    from mmproxy.testing import audio_bytes

    empty = audio_bytes(np.zeros(0, np.float32), 16000, "WAV")
    with mmproxy.DALIServer(audio_pipeline(batch_size=2, device="cpu", num_threads=1)) as server:
        ds = MultiModalDataset(_fuzz_shard(tmp_path, "wav", [empty]), {"x": ("wav", server.proxy)},
                               batch_size=2)
        with pytest.raises(mmproxy.SampleError, match=r"sample 'k000'.*no audio frames"):
            list(ds.loader(server, num_workers=0))


# -- process faults -----------------------------------------------------------------------------

@pytest.fixture
def server():
    with mmproxy.DALIServer(cpu(double_pipe), name="faults") as s:
        yield s


@pytest.mark.parametrize("at", [0, 7, 30])
def test_worker_sigkill_raises_within_seconds(server, at):
    gc.collect()
    loader = mmproxy.DataLoader(server, KillingDataset(server.proxy, at), batch_size=4, num_workers=2)
    it = iter(loader)
    start = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="exited unexpectedly|killed by signal|worker died"):
            for _ in it:
                pass
        assert time.perf_counter() - start < 15
    finally:
        it.close()  # torch's SIGCHLD handler must not fire again after the test


def test_user_dataset_exception_names_itself(server):
    loader = mmproxy.DataLoader(server, RaisingDataset(server.proxy), batch_size=4, num_workers=2)
    with pytest.raises(KeyError, match="user code failed on sample 13"):
        for _ in loader:
            pass


def _interrupted_epoch():
    with mmproxy.DALIServer(cpu(double_pipe)) as s:
        loader = mmproxy.DataLoader(s, KillingDataset(s.proxy, at=-1), batch_size=4, num_workers=2)
        for k, _ in enumerate(loader):
            if k == 2:
                raise KeyboardInterrupt


def test_keyboard_interrupt_stops_cleanly():
    with pytest.raises(KeyboardInterrupt):
        _interrupted_epoch()  # warm-up: first-use allocations (mp heap, DALI) are not leaks
    gc.collect()
    before = snapshot()
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        _interrupted_epoch()
    assert time.perf_counter() - start < 5  # the server stops at once; workers end with the loader
    _assert_nothing_left(before)


def test_server_stopped_with_batches_in_flight_raises_fast():
    s = mmproxy.DALIServer(cpu(double_pipe), name="stopping")
    s.start_thread()
    loader = mmproxy.DataLoader(s, KillingDataset(s.proxy, at=-1), batch_size=4, num_workers=2,
                                prefetch_factor=4)
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    s.stop_thread()
    assert time.perf_counter() - start < 1.0
    # the main loop (server stopped) or a worker (server not accepting inputs) says so first
    with pytest.raises((mmproxy.ServerStateError, mmproxy.TransportError),
                       match="'stopping' is (stopped|not accepting)"):
        for _ in it:
            pass
    assert time.perf_counter() - start < 10


def _assert_nothing_left(before, rss_slack=None):
    deadline = time.time() + 10
    while True:
        gc.collect()
        after = snapshot()
        ok = (after["threads"] == before["threads"] and after["children"] <= before["children"]
              and after["fds"] <= before["fds"] and set(after["shm"]) <= set(before["shm"]))
        if ok or time.time() > deadline:
            break
        time.sleep(0.2)
    assert after["threads"] == before["threads"]
    assert after["children"] <= before["children"]
    assert after["fds"] <= before["fds"], (before["fds"], after["fds"])
    assert set(after["shm"]) <= set(before["shm"])
    if rss_slack is not None:
        assert after["rss"] - before["rss"] < rss_slack


def test_loader_garbage_collected_mid_epoch_leaves_nothing():
    s = mmproxy.DALIServer(cpu(double_pipe))
    with s:
        loader = mmproxy.DataLoader(s, KillingDataset(s.proxy, at=-1), batch_size=4, num_workers=2)
        next(iter(loader))  # warm-up: first-use allocations are not leaks
        before = snapshot()
        it = iter(loader)
        next(it)
        del it, loader
    s.stop_thread()
    before["threads"] = []
    _assert_nothing_left(before)


# -- lifecycle ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_hundred_start_stop_cycles():
    s = mmproxy.DALIServer(cpu(double_pipe))
    before = snapshot()
    start = time.perf_counter()
    for _ in range(100):
        s.start_thread()
        s.stop_thread()
    assert time.perf_counter() - start < 30
    _assert_nothing_left(before)
    with s:
        out = s.produce_data(torch.utils.data.default_collate([s.proxy(np.ones(2, np.float32))]))
        assert out.tolist() == [[2.0, 2.0]]


@pytest.mark.slow
def test_fifty_persistent_epochs_breaking_every_other_stay_flat():
    from conftest import add_sub_pipe

    with mmproxy.DALIServer(cpu(add_sub_pipe)) as s:
        loader = mmproxy.DataLoader(s, AddDataset(s.proxy, n=48), batch_size=4, num_workers=2,
                                    persistent_workers=True)
        for _ in loader:  # warm-up epoch
            pass
        gc.collect()
        before = snapshot()
        for epoch in range(50):
            for k, (total, _, i) in enumerate(loader):
                torch.testing.assert_close(total[:, 0], i.float() + 1)  # paired with its inputs
                if epoch % 2 == 0 and k == 1:
                    break
            assert len(s._runs) <= 2 * 2 * 2  # workers x prefetch x an abandoned epoch
        gc.collect()
        after = snapshot()
        # bound: 30 MB of RSS growth over 50 epochs (allocator noise; a leak of one batch per
        # epoch would be far more), the same threads, no new fds or /dev/shm entries
        assert after["rss"] - before["rss"] < 30 * 2**20, (before["rss"], after["rss"])
        assert after["fds"] <= before["fds"] + 2 and set(after["shm"]) <= set(before["shm"])


# -- determinism --------------------------------------------------------------------------------

def _train_batches(seed):
    jpegs = [image_bytes(synth_image(i, 60, 80)) for i in range(24)]
    pipe = image_train_pipeline(batch_size=4, size=24, device="cpu", num_threads=2, seed=seed)

    class Images(torch.utils.data.Dataset):
        def __init__(self, proxy):
            self.proxy = proxy

        def __len__(self):
            return len(jpegs)

        def __getitem__(self, i):
            return self.proxy(np.frombuffer(jpegs[i], np.uint8)), i

    with mmproxy.DALIServer(pipe, deterministic=True) as s:
        loader = mmproxy.DataLoader(s, Images(s.proxy), batch_size=4, num_workers=2)
        return [(x.clone(), i) for x, i in loader]


def test_deterministic_runs_are_bitwise_identical():
    a, b = _train_batches(99), _train_batches(99)
    assert len(a) == len(b) == 6
    for (xa, ia), (xb, ib) in zip(a, b):
        assert torch.equal(ia, ib) and torch.equal(xa, xb)


def test_deterministic_noise_with_three_workers():
    from conftest import noisy_pipe

    def run():
        with mmproxy.DALIServer(cpu(noisy_pipe, seed=5), deterministic=True) as s:
            loader = mmproxy.DataLoader(s, NoisyDataset(s.proxy), batch_size=4, num_workers=2)
            return torch.cat([x[:, 0] for x, _ in loader])

    assert torch.equal(run(), run())


# -- security -----------------------------------------------------------------------------------

def test_shared_memory_stays_empty(server):
    before = set(os.listdir("/dev/shm"))
    loader = mmproxy.DataLoader(server, KillingDataset(server.proxy, at=-1), batch_size=4,
                                num_workers=2)
    for _ in loader:
        # memfd buffers have no name: mmproxy never puts anything in /dev/shm (torch may, briefly)
        assert not [n for n in os.listdir("/dev/shm") if "mmproxy" in n]
    del loader
    gc.collect()
    assert set(os.listdir("/dev/shm")) <= before


_LEAVE = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import mmproxy
from conftest import add_sub_pipe, cpu
from datasets_for_tests import AddDataset
server = mmproxy.DALIServer(cpu(add_sub_pipe), name="left")
server.start_thread()  # never stopped: no `with`, no stop_thread()
for total, _, i in mmproxy.DataLoader(server, AddDataset(server.proxy, n=8), batch_size=4,
                                      num_workers=2):
    assert total.shape == (4, 3)
if {kill}:
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("ending", ["normal exit", "SIGKILL"])
def test_nothing_is_left_in_tmpdir(request, ending):
    """A run whose server was never stopped leaves nothing in TMPDIR; a killed one leaves its
    socket folder, which the next server started removes (and no live process's folder)."""
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp(prefix="mm", dir="/tmp"))  # short enough for a socket's path
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    env = {**os.environ, "TMPDIR": str(tmp)}
    script = _LEAVE.format(tests=str(ROOT / "tests"), kill=ending == "SIGKILL")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == (-9 if ending == "SIGKILL" else 0), done.stderr[-2000:]
    left = [p for p in tmp.iterdir() if "mmproxy" in p.name]
    if ending == "normal exit":
        assert not left, left
        return
    assert len(left) == 1 and (left[0] / "inputs.sock").exists(), left
    # a live process's folder is never taken for a stale one
    live = tmp / f"mmproxy-{os.getpid()}-{'0' * 16}"
    live.mkdir(mode=0o700)
    again = _LEAVE.format(tests=str(ROOT / "tests"), kill=False)
    done = subprocess.run([sys.executable, "-c", again], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [p for p in tmp.iterdir() if "mmproxy" in p.name] == [live]


def test_the_socket_folder_is_private(server, monkeypatch):
    folder = os.path.dirname(server.proxy.address)
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert os.path.basename(folder).startswith(f"mmproxy-{os.getpid()}-")
    # a TMPDIR too long for a socket's path: the folder goes to /tmp
    import tempfile

    from mmproxy._wire import sockdir as _sockdir

    monkeypatch.setattr(tempfile, "gettempdir", lambda: "/tmp/" + "x" * 100)
    assert _sockdir.path("0" * 16).startswith(f"/tmp/mmproxy-{os.getpid()}-")


def test_datagrams_of_another_user_are_dropped(server):
    """Only this user's datagrams count (the folder keeps others out; the kernel's word on the
    sender is checked too)."""
    import warnings

    from mmproxy._wire import transport as _transport

    def send(run_id):
        fd, files = _transport.pack(run_id, None, [None], [[np.ones(2, np.float32)]])
        try:
            _transport.send(server.proxy.address, [fd, *files], server.name)
        finally:
            os.close(fd)

    listener = server._listener
    listener._uid = os.getuid() + 1  # as if this process were another user
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        send("stranger:0")
        time.sleep(0.5)
    assert "stranger:0" not in server.table.runs
    assert any("dropped a datagram sent by user id" in str(w.message) for w in caught)
    listener._uid = os.getuid()
    send("mine:0")
    out = server.table.wait("mine:0").outputs[0]
    assert out.tolist() == [[2.0, 2.0]]
    _transport._clients.pop(server.proxy.address).close()  # this process's client socket


# The child processes the library starts: the demo's stderr filter and the listing of an
# object-store prefix, this Python with an argument list (no shell, nothing of the user's in it
# but the prefix's URL, one argument).
_STARTS_A_PROCESS = {ROOT / "mmproxy" / "apps" / "noise.py",
                     ROOT / "datasets" / "remote" / "_stores.py"}
# The bench's and the remote tests' GCS and Azure servers: fake-gcs-server and Azurite, programs of
# the test extra and of .ci/run, each given an argument list of its own (no shell).
_STARTS_A_SERVER = {ROOT / "mmproxy" / "apps" / "bench" / "remote.py"}


def test_no_shell_command_is_built_anywhere():
    sources = [p for d in ("mmproxy", "datasets", "pipelines") for p in (ROOT / d).rglob("*.py")]
    assert sources
    for path in sources:
        text = path.read_text()
        for pattern in ("os.system", "shell=True", "os.popen"):
            assert pattern not in text, f"{path}: {pattern}"
        if path not in _STARTS_A_PROCESS | _STARTS_A_SERVER:
            for pattern in ("subprocess", "Popen("):
                assert pattern not in text, f"{path}: {pattern}"
    for path in _STARTS_A_PROCESS:
        assert "[sys.executable, " in path.read_text(), path


def test_server_restart_under_persistent_workers_keeps_working():
    # Regression: forked workers held the old socket open, so sends after a restart were lost.
    from conftest import add_sub_pipe

    s = mmproxy.DALIServer(cpu(add_sub_pipe), name="restart")
    s.start_thread()
    loader = mmproxy.DataLoader(s, AddDataset(s.proxy, n=32), batch_size=4, num_workers=2,
                                persistent_workers=True)
    try:
        for epoch in range(4):
            for total, _, i in loader:
                torch.testing.assert_close(total[:, 0], i.float() + 1)
            s.stop_thread()
            s.start_thread()
    finally:
        s.stop_thread()


class _Holder:
    """A pipeline in a reference cycle: garbage only the cyclic collector frees."""

    def __init__(self, pipeline):
        self.pipeline, self.me = pipeline, self


def _exit_code(pid, hung, seconds=30):
    """The exit code of child ``pid``; the test fails with ``hung`` (the child killed) when it
    runs past ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(hung)


def test_a_forked_child_frees_a_pipeline_its_parent_dropped_without_hanging():
    # A pipeline the parent dropped in a cycle, not shut down and not yet collected, is freed
    # in the child by its first collection (Python's own after-fork work can run one). DALI's
    # shutdown there waits for the parent's threads forever; the child must not try it.
    pipeline = cpu(double_pipe, batch_size=2)
    pipeline.build()
    enabled = gc.isenabled()
    gc.disable()  # the cycle stays uncollected until the fork
    try:
        _Holder(pipeline)
        del pipeline
        pid = os.fork()
        if pid == 0:
            try:
                gc.collect()
            finally:
                os._exit(0)
    finally:
        if enabled:
            gc.enable()
    assert _exit_code(pid, "the forked child hung freeing the pipeline its parent dropped") == 0
    gc.collect()  # the parent frees it: shut down here, where its threads are


def test_a_forked_child_that_iterates_an_inherited_loader_is_told_at_once(add_server):
    # The server's threads and its table's runs are the parent's: the child's loader would
    # wait out the server's timeout for runs no thread of its own makes.
    loader = mmproxy.DataLoader(add_server, AddDataset(add_server.proxy, n=8), batch_size=4,
                                num_workers=0)
    assert len(list(loader)) == 2
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 1
        try:
            next(iter(loader))
        except mmproxy.ServerStateError as err:
            os.write(write, str(err).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    assert _exit_code(pid, "the forked child waited for runs its inherited server never makes") == 0
    message = os.read(read, 4096).decode()
    os.close(read)
    assert f"server 'addsub' runs in process {os.getpid()}, and this process" in message
    assert "is a fork of it" in message
    assert len(list(loader)) == 2  # the parent's server serves on


_COLLECTOR_AT_FORK = """
import gc, os, threading, time
seen = []
os.register_at_fork(after_in_child=lambda: seen.append(gc.isenabled()))  # runs before mmproxy's
os.register_at_fork(before=lambda: time.sleep(0.005))  # after mmproxy's: other threads' forks begin
import mmproxy  # noqa: E402
from mmproxy import _process

_process.on_fork_in_child(lambda: 1 / 0)  # a hook that fails: the others still run


def fork_and_check():
    pid = os.fork()
    if pid == 0:
        os._exit(0 if seen == [False] and gc.isenabled() else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "child"

threads = [threading.Thread(target=lambda: [fork_and_check() for _ in range(20)]) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert gc.isenabled(), "the parent's collector stayed off"
gc.disable()
pid = os.fork()
if pid == 0:
    os._exit(0 if not gc.isenabled() else 1)  # the user's choice holds in the child
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 and not gc.isenabled()
"""


@pytest.mark.timeout(120)
def test_the_collector_is_off_from_a_fork_until_the_hooks_ran_and_then_as_it_was():
    # Python's own after-fork work (threading's hook, registered first) must not collect
    # garbage the hooks have not made inert; forks from three threads at once leave the
    # parent's collector on, a failing hook does not stop the rest, and a collector the user
    # turned off stays off.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _COLLECTOR_AT_FORK], capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "an after-fork hook failed in a forked child (ZeroDivisionError" in done.stderr
