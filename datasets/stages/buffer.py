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
from mmproxy.datasets.stages.plan import Work
from mmproxy.datasets.stages.reader import ShardReader, Taken

from mmproxy.skips import SkippedSample

__all__ = ["ShuffleBuffer"]


class ShuffleBuffer(Stage):
    """One source's samples for one worker in one pass, through a shuffle buffer.

    :meth:`take` gives a :class:`~mmproxy.datasets.stages.reader.Taken`, or a shard's record, or None
    once the pass is over (until :meth:`restart`). ``taken`` counts the samples given in this
    pass (a pass that gives none cannot fill ``epoch_length``).

    Args:
        reader: The source's shard reader.
        size: How many samples the buffer holds; 0: none (samples in order).
    """

    NAME = "shuffle buffer"
    TAKEN, ENDED, RNG, URLS, HELD, READER = "taken", "ended", "rng", "urls", "held", "reader"
    KEYS = (TAKEN, ENDED, RNG, URLS, HELD, READER)

    def __init__(self, reader: ShardReader, size: int) -> None:
        self.reader, self.size = reader, size
        self._start_pass()

    def _start_pass(self) -> None:
        plan = self.reader.plan
        lay = plan.layout
        self.held: list[Taken] = []
        self.taken, self.ended = 0, False
        self._records: list[SkippedSample] = []  # of shards read again on loading a state
        rng = generator(lay.seed, lay.epoch, plan.source, lay.rank, lay.worker, plan.pass_, 1)
        size = self.size  # a full buffer's draws, made in blocks
        self._draws = Draws(rng, lambda g, count: g.integers(size, size=count))

    @property
    def pass_(self) -> int:
        return self.reader.plan.pass_

    def take(self) -> Taken | SkippedSample | None:
        if self._records:
            return self._records.pop(0)
        if self.ended:
            return None
        while len(self.held) < max(1, self.size):
            got = self.reader.take()
            if got is None:
                break
            if isinstance(got, SkippedSample) or self.size == 0:
                self.taken += isinstance(got, Taken)
                return got
            self.held.append(got)
        if not self.held:
            self.ended = True
            return None
        n = len(self.held)
        j = self._draws() if n == self.size else int(self._draws.settle().integers(n))
        self.held[j], self.held[-1] = self.held[-1], self.held[j]
        self.taken += 1
        return self.held.pop()

    def restart(self) -> None:
        """Starts the next pass (after :meth:`take` gave None)."""
        self.reader.restart()
        self._start_pass()

    def state_dict(self) -> dict[str, Any]:
        urls, held = pack_addresses([(0, t.url, t.index) for t in self.held])
        return self._pack(**{self.TAKEN: self.taken, self.ENDED: self.ended,
                             self.RNG: self._draws.state, self.URLS: urls,
                             self.HELD: held, self.READER: self.reader.state_dict()})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Back to a saved position; the buffered samples are read again from their shards."""
        state = self._unpack(state)
        self.reader.load_state_dict(state[self.READER])
        self._start_pass()
        self.taken, self.ended = int(state[self.TAKEN]), bool(state[self.ENDED])
        self._draws.state = state[self.RNG]
        wanted = [(url, i) for _, url, i in unpack_addresses(state[self.URLS], state[self.HELD])]
        found, self._records = self.reader.read.fetch(wanted)
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
