"""Session: one ``mmproxy bench`` run, every workload through each of its systems, then the report.

Every system reads the same WebDataset shards (:mod:`~mmproxy.apps.bench.shards`, or yours with
``--data``) with the same batch size and worker count; each runs ``--epochs`` epochs: the first
(warm-up: workers and pipelines starting) is reported apart, the best epoch and the sustained rate
over the later ones count. With ``--runs N`` every system runs N times, the runs interleaved
(run 1 of every system, then run 2, ...), and the report gives the median and the range over the
runs, of the rates and of mmproxy's ratio to each system. Results are printed as ratios to
mmproxy and written as JSON (and a PNG bar chart with ``--plot``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from mmproxy.apps.bench.cpu import cores_apart, pin_threads
from mmproxy.apps.bench.memory import memory
from mmproxy.apps.bench.report import (
    add_ratios,
    error_line,
    machine,
    plot,
    print_summary,
    provenance,
    system_line,
)
from mmproxy.apps.bench.shards import write_shards
from mmproxy.apps.bench.stacks import ThreadStacks
from mmproxy.apps.bench.systems import WORKLOADS, Setup, select

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Runs the bench of ``args`` (the ``mmproxy bench`` command line); returns the exit code."""
    from mmproxy.pipelines import resolve_device
    from mmproxy.testing import cache_dir

    gpu, device_id = resolve_device(args.device)
    folder = Path(args.data_dir or cache_dir() / "bench")
    asked = args.workload or "image"
    workloads = list(WORKLOADS) if asked == "all" else [w.strip() for w in asked.split(",")]
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workload(s) {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    if args.runs < 1 or args.epochs < 1:
        raise ValueError(f"--runs and --epochs must be at least 1, got {args.runs} and {args.epochs}")
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    select("image", names, 0.0)  # unknown names fail before any shard is written
    apart = cores_apart(getattr(args, "worker_cpus", None))
    out: dict[str, Any] = {**provenance(), "machine": machine(gpu),
                           "settings": {k: v for k, v in vars(args).items()
                                        if k not in ("func", "command_parser")},
                           "results": {}}
    setups = ([_user_setup(args, folder, gpu, device_id)] if args.data else
              [_setup(args, workload, folder, gpu, device_id) for workload in workloads])
    for setup in setups:
        workload = setup.workload
        runs: dict[str, list[dict[str, Any]]] = {}
        damaged = ""  # what mmproxy skipped of your data (--data), once it has run
        for number in range(args.runs):
            systems = select(workload, names, args.damage)
            if args.data:  # mmproxy first: what it finds damaged decides what else may run
                systems.sort(key=lambda s: s.name != "mmproxy")
            for system in systems:
                if apart:  # DALI's threads off the workers' cores; a system without workers
                    pin_threads(apart[1] if system.has_workers else apart[0])  # gets them all
                gc.collect()  # destroy the last system's pipelines here, not in forked workers
                if damaged and system.dali_without_checks:
                    result: dict[str, Any] = {"error": (
                        f"not run: mmproxy skipped files of your data ({damaged}); "
                        f"{system.name} would feed them to DALI's decoders unchecked, and some "
                        "such files crash the process (bench clean shards to compare)")}
                else:
                    try:
                        if args.stacks:
                            with ThreadStacks(gpu, device_id) as stacks:
                                result = system.run(setup)
                            result["stacks"] = stacks.report()
                        else:
                            result = system.run(setup)
                    except Exception as err:  # a reference system that cannot run is reported
                        result = {"error": error_line(err)}
                if system.name == "mmproxy" and args.data:
                    damaged = damaged or _damage(result)
                runs.setdefault(system.name, []).append(result)
                print(f"[{workload}]{f' run {number + 1}' if args.runs > 1 else ''} "
                      f"{system.name:15s} {system_line(result)}", flush=True)
                # after every system: a run cut short (a time limit, a crash) keeps what it measured
                out["results"][workload] = _workload(args, setup, runs)
                Path(args.json).write_text(json.dumps(out, indent=2))
    if args.memory_epochs:
        setup = Setup(args, "image", write_shards(folder, "image", args.samples, args.workers),
                      folder, gpu, device_id, args.batch_size or (256 if gpu else 64))
        if apart:
            pin_threads(apart[1])
        out["memory"] = memory(setup, args.memory_epochs)
        for row in out["memory"]["per_epoch"]:
            print(f"[memory] epoch {row['epoch']}: resident {row['rss_mb']} MB, /dev/shm "
                  f"{row['dev_shm_mb']} MB, shared memory {row['shmem_mb']} MB, runs held by the "
                  f"server {row['server_runs_held']}")
    Path(args.json).write_text(json.dumps(out, indent=2))
    print_summary(out, args.workers)
    if args.plot:
        plot(out, args.plot)
    failed = [w for w, r in out["results"].items() if "error" in r["systems"].get("mmproxy", {})]
    if failed:  # the system the bench is about did not run: not a success
        print(f"mmproxy bench: mmproxy failed on the {', '.join(failed)} workload(s); see its "
              "error above", file=sys.stderr)
        return 1
    return 0


def _workload(args: argparse.Namespace, setup: Setup,
              runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """A workload's entry of the JSON from its systems' runs so far."""
    results = {name: _combine(rs) for name, rs in runs.items()}
    add_ratios(results)
    _run_ratios(results, runs)
    counted = next((r["samples"] for r in results.values() if "samples" in r), None)
    return {"batch_size": setup.batch, "systems": results,
            "samples": counted if args.data else _samples(args, setup.workload),
            **({"data": args.data, "field": setup.ext} if args.data else {})}


def _damage(result: dict[str, Any]) -> str:
    """What mmproxy skipped, in words ("3 sample(s) and 1 shard(s) skipped", or its skip limit's
    count), or "" when it skipped nothing."""
    if "damaged" in result:  # it stopped at its skip limit
        return str(result["damaged"])
    skipped = result.get("skipped") or {}
    parts = [f"{skipped[k]} {k[:-1]}(s)" for k in ("samples", "shards") if skipped.get(k)]
    return " and ".join(parts) + " skipped" if parts else ""


def _combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's runs as one result: the median run's figures (best epoch and sustained rate
    medians over the runs), every run's epochs kept."""
    if len(results) == 1 or any("error" in r for r in results):
        return next((r for r in results if "error" in r), results[0])
    best = [r["samples_per_s"] for r in results]
    sustained = [r["sustained_samples_per_s"] for r in results if r.get("sustained_samples_per_s")]
    middle = sorted(results, key=lambda r: r["samples_per_s"])[len(results) // 2]
    return {**middle, "samples_per_s": statistics.median(best),
            "samples_per_s_range": [min(best), max(best)],
            "sustained_samples_per_s": statistics.median(sustained) if sustained else None,
            "sustained_range": [min(sustained), max(sustained)] if sustained else None,
            "warmup_epochs": [r["epochs"][0] for r in results],
            "runs": [{"epochs": r["epochs"], "sustained": r.get("sustained_samples_per_s")}
                     for r in results]}


def _run_ratios(results: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> None:
    """mmproxy's sustained rate over each system's, run by run (runs interleaved, so run i of
    both saw the same machine): the median and the range."""
    mine = runs.get("mmproxy", [])
    for name, theirs in runs.items():
        ratios = [a["sustained_samples_per_s"] / b["sustained_samples_per_s"]
                  for a, b in zip(mine, theirs)
                  if a.get("sustained_samples_per_s") and b.get("sustained_samples_per_s")]
        if ratios and "error" not in results[name]:
            results[name]["mmproxy_ratio_sustained"] = {
                "median": round(statistics.median(ratios), 3),
                "range": [round(min(ratios), 3), round(max(ratios), 3)], "runs": len(ratios)}


_BATCH = {"image": (256, 64), "audio": (64, 32), "video": (32, 8)}  # (on a GPU, on CPU)


def _user_setup(args: argparse.Namespace, folder: Path, gpu: bool,
                device_id: int | None) -> Setup:
    """Your shards (``--data``): the heavy field is ``--field`` (an extension, or several joined
    by ``;``), else every image, audio or video extension, whichever family the first sample
    has, so a set of JPEGs and PNGs is read whole; the workload follows from it."""
    from mmproxy.apps.data import expand_data, first_sample_fields
    from mmproxy.datasets.recipes import AUDIO_EXTS, IMAGE_EXTS, VIDEO_EXTS

    paths = expand_data(args.data)
    first, exts = first_sample_fields(paths)
    families = {"image": IMAGE_EXTS, "audio": AUDIO_EXTS, "video": VIDEO_EXTS}
    of = {ext: family for family, spec in families.items() for ext in spec.split(";")}
    if args.field:
        named = [e.strip().lower() for e in args.field.split(";") if e.strip()]
        if not named or len({of.get(e) for e in named}) != 1 or named[0] not in of:
            raise ValueError(f"--field {args.field!r} is neither image ({IMAGE_EXTS}), audio "
                             f"({AUDIO_EXTS}) nor video ({VIDEO_EXTS}) extensions (of one of them)")
        if not set(named) & set(exts):
            raise ValueError(f"the first sample of {first} has no {args.field!r} field (it has "
                             f"{', '.join(exts)}); --field names a field of your samples")
        field, workload = ";".join(named), of[named[0]]
    else:
        workload = next((of[e] for e in exts if e in of), "")
        if not workload:
            raise ValueError(f"the first sample of {first} has no image, audio or video field "
                             f"(it has {', '.join(exts)}); name one with --field")
        field = families[workload]
    if args.workload is not None and args.workload != workload:
        raise ValueError(f"--workload {args.workload} does not apply to --data: the bench loads "
                         f"one heavy field of your shards, here {field!r} (the {workload} "
                         "workload); name another with --field")
    batch = args.batch_size or _BATCH[workload][0 if gpu else 1]
    print(f"mmproxy bench: your data, {len(paths)} shard(s), field {field!r} ({workload} "
          "workload)", flush=True)
    return Setup(args, workload, paths, folder, gpu, device_id, batch, field=field)


def _samples(args: argparse.Namespace, workload: str) -> int:
    return max(1, args.samples // {"audio": 4, "video": 16}.get(workload, 1))


def _setup(args: argparse.Namespace, workload: str, folder: Path, gpu: bool,
           device_id: int | None) -> Setup:
    """The workload's shards (written once), batch size and, for image-text, tokenizer."""
    from mmproxy.testing import demo_tokenizer

    if workload == "video":
        import av  # noqa: F401  (the clips are written and decoded with PyAV: said when missing)
    batch = args.batch_size or _BATCH.get(workload, _BATCH["image"])[0 if gpu else 1]
    paths = ([] if workload == "machinery" else
             write_shards(folder, workload if workload in ("audio", "video") else "image",
                          _samples(args, workload), args.workers))
    tokenizer = demo_tokenizer(folder / "tokenizer") if workload == "image-text" else None
    return Setup(args, workload, paths, folder, gpu, device_id, batch, tokenizer)
