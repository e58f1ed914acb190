"""Session: one ``mmproxy bench`` run, every workload through each of its systems, then the report.

Every system reads the same WebDataset shards (:mod:`~mmproxy.apps.bench.shards`) with the same
batch size and worker count; each runs ``--epochs`` epochs and its best epoch counts. Results are
printed as ratios to mmproxy and written as JSON (and a PNG bar chart with ``--plot``).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

from mmproxy.apps.bench.memory import memory
from mmproxy.apps.bench.report import add_ratios, error_line, machine, plot, print_summary
from mmproxy.apps.bench.shards import write_shards
from mmproxy.apps.bench.systems import WORKLOADS, Setup, select

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Runs the bench of ``args`` (the ``mmproxy bench`` command line); returns the exit code."""
    from mmproxy.pipelines import resolve_device
    from mmproxy.testing import cache_dir

    gpu, device_id = resolve_device(args.device)
    folder = Path(args.data_dir or cache_dir() / "bench")
    workloads = (list(WORKLOADS) if args.workload == "all"
                 else [w.strip() for w in args.workload.split(",")])
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown workload(s) {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    select("image", names, 0.0)  # unknown names fail before any shard is written
    out: dict[str, Any] = {"machine": machine(gpu),
                           "settings": {k: v for k, v in vars(args).items() if k != "func"},
                           "results": {}}
    for workload in workloads:
        setup = _setup(args, workload, folder, gpu, device_id)
        results: dict[str, Any] = {}
        for system in select(workload, names, args.damage):
            gc.collect()  # destroy the last system's pipelines here, not in forked workers
            try:
                results[system.name] = system.run(setup)
            except Exception as err:  # a reference system that cannot run is reported, not fatal
                results[system.name] = {"error": error_line(err)}
            print(f"[{workload}] {system.name:12s} {results[system.name]}", flush=True)
        add_ratios(results)
        out["results"][workload] = {"batch_size": setup.batch, "samples": _samples(args, workload),
                                    "systems": results}
    if args.memory_epochs:
        setup = Setup(args, "image", write_shards(folder, "image", args.samples, args.workers),
                      folder, gpu, device_id, args.batch_size or (256 if gpu else 64))
        out["memory"] = memory(setup, args.memory_epochs)
        print("[memory]", out["memory"])
    Path(args.json).write_text(json.dumps(out, indent=2))
    print_summary(out, args.workers)
    if args.plot:
        plot(out, args.plot)
    return 0


def _samples(args: argparse.Namespace, workload: str) -> int:
    return args.samples // 4 if workload == "audio" else args.samples


def _setup(args: argparse.Namespace, workload: str, folder: Path, gpu: bool,
           device_id: int | None) -> Setup:
    """The workload's shards (written once), batch size and, for image-text, tokenizer."""
    from mmproxy.testing import demo_tokenizer

    audio = workload == "audio"
    batch = args.batch_size or ((64 if audio else 256) if gpu else (32 if audio else 64))
    paths = ([] if workload == "machinery" else
             write_shards(folder, "audio" if audio else "image", _samples(args, workload),
                          args.workers))
    tokenizer = demo_tokenizer(folder / "tokenizer") if workload == "image-text" else None
    return Setup(args, workload, paths, folder, gpu, device_id, batch, tokenizer)
