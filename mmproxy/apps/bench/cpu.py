"""CPU accounting: CPU time of the DataLoader workers and of this process's threads, by group."""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["CPU_GROUPS", "PinWorker", "cores_apart", "cpu_ms_per_batch", "cpu_seconds",
           "pin_threads"]

CPU_GROUPS = ("workers", "main-thread", "server-threads", "dali-threads")


def cpu_seconds() -> dict[tuple[str, int], float]:
    """CPU time so far of each worker (child process) and of each of this process's threads,
    keyed by (group, pid or thread id)."""
    import threading

    import psutil

    from mmproxy.pipelines.audio import THREAD_PREFIX, pool_cpu_seconds

    me = psutil.Process()
    # Python's own threads by name; a thread Python did not start (DALI's, torch's, FFmpeg's)
    # shows up only as a placeholder once it has called Python code: such threads count as the
    # pipeline's, as threads Python does not know at all do
    names = {t.native_id: t.name for t in threading.enumerate()
             if not isinstance(t, threading._DummyThread)}  # type: ignore[attr-defined]
    out: dict[tuple[str, int], float] = {}
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
            out["workers", child.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    # The pools of a pipeline's Python functions live for one call each: their CPU comes from
    # their own count (pipelines/audio.py, map_batch), not from the threads alive now. The bench's
    # own threads ("bench-": the --stacks sampler) count in no group.
    for t in me.threads():
        name = names.get(t.id)
        if name is not None and name.startswith((THREAD_PREFIX, "bench-")):
            continue
        group = ("dali-threads" if name is None else "main-thread" if name == "MainThread"
                 else "server-threads")
        out[group, t.id] = t.user_time + t.system_time
    out["dali-threads", 0] = pool_cpu_seconds()
    return out


def cpu_ms_per_batch(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float],
                     batches: int) -> dict[str, float]:
    """CPU per batch by group, between two snapshots (a process or thread that ended in between
    is not counted, but for the pipeline functions' pools, counted apart; one that started
    counts from zero)."""
    out = dict.fromkeys(CPU_GROUPS, 0.0)
    for (group, ident), seconds in after.items():
        out[group] += seconds - before.get((group, ident), 0.0)
    return {k: round(1000 * v / batches, 2) for k, v in out.items()}


def pin_threads(cores: frozenset[int]) -> None:
    """Puts every thread of this process on ``cores``: DALI's threads (started when a pipeline is
    built) included; threads started later inherit it from the thread that starts them."""
    done: set[str] = set()
    while True:  # again until no new thread shows up (one may start while the others move)
        new = set(os.listdir("/proc/self/task")) - done
        if not new:
            return
        for tid in new:
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:  # a thread that has just ended
                pass
        done |= new


def cores_apart(worker_cpus: str | None) -> tuple[frozenset[int], frozenset[int]] | None:
    """``--worker-cpus``: (all the cores this process may use, those that are not the workers')."""
    from mmproxy.apps.bench.remote import cpu_list

    workers = cpu_list(worker_cpus)
    if workers is None:
        return None
    mine = frozenset(os.sched_getaffinity(0))
    rest = mine - workers
    if not workers or not workers <= mine or not rest:
        raise ValueError(f"--worker-cpus {worker_cpus}: this process may use cores "
                         f"{sorted(mine)}; the workers' cores must be some of them, not all")
    return mine, rest


class PinWorker:
    """A DataLoader ``worker_init_fn`` that moves the worker onto ``cores``, then calls ``then``."""

    def __init__(self, cores: frozenset[int], then: Callable[[int], None] | None = None) -> None:
        self.cores, self.then = cores, then

    def __call__(self, worker_id: int) -> None:
        pin_threads(self.cores)
        if self.then is not None:
            self.then(worker_id)
