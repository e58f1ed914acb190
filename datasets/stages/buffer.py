"""Shuffle buffer: one source's samples drawn at random from a window of raw samples.

The buffer fills to its size from the shard reader, then gives a sample drawn from it (by a
generator seeded by seed, epoch, source, rank, worker and pass) and refills. It holds raw bytes
(nothing has been sent to a server yet); its state holds only their addresses and the
generator's state, so a resumed buffer reads its samples again from their shards. Size 0 passes
the samples through in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmproxy.datasets.stages._stage import Draws, Stage, generator, pack_addresses, unpack_addresses
from mmproxy.datasets.stages.plan import Layout, Work
from mmproxy.datasets.stages.reader import Fetch, ShardReader, Taken

from mmproxy.skips import SkippedSample

__all__ = ["ShuffleBuffer"]


class ShuffleBuffer(Stage[Taken | SkippedSample]):
    """One source's samples for one worker in one pass, through a shuffle buffer.

    :meth:`~Stage.next` gives a :class:`~mmproxy.datasets.stages.reader.Taken` or a shard's
    record; the pass ends once the reader's has and the buffer is empty.

    Args:
        reader: The source's shard reader.
        size: How many samples the buffer holds; 0: none (samples in order).
        fetch: Reads the samples at given addresses again (those of a loaded state).
        layout: Where the worker sits, and ``source`` the source's number: with the pass, they
            seed the buffer's draws.
    """

    NAME = "shuffle buffer"
    VERSION = 2
    PASS, ENDED, RNG, URLS, HELD, READER = "pass", "ended", "rng", "urls", "held", "reader"
    KEYS = (PASS, ENDED, RNG, URLS, HELD, READER)

    def __init__(self, reader: ShardReader, size: int, *, fetch: Fetch, layout: Layout,
                 source: int) -> None:
        self.reader, self.size, self.fetch = reader, size, fetch
        self.layout, self.source = layout, source
        self.pass_ = 0
        self._start_pass()

    def _start_pass(self) -> None:
        lay = self.layout
        self.held: list[Taken] = []
        self.ended = False
        self._records: list[SkippedSample] = []  # of shards read again on loading a state
        rng = generator(lay.seed, lay.epoch, self.source, lay.rank, lay.worker, self.pass_, 1)
        size = self.size  # a full buffer's draws, made in blocks
        self._draws = Draws(rng, lambda g, count: g.integers(size, size=count))

    def next(self) -> Taken | SkippedSample:
        if self._records:
            return self._records.pop(0)
        if self.ended:
            raise StopIteration
        while len(self.held) < max(1, self.size):
            try:
                got = self.reader.next()
            except StopIteration:
                break
            if isinstance(got, SkippedSample) or self.size == 0:
                return got
            self.held.append(got)
        if not self.held:
            self.ended = True
            raise StopIteration
        n = len(self.held)
        j = self._draws() if n == self.size else int(self._draws.settle().integers(n))
        self.held[j], self.held[-1] = self.held[-1], self.held[j]
        return self.held.pop()

    def _next_pass(self) -> None:
        self.reader.reset()
        self.pass_ += 1
        self._start_pass()

    def state_dict(self) -> dict[str, Any]:
        urls, held = pack_addresses([(0, t.url, t.index) for t in self.held])
        return self._pack(**{self.PASS: self.pass_, self.ENDED: self.ended,
                             self.RNG: self._draws.state, self.URLS: urls,
                             self.HELD: held, self.READER: self.reader.state_dict()})

    def _load(self, state: Mapping[str, Any]) -> None:
        """Back to a saved position; the buffered samples are read again from their shards."""
        self.reader.reset(state[self.READER])
        self.pass_ = int(state[self.PASS])
        self._start_pass()
        self.ended = bool(state[self.ENDED])
        self._draws.state = state[self.RNG]
        wanted = [(url, i) for _, url, i in unpack_addresses(state[self.URLS], state[self.HELD])]
        found, self._records = self.fetch(wanted)
        self.held = [Taken(url, i, found[url, i]) for url, i in wanted if (url, i) in found]

    def remaining(self, state: Mapping[str, Any]) -> list[Work]:
        """What a state of this buffer has left: the samples it holds, and (unless its pass
        ended) what its reader has left."""
        state = self._unpack(state)
        held = unpack_addresses(state[self.URLS], state[self.HELD])
        out = [Work(url, only=tuple(sorted(i for _, u, i in held if u == url)))
               for url in dict.fromkeys(u for _, u, _ in held)]
        if not state[self.ENDED]:
            out += self.reader.remaining(state[self.READER])
        return out
