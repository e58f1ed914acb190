"""Schedule: the runs whose inputs have arrived, and the order the runner takes them in.

Without ``deterministic``, the oldest arrival goes first, except that the current epoch's runs
go before the next epoch's early first batches (:class:`Epochs`: stale and early runs). With
it, runs go in the order the main loop claims them (the order it consumes batches), each once its
inputs are here, so a seeded pipeline gives the same outputs run after run; a server of several
pipelines then deals them to its pipelines in turn (the k-th run to pipeline ``k % lanes``), so
each pipeline's own random stream sees the same runs every time. It is guarded by the run table's
lock.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from mmproxy._server.run import Run

__all__ = ["Epochs", "Schedule", "Tag"]


Tag = tuple[str, int] | None  # (loader id, epoch) of a run


class Epochs:
    """The current epoch of each loader of one server (guarded by the run table's lock)."""

    def __init__(self) -> None:
        self._current: dict[str, int] = {}  # loader id -> its current epoch

    def begin(self, loader_id: str, epoch: int) -> None:
        self._current[loader_id] = epoch

    def is_stale(self, tag: Tag) -> bool:
        """Whether the run belongs to an epoch its loader has left."""
        return tag is not None and tag[1] < self._current.get(tag[0], tag[1])

    def is_early(self, tag: Tag) -> bool:
        """Whether the run belongs to an epoch its loader has not started yet."""
        return tag is not None and tag[1] > self._current.get(tag[0], tag[1])

    def stale_reason(self, tag: Tag) -> str:
        """Why a stale run was dropped, in words."""
        loader, epoch = tag or ("?", -1)
        return (f"it belongs to epoch {epoch} of loader {loader}, which has started epoch "
                f"{self._current.get(loader)} (a batch kept from an abandoned epoch)")


class Schedule:
    """Arrived runs and claims of one server.

    Args:
        deterministic: Take runs in claimed order.
        epochs: The server's loaders' epochs (to put early runs last).
        lanes: The server's pipelines (each takes runs as its lane).
    """

    def __init__(self, deterministic: bool, epochs: Epochs, lanes: int = 1) -> None:
        self.deterministic = deterministic
        self._epochs = epochs
        self.lanes = lanes
        self._turn = 0  # deterministic: the lane whose turn it is
        self._arrived: OrderedDict[str, Run] = OrderedDict()  # inputs here, not yet scheduled
        self._claims: deque[str] = deque()  # the main loop's order

    def arrived(self, run: Run) -> None:
        self._arrived[run.id] = run

    def is_claimed(self, run_id: str) -> bool:
        return run_id in self._claims

    def claim(self, run_id: str) -> None:
        self._claims.append(run_id)

    def forget(self, run_ids: set[str]) -> None:
        """Drops runs that will never be run (a loader's abandoned epoch)."""
        for run_id in run_ids:
            self._arrived.pop(run_id, None)
        self._claims = deque(c for c in self._claims if c not in run_ids)

    def clear(self) -> None:
        self._arrived.clear()
        self._claims.clear()
        self._turn = 0

    def take(self, lane: int = 0) -> Run | None:
        """The run for ``lane`` to feed next, taken off the schedule, or None when none may go
        yet (deterministic: nor while it is another lane's turn)."""
        if self.deterministic:
            if self._turn == lane and self._claims and self._claims[0] in self._arrived:
                self._turn = (self._turn + 1) % self.lanes
                return self._arrived.pop(self._claims.popleft())
            return None
        if not self._arrived:
            return None
        run = next((r for r in self._arrived.values() if not self._epochs.is_early(r.tag)),
                   None) or next(iter(self._arrived.values()))
        del self._arrived[run.id]
        return run
