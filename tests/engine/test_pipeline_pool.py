"""Several pipelines a server (``DALIServer(..., pipelines=N)``): copies, dealing, outputs."""

from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import pytest
import torch
from conftest import cpu, noisy_pipe
from datasets_for_tests import NoisyDataset
from mmproxy.datasets import MultiModalDataset, audio_label_dataset
from mmproxy.pipelines import audio_pipeline, image_train_pipeline
from nvidia.dali import fn, pipeline_def, types
from torch.utils.data import default_collate

import mmproxy
from mmproxy.testing import audio_bytes, damage_jpeg, image_bytes, synth_speech, write_tar

pytestmark = pytest.mark.timeout(240)

BATCH = 4


def _image(i: int) -> bytes:
    rng = np.random.default_rng(i)
    return image_bytes(rng.integers(0, 255, (24 + i % 4 * 8, 32 + i % 3 * 8, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    for s in range(4):
        samples = [{"__key__": f"k{s * 10 + k:03d}", "jpg": _image(s * 10 + k), "txt": f"t{k}"}
                   for k in range(10)]
        if s == 2:  # a damaged JPEG the header checks pass
            samples[3]["jpg"] = damage_jpeg(samples[3]["jpg"], "garbage")
        write_tar(root / f"p-{s}.tar", samples)
    return str(root / "p-{0..3}.tar")


def _train(**kw):
    return image_train_pipeline(batch_size=BATCH, size=16, dtype="uint8", device="cpu",
                                num_threads=1, scale=(0.2, 1.0), sample_seeded=True, **kw)


def _dataset(shards, server, **kw):
    return MultiModalDataset(shards, {"image": ("jpg", server.proxy), "text": ("txt", bytes.decode)},
                             batch_size=BATCH, seed=3, shuffle_buffer=8, on_error="skip", **kw)


def _by_key(loader, epochs=1):
    out = {}
    for _ in range(epochs):
        for batch in loader:
            for key, image in zip(batch["__key__"], batch["image"]):
                out.setdefault(key, []).append(image.clone())
    return out


@pytest.mark.parametrize("start", ["fork", "spawn", "forkserver"])
def test_outputs_do_not_depend_on_the_number_of_pipelines(shards, start):
    """Sample-seeded crops and flips: the same image for every key, two epochs, with one
    pipeline and with three; the damaged sample is skipped by both and named."""
    runs = {}
    for n in (1, 3):
        with mmproxy.DALIServer(_train(), name="train", pipelines=n) as server:
            assert server.pipelines == n
            loader = _dataset(shards, server).loader(server, num_workers=2,
                                                     multiprocessing_context=start)
            runs[n] = _by_key(loader, epochs=2)
            assert [r.key for r in loader.skipped.records] == ["k023"]  # the last epoch's
    assert sorted(runs[1]) == sorted(runs[3]) and len(runs[1]) == 39
    for key, images in runs[1].items():
        assert len(images) == 2 and not torch.equal(images[0], images[1])  # epochs draw anew
        for a, b in zip(images, runs[3][key]):
            assert torch.equal(a, b), key


def test_two_pooled_servers_in_one_loader(shards):
    """A training server of three pipelines and an evaluation server of two, both fed by one
    loader: every row of both fields is its own sample's, as with one pipeline each."""
    from mmproxy.pipelines import image_eval_pipeline

    def both(n):
        evaluation = image_eval_pipeline(batch_size=BATCH, size=8, dtype="uint8", device="cpu",
                                         num_threads=1)
        with mmproxy.DALIServer(_train(), name="train", pipelines=n) as train, \
                mmproxy.DALIServer(evaluation, name="eval", pipelines=max(1, n - 1)) as ev:
            ds = MultiModalDataset(shards, {"image": ("jpg", train.proxy), "small": ("jpg", ev.proxy)},
                                   batch_size=BATCH, seed=3, on_error="skip")
            return {k: (a.clone(), b.clone()) for batch in ds.loader([train, ev], num_workers=2)
                    for k, a, b in zip(batch["__key__"], batch["image"], batch["small"])}
    one, pooled = both(1), both(3)
    assert sorted(one) == sorted(pooled) and len(one) == 39
    for key, (image, small) in one.items():
        assert torch.equal(image, pooled[key][0]) and torch.equal(small, pooled[key][1]), key


def test_a_graph_with_python_operators_is_copied(tmp_path):
    """The CPU audio pipeline resamples in a Python operator (libsoxr on threads of its own):
    three copies of it give the clips one pipeline gives."""
    samples = [{"__key__": f"a{i}", "flac": audio_bytes(synth_speech(i, 0.3 + 0.1 * i, 22050), 22050,
                                                        "FLAC"), "cls": str(i)} for i in range(12)]
    write_tar(tmp_path / "a-0.tar", samples)
    clips = {}
    for n in (1, 3):
        pipe = audio_pipeline(batch_size=BATCH, sample_rate=16000, device="cpu", num_threads=1)
        with mmproxy.DALIServer(pipe, name="audio", pad=[0], pipelines=n) as server:
            ds = audio_label_dataset(str(tmp_path / "a-0.tar"), server, batch_size=BATCH)
            clips[n] = {k: (a[:length], label) for batch in ds.loader(server, num_workers=1)
                        for k, a, length, label in zip(batch["__key__"], batch["audio"].data,
                                                       batch["audio_length"], batch["label"])}
    assert sorted(clips[1]) == sorted(clips[3]) and len(clips[1]) == 12
    for key, (audio, label) in clips[1].items():
        assert torch.equal(audio, clips[3][key][0]) and label == clips[3][key][1]


@pipeline_def
def _slow_pipe():
    x = fn.external_source(name="x", no_copy=True, dtype=types.FLOAT)
    return fn.python_function(x, function=_sleep_and_double, num_outputs=1)


_calls: list[int] = []


def _sleep_and_double(x):
    _calls.append(threading.get_ident())
    time.sleep(0.05)  # long enough for all six runs to be in flight
    return x * 2


def _run_all(server, runs):
    rows = [[np.full(2, float(r * BATCH + i), np.float32) for i in range(BATCH)] for r in range(runs)]
    refs = [default_collate([server.proxy(x) for x in row]) for row in rows]  # all sent, then read
    return [server.produce_data(ref) for ref in refs], rows


def test_every_pipeline_takes_runs_and_every_output_is_its_own_runs():
    """Six runs in flight at once: each of the three pipelines (each with a runner thread and
    DALI threads of its own) runs some of them, and every output is its own run's. (DALI runs
    Python operators one call at a time in a process, so this graph gains no time from the
    copies; BENCHMARKS.md measures the gain of native graphs.)"""
    for n in (1, 3):
        with mmproxy.DALIServer(cpu(_slow_pipe, batch_size=BATCH, prefetch_queue_depth=1),
                                name="slow", pipelines=n) as server:
            names = {t.name for t in threading.enumerate() if t.name.startswith("mmproxy-slow-run")}
            assert len(names) == n
            _calls.clear()
            outputs, rows = _run_all(server, 6)
            for out, row in zip(outputs, rows):
                assert torch.equal(out, torch.from_numpy(np.stack(row)) * 2)
            assert len(set(_calls)) == n  # DALI calls the operator on its pipeline's thread


def test_deterministic_runs_repeat_with_random_operators_of_the_pipeline():
    """A pipeline that draws its own noise (not sample-seeded): with deterministic=True and a
    seed, three pipelines give the same outputs run after run, and they are not all one
    pipeline's stream (each copy has a seed of its own)."""
    def noise(pipelines):
        with mmproxy.DALIServer(cpu(noisy_pipe, batch_size=4, seed=11), deterministic=True,
                                pipelines=pipelines) as server:
            loader = mmproxy.DataLoader(server, NoisyDataset(server.proxy), batch_size=4,
                                        num_workers=3)
            return [x[:, 0] - i for x, i in loader]
    first, second, single = noise(3), noise(3), noise(1)
    assert all(torch.equal(a, b) for a, b in zip(first, second)) and len(first) > 3
    assert torch.equal(first[0], single[0])  # pipeline 0 is the pipeline given, seed and all
    assert not torch.equal(first[1], single[1])  # run 1 went to pipeline 1, of seed 12


def test_a_pipeline_function_is_called_for_each_copy():
    built = []

    def build():
        built.append(1)
        return cpu(noisy_pipe, batch_size=BATCH)

    with mmproxy.DALIServer(build, pipelines=3) as server:
        seeds = [pipe.seed for pipe in server._pipes]
        out, _ = _run_all(server, 3)
    assert len(built) == 3 and seeds == [None] * 3 and len(out) == 3


def test_exact_resume_with_three_pipelines(shards):
    with mmproxy.DALIServer(_train(), name="train", pipelines=3) as server:
        whole = [list(b["__key__"]) for b in _dataset(shards, server).loader(server, num_workers=2)]
        loader = _dataset(shards, server).loader(server, num_workers=2)
        before = []
        for batch in loader:
            before.append(list(batch["__key__"]))
            if len(before) == 4:
                state = pickle.loads(pickle.dumps(loader.state_dict()))
                break
        resumed = _dataset(shards, server).loader(server, num_workers=2)
        resumed.load_state_dict(state)
        after = [list(b["__key__"]) for b in resumed]
    assert before + after == whole


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "two", None])
def test_a_bad_number_of_pipelines_is_refused(bad):
    with pytest.raises(ValueError, match="pipelines must be a whole number >= 1 or 'auto'"):
        mmproxy.DALIServer(cpu(noisy_pipe), name="bad", pipelines=bad)


def test_auto_is_one_pipeline_on_a_cpu():
    with mmproxy.DALIServer(cpu(noisy_pipe), pipelines="auto") as server:
        assert server.pipelines == 1


@pytest.mark.gpu
def test_auto_on_a_gpu_follows_the_cores_and_three_pipelines_match_one(shards):
    import os

    from mmproxy.server import AUTO_PIPELINES_MAX

    cores = len(os.sched_getaffinity(0))
    pipe = image_train_pipeline(batch_size=BATCH, size=32, device="gpu", num_threads=4,
                                sample_seeded=True)
    with mmproxy.DALIServer(pipe, pipelines="auto") as server:
        assert server.pipelines == max(1, min(AUTO_PIPELINES_MAX, cores // 4))
    out = {}
    for n in (1, 3):
        pipe = image_train_pipeline(batch_size=BATCH, size=32, device="gpu", num_threads=2,
                                    sample_seeded=True)
        with mmproxy.DALIServer(pipe, pipelines=n) as server:
            loader = _dataset(shards, server).loader(server, num_workers=2)
            out[n] = {k: v.cpu() for k, (v,) in _by_key(loader).items()}
    assert sorted(out[1]) == sorted(out[3]) and len(out[1]) == 39
    assert all(torch.equal(out[1][k], out[3][k]) for k in out[1])


class _Rows(torch.utils.data.Dataset):
    def __init__(self, proxy):
        self.proxy = proxy

    def __len__(self):
        return 12 * BATCH

    def __getitem__(self, i):
        return self.proxy(np.full(2, float(i), np.float32)), i


def test_deterministic_mode_keeps_every_pipeline_fed():
    """The loader claims enough batches ahead that each of three pipelines has a run of its own
    at once (not only two runs in flight in all), and the outputs stay in order."""
    with mmproxy.DALIServer(cpu(_slow_pipe, batch_size=BATCH, prefetch_queue_depth=1),
                            deterministic=True, pipelines=3) as server:
        most, done = 0, threading.Event()

        def watch():
            nonlocal most
            while not done.is_set():
                with server.table.cond:
                    busy = sum(r.state is mmproxy.server.RunState.SCHEDULED
                               for r in server.table.runs.values())
                most = max(most, busy)
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            loader = mmproxy.DataLoader(server, _Rows(server.proxy), batch_size=BATCH, num_workers=2)
            for x, i in loader:
                assert torch.equal(x[:, 0], i.float() * 2)
        finally:
            done.set()
            watcher.join()
    assert most >= 3  # a lane may hold one more: the run it converts, and the one fed meanwhile


def test_copies_keep_their_seeds_through_a_rebuild_and_shared_sources_are_refused():
    def build():
        return cpu(noisy_pipe, batch_size=BATCH, seed=11)

    with mmproxy.DALIServer(build, pipelines=3) as server:
        assert [p.seed for p in server._pipes] == [11, 12, 13]
        server._pipes[2].rebuild()  # what a refused feed or a classic executor's error does
        assert server._pipes[2].seed == 13

    def built():
        pipe = cpu(noisy_pipe, batch_size=BATCH, seed=11)
        pipe.build()
        return pipe

    with pytest.raises(ValueError, match="returned a built pipeline, which cannot take a copy's seed"):
        mmproxy.DALIServer(built, pipelines=2)

    @pipeline_def
    def sourced():
        return fn.external_source(name="x", no_copy=True) * fn.external_source(
            source=lambda: [np.ones(1, np.float32)] * BATCH)

    with pytest.raises(ValueError, match="external_source with a source, which copies of it would"):
        mmproxy.DALIServer(cpu(sourced, batch_size=BATCH), pipelines=2)
