"""Timing: epochs of a system, the best one counting, with its CPU cost and the server's waits."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from mmproxy.apps.bench.cpu import cpu_ms_per_batch, cpu_seconds

__all__ = ["count_samples", "time_epochs"]


def count_samples(batch: Any) -> int:
    """Samples in a batch of any system: a tensor, a (data, lengths) pair, a padded batch, or
    mmproxy's dict (its image or audio field)."""
    if isinstance(batch, dict):
        batch = next(batch[k] for k in ("image", "audio", "video") if k in batch)
    if isinstance(batch, (tuple, list)):
        batch = batch[0]
    if hasattr(batch, "lengths"):  # a PaddedBatch
        batch = batch.data
    return int(batch.shape[0])


def time_epochs(make_iter: Callable[[], Iterable[Any]], epochs: int, gpu: bool,
                server: Any = None) -> dict[str, Any]:
    """Times each epoch of ``make_iter()``; the best one after the first (the warm-up, reported
    apart; it counts only when it is the only one) counts. Reports each epoch's time to its
    first batch (the first epoch's includes starting the workers) and, for the best epoch, the CPU
    time per batch of the workers and of the main process's threads, and (for mmproxy's
    ``server``) how long the server starved and the main loop waited, per batch."""
    import torch

    rates, best, n, batches, total, since = [], None, 0, 0, 0, 0.0
    first: list[float] = []  # seconds to each epoch's first batch
    for epoch in range(epochs):
        if epoch == 1:
            since = time.perf_counter()
        n, batches = 0, 0
        cpu0 = cpu_seconds()
        starved0 = server.starved_seconds if server else 0.0
        waited0 = server.wait_seconds if server else 0.0
        start = time.perf_counter()
        for batch in make_iter():
            if not batches:
                first.append(round(time.perf_counter() - start, 3))
            n += count_samples(batch)
            batches += 1
        if gpu:
            torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - start))
        total += n if epoch else 0
        if rates[-1] == max(rates[1:] or rates):  # the warm-up counts only while it is alone
            best = {"cpu_ms_per_batch": cpu_ms_per_batch(cpu0, cpu_seconds(), batches)}
            if server:
                best["server_starved_per_batch_ms"] = round(
                    1000 * (server.starved_seconds - starved0) / batches, 3)
                best["main_loop_wait_per_batch_ms"] = round(
                    1000 * (server.wait_seconds - waited0) / batches, 3)
    # Also the rate over every epoch after the first, wall clock, gaps between epochs included.
    sustained = total / (time.perf_counter() - since) if epochs > 1 else None
    return {"samples_per_s": max(rates[1:] or rates), "epochs": [round(r, 1) for r in rates],
            "samples": n, "batches": batches, "sustained_samples_per_s": sustained, "first_batch_s": first,
            **(best or {})}
