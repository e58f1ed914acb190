"""Source mixer: which source each sample of a worker comes from, and when the epoch ends.
docs/internals.md, ``mmproxy.datasets.stages.mixer``, has the rest.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
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


class SourceMixer(Stage[tuple[int, Taken] | SkippedSample]):
    """One worker's raw samples for one epoch, from one or several sources' buffers.

    :meth:`~Stage.next` gives ``(source number, Taken)``, or a shard's record. It counts, per
    source, the passes it has begun and ended and the samples of the pass (its state).

    Args:
        buffers: Each source's buffer, by source name.
        weights: Each source's weight, in the same order.
        on_exhausted: What a source that runs out does (see the module docstring).
        endless: Sources always restart (the batcher's quota ends the epoch).
        layout: Where the worker sits.
        required: Per source, whether its first pass must give samples: it has shards for this
            worker and no elastic resume dealt them (see the module docstring); by default every
            source's. It is part of the state, as a resumed chain is built without what an
            elastic resume dealt it.
    """

    NAME = "source mixer"
    VERSION = 3
    RNG, ACTIVE, PASSES, REQUIRED, SOURCES = "rng", "active", "passes", "required", "sources"
    KEYS = (RNG, ACTIVE, PASSES, REQUIRED, SOURCES)

    def __init__(self, buffers: Mapping[str, ShuffleBuffer], weights: Sequence[float],
                 on_exhausted: OnExhausted, endless: bool, layout: Layout,
                 required: Sequence[bool] | None = None) -> None:
        self.names = list(buffers)
        self.buffers = list(buffers.values())
        self.weights = list(weights)
        self.on_exhausted, self.endless, self.layout = on_exhausted, endless, layout
        self.required = [True] * len(self.buffers) if required is None else list(required)
        self.reasons: list[Counter[str]] = [Counter() for _ in self.buffers]  # records, for messages
        self._start()

    def _start(self) -> None:
        layout = self.layout
        self._draws = Draws(generator(layout.seed, layout.epoch, layout.rank, layout.worker, 3),
                            lambda g, count: g.random(count))  # one per sample of several sources
        self._set_active(list(range(len(self.buffers))))
        # per source: [passes begun after the first, whether the pass ended, samples of the pass]
        self.passes = [[0, False, 0] for _ in self.buffers]

    def _set_active(self, active: list[int]) -> None:
        self._active = active
        if active:
            shares = [self.weights[s] for s in active]
            self._cumulative = np.cumsum([w / sum(shares) for w in shares]).tolist()

    def next(self) -> tuple[int, Taken] | SkippedSample:
        while self._active:
            s = self._active[0] if len(self._active) == 1 else self._active[min(
                bisect.bisect_right(self._cumulative, self._draws()),
                len(self._active) - 1)]
            count = self.passes[s]
            try:
                got = self.buffers[s].next()
            except StopIteration:
                count[1] = True
                self._ended(s)
                continue
            if isinstance(got, SkippedSample):
                self.reasons[s][got.reason] += 1
                return got
            count[2] += 1
            return s, got
        raise StopIteration

    def _ended(self, s: int) -> None:
        """Source ``s``'s pass is over: it restarts, leaves the draw, or ends the epoch (raising
        ``StopIteration``), or it raises for a source without samples."""
        passes, _, taken = self.passes[s]
        spare = passes == 0 and taken == 0 and not self.required[s]  # nothing of its own here
        if not self.endless and passes == 0 and taken == 0:
            if not spare and len(self.buffers) > 1:  # shards, no sample
                raise ShardError(f"{self.layout}: source {s}'s shards hold no samples "
                                 f"(reasons: {self._reasons(s)}); the other sources would "
                                 "take its share unnoticed")
            self._set_active([a for a in self._active if a != s])
            return
        if self.endless:
            if taken == 0 and not spare:
                which = f" of source {s}" if len(self.buffers) > 1 else ""
                raise ShardError(f"{self.layout}: its shards{which} hold no samples, so it "
                                 "cannot make its share of epoch_length "
                                 f"(reasons: {self._reasons(s)})")
        elif self.on_exhausted == "stop" or all(p + e >= 1 for p, e, _ in self.passes):
            raise StopIteration
        self.buffers[s].reset()
        self.passes[s] = [passes + 1, False, 0]

    def _reasons(self, source: int) -> list[tuple[str, int]]:
        return self.reasons[source].most_common(3)

    def state_dict(self) -> dict[str, Any]:
        return self._pack(**{self.RNG: self._draws.state,
                             self.ACTIVE: [self.names[s] for s in self._active],
                             self.PASSES: {name: tuple(p) for name, p in zip(self.names, self.passes)},
                             self.REQUIRED: [n for n, r in zip(self.names, self.required) if r],
                             self.SOURCES: {name: b.state_dict()
                                            for name, b in zip(self.names, self.buffers)}})

    def _load(self, state: Mapping[str, Any]) -> None:
        sources, passes = state[self.SOURCES], state[self.PASSES]
        if (sorted(sources) != sorted(self.names) or sorted(passes) != sorted(self.names)
                or not set(state[self.ACTIVE]) | set(state[self.REQUIRED]) <= set(sources)):
            raise self._other_sources(sorted(sources))
        self._draws.state = state[self.RNG]
        self.required = [name in state[self.REQUIRED] for name in self.names]
        self._set_active([self.names.index(name) for name in state[self.ACTIVE]])
        self.passes = [[int(p), bool(e), int(t)] for p, e, t in (passes[n] for n in self.names)]
        for name, buffer in zip(self.names, self.buffers):
            buffer.reset(sources[name])

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
