"""Source mixer: which source each sample of a worker comes from, and when the epoch ends.

With several sources every sample's source is drawn by weight (from a generator seeded by seed,
epoch, rank and worker). A source whose pass ends either ends the worker's epoch (``"stop"``), or
starts its next pass (``"restart"``: the epoch ends once every source has finished a pass); with
``endless`` (``epoch_length`` set) sources always restart and the batcher's quota ends the epoch.
A source with no work for this worker (after an elastic resume) is left out of the draw; one
whose shards hold no sample at all (a wrong path, every shard unreadable) raises, instead of
leaving its share to the others.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
from mmproxy.datasets.stages._stage import Draws, Stage, generator
from mmproxy.datasets.stages.buffer import ShuffleBuffer
from mmproxy.datasets.stages.plan import Layout, Work
from mmproxy.datasets.stages.reader import Taken

from mmproxy.errors import ShardError, StateError
from mmproxy.skips import SkippedSample

__all__ = ["OnExhausted", "Source", "SourceMixer", "check_weights"]

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


def check_weights(weights: Sequence[float]) -> None:
    if not weights or any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"source weights must be positive numbers (leave a source out to skip "
                         f"it), got {list(weights)}")


class SourceMixer(Stage):
    """One worker's raw samples for one epoch, from one or several sources' buffers.

    Iterating gives ``(source number, Taken)``, or a shard's record.

    Args:
        buffers: Each source's buffer, by source name.
        weights: Each source's weight, in the same order.
        on_exhausted: What a source that runs out does (see the module docstring).
        endless: Sources always restart (the batcher's quota ends the epoch).
        layout: Where the worker sits.
    """

    NAME = "source mixer"
    RNG, ACTIVE, SOURCES = "rng", "active", "sources"
    KEYS = (RNG, ACTIVE, SOURCES)

    def __init__(self, buffers: Mapping[str, ShuffleBuffer], weights: Sequence[float],
                 on_exhausted: OnExhausted, endless: bool, layout: Layout) -> None:
        self.names = list(buffers)
        self.buffers = list(buffers.values())
        self.weights = list(weights)
        self.on_exhausted, self.endless, self.layout = on_exhausted, endless, layout
        self._draws = Draws(generator(layout.seed, layout.epoch, layout.rank, layout.worker, 3),
                            lambda g, count: g.random(count))  # one per sample of several sources
        self._set_active(list(range(len(self.buffers))))

    def _set_active(self, active: list[int]) -> None:
        self._active = active
        if active:
            shares = [self.weights[s] for s in active]
            self._cumulative = np.cumsum([w / sum(shares) for w in shares]).tolist()

    def __iter__(self) -> SourceMixer:
        return self

    def __next__(self) -> tuple[int, Taken] | SkippedSample:
        while self._active:
            s = self._active[0] if len(self._active) == 1 else self._active[min(
                bisect.bisect_right(self._cumulative, self._draws()),
                len(self._active) - 1)]
            buffer = self.buffers[s]
            got = buffer.take()
            if isinstance(got, SkippedSample):
                return got
            if got is not None:
                return s, got
            if not self.endless and buffer.pass_ == 0 and buffer.taken == 0:
                if buffer.reader.plan.items() and len(self.buffers) > 1:  # shards, no sample
                    raise ShardError(f"{self.layout}: source {s}'s shards hold no samples "
                                     f"(reasons: {self._reasons(s)}); the other sources would "
                                     "take its share unnoticed")
                self._set_active([a for a in self._active if a != s])  # no work of its own here
                continue
            if self.endless:
                if buffer.taken == 0:
                    which = f" of source {s}" if len(self.buffers) > 1 else ""
                    raise ShardError(f"{self.layout}: its shards{which} hold no samples, so it "
                                     "cannot make its share of epoch_length "
                                     f"(reasons: {self._reasons(s)})")
            elif self.on_exhausted == "stop" or all(b.pass_ + b.ended >= 1 for b in self.buffers):
                raise StopIteration
            buffer.restart()
        raise StopIteration

    def _reasons(self, source: int) -> list[tuple[str, int]]:
        return self.buffers[source].reader.reasons.most_common(3)

    def state_dict(self) -> dict[str, Any]:
        return self._pack(**{self.RNG: self._draws.state,
                             self.ACTIVE: [self.names[s] for s in self._active],
                             self.SOURCES: {name: b.state_dict()
                                            for name, b in zip(self.names, self.buffers)}})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = self._unpack(state)
        sources = state[self.SOURCES]
        if sorted(sources) != sorted(self.names) or not set(state[self.ACTIVE]) <= set(sources):
            raise self._other_sources(sorted(sources))
        self._draws.state = state[self.RNG]
        self._set_active([self.names.index(name) for name in state[self.ACTIVE]])
        for name, buffer in zip(self.names, self.buffers):
            buffer.load_state_dict(sources[name])

    def _other_sources(self, names: list[str]) -> StateError:
        return StateError(f"the {self.NAME} state is of sources {names}; this dataset's are "
                          f"{sorted(self.names)}")

    def remaining(self, state: Mapping[str, Any]) -> list[list[Work]]:
        """What a state of this mixer has left, per source (in this mixer's order)."""
        state = self._unpack(state)
        sources = state[self.SOURCES]
        if sorted(sources) != sorted(self.names):
            raise self._other_sources(sorted(sources))
        return [b.remaining(sources[name]) for name, b in zip(self.names, self.buffers)]
