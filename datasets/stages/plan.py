"""Shard plan: which shards of a source each worker reads, pass after pass.

The shard list is shuffled alike on every rank (from the seed and the epoch), split by rank, then
by worker (:func:`split`, the one place that split is made); later passes (to fill
``epoch_length``, or to restart a source) reshuffle the worker's own part. With ``resampled``
every worker draws shards from the whole list, with replacement, without end. After an elastic
resume, pass 0 is the list of work items the resume dealt to the worker instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from mmproxy.datasets.stages._stage import Stage, generator

from mmproxy.errors import ShardError, StateError

__all__ = ["Layout", "ShardPlan", "Work", "check_shares", "shard_plan", "split", "split_quota"]

T = TypeVar("T")


class Work(NamedTuple):
    """A part of a shard to read: its samples from ``start`` on, or only the indices ``only``."""

    url: str
    start: int = 0
    only: tuple[int, ...] | None = None

    def starting_at(self, index: int) -> Work:
        """The part of this work from sample ``index`` on."""
        if self.only is not None:
            return self._replace(only=tuple(i for i in self.only if i >= index))
        return self._replace(start=max(self.start, index))


class Layout(NamedTuple):
    """Where a worker sits in an epoch: the seed, the epoch, its rank and worker, and how many."""

    seed: int
    epoch: int
    rank: int
    world: int
    worker: int
    workers: int

    def __str__(self) -> str:
        return f"worker {self.worker} on rank {self.rank}"


def split(items: Sequence[T], *, rank: int, world: int, worker: int = 0,
          workers: int = 1) -> list[T]:
    """The part of ``items`` of worker ``worker`` (of ``workers``) of rank ``rank`` (of
    ``world``): every ``world``-th item for the rank, then every ``workers``-th of those."""
    return list(items[rank::world][worker::workers])


def check_shares(urls: Sequence[str], *, rank: int, world: int, workers: int,
                 source: str | None, own_shards: bool) -> None:
    """Raises :class:`~mmproxy.errors.ShardError` when rank ``rank`` gets no shards, or fewer
    shards than ``workers`` where every worker needs its own: with several sources (``source``
    names the one checked) or when every worker must fill a quota (``own_shards``)."""
    mine = split(urls, rank=rank, world=world)
    where = "" if source is None else f" of source {source!r}"
    if not mine:
        raise ShardError(f"rank {rank} of {world} gets no shards{where}: there are only "
                         f"{len(urls)} shards for {world} ranks; write more, smaller shards or "
                         "use resampled=True")
    if source is not None and len(mine) < workers:
        raise ShardError(
            f"rank {rank} of {world} has {len(mine)} shards{where} for {workers} workers; "
            "with several sources every worker needs shards of each source (or its share "
            f"of the weights would go to the others): use at most {_workers(len(mine))}, or "
            "more (smaller) shards")
    if own_shards and len(mine) < workers:
        raise ShardError(
            f"rank {rank} of {world} has {len(mine)} shards{where} for {workers} workers, "
            "and with epoch_length every worker needs shards of its own; use at most "
            f"{_workers(len(mine))}, more (smaller) shards, or resampled=True")


def _workers(n: int) -> str:
    return f"{n} worker" + ("" if n == 1 else "s")


def shard_plan(urls: Sequence[str], layout: Layout, *, source: int, shuffle: bool,
               pass_: int) -> list[Work]:
    """A worker's shards of one source for one pass (see the module docstring)."""
    ordered = list(urls)
    if shuffle:
        generator(layout.seed, layout.epoch, source).shuffle(ordered)
    mine = split(ordered, rank=layout.rank, world=layout.world, worker=layout.worker,
                 workers=layout.workers)
    if pass_:
        generator(layout.seed, layout.epoch, source, layout.rank, layout.worker,
                  pass_).shuffle(mine)
    return [Work(url) for url in mine]


def split_quota(batches: int, workers: int) -> list[int]:
    """``batches`` dealt to ``workers`` (the first ones get one more)."""
    return [batches // workers + (1 if w < batches % workers else 0) for w in range(workers)]


class ShardPlan(Stage[Work]):
    """One source's work items for one worker, pass after pass: the first stage of a source.

    :meth:`~Stage.next` gives the pass's next item (without end when resampling);
    :meth:`~Stage.reset` without a state starts the next pass (its own shuffle).

    Args:
        urls: The source's shards.
        layout: Where the worker sits.
        source: The source's number (its shuffles are its own).
        shuffle: Shuffle the shards every epoch.
        resampled: Draw shards with replacement, without end.
        dealt: Pass 0's items, when an elastic resume dealt them.
    """

    NAME = "shard plan"
    VERSION = 2
    PASS, ITEM, DEALT, SHARDS = "pass", "item", "dealt", "shards"
    KEYS = (PASS, ITEM, DEALT, SHARDS)

    def __init__(self, urls: Sequence[str], layout: Layout, *, source: int, shuffle: bool,
                 resampled: bool, dealt: Sequence[Work] | None = None) -> None:
        self.urls, self.layout, self.source = list(urls), layout, source
        self.shuffle, self.resampled = shuffle, resampled
        self.dealt = None if dealt is None else [Work(*w) for w in dealt]
        self.pass_ = 0
        self.item = 0  # the work items given in this pass
        self._items: list[Work] | None = None

    def items(self, pass_: int | None = None) -> list[Work] | None:
        """The work items of a pass (this one by default); None when resampling."""
        pass_ = self.pass_ if pass_ is None else pass_
        if self.resampled:
            return None
        if pass_ == 0 and self.dealt is not None:
            return self.dealt
        return shard_plan(self.urls, self.layout, source=self.source, shuffle=self.shuffle,
                          pass_=pass_)

    def next(self) -> Work:
        lay = self.layout
        if self.resampled:  # every rank and worker draws from all shards, with replacement
            pick = generator(lay.seed, lay.epoch, self.source, lay.rank, lay.worker, self.item, 2)
            work = Work(self.urls[int(pick.integers(len(self.urls)))])
        else:
            if self._items is None:
                self._items = self.items()
            assert self._items is not None
            if self.item >= len(self._items):
                raise StopIteration
            work = self._items[self.item]
        self.item += 1
        return work

    def _next_pass(self) -> None:
        self.pass_, self.item, self._items = self.pass_ + 1, 0, None

    def _shards(self) -> list[Any]:
        """Which shards the plan is over, in order, and the seed that orders its epochs: their
        count, a digest of their names, the dataset's seed."""
        digest = hashlib.sha256("\n".join(self.urls).encode()).hexdigest()[:16]
        return [len(self.urls), digest, int(self.layout.seed)]  # a plain int: weights_only

    def _same_shards(self, state: Mapping[str, Any]) -> None:
        """Refuses a state saved over other shards, or with another seed: its positions would
        point into other shards, or into another order of them and of their samples."""
        saved, mine = state[self.SHARDS], self._shards()
        if not isinstance(saved, (list, tuple)) or len(saved) != len(mine):
            raise StateError(f"the {self.NAME} state's shards are {saved!r}, not their count, "
                             "digest and seed")
        saved = list(saved)
        if saved[:2] != mine[:2]:
            raise StateError(
                f"the state was saved by a dataset over other shards ({saved[0]} of them) than "
                f"this one's {len(self.urls)} (from {self.urls[0]!r}), or over the same ones in "
                "another order or under other names; resume with the dataset built on the "
                "shards it was saved with")
        if saved[2] != mine[2]:
            raise StateError(
                f"the state was saved by a dataset of seed={saved[2]}, and this one's seed is "
                f"{mine[2]}: its positions are in the other seed's order of shards and samples, "
                f"where resuming could give some samples twice and others not at all; resume "
                f"with seed={saved[2]}")

    def state_dict(self) -> dict[str, Any]:
        return self._pack(**{self.PASS: self.pass_, self.ITEM: self.item,
                             self.DEALT: None if self.dealt is None else
                             [tuple(w) for w in self.dealt],  # tuples: torch's weights_only
                             self.SHARDS: self._shards()})

    def _load(self, state: Mapping[str, Any]) -> None:
        self._same_shards(state)
        dealt = state[self.DEALT]
        self.dealt = None if dealt is None else [Work(*w) for w in dealt]
        self.pass_, self.item, self._items = int(state[self.PASS]), int(state[self.ITEM]), None

    def remaining(self, state: Mapping[str, Any]) -> list[Work]:
        """What a state of this plan has left: the items it had not given (nothing when
        resampling: there is no end to draw up to)."""
        state = self._unpack(state)
        self._same_shards(state)
        dealt = state[self.DEALT]
        plan = ShardPlan(self.urls, self.layout, source=self.source, shuffle=self.shuffle,
                         resampled=self.resampled,
                         dealt=None if dealt is None else [Work(*w) for w in dealt])
        return (plan.items(int(state[self.PASS])) or [])[int(state[self.ITEM]):]
