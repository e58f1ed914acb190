"""Elastic resume: the samples a saved epoch has left, dealt to other numbers of ranks and workers.

Every old worker's state says what it has left (each stage's ``remaining``: the samples of the
batch being filled, the buffered ones, the rest of the shard being read, the shards after it).
Those work items are dealt round-robin, per source, to the new workers of every new rank, and
each new worker gets the state of a fresh chain whose first pass is its share: every sample not
yet delivered is delivered once, in a new order. With ``epoch_length`` each new rank's quota is
what the epoch had left, split over its workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mmproxy.datasets.stages.plan import Work, split_quota
from mmproxy.datasets.stages.position import PositionStamp

from mmproxy.state import LoaderState

__all__ = ["Build", "reshard"]


class Build(Protocol):
    """Builds a worker's chain: a dataset's ``_chain``."""

    def __call__(self, epoch: int, worker_id: int, workers: int, *, rank: int | None = None,
                 world: int | None = None, dealt: Sequence[Sequence[Work]] | None = None,
                 quota: int | None = None) -> PositionStamp: ...


def reshard(build: Build, saved: Sequence[LoaderState], *, sources: int, rank: int, world: int,
            workers: int, epoch_length: int | None) -> list[dict[str, Any]]:
    """The states of the ``workers`` new workers of rank ``rank`` (of ``world``), given the
    saved states of every old rank (each worker's state of this version, or None for a worker
    that had delivered nothing)."""
    work: list[list[Work]] = [[] for _ in range(sources)]
    for old in sorted(saved, key=lambda s: s.rank):
        for w in range(old.workers):
            chain = build(old.epoch, w, old.workers, rank=old.rank, world=old.world)
            state = old.positions.get(w)
            if state is None:
                state = chain.state_dict()
            for source, items in enumerate(chain.remaining(state)):
                work[source].extend(_merged(items))
    dealt = _deal(work, world * workers)
    quota: list[int | None] = [None] * workers
    if epoch_length is not None:
        delivered = max(s.batches for s in saved)
        quota = list(split_quota(max(0, epoch_length - delivered), workers))
    epoch = saved[0].epoch
    return [build(epoch, w, workers, rank=rank, world=world, dealt=dealt[rank * workers + w],
                  quota=quota[w]).state_dict() for w in range(workers)]


def _merged(items: list[Work]) -> list[Work]:
    """``items`` with the single samples of one shard (``only``) read in one go."""
    only: dict[str, set[int]] = {}
    rest: list[Work] = []
    for item in items:
        if item.only is not None and item.start == 0:
            only.setdefault(item.url, set()).update(item.only)
        else:
            rest.append(item)
    return [Work(url, only=tuple(sorted(i))) for url, i in only.items() if i] + rest


def _deal(work: list[list[Work]], total: int) -> list[list[list[Work]]]:
    """Each source's work items dealt to ``total`` workers: ``result[worker][source]``."""
    out: list[list[list[Work]]] = [[[] for _ in work] for _ in range(total)]
    for source, items in enumerate(work):
        for n, item in enumerate(items):
            out[n % total][source].append(item)
    return out
