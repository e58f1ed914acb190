"""Where an image epoch's time goes, mmproxy against DALI's reader: runs ``mmproxy bench`` in this
process with two probes and prints, per system:

- what the main process's Python threads were doing: a sampler looks at every thread's stack every
  few milliseconds and counts the innermost frame of ours or DALI's (the runner thread waiting in
  ``Pipe.outputs`` means DALI is the pace; in ``Pipe.feed`` or ``_convert``, the runner itself);
- the GPU's use from ``nvidia-smi dmon`` (SM, memory, and the JPEG decoder engines' ``jpg``
  column), averaged over the system's epochs (needs ``nvidia-smi``; skipped without it);
- the garbage collector's full (generation 2) collections in the system's epochs: how many, and
  how long they stopped every thread of the process;
- for mmproxy and DALI's reader, how many runs DALI held (scheduled, outputs not yet taken) over
  the system's time: the share of time with 0, 1, 2... runs queued, the runner's
  mean times in ``Pipe.feed`` and waiting in DALI's ``outputs``, and the *gap*: from a run's
  outputs coming back to the next run being scheduled, the time DALI had one run fewer.

``--no-freeze-gc`` leaves the collector as it is: the process counts as frozen already, so no
loader freezes it (as ``freeze_gc=False`` would; see ``mmproxy.DataLoader``).

Each system run is labelled ``NAME#K``: its name, and K its place among all the runs (``--runs``
interleaves them).

    python benchmarks/image_profile.py [--json OUT] -- BENCH-ARGUMENTS...
    # e.g. on one H200 with 16 cores:
    CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python benchmarks/image_profile.py -- --workload image \\
        --samples 16384 --workers 15 --threads 8 --epochs 8 --systems mmproxy,dali-reader

``mmproxy bench``'s own JSON and report still come out (pass ``--json`` after ``--``). The
engine variants of ``engine_ab.py`` (e.g. ``mmproxy-depth4``) can be named in ``--systems``.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import gc
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import engine_ab  # this script's folder is on the path

from mmproxy import cli, loader
from mmproxy.apps.bench import systems

OURS = ("/mmproxy/", "/nvidia/dali/", "/torch/utils/data/")


def _where(frame: Any) -> str:
    """The innermost frame of a thread's stack that is ours or DALI's, as ``file:function``."""
    while frame is not None:
        path = frame.f_code.co_filename
        if any(part in path for part in OURS):
            short = path.rsplit("/", 2)
            return f"{short[-2]}/{short[-1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


class Sampler(threading.Thread):
    """Samples the other threads' stacks every ``interval`` seconds into ``counts[label][thread]``."""

    def __init__(self, interval: float = 0.002) -> None:
        super().__init__(name="profile-sampler", daemon=True)
        self.interval, self.label = interval, None
        self.counts: dict[str, dict[str, collections.Counter]] = collections.defaultdict(
            lambda: collections.defaultdict(collections.Counter))
        self.stop = threading.Event()

    def run(self) -> None:
        names = {}
        while not self.stop.wait(self.interval):
            label = self.label
            if label is None:
                continue
            frames = sys._current_frames()
            for t in threading.enumerate():
                names[t.ident] = t.name
            for ident, frame in frames.items():
                name = names.get(ident, "?")
                if name == self.name:
                    continue
                kind = "runner" if name.endswith("-run") else "listener" if name.endswith(
                    "-listen") else "main" if name == "MainThread" else name.split("-")[0]
                self.counts[label][kind][_where(frame)] += 1


class GcPauses:
    """Times the collector's full collections: ``(start, seconds)`` each."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.time()
        else:
            self.pauses.append((self._start, time.time() - self._start))

    def within(self, start: float, end: float) -> dict[str, Any]:
        inside = [d for t, d in self.pauses if start <= t <= end]
        return {"full_collections": len(inside), "paused_ms": round(1000 * sum(inside), 1),
                "longest_ms": round(1000 * max(inside, default=0.0), 1)}


class Queued:
    """Runs held by DALI over time, by DALI's own count: each run given to a pipeline
    (``Pipeline._run_once``, or the first ``_prefetch`` of DALI's iterator) adds one; DALI's
    ``Pipeline.outputs`` returning in a server's runner thread (named ``mmproxy-NAME-run``), or
    ``Pipeline.share_outputs`` (DALI's iterator, for the reader), gives one back. Every pipeline
    counts in one total (the bench runs one system at a time). Runs a classic executor drops
    when the server rebuilds it after a bad sample stay counted: use it on clean data, or with
    DALI's dynamic executor (the default)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int, int]] = []  # (time, +n scheduled / -1 taken, pipeline)
        self.feeds: list[tuple[float, float]] = []  # (start, end) of Pipe.feed
        self.waits: list[tuple[float, float]] = []  # (start, end) of DALI's outputs in a runner

    def install(self) -> None:
        from nvidia.dali.pipeline import Pipeline

        from mmproxy._dali import Pipe

        feed, outputs, share_outputs = Pipe.feed, Pipeline.outputs, Pipeline.share_outputs
        run_once, prefetch = Pipeline._run_once, Pipeline._prefetch

        def timed_feed(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            feed(pipe, *args, **kwargs)  # (schedules too, unless fed ahead)
            self.feeds.append((start, time.perf_counter()))

        ids = itertools.count()

        def key(pipeline: Any) -> int:  # not id(): a later pipeline may reuse an address
            if "_profile_key" not in vars(pipeline):
                pipeline._profile_key = next(ids)
            return int(pipeline._profile_key)

        def counted(schedule: Any) -> Any:  # DALI's own count of the runs it was given
            def counted_schedule(pipeline: Any) -> Any:
                before = pipeline._batches_to_consume
                schedule(pipeline)
                if pipeline._batches_to_consume > before:
                    self.events.append((time.perf_counter(), pipeline._batches_to_consume - before,
                                        key(pipeline)))
            return counted_schedule

        def timed(take: Any, runner_only: bool) -> Any:
            def timed_take(pipeline: Any, *args: Any, **kwargs: Any) -> Any:
                if runner_only and not threading.current_thread().name.endswith("-run"):
                    return take(pipeline, *args, **kwargs)
                start = time.perf_counter()
                try:
                    return take(pipeline, *args, **kwargs)
                finally:
                    end = time.perf_counter()
                    self.waits.append((start, end))
                    self.events.append((end, -1, key(pipeline)))
            return timed_take

        Pipe.feed = timed_feed  # type: ignore[method-assign]
        Pipeline._run_once, Pipeline._prefetch = counted(run_once), counted(prefetch)  # type: ignore[method-assign]
        # mmproxy's runner takes outputs, DALI's iterator (the reader) shares them
        Pipeline.outputs = timed(outputs, runner_only=True)  # type: ignore[method-assign]
        Pipeline.share_outputs = timed(share_outputs, runner_only=False)  # type: ignore[method-assign]

    def within(self, start: float, end: float) -> dict[str, Any]:
        """Over [start, end] (perf_counter): the share of time with each number of runs held,
        mean feed and outputs-wait times, and the gap's median, mean and 90th percentile, in ms
        (the mean includes the waits for the workers' first batches at epoch starts)."""
        inside = sorted(e for e in self.events if start <= e[0] <= end)
        pipelines = {p for _, _, p in inside}  # runs an earlier system left in its pipeline: not counted
        level = sum(d for t, d, p in self.events if t < start and p in pipelines)
        held: dict[int, float] = collections.defaultdict(float)
        last = start
        for t, d, _ in [*inside, (end, 0, 0)]:
            if t > last:
                held[level] += t - last
            level, last = level + d, t
        total = sum(held.values()) or 1.0
        feeds = [(a, b) for a, b in self.feeds if start <= a <= end]
        waits = [(a, b) for a, b in self.waits if start <= a <= end]
        ends = sorted(t for t, d, _ in inside if d > 0)  # scheduled
        # (a prefetch schedules several at once; the gap is to the first scheduling after)
        gaps = []
        for _, back in waits:  # outputs came back: until the next run is scheduled
            i = bisect.bisect_left(ends, back)
            if i < len(ends):
                gaps.append(ends[i] - back)
        gaps.sort()

        def mean_ms(spans: list[tuple[float, float]]) -> float:
            return round(1000 * sum(b - a for a, b in spans) / max(1, len(spans)), 3)

        if not waits:
            return {}
        return {"share_of_time_with_runs_held": {str(k): round(v / total, 3)
                                                 for k, v in sorted(held.items())},
                "feed_ms": mean_ms(feeds), "outputs_wait_ms": mean_ms(waits),
                "gap_median_ms": round(1000 * gaps[len(gaps) // 2], 3) if gaps else 0.0,
                "gap_ms": round(1000 * sum(gaps) / max(1, len(gaps)), 3),
                "gap_p90_ms": round(1000 * gaps[int(0.9 * (len(gaps) - 1))], 3) if gaps else 0.0,
                "runs": len(waits)}


def _gpu_index() -> str:
    """The GPU the bench uses (the first of CUDA_VISIBLE_DEVICES), as nvidia-smi names it."""
    return (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"


def _dmon() -> subprocess.Popen | None:
    if shutil.which("nvidia-smi") is None:
        return None
    return subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-d", "1", "-o", "DT", "-i", _gpu_index()],
                            stdout=subprocess.PIPE, text=True)


def _gpu_use(lines: list[str], windows: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Averages dmon's columns over each system's window (dmon prints local YYYYMMDD HH:MM:SS)."""
    header = next((line.lstrip("#").split() for line in lines if line.startswith("#Date")), None)
    if header is None:
        return {}
    rows = []
    for line in lines:
        if line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != len(header):
            continue
        stamp = time.mktime(time.strptime(f"{fields[0]} {fields[1]}", "%Y%m%d %H:%M:%S"))
        rows.append((stamp, dict(zip(header[2:], fields[2:]))))
    out: dict[str, Any] = {}
    for label, start, end in windows:
        inside = [r for stamp, r in rows if int(start) < stamp <= int(end)]
        avg = {}
        for col in ("sm", "mem", "jpg", "dec"):
            vals = [float(r[col]) for r in inside if r.get(col, "-").replace(".", "").isdigit()]
            if vals:
                avg[col] = round(sum(vals) / len(vals), 1)
        out[label] = {"seconds_sampled": len(inside), **avg}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the profile here")
    parser.add_argument("--no-freeze-gc", action="store_true",
                        help="mmproxy's loaders leave the garbage collector as it is")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then mmproxy bench's arguments")
    args = parser.parse_args()
    bench = [a for a in args.bench if a != "--"]
    engine_ab.register()
    sampler = Sampler()
    windows: list[tuple[str, float, float]] = []
    spans: dict[str, tuple[float, float]] = {}  # the same windows in perf_counter time
    queued = Queued()
    queued.install()
    timed, running = systems.time_epochs, ["?"]

    def named(name: str, run: Any) -> Any:
        def run_named(setup: Any) -> Any:
            running[0] = name
            return run(setup)
        return run_named

    for name, system in list(systems.SYSTEMS.items()):
        systems.SYSTEMS[name] = dataclasses.replace(system, run=named(name, system.run))

    def time_epochs(make_iter: Any, epochs: int, gpu: bool, server: Any = None) -> Any:
        label = f"{running[0]}#{len(windows)}"  # the system's name, and its place in the run
        sampler.label, start, clock = label, time.time(), time.perf_counter()
        try:
            return timed(make_iter, epochs, gpu, server)
        finally:
            sampler.label = None
            windows.append((label, start, time.time()))
            spans[label] = (clock, time.perf_counter())

    systems.time_epochs = time_epochs
    if args.no_freeze_gc:
        loader._gc_frozen = True  # what the loaders check before freezing
    pauses = GcPauses()
    gc.callbacks.append(pauses)
    dmon = _dmon()
    sampler.start()
    try:
        code = cli.main(["bench", *bench])
    finally:
        sampler.stop.set()
        lines: list[str] = []
        if dmon is not None:
            dmon.terminate()
            try:
                lines = (dmon.communicate(timeout=10)[0] or "").splitlines()
            except subprocess.TimeoutExpired:
                dmon.kill()
                dmon.communicate()
    gpu = _gpu_use(lines, windows)
    report: dict[str, Any] = {"bench": bench, "freeze_gc": not args.no_freeze_gc, "systems": {}}
    for label, start, end in windows:
        threads = {}
        for kind, counter in sampler.counts[label].items():
            total = sum(counter.values())
            threads[kind] = {"samples": total, "top": {k: round(v / total, 3)
                                                       for k, v in counter.most_common(8)}}
        collections_ = pauses.within(start, end)
        held = queued.within(*spans[label])
        report["systems"][label] = {"gpu": gpu.get(label, {}), "gc": collections_,
                                    "threads": threads, **({"dali_runs": held} if held else {})}
        print(f"== {label}: GPU {gpu.get(label, {})}, GC {collections_}")
        if held:
            print(f"   DALI held runs (share of time) {held['share_of_time_with_runs_held']}; "
                  f"feed {held['feed_ms']} ms, outputs wait {held['outputs_wait_ms']} ms, "
                  f"gap median {held['gap_median_ms']} ms (mean {held['gap_ms']}, "
                  f"p90 {held['gap_p90_ms']})")
        for kind in ("main", "runner", "listener"):
            if kind in threads:
                top = ", ".join(f"{k} {v:.0%}" for k, v in list(threads[kind]["top"].items())[:5])
                print(f"   {kind:8s} {top}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
