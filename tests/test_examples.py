"""Every example runs as written, on CPU with tiny data; the DDP example across two ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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


def test_ddp_two_ranks_disjoint_cover_and_equal_batches(tmp_path):
    keys = tmp_path / "keys"
    out = run(["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
               "examples/train_ddp.py", "--epochs", "2", "--batch-size", "16",
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
    out = run(["examples/train_ddp.py", "--synthetic", "--model", "resnet50", "--epochs", "2",
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


def test_demo_command_runs(tmp_path):
    out = run(["-m", "mmproxy.cli", "demo", "--samples", "64", "--quiet"], tmp_path)
    assert "image      64 samples" in out and "skipped 0 samples" in out
