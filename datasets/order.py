"""Sample order: which raw sample each worker reads next, kept as state.

A worker's samples for one epoch come from one :class:`SourceStream` per source (its shards
split by rank and worker, read pass after pass, through a shuffle buffer) and, with several
sources, a weighted draw of the source for every sample (:class:`Order`). Everything random is
drawn from generators seeded by (seed, epoch, rank, worker, source, pass), and everything read is
named by an *address*, (shard, index of the sample in its shard). So the position of a worker is
small state: per source the pass, the work item being read and the next sample index in it, the
addresses in the shuffle buffer and the buffer's generator; and the mixing generator. Resuming
from it re-reads only the shards that the buffer and the current item name, skipping the samples
before the position without processing them (no field functions, nothing sent to a server).

The same state gives elastic resume: :func:`reshard` turns the states of every worker of every
rank into the work that remains (the shard parts not yet read, the buffered samples) and deals it
to a new number of ranks and workers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, cast

import numpy as np

from mmproxy.errors import ShardError
from mmproxy.skips import SkippedSample

__all__ = ["END", "Order", "OnExhausted", "Source", "SourceStream", "Work", "reshard", "shard_plan"]

OnExhausted = Literal["stop", "restart"]


class Source(NamedTuple):
    """One source of a mixed :class:`~mmproxy.datasets.MultiModalDataset`.

    Attributes:
        urls: Its shards (a brace pattern, a list, URLs; as the dataset's ``urls``).
        fields: Its field mapping (as the dataset's ``fields``); every source must give the same
            output names, each from its own extensions and functions.
        weight: Its share of the samples (weights are normalized).
        name: What ``"__source__"`` says for its samples (default: ``source0``, ``source1``...).
    """

    urls: str | Sequence[str]
    fields: Mapping[str, Any]
    weight: float = 1.0
    name: str | None = None


class Work(NamedTuple):
    """A part of a shard to read: its samples from ``start`` on, or only the indices ``only``."""

    url: str
    start: int = 0
    only: tuple[int, ...] | None = None


Reader = Callable[[Work, list[SkippedSample]], Iterator[tuple[int, dict[str, Any]] | None]]
Taken = tuple[str, int, dict[str, Any]]  # (shard, index in the shard, raw sample)
END = object()  # a stream's pass is over


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(list(key)))


def shard_plan(urls: Sequence[str], *, shuffle: bool, seed: int, epoch: int, source: int,
               rank: int, world: int, worker: int, workers: int, pass_: int) -> list[Work]:
    """A worker's shards for one pass: the list shuffled alike on every rank (seed, epoch),
    split by rank then by worker; later passes (to fill ``epoch_length`` or to restart a
    source) reshuffle the worker's own part."""
    ordered = list(urls)
    if shuffle:
        _rng(seed, epoch, source).shuffle(ordered)
    mine = ordered[rank::world][worker::workers]
    if pass_:
        _rng(seed, epoch, source, rank, worker, pass_).shuffle(mine)
    return [Work(url) for url in mine]


class Layout(NamedTuple):
    """Where a worker sits and what it reads: the dataset's settings for one epoch."""

    seed: int
    epoch: int
    rank: int
    world: int
    worker: int
    workers: int
    shuffle_shards: bool
    shuffle_buffer: int
    resampled: bool


class SourceStream:
    """One source's raw samples in one worker for one epoch: its passes, through the buffer.

    :meth:`take` gives ``(shard, index, sample)``, or ``None`` when a shard was skipped (its
    record is in ``skipped``), or :data:`END` once the pass is over (until :meth:`restart`).
    """

    def __init__(self, index: int, urls: list[str], layout: Layout, read: Reader,
                 skipped: list[SkippedSample], plan: list[Work] | None = None) -> None:
        self.index, self.urls, self.layout = index, urls, layout
        self._read, self.skipped = read, skipped
        self.custom_plan = plan  # pass 0's plan when resharded (elastic resume)
        self._plan: list[Work] | None = None
        self._plan_pass = -1
        self.passes = 0  # passes finished
        self.taken = 0  # samples taken in this pass (a pass with none cannot fill epoch_length)
        self._start_pass(0)

    def _start_pass(self, number: int) -> None:
        self.pass_ = number
        self.item = 0  # the work item being read
        self.next = 0  # the next sample index to read in it
        self.buffer: list[Taken] = []
        self.taken = 0
        lay = self.layout
        self._buffer_rng = _rng(lay.seed, lay.epoch, self.index, lay.rank, lay.worker, number, 1)
        self._reader: Iterator[tuple[int, dict[str, Any]] | None] | None = None
        self._ended = False

    def plan(self) -> list[Work] | None:
        """This pass's work items (None when resampling: drawn one by one, without end)."""
        if self.layout.resampled:
            return None
        if self.pass_ == 0 and self.custom_plan is not None:
            return self.custom_plan
        lay = self.layout
        return shard_plan(self.urls, shuffle=lay.shuffle_shards, seed=lay.seed, epoch=lay.epoch,
                          source=self.index, rank=lay.rank, world=lay.world, worker=lay.worker,
                          workers=lay.workers, pass_=self.pass_)

    def _work(self, item: int) -> Work | None:
        lay = self.layout
        if lay.resampled:  # every rank and worker draws from all shards, with replacement
            pick = _rng(lay.seed, lay.epoch, self.index, lay.rank, lay.worker, item, 2)
            return Work(self.urls[int(pick.integers(len(self.urls)))])
        if self._plan_pass != self.pass_:
            self._plan, self._plan_pass = self.plan(), self.pass_
        assert self._plan is not None
        return self._plan[item] if item < len(self._plan) else None

    def _read_one(self) -> Taken | None | object:
        empty = 0  # shards in a row that held nothing
        while True:
            if self._reader is None:
                work = self._work(self.item)
                if work is None:
                    return END
                if self.next:
                    work = _from(work, self.next)
                self._reader = self._read(work, self.skipped)
            got = next(self._reader, END)
            if got is END:
                self._reader, self.item, self.next = None, self.item + 1, 0
                empty += 1
                if self.layout.resampled and empty > 2 * len(self.urls) + 100:
                    raise ShardError(f"{_where(self.layout)}: {empty} shards drawn in a row held "
                                     "no samples (resampled=True draws forever)")
                continue
            if got is None:  # the shard failed or was empty, and is over: its record is taken
                self._reader, self.item, self.next = None, self.item + 1, 0
                return None
            index, raw = cast(tuple[int, dict[str, Any]], got)
            self.next = index + 1
            return cast(Work, self._work(self.item)).url, index, raw

    def restart(self) -> None:
        """Starts the next pass (after :meth:`take` gave :data:`END`)."""
        self.passes += 1
        self._start_pass(self.pass_ + 1)

    def take(self) -> Taken | None | object:
        if self._ended:
            return END
        size = self.layout.shuffle_buffer
        while len(self.buffer) < max(1, size):
            got = self._read_one()
            if got is END:
                break
            if got is None:
                return None
            if size == 0:
                self.taken += 1
                return got
            self.buffer.append(got)  # type: ignore[arg-type]
        if not self.buffer:
            self._ended = True
            return END
        j = int(self._buffer_rng.integers(len(self.buffer)))
        self.buffer[j], self.buffer[-1] = self.buffer[-1], self.buffer[j]
        self.taken += 1
        return self.buffer.pop()

    # -- state ----------------------------------------------------------------------------------

    def state(self, table: UrlTable) -> dict[str, Any]:
        return {"pass": self.pass_, "passes": self.passes, "item": self.item, "next": self.next,
                "taken": self.taken, "ended": self._ended,
                "buffer": [(table.id(url), index) for url, index, _ in self.buffer],
                "rng": self._buffer_rng.bit_generator.state,
                "plan": None if self.custom_plan is None else [tuple(w) for w in self.custom_plan]}

    def restore(self, state: Mapping[str, Any], urls: list[str]) -> None:
        """Back to a saved position; the buffered samples are read again from their shards."""
        plan = state.get("plan")
        self.custom_plan = None if plan is None else [Work(*w) for w in plan]
        self._start_pass(state["pass"])
        self.passes, self.item, self.next = state["passes"], state["item"], state["next"]
        self.taken, self._ended = state["taken"], state["ended"]
        self._buffer_rng.bit_generator.state = state["rng"]
        wanted = [(urls[u], i) for u, i in state["buffer"]]
        found = fetch(wanted, self._read, self.skipped)
        self.buffer = [(url, i, found[url, i]) for url, i in wanted if (url, i) in found]


class UrlTable:
    """Shard names in a state, each stored once (addresses refer to them by number)."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self._ids: dict[str, int] = {}

    def id(self, url: str) -> int:
        if url not in self._ids:
            self._ids[url] = len(self.urls)
            self.urls.append(url)
        return self._ids[url]


def _from(work: Work, start: int) -> Work:
    if work.only is not None:
        return work._replace(only=tuple(i for i in work.only if i >= start))
    return work._replace(start=max(work.start, start))


def fetch(addresses: Sequence[tuple[str, int]], read: Reader, skipped: list[SkippedSample]
          ) -> dict[tuple[str, int], dict[str, Any]]:
    """The raw samples at ``addresses``, each shard read once up to the last index wanted."""
    by_url: dict[str, set[int]] = {}
    for url, index in addresses:
        by_url.setdefault(url, set()).add(index)
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for url, indices in by_url.items():
        for got in read(Work(url, only=tuple(sorted(indices))), skipped):
            if got is not None:
                found[url, got[0]] = got[1]
    return found


class Order:
    """One worker's raw samples for one epoch, from one or several sources.

    With several sources every sample's source is drawn by weight. A source whose pass ends
    either ends the worker's epoch (``"stop"``), or starts its next pass (``"restart"``: the
    epoch ends once every source has finished a pass); with ``endless`` (``epoch_length`` set)
    sources always restart and the quota ends the epoch. A source with no work for this worker
    (after an elastic resume) is left out of the draw; one whose shards hold no sample at all (a
    wrong path, every shard unreadable) raises, instead of leaving its share to the others.
    Yields ``(source, (shard, index, sample))`` or ``None`` (a shard was skipped).
    """

    def __init__(self, streams: list[SourceStream], weights: Sequence[float],
                 on_exhausted: OnExhausted, endless: bool, layout: Layout) -> None:
        self.streams = streams
        self.weights = list(weights)
        self._active = list(range(len(streams)))
        self._cumulative = self._cumulate()
        self.on_exhausted, self.endless = on_exhausted, endless
        self._rng = _rng(layout.seed, layout.epoch, layout.rank, layout.worker, 3)

    def __iter__(self) -> Iterator[tuple[int, Taken] | None]:
        while self._active:
            s = self._active[0] if len(self._active) == 1 else self._active[min(
                int(np.searchsorted(self._cumulative, self._rng.random(), side="right")),
                len(self._active) - 1)]
            stream = self.streams[s]
            got = stream.take()
            if got is END and not self.endless and stream.passes == 0 and stream.taken == 0:
                if stream.plan() and len(self.streams) > 1:  # shards, and not one sample in them
                    reasons = Counter(r.reason for r in stream.skipped).most_common(3)
                    raise ShardError(f"{_where(stream.layout)}: source {s}'s shards hold no "
                                     f"samples (reasons: {reasons}); the other sources would "
                                     "take its share unnoticed")
                self._drop(s)  # no work of this source for this worker: the others go on
                continue
            if got is END:
                if self.endless:
                    if stream.taken == 0:
                        which = f" of source {s}" if len(self.streams) > 1 else ""
                        reasons = Counter(r.reason for r in stream.skipped).most_common(3)
                        raise ShardError(f"{_where(stream.layout)}: its shards{which} hold no "
                                         "samples, so it cannot make its share of epoch_length "
                                         f"(reasons: {reasons})")
                elif self.on_exhausted == "stop" or all(st.passes + st._ended >= 1
                                                        for st in self.streams):
                    return
                stream.restart()
                continue
            yield None if got is None else (s, got)  # type: ignore[misc]

    def _cumulate(self) -> np.ndarray:
        active = [self.weights[s] for s in self._active]
        return np.cumsum([w / sum(active) for w in active])

    def _drop(self, source: int) -> None:
        self._active.remove(source)
        if self._active:
            self._cumulative = self._cumulate()

    def state(self, table: UrlTable) -> dict[str, Any]:
        return {"mix": self._rng.bit_generator.state, "active": list(self._active),
                "sources": [st.state(table) for st in self.streams]}

    def restore(self, state: Mapping[str, Any], urls: list[str]) -> None:
        self._rng.bit_generator.state = state["mix"]
        self._active = list(state["active"])
        if self._active:
            self._cumulative = self._cumulate()
        for stream, saved in zip(self.streams, state["sources"]):
            stream.restore(saved, urls)


def _where(layout: Layout) -> str:
    return f"worker {layout.worker} on rank {layout.rank}"


# -- elastic resume ---------------------------------------------------------------------------


def remaining(state: Mapping[str, Any] | None, source: int,
              plan_of: Callable[[int], list[Work]]) -> list[Work]:
    """What one old worker had left of one source's current pass (``plan_of(pass)`` is its plan
    of a pass): its taken-but-undelivered samples, its buffer, the rest of the item it was
    reading, and the items after it."""
    if state is None:
        return plan_of(0)
    urls = state["urls"]
    saved = state["order"]["sources"][source]
    held = [(urls[u], i) for u, i in saved["buffer"]]
    held += [(urls[u], i) for s, u, i in state["batch"] if s == source]
    out = [Work(url, only=tuple(sorted(i for u, i in held if u == url)))
           for url in dict.fromkeys(u for u, _ in held)]
    if saved["ended"]:
        return out
    if saved["plan"] is not None and saved["pass"] == 0:
        plan = [Work(*w) for w in saved["plan"]]
    else:
        plan = plan_of(saved["pass"])
    item, start = saved["item"], saved["next"]
    if item < len(plan):
        out.append(_from(plan[item], start))
        out.extend(plan[item + 1:])
    return out


def reshard(work: list[list[Work]], *, world: int, workers: int) -> list[list[list[Work]]]:
    """Deals each source's remaining work items to ``world`` ranks of ``workers`` workers:
    ``result[rank * workers + worker][source]`` is that worker's pass-0 plan."""
    total = world * workers
    out: list[list[list[Work]]] = [[[] for _ in work] for _ in range(total)]
    for source, items in enumerate(work):
        for n, item in enumerate(items):
            out[n % total][source].append(item)
    return out


def split_quota(batches: int, workers: int) -> list[int]:
    """``batches`` dealt to ``workers`` (the first ones get one more)."""
    return [batches // workers + (1 if w < batches % workers else 0) for w in range(workers)]


def check_weights(weights: Sequence[float]) -> None:
    if not weights or any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"source weights must be positive numbers (leave a source out to skip "
                         f"it), got {list(weights)}")
