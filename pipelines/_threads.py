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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["THREAD_PREFIX", "map_batch"]

THREAD_PREFIX = "mmproxy-pyfn"  # their names: the bench counts their CPU as the pipeline's
_MOST = 8


def map_batch(function: Callable[..., Any], *columns: Sequence[Any]) -> list[Any]:
    """``[function(*row) for row in zip(*columns)]``, the rows on threads of this call's own."""
    n = len(columns[0]) if columns else 0
    threads = min(_MOST, len(os.sched_getaffinity(0)), n)
    if threads <= 1:
        return [function(*row) for row in zip(*columns)]
    with ThreadPoolExecutor(threads, thread_name_prefix=THREAD_PREFIX) as pool:
        return list(pool.map(function, *columns))
