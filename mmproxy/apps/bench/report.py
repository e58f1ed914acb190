"""Report: the machine, mmproxy's ratio to each system, the printed summary and the bar chart."""

from __future__ import annotations

import glob
import os
import platform
import shlex
import sys
import time
from typing import Any

__all__ = ["add_ratios", "error_line", "machine", "plot", "print_summary", "provenance",
           "system_line"]


def machine(gpu: bool) -> dict[str, Any]:
    """The GPU's name (None on CPU), CPU count, the versions that matter, and the code measured."""
    import nvidia.dali
    import torch

    return {"gpu": torch.cuda.get_device_name() if gpu else None, "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "dali": nvidia.dali.__version__, "mmproxy": revision()}


def provenance() -> dict[str, str]:
    """What a results file opens with: ``command``, this process's command line (``mmproxy ...``
    for the mmproxy program, ``python3 SCRIPT ...`` for a script); ``commit``, the HEAD of the
    checkout mmproxy runs from (read from ``.git``), or ``mmproxy VERSION`` outside one; and
    ``date``, today's (``YYYY-MM-DD``)."""
    import mmproxy

    program = sys.argv[0]
    if os.path.basename(program) == "mmproxy" or program.endswith(os.path.join("mmproxy", "cli.py")):
        words = ["mmproxy"]
    elif program.endswith(".py"):
        words = ["python3", program]
    else:
        words = [os.path.basename(program)]
    commit = revision()["commit"][:12] or f"mmproxy {mmproxy.__version__}"  # no git run
    return {"command": shlex.join(words + sys.argv[1:]), "commit": commit,
            "date": time.strftime("%Y-%m-%d")}


def revision() -> dict[str, str]:
    """The code measured: ``source``, a hash of mmproxy's Python files (the engine, datasets and
    pipelines: the same files give the same hash, in a checkout, an installed copy or a copied
    tree, so it also tells whether a checkout's files are its commit's), and ``commit``, the
    HEAD of the git checkout that runs, or "" outside one (read from ``.git``, no git run)."""
    import hashlib

    import mmproxy
    import mmproxy.datasets
    import mmproxy.pipelines

    digest = hashlib.sha256()
    for name, package in (("mmproxy", mmproxy), ("datasets", mmproxy.datasets),
                          ("pipelines", mmproxy.pipelines)):
        folder = os.path.dirname(os.path.abspath(package.__file__ or ""))
        for path in sorted(glob.glob(os.path.join(folder, "**", "*.py"), recursive=True)):
            relative = os.path.relpath(path, folder)
            if name == "mmproxy" and relative.split(os.sep)[0] in ("datasets", "pipelines"):
                continue  # installed, they sit inside mmproxy/: counted as their own packages
            digest.update(f"{name}/{relative}".encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read())
    root = os.path.dirname(os.path.dirname(os.path.abspath(mmproxy.__file__ or "")))
    return {"source": digest.hexdigest()[:12], "commit": _git_head(os.path.join(root, ".git"))}


def _git_head(git: str) -> str:
    """The commit a checkout's ``.git`` names as HEAD (a branch's ref, a packed ref, or a
    detached commit), or "" when there is none."""
    try:
        if os.path.isfile(git):  # a worktree or submodule: "gitdir: PATH"
            with open(git) as f:
                git = os.path.join(os.path.dirname(git), f.read().split(":", 1)[1].strip())
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref: "):
            return head[:12]
        ref = head[5:]
        common = git
        if os.path.exists(os.path.join(git, "commondir")):
            with open(os.path.join(git, "commondir")) as f:
                common = os.path.join(git, f.read().strip())
        for where in (git, common):
            if os.path.exists(os.path.join(where, ref)):
                with open(os.path.join(where, ref)) as f:
                    return f.read().strip()[:12]
        with open(os.path.join(common, "packed-refs")) as f:
            for line in f:
                if line.rstrip().endswith(" " + ref):
                    return line.split()[0][:12]
    except (OSError, IndexError):
        pass
    return ""


def error_line(err: BaseException) -> str:
    """One line for a failed system; for an error raised in a DataLoader worker, its own line
    (torch's message starts with "Caught X in DataLoader worker process N" and a traceback)."""
    from mmproxy._server.dali import summary
    from mmproxy.errors import SkipLimitError

    if isinstance(err, SkipLimitError):  # the bench's option, not the dataset's argument
        return (f"SkipLimitError: {err.counted}, more than --max-skipped={err.limit:g} "
                "(raise it to measure on this data)")
    lines = [line for line in str(err).strip().splitlines() if line.strip()] or [""]
    if "Original Traceback" in str(err):
        return lines[-1][:300]
    # DALI's own errors: the line after "encountered:" and the operator, not the preamble
    return f"{type(err).__name__}: {summary(err) if 'encountered:' in lines else lines[0]}"[:300]


def add_ratios(results: dict[str, dict[str, Any]]) -> None:
    """Adds ``mmproxy_ratio`` (mmproxy's rate / the system's) to each system's result, for the
    remote systems their rate relative to local shards (``vs_local``), and for mmproxy-damaged
    its rate over the samples delivered relative to clean data."""
    base = results.get("mmproxy", {}).get("samples_per_s")
    for result in results.values():
        if base and "samples_per_s" in result:
            result["mmproxy_ratio"] = round(base / result["samples_per_s"], 3)
    for name in ("mmproxy-http", "mmproxy-s3", "mmproxy-cached"):
        if base and "samples_per_s" in results.get(name, {}):
            results[name]["vs_local"] = round(results[name]["samples_per_s"] / base, 3)
    damaged = results.get("mmproxy-damaged", {})
    if base and "samples_per_s" in damaged:
        damaged["damaged_vs_clean"] = round(damaged["samples_per_s"] / base, 3)
        clean = results["mmproxy"]["sustained_samples_per_s"]
        damaged["sustained_damaged_vs_clean"] = (
            round(damaged["sustained_samples_per_s"] / clean, 3)
            if damaged.get("sustained_samples_per_s") else None)


def system_line(result: dict[str, Any]) -> str:
    """One system's result in words: its best rate, each epoch's (the first warms up), the
    samples and batches of an epoch, what it skipped; or why it did not run."""
    if "samples_per_s" not in result:
        return str(result.get("error", "no result"))
    epochs = result.get("epochs") or []
    each = (f"; epochs {epochs[0]:.1f} (warm-up), {', '.join(f'{r:.1f}' for r in epochs[1:])}"
            if len(epochs) > 1 else "")
    skipped = result.get("skipped") or {}
    lost = ", ".join(f"{skipped[k]} {k}" for k in ("samples", "shards") if skipped.get(k))
    pipes = (f"; {_count(result['pipelines'], 'pipeline')}" if result.get("pipelines") else "")
    memory = result.get("gpu_memory_mib")
    return (f"{result['samples_per_s']:10.1f} samples/s (best epoch{each}); "
            f"{_count(result.get('samples', 0), 'sample')} in "
            f"{_count(result.get('batches', 0), 'batch')} an epoch" + pipes
            + (f"; GPU memory {memory:+.0f} MiB" if memory is not None else "")
            + (f"; skipped {lost}" if lost else ""))


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("ch") else "s")


_FEW_BATCHES = 20  # fewer batches an epoch than this: the rates say little


def print_summary(out: dict[str, Any], workers: int) -> None:
    """Throughput per workload and system, and mmproxy's ratio to each."""
    gpu = out["machine"]["gpu"]
    print(f"\nmmproxy bench ({'GPU ' + str(gpu) if gpu else 'CPU'}, {_count(workers, 'worker')}): "
          "throughput, and mmproxy's ratio to each system")
    width = max((len(n) for r in out["results"].values() for n in r["systems"]), default=15)
    for kind, r in out["results"].items():
        for name, s in r["systems"].items():
            if "samples_per_s" in s:
                runs = s.get("mmproxy_ratio_sustained")
                spread = (f"; sustained, median of {runs['runs']} runs: {runs['median']:.2f} "
                          f"(range {runs['range'][0]:.2f}-{runs['range'][1]:.2f})"
                          if runs and runs["runs"] > 1 else "")
                ratio = s.get("mmproxy_ratio")
                print(f"  {kind:10s} {name:{width}s} {s['samples_per_s']:10.1f} samples/s   "
                      f"mmproxy / this = {'n/a' if ratio is None else f'{ratio:.2f}'}{spread}")
            else:
                print(f"  {kind:10s} {name:{width}s} {s['error']}")
        counted = [s["batches"] for s in r["systems"].values() if s.get("batches")]
        batches = (r["systems"].get("mmproxy", {}).get("batches") or min(counted, default=0)
                   or -(-(r.get("samples") or 0) // (r.get("batch_size") or 1)))  # as measured
        if 0 < batches < _FEW_BATCHES:
            print(f"  {kind:10s} note: {_count(batches, 'batch')} an epoch "
                  f"{'is' if batches == 1 else 'are'} too few to time: start-up is most of each "
                  "epoch (a DALI reader's first batches are ready before its clock starts); use "
                  f"at least {_FEW_BATCHES}")


def plot(out: dict[str, Any], path: str) -> None:
    """A PNG with a bar chart of samples/s per system, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(out["results"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        systems = {k: v["samples_per_s"] for k, v in out["results"][kind]["systems"].items()
                   if "samples_per_s" in v}
        ax.bar(list(systems), list(systems.values()),
               color=["tab:green" if k == "mmproxy" else "tab:gray" for k in systems])
        ax.set_title(kind)
        ax.set_ylabel("samples/s")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
