"""Every example runs as written, on CPU with tiny data; the DDP example across two ranks."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def run(args, tmp_path, timeout=240):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("script,expect", [
    ("dali_proxy_example1.py", "example 1: last batch (4, 3, 224, 224)"),
    ("dali_proxy_example2.py", "example 2: a + b and a - b"),
    ("dali_proxy_example3.py", "example 3: last batch (4, 3, 224, 224)"),
    ("clip_train.py", "clip: 6 steps"),
    ("audio_classify.py", "audio: 6 steps"),
])
def test_example_runs(script, expect, tmp_path):
    assert expect in run([f"examples/{script}"], tmp_path)


def test_clip_example_resumes_where_it_stopped(tmp_path):
    """3 steps with a checkpoint, then on to 10 (past the end of the demo's first epoch, 128
    samples in batches of 16): the losses are those of one uninterrupted 10-step run. Resuming
    the finished run trains nothing and says so (it said "steps 11-10")."""
    def losses(out):
        return [line for line in out.splitlines() if line.startswith("step ")]

    whole = losses(run(["examples/clip_train.py", "--steps", "10"], tmp_path))
    ckpt = str(tmp_path / "ckpt.pt")
    first = run(["examples/clip_train.py", "--steps", "3", "--checkpoint", ckpt], tmp_path)
    second = run(["examples/clip_train.py", "--steps", "10", "--checkpoint", ckpt], tmp_path)
    assert "resumed at step 3" in second and "clip: steps 4-10 in" in second
    assert losses(first) + losses(second) == whole
    third = run(["examples/clip_train.py", "--steps", "10", "--checkpoint", ckpt], tmp_path)
    assert "clip: nothing left to train: the checkpoint is at step 10, --steps is 10" in third
    assert not losses(third)


def test_ddp_two_ranks_disjoint_cover_and_equal_batches(tmp_path):
    keys = tmp_path / "keys"
    out = run(["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
               "benchmarks/ddp_bench.py", "--epochs", "2", "--batch-size", "16",
               "--dump-keys", str(keys)], tmp_path)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["world"] == 2
    assert len(summary["per_rank_sustained_samples_per_s"]) == 2
    assert all(r > 0 for r in summary["per_rank_sustained_samples_per_s"])
    ranks = [json.loads(Path(f"{keys}.rank{r}.json").read_text()) for r in (0, 1)]
    for epoch in range(2):
        a, b = ranks[0][epoch], ranks[1][epoch]
        assert len(a) == len(b) == 64  # equal batch counts: 4 batches of 16 on each rank
        assert not set(a) & set(b)  # disjoint
        assert sorted(a + b) == [f"demo{i:06d}" for i in range(128)]  # together, all the data


def test_ddp_example_synthetic_control_with_resnet50(tmp_path):
    """The no-loader control of the DDP benchmark runs, with the ResNet-50 tower."""
    out = run(["benchmarks/ddp_bench.py", "--synthetic", "--model", "resnet50", "--epochs", "2",
               "--batch-size", "4", "--image-size", "32"], tmp_path)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["model"] == "resnet50" and summary["world"] == 1
    assert summary["per_rank_main_loop_wait_ms_per_batch"] == [0.0]  # nothing was loaded
    assert "rank 0 epoch 1: 128 samples" in out


def test_bench_runs_every_system_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    run(["-m", "mmproxy.cli", "bench", "--workload", "image", "--samples", "64", "--batch-size",
         "16", "--epochs", "1", "--device", "cpu", "--data-dir", str(tmp_path / "data"),
         "--systems", "mmproxy,dali-reader,dali-proxy,torch", "--json", str(out)], tmp_path)
    systems = json.loads(out.read_text())["results"]["image"]["systems"]
    assert set(systems) == {"mmproxy", "dali-reader", "dali-proxy", "torch"}
    for name, result in systems.items():
        assert result["samples"] == 64 and result["samples_per_s"] > 0, name
        assert all(ms >= 0 for ms in result["cpu_ms_per_batch"].values()), (name, result)
    assert systems["torch"]["mmproxy_ratio"] > 0


def test_bench_on_your_own_shards_reports_runs_and_spread(tmp_path):
    """--data: every system on shards the bench did not write (make-shards of an image folder),
    two interleaved runs: the median and range of mmproxy's sustained ratio."""
    from mmproxy.datasets import make_shards

    from mmproxy.testing import image_folder

    make_shards(image_folder(tmp_path / "photos", per_class=12), tmp_path / "mine", max_count=8)
    out = tmp_path / "bench.json"
    run(["-m", "mmproxy.cli", "bench", "--data", str(tmp_path / "mine"), "--runs", "2",
         "--epochs", "2", "--batch-size", "8", "--device", "cpu", "--systems", "mmproxy,torch",
         "--json", str(out)], tmp_path)
    result = json.loads(out.read_text())["results"]["image"]
    assert result["field"] == "jpg;jpeg;png;webp;bmp;tif;tiff" and result["samples"] == 24
    assert result["systems"]["mmproxy"]["skipped"] == {"samples": 0, "shards": 0}
    torch_run = result["systems"]["torch"]
    assert len(torch_run["runs"]) == 2 and len(torch_run["warmup_epochs"]) == 2
    ratio = torch_run["mmproxy_ratio_sustained"]
    assert ratio["runs"] == 2 and ratio["range"][0] <= ratio["median"] <= ratio["range"][1]
    bad = subprocess.run([sys.executable, "-m", "mmproxy.cli", "bench", "--data",
                          str(tmp_path / "mine"), "--field", "txt", "--device", "cpu"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "--field 'txt' is neither image (jpg;" in bad.stderr


@pytest.mark.parametrize("damaged", [1, 4])
def test_bench_on_damaged_data_does_not_feed_it_to_dalis_unchecked_decoders(tmp_path, damaged):
    """Truncated JPEGs among JPEGs and PNGs (a set make-shards writes from an ordinary folder)
    in the user's shards. mmproxy runs first, whatever --systems says, and reads both formats;
    the DALI systems that would decode the damage unchecked (one kind crashes the process) are
    reported as not run, both when mmproxy skipped the files (1 of 16) and when it stopped at
    its skip limit (4 of 16: the bench then exits 1); torch still runs and names the sample."""
    from mmproxy.testing import damage_jpeg, image_bytes, synth_image, write_tar

    samples = [{"__key__": f"k{i:02d}", "cls": b"1", **(
        {"png": image_bytes(synth_image(i), "PNG")} if i % 3 == 0 else
        {"jpg": damage_jpeg(image_bytes(synth_image(i)), "truncate") if i in (2, 5, 7, 8)[:damaged]
         else image_bytes(synth_image(i))})} for i in range(16)]
    (tmp_path / "mine").mkdir()
    write_tar(tmp_path / "mine" / "a.tar", samples)
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "mmproxy.cli", "bench", "--data",
                           str(tmp_path / "mine"), "--epochs", "1", "--batch-size", "4",
                           "--workers", "1", "--device", "cpu", "--systems",
                           "dali-reader,torch-tensor,mmproxy", "--json", str(out)], cwd=ROOT,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == (0 if damaged == 1 else 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())["results"]["image"]
    systems = result["systems"]
    assert result["field"] == "jpg;jpeg;png;webp;bmp;tif;tiff"  # the first sample's is a PNG
    assert list(systems) == ["mmproxy", "dali-reader", "torch-tensor"]
    if damaged == 1:
        assert systems["mmproxy"]["skipped"] == {"samples": 1, "shards": 0}
        assert systems["mmproxy"]["samples"] == 15  # the PNGs and the good JPEGs
        found = "(1 sample(s) skipped)"
    else:
        assert systems["mmproxy"]["error"].startswith("SkipLimitError: 4 of 16 samples skipped ")
        assert "more than --max-skipped=0.1 (raise it" in systems["mmproxy"]["error"]
        assert "mmproxy failed on the image workload" in proc.stderr
        found = "(4 of 16 samples skipped"
    assert systems["dali-reader"]["error"].startswith(
        f"not run: mmproxy skipped files of your data {found}"), systems["dali-reader"]
    assert "sample 'k02' of " in systems["torch-tensor"]["error"], systems["torch-tensor"]


def test_a_failed_reference_loader_leaves_no_worker_behind(tmp_path, monkeypatch):
    """torch's loader stopped by a damaged file: its persistent workers are stopped with it, not
    when the collector finds the loader at exit (a 3 s bench took 13 s to end)."""
    import psutil

    from mmproxy.apps.bench import session
    from mmproxy.cli import build_parser
    from mmproxy.testing import damage_jpeg, image_bytes, synth_image, write_tar

    (tmp_path / "mine").mkdir()
    write_tar(tmp_path / "mine" / "a.tar", [{"__key__": f"k{i:02d}", "cls": b"1", "jpg": (
        damage_jpeg(image_bytes(synth_image(i)), "truncate") if i == 2 else
        image_bytes(synth_image(i)))} for i in range(32)])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    args = build_parser().parse_args([
        "bench", "--data", str(tmp_path / "mine"), "--device", "cpu", "--epochs", "1",
        "--batch-size", "4", "--workers", "2", "--systems", "torch", "--json", str(tmp_path / "b.json")])
    import gc

    gc.disable()  # the collector may not be the one to stop them (at exit it is slow to)
    try:
        session.run(args)
        left = [p for p in psutil.Process().children(recursive=True)
                if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        gc.enable()
    error = json.loads((tmp_path / "b.json").read_text())["results"]["image"]["systems"]["torch"]
    assert "sample 'k02' of " in error["error"]
    assert left == []


def test_demo_command_runs(tmp_path):
    out = run(["-m", "mmproxy.cli", "demo", "--samples", "64", "--quiet"], tmp_path)
    assert "image      64 samples" in out and "skipped 0 samples" in out


def test_ddp_example_profile_writes_a_trace_per_rank(tmp_path):
    folder = tmp_path / "profile"
    run(["benchmarks/ddp_bench.py", "--epochs", "2", "--batch-size", "8", "--profile", str(folder),
         "--profile-steps", "3"], tmp_path)
    assert "train_step" in (folder / "rank0.txt").read_text()
    with gzip.open(folder / "rank0.trace.json.gz", "rt") as f:
        names = [e.get("name") for e in json.load(f)["traceEvents"]]
    assert names.count("train_step") == 3 and names.count("next_batch") >= 3


def test_ddp_bench_trains_from_dalis_reader_as_well(tmp_path):
    """--loader dali-reader: the same training fed by fn.readers.webdataset, captions tokenized in
    the main loop; the summary names the loader and every epoch has its batches."""
    out = run(["benchmarks/ddp_bench.py", "--epochs", "2", "--batch-size", "8", "--epoch-length",
               "5", "--loader", "dali-reader", "--json", str(tmp_path / "r.json")], tmp_path)
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["loader"] == "dali-reader" and summary["total_samples_per_s"] > 0
    assert out.count(": 40 samples,") == 2  # 5 batches of 8, each epoch


def test_bench_keeps_each_finished_system_when_a_run_is_cut_short(tmp_path, monkeypatch):
    """The JSON is written after every system: a bench stopped during its second system (here an
    interrupt, as from a time limit) keeps the first one's figures."""
    from mmproxy.apps.bench import session
    from mmproxy.apps.bench.systems import System

    def cut(setup):
        raise KeyboardInterrupt

    real = session.select
    monkeypatch.setattr(session, "select", lambda workload, names, damage: [
        *real(workload, ["mmproxy"], damage), System("dali-reader", frozenset({"image"}), cut)])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    from mmproxy.cli import build_parser

    args = build_parser().parse_args([
        "bench", "--device", "cpu", "--samples", "64", "--batch-size", "16", "--epochs", "2",
        "--systems", "mmproxy,dali-reader", "--data-dir", str(tmp_path / "data"),
        "--json", str(tmp_path / "b.json")])
    with pytest.raises(KeyboardInterrupt):
        session.run(args)
    kept = json.loads((tmp_path / "b.json").read_text())["results"]["image"]["systems"]
    assert list(kept) == ["mmproxy"] and kept["mmproxy"]["samples"] == 64


def test_ddp_profile_splits_gpu_time_by_who_launched_it(tmp_path):
    """A hand-made trace: two training steps on thread 1 (each also on the GPU's timeline, as
    torch.profiler writes them), an NCCL all-reduce, DALI kernels from thread 9; times in
    microseconds, the summary in ms per step."""
    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"correlation": corr}}

    def launch(tid, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": tid,
                "ts": 0, "dur": 1, "args": {"correlation": corr}}

    step = {"ph": "X", "cat": "user_annotation", "name": "train_step", "tid": 1}
    events = [{**step, "ts": 0, "dur": 10}, {**step, "ts": 10, "dur": 10},
              # the profiler repeats each range on the GPU's timeline: not more steps
              {**step, "cat": "gpu_user_annotation", "tid": 7, "ts": 0, "dur": 4000},
              {**step, "cat": "gpu_user_annotation", "tid": 7, "ts": 8000, "dur": 2000},
              launch(1, 1), launch(1, 2), launch(1, 3), launch(9, 4),
              kernel("conv", 0, 3000, 1),              # training 0-3 ms
              kernel("gemm", 2000, 2000, 2),           # training 2-4 ms (overlaps: 0-4 in all)
              kernel("ncclAllReduce", 3000, 3000, 3),  # 3-6 ms, 1 ms beside training
              kernel("nvjpeg_decode", 3500, 2000, 4),  # pipeline 3.5-5.5 ms, 0.5 ms beside
              kernel("conv", 8000, 2000, 1)]           # training 8-10 ms; idle 6-8 ms
    path = tmp_path / "rank0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from ddp_profile import summarize
    finally:
        sys.path.pop(0)
    row = summarize(str(path))
    assert row["steps"] == 2
    assert row == {**row, "step": 5.0, "train": 3.0, "nccl": 1.5, "nccl_only": 1.0,
                   "pipeline": 1.0, "pipeline_beside_train": 0.25, "idle": 1.0}


_PIN_SCRIPT = """
import os, sys, threading
from mmproxy.apps.bench.cpu import PinWorker, pin_threads
a, b = (int(c) for c in sys.argv[1:3])
ready, done = threading.Event(), threading.Event()
t = threading.Thread(target=lambda: (ready.set(), done.wait()))
t.start(); ready.wait()
pin_threads(frozenset({a}))
print(sorted(os.sched_getaffinity(t.native_id)) == [a], sorted(os.sched_getaffinity(0)) == [a])
seen = []
PinWorker(frozenset({b}), seen.append)(3)
print(sorted(os.sched_getaffinity(t.native_id)) == [b], seen)
done.set(); t.join()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_bench_worker_cpus_moves_every_thread_and_the_workers_apart(tmp_path):
    a, b = sorted(os.sched_getaffinity(0))[:2]
    done = subprocess.run([sys.executable, "-c", _PIN_SCRIPT, str(a), str(b)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["True True", "True [3]"]  # a thread started before too
    from mmproxy.apps.bench.cpu import cores_apart

    mine = frozenset(os.sched_getaffinity(0))
    assert cores_apart(str(b)) == (mine, mine - {b})
    for wrong in ("0-4096", "9-8", ",".join(map(str, sorted(mine)))):  # too many, none, all
        with pytest.raises(ValueError, match=f"--worker-cpus {wrong}: this process may use cores"):
            cores_apart(wrong)


def test_the_bench_best_epoch_leaves_the_warm_up_out():
    """A warm-up epoch that looks fast (a reader's first batches made before the timer starts) is
    reported but never counts as the best one, unless it is the only epoch."""
    import time

    import torch

    from mmproxy.apps.bench.timing import time_epochs

    calls = []

    def make_iter():
        calls.append(1)
        for _ in range(3):
            if len(calls) > 1:
                time.sleep(0.01)  # later epochs take ~30 ms; the first, nothing
            yield torch.zeros(8, 1)

    result = time_epochs(make_iter, 3, gpu=False)
    assert result["epochs"][0] > 10 * max(result["epochs"][1:])
    assert result["samples_per_s"] == pytest.approx(max(result["epochs"][1:]), abs=0.1)
    calls.clear()
    alone = time_epochs(make_iter, 1, gpu=False)
    assert alone["samples_per_s"] == pytest.approx(alone["epochs"][0], abs=0.1)
    assert alone["samples_per_s"] > 1000


def test_bench_damage_reports_what_mmproxy_skipped(tmp_path):
    """--damage: mmproxy on a copy of the shards with that share of JPEGs cut short; the result
    says how many samples its last epoch skipped, next to its rate."""
    out = tmp_path / "bench.json"
    run(["-m", "mmproxy.cli", "bench", "--workload", "image", "--samples", "64", "--batch-size",
         "16", "--epochs", "1", "--device", "cpu", "--data-dir", str(tmp_path / "data"),
         "--damage", "0.0625", "--systems", "mmproxy", "--json", str(out)], tmp_path)
    systems = json.loads(out.read_text())["results"]["image"]["systems"]
    assert systems["mmproxy"]["skipped"] == {"samples": 0, "shards": 0}
    assert systems["mmproxy-damaged"]["skipped"] == {"samples": 4, "shards": 0}
    assert systems["mmproxy-damaged"]["samples"] == 60


def test_benchmark_scripts_share_one_harness(tmp_path):
    """benchmarks/_harness.py: the options every script takes, the median and range of repeated
    measurements (ratios taken round by round), and the JSON with the settings, the date and the
    machine and code measured; remote_bench.py runs on it end to end (local shards only)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _harness
    finally:
        sys.path.pop(0)
    args = _harness.parser("Measures a thing.\n\nMore text.", workers=15).parse_args(
        ["--device", "cpu", "--data-dir", str(tmp_path / "d"), "--json", str(tmp_path / "o.json")])
    assert (args.workers, args.threads, args.batch_size) == (15, 2, None)
    assert _harness.setup(args) == (False, None, 64, tmp_path / "d")
    assert _harness.ratios([2.0, 3.0, 1.0], [1.0, 2.0, 2.0]) == [2.0, 1.5, 0.5]
    assert _harness.spread([2.0, 1.5, 0.5]) == {"median": 1.5, "range": [0.5, 2.0]}
    with pytest.raises(ValueError, match="rounds must pair up"):
        _harness.ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="no measurements"):
        _harness.spread([])
    _harness.write_json(args.json, args, False, {"rates": [1.0]})
    written = json.loads((tmp_path / "o.json").read_text())
    assert written["settings"]["workers"] == 15 and written["rates"] == [1.0]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", written["date"]) and written["machine"]["gpu"] is None
    assert re.fullmatch(r"[0-9a-f]{12}", written["machine"]["mmproxy"]["source"])

    out = tmp_path / "remote.json"
    printed = run(["benchmarks/remote_bench.py", "--systems", "local", "--samples", "64",
                   "--rounds", "2", "--workers", "1", "--threads", "1", "--batch-size", "16",
                   "--device", "cpu", "--data-dir", str(tmp_path / "data"), "--json", str(out)],
                  tmp_path)
    assert "round 1: local" in printed
    result = json.loads(out.read_text())
    assert result["settings"]["rounds"] == 2 and result["machine"]["cpus"] > 0
    local = result["results"]["image"]["systems"]["mmproxy"]  # the layout report.py renders
    assert local["vs_local"] == 1.0 and len(local["runs"]) == 2 and result["clients"] == {}


def _readme_block(heading, language):
    """The first ``language`` code block under README.md's ``heading``."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def test_readme_setup_runs_the_demo_without_the_test_tools():
    """README's first command installs the library alone and runs the demo (a user trying it does
    not install moto, mypy, ruff...); the second adds the test extra and runs the tests. CI runs
    these two lines as they are written."""
    first, second = _readme_block("Set-up", "bash").strip().splitlines()
    assert "pip install -c constraints.txt -e . &&" in first and "[test]" not in first
    assert first.endswith("&& mmproxy demo")
    assert 'pip install -c constraints.txt -e ".[test]"' in second
    assert second.endswith("&& python -m pytest")
    assert "README.md" in (ROOT / ".ci" / "run").read_text()


def test_readme_tour_runs_on_shards_that_make_shards_wrote(tmp_path):
    """The README's tour, as written but for sizes, on what `mmproxy make-shards` writes from an
    image class-folder tree and from audio class folders: its shard names are the tour's."""
    from mmproxy.testing import audio_bytes, demo_tokenizer, image_folder, synth_speech

    image_folder(tmp_path / "photos", per_class=8)
    for label in ("yes", "no"):
        (tmp_path / "clips" / label).mkdir(parents=True)
        for i in range(8):
            (tmp_path / "clips" / label / f"{i}.flac").write_bytes(
                audio_bytes(synth_speech(i, 0.3 + 0.1 * i, 16000), 16000, "FLAC"))
    run(["-m", "mmproxy.cli", "make-shards", str(tmp_path / "photos"), str(tmp_path / "shards")],
        tmp_path)
    run(["-m", "mmproxy.cli", "make-shards", "--kind", "audio-label", str(tmp_path / "clips"),
         str(tmp_path / "speech")], tmp_path)
    assert sorted(p.name for p in (tmp_path / "shards").glob("*.tar")) == ["shard-000000.tar"]
    assert sorted(p.name for p in (tmp_path / "speech").glob("*.tar")) == ["shard-000000.tar"]

    code = _readme_block("A short tour", "python")
    for pattern in ("shards/shard-{000000..000099}.tar", "speech/shard-{000000..000009}.tar"):
        assert f'"{pattern}"' in code
        folder = pattern.split("/")[0]
        code = code.replace(f'"{pattern}"', repr(str(tmp_path / folder / "shard-{000000..000000}.tar")))
    tokenizer = demo_tokenizer(tmp_path / "tokenizer")
    code = code.replace('"openai/clip-vit-base-patch32"', repr(tokenizer))
    code = re.sub(r"batch_size=\d+", "batch_size=4", code)
    code = re.sub(r"num_workers=\d+", "num_workers=2", code)
    # each loop's line naming the batch's fields prints their shapes instead
    code, lines = re.subn(r"^(\s+)(batch\[.*?)\s+#.*$", r"\1print(*(tuple(t.shape) for t in (\2)))",
                          code, flags=re.M)
    assert lines == 2, code
    script = tmp_path / "tour.py"
    script.write_text(code)
    out = run([str(script)], tmp_path).splitlines()
    assert len(out) == 8, out  # 16 images, then 16 clips, in batches of 4
    assert all(re.fullmatch(r"\(4, 3, 224, 224\) \(4, \d+\) \(4, \d+\)", line) for line in out[:4]), out
    assert all(re.fullmatch(r"\(4, \d+\) \(4,\) \(4,\)", line) for line in out[4:]), out
