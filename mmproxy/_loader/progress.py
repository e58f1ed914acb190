"""Progress: where a loader stands in its epoch, as the state that resumes it.

Workers yield :class:`~mmproxy._context.Stamped` items (a batch with the worker's position right
after it). torch's DataLoader hands out items round-robin over its workers (a worker that has
run out is passed over), so the loader keeps, per worker, the position after the last item it
took from that worker, and which worker comes next. A loader resuming from that state starts
worker ``j`` at the position of worker ``(next + j) % workers``: its round-robin then deals the
same items in the same order as the uninterrupted run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mmproxy._context import Stamped, unpacked
from mmproxy._loader.indexed import unwrapped
from mmproxy.protocols import Reshardable
from mmproxy.skips import SkipReport
from mmproxy.state import LoaderState, ResumePoint

__all__ = ["Progress", "hand_out", "rank_and_world"]


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size: torch.distributed's, else ``RANK``/``WORLD_SIZE``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Progress:
    """One epoch's progress: batches delivered, each worker's last position, the next worker.

    ``start`` holds what each worker was handed at the start of this epoch (a resume), kept
    for workers that have delivered nothing since. Positions are the dataset's own values.
    """

    def __init__(self, epoch: int, workers: int, start: dict[int, Any] | None = None,
                 next_worker: int = 0, batches: int = 0, report: SkipReport | None = None) -> None:
        self.epoch, self.workers = epoch, workers
        self.report = report or SkipReport(epoch)
        self.rank, self.world = rank_and_world()
        self.batches, self.done = batches, False
        self.positions: dict[int, Any] = dict(start or {})
        self._seq: dict[int, int] = {}
        self._last = (-1, next_worker - 1)  # (sequence number, worker) of the last item taken

    def took(self, seq: int, item: Stamped) -> None:
        """Item number ``seq`` of torch's iterator was taken (delivered, or used up on the way)."""
        if seq <= self._seq.get(item.worker, -1):
            return
        self._seq[item.worker] = seq
        self.positions[item.worker] = item.state
        self._last = max(self._last, (seq, item.worker))

    def state(self) -> LoaderState:
        positions = {w: _position(w, p) for w, p in self.positions.items()}
        return LoaderState(self.epoch, self.done, self.rank, self.world, self.workers,
                           self.batches, (self._last[1] + 1) % self.workers, positions,
                           self.report.state_dict())


def _position(worker: int, state: Any) -> Any:
    try:
        return unpacked(state)
    except Exception as err:  # noqa: BLE001 - the dataset's own state, whatever it holds
        raise RuntimeError(f"the position worker {worker} sent with its last batch cannot be "
                           f"read back: {err!r}") from err


def hand_out(saved: Sequence[LoaderState], dataset: Any, workers: int
             ) -> tuple[dict[int, ResumePoint], Progress]:
    """What each of this loader's ``workers`` starts from, given the saved state of this rank
    (exact) or of every rank (elastic, through the dataset's ``reshard``); and the progress so
    far."""
    rank, world = rank_and_world()
    epoch = saved[0].epoch
    mine = [s for s in saved if s.rank == rank and s.world == world]
    if mine and mine[0].workers == workers:
        state = mine[0]
        hand = {}
        for j in range(workers):
            logical = (state.next + j) % workers
            hand[j] = ResumePoint(epoch, logical, state.positions.get(logical))
        report = None if state.report is None else SkipReport.from_state(state.report)
        progress = Progress(epoch, workers, state.positions, state.next, state.batches, report)
        return hand, progress
    if not isinstance(dataset, Reshardable):
        raise ValueError(f"the state was saved with {saved[0].workers} workers on "
                         f"{saved[0].world} ranks, this loader has {workers} workers on "
                         f"{world} ranks, and {type(unwrapped(dataset)).__name__} cannot redistribute "
                         "its samples (it has no reshard method)")
    old_world = saved[0].world
    if sorted(s.rank for s in saved) != list(range(old_world)):
        raise ValueError(f"an elastic resume needs the states of all {old_world} ranks that "
                         f"saved them; got ranks {sorted(s.rank for s in saved)}")
    states = dataset.reshard(saved, rank=rank, world=world, workers=workers)
    hand = {w: ResumePoint(epoch, w, state) for w, state in enumerate(states)}
    batches = max(s.batches for s in saved)
    # every old rank's counts, on new rank 0 only: summed over the new ranks they stay exact
    report = SkipReport.merged([s.report for s in saved if s.report] if rank == 0 else [],
                                epoch)
    return hand, Progress(epoch, workers, dict(enumerate(states)), 0, batches, report)
