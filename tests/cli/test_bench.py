"""The bench: its systems, summaries, workloads, reference loaders and CPU accounting."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
import torch
import torchaudio
from cli_helpers import run_cli
from mmproxy.datasets import make_shards

from mmproxy.testing import (
    audio_bytes,
    synth_speech,
    write_tar,
)

pytestmark = pytest.mark.timeout(240)


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


@pytest.mark.timeout(60)
def test_bench_stacks_finds_each_thread_group_where_it_spends_its_time():
    """--stacks: threads named ``spin_0``, ``spin_1`` busy in one function are one group whose
    most frequent frame is that function; without a GPU there is no NVML entry."""
    import threading

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
