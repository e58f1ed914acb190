"""A batch's samples on threads of the call's own, for functions DALI runs through
``fn.python_function(..., batch_processing=True)``.

DALI runs such a function one call at a time, with the GIL, so a function that takes its batch
sample by sample holds the pipeline to one core. :func:`map_batch` spreads the samples over up to
8 threads (no more than the cores this process may use); the work must release the GIL (torch's
and libsoxr's kernels do). The threads start and end with the call: nothing outlives a server's
stop, and a forked child starts threads of its own.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["THREAD_PREFIX", "map_batch", "pool_cpu_seconds"]

THREAD_PREFIX = "mmproxy-pyfn"  # their names
_MOST = 8
_spent = 0.0  # CPU seconds the pools' threads have spent in this process, all calls together
_spent_lock = threading.Lock()


def pool_cpu_seconds() -> float:
    """CPU seconds spent on :func:`map_batch`'s threads so far in this process (threads that
    live for one call each, which a count of the live threads misses): the bench counts them as
    the pipeline's."""
    return _spent


def map_batch(function: Callable[..., Any], *columns: Sequence[Any]) -> list[Any]:
    """``[function(*row) for row in zip(*columns)]``, the rows on threads of this call's own."""
    n = len(columns[0]) if columns else 0
    threads = min(_MOST, len(os.sched_getaffinity(0)), n)
    if threads <= 1:
        return [function(*row) for row in zip(*columns)]
    with ThreadPoolExecutor(threads, thread_name_prefix=THREAD_PREFIX) as pool:
        return list(pool.map(lambda *row: _timed(function, row), *columns))


def _timed(function: Callable[..., Any], row: tuple[Any, ...]) -> Any:
    global _spent
    start = time.thread_time()
    try:
        return function(*row)
    finally:
        spent = time.thread_time() - start
        with _spent_lock:
            _spent += spent
