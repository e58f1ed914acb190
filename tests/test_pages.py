"""The pages stay current by construction: BENCHMARKS.md and the README's table are what
benchmarks/report.py renders from benchmarks/results/, the README is a page of at most 8 KB, the
results are one folder a machine with the latest file a workload, and every results file the
bench and the scripts write names its command, commit and date."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REPORT = ROOT / "benchmarks" / "report.py"


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPORT), *args], capture_output=True, text=True,
                          timeout=60)


def tree(tmp_path: Path) -> Path:
    """A copy of the pages and the results that report.py --root can render."""
    for name in ("README.md", "BENCHMARKS.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(RESULTS, tmp_path / "benchmarks" / "results")
    return tmp_path


def test_the_pages_are_what_the_results_render():
    done = report("--check")
    assert done.returncode == 0, done.stderr


def test_check_names_the_page_a_changed_result_makes_stale(tmp_path):
    root = tree(tmp_path)
    image = root / "benchmarks" / "results" / "gpu-h200" / "image.json"
    data = json.loads(image.read_text())
    mmproxy = data["results"]["image"]["systems"]["mmproxy"]
    mmproxy["runs"][0]["sustained"] *= 1.5
    changed = f"{round(mmproxy['runs'][0]['sustained']):,}"
    mmproxy["sustained_samples_per_s"] *= 1.2
    image.write_text(json.dumps(data))
    stale = report("--check", "--root", str(root))
    assert stale.returncode == 1
    assert "README.md" in stale.stderr and "BENCHMARKS.md" in stale.stderr
    before = (root / "BENCHMARKS.md").read_text()
    assert report("--root", str(root)).returncode == 0
    after = (root / "BENCHMARKS.md").read_text()
    assert after != before and changed in after  # the changed run's rate
    assert report("--check", "--root", str(root)).returncode == 0


def test_a_results_file_no_section_reads_is_refused(tmp_path):
    root = tree(tmp_path)
    extra = root / "benchmarks" / "results" / "cpu-2core" / "image-again.json"
    shutil.copy(root / "benchmarks" / "results" / "cpu-2core" / "image.json", extra)
    done = report("--check", "--root", str(root))
    assert done.returncode != 0
    assert "cpu-2core/image-again.json" in done.stderr and "section" in done.stderr


def test_a_results_file_without_its_command_is_refused(tmp_path):
    root = tree(tmp_path)
    path = root / "benchmarks" / "results" / "cpu-2core" / "video.json"
    data = json.loads(path.read_text())
    del data["command"]
    path.write_text(json.dumps(data))
    done = report("--check", "--root", str(root))
    assert done.returncode != 0 and "cpu-2core/video.json lacks command" in done.stderr


def test_results_are_one_folder_a_machine_each_file_with_its_provenance():
    tracked = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    assert len(tracked) <= 40, len(tracked)
    folders = {Path(p).parent.name for p in tracked}
    assert folders <= {"cpu-2core", "gpu-h200", "gpu-h200x2"}, folders
    assert all(len(Path(p).parts) == 4 and p.endswith(".json") for p in tracked), tracked
    for path in tracked:
        data = json.loads((ROOT / path).read_text())
        assert all(data.get(k) for k in ("command", "commit", "date")), path


def test_readme_is_a_page_of_at_most_8_kb_with_its_table_and_no_limitations_list():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 8 * 1024
    assert "<!-- headline: rendered by benchmarks/report.py -->" in readme
    assert "## Limitations" not in readme and "docs/limitations.md" in readme
    assert 'pipelines="auto"' in readme


def test_no_page_names_how_a_machine_was_had():
    words = "|".join(["le" + "ases?", "call [0-9]+"])  # spelt apart, so that this file is no hit
    found = subprocess.run(["git", "grep", "-n", "-i", "-w", "-E", words],
                           cwd=ROOT, capture_output=True, text=True)
    if found.returncode == 128:
        pytest.skip("not a git checkout")
    assert found.stdout == "", found.stdout


def test_history_is_at_most_200_lines():
    assert len((ROOT / "benchmarks" / "HISTORY.md").read_text().splitlines()) <= 200


@pytest.mark.timeout(300)
def test_bench_json_opens_with_command_commit_and_date(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "mmproxy.cli", "bench", "--device", "cpu", "--workload", "machinery",
         "--systems", "mmproxy", "--samples", "64", "--workers", "0", "--epochs", "2",
         "--data-dir", str(tmp_path / "data"), "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    assert list(data)[:3] == ["command", "commit", "date"]
    assert data["command"].startswith("mmproxy bench --device cpu --workload machinery")
    assert data["date"] == time.strftime("%Y-%m-%d")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert data["commit"] == head.stdout.strip()[:12]


def test_a_script_json_opens_with_command_commit_and_date(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmarks/resume_bench.py", "--rounds", "2"])
    import argparse

    import _harness

    out = tmp_path / "r.json"
    _harness.write_json(str(out), argparse.Namespace(rounds=2), False, {"rates": [1.0]})
    data = json.loads(out.read_text())
    assert data["command"] == "python3 benchmarks/resume_bench.py --rounds 2"
    assert data["commit"] and data["date"] == time.strftime("%Y-%m-%d")
    assert data["rates"] == [1.0] and data["machine"]["cpus"] > 0
