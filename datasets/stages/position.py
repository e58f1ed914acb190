"""Position stamp: every item a worker yields, with the worker's state right after it.

The last stage of a worker's chain. Under an :class:`mmproxy.DataLoader` each batch (and each
records-only item) is wrapped by :func:`mmproxy.worker.stamp` with the state of the whole chain,
which the loader keeps per worker without reading it: a fresh chain given that state continues
with the next item. Outside such a loader the items go out as they are (no state is made).

The state names where the worker sat (epoch, worker, number of workers: a chain is built for
them before the state is loaded) and nests the batcher's state, which nests the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mmproxy.datasets.stages._stage import Stage
from mmproxy.datasets.stages.batcher import Batcher
from mmproxy.datasets.stages.plan import Layout, Work

from mmproxy import worker
from mmproxy.errors import StateError

__all__ = ["PositionStamp"]


class PositionStamp(Stage[Any]):
    """A worker's items, stamped with its position.

    Args:
        batcher: The batcher.
        layout: Where the worker sits.
    """

    NAME = "dataset position"
    VERSION = 2
    EPOCH, WORKER, WORKERS, BATCHER = "epoch", "worker", "workers", "batcher"
    KEYS = (EPOCH, WORKER, WORKERS, BATCHER)

    def __init__(self, batcher: Batcher, layout: Layout) -> None:
        self.batcher, self.layout = batcher, layout

    def next(self) -> Any:
        return worker.stamp(self.batcher.next(), self.layout.worker, self.state_dict)

    @classmethod
    def where(cls, state: Any) -> tuple[int, int, int]:
        """The epoch, worker and number of workers of a state (to build its chain)."""
        state = cls._unpack(state)
        return int(state[cls.EPOCH]), int(state[cls.WORKER]), int(state[cls.WORKERS])

    def state_dict(self) -> dict[str, Any]:
        lay = self.layout
        return self._pack(**{self.EPOCH: lay.epoch, self.WORKER: lay.worker,
                             self.WORKERS: lay.workers, self.BATCHER: self.batcher.state_dict()})

    def _load(self, state: Mapping[str, Any]) -> None:
        where = self.where(state)
        lay = self.layout
        if where != (lay.epoch, lay.worker, lay.workers):
            raise StateError(f"the {self.NAME} state is of epoch {where[0]}, worker {where[1]} "
                             f"of {where[2]}; this chain is of epoch {lay.epoch}, worker "
                             f"{lay.worker} of {lay.workers}")
        self.batcher.reset(state[self.BATCHER])

    def remaining(self, state: Mapping[str, Any]) -> list[list[Work]]:
        """What a state of this worker has left, per source."""
        return self.batcher.remaining(self._unpack(state)[self.BATCHER])
