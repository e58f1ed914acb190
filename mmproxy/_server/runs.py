"""Run table: a server's shared state, and the internal interface of proxies, loaders and resolvers.
docs/internals.md, ``mmproxy._server.runs``, has the rest.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from mmproxy._server.run import Run, RunSource, RunState, ServerState, moved
from mmproxy._server.schedule import Epochs, Schedule, Tag
from mmproxy._wire.transport import Request
from mmproxy.errors import (
    BatchSizeError,
    RunDroppedError,
    ServerFailedError,
    ServerStateError,
    WaitTimeoutError,
    fresh_copy,
)

__all__ = ["Lane", "Request", "Run", "RunSource", "RunState", "RunTable", "ServerState"]

_POLL = 0.05
_DONE_KEPT = 8  # released runs kept (a batch's other outputs of the same run may follow)
_DROPPED_KEPT = 4096  # ids of dropped runs remembered, to say why a reference cannot be served


class RunTable:
    """The state a server shares with its proxies, loaders, resolvers and threads.

    Args:
        name: The server's name, for messages.
        max_batch_size: The pipeline's ``batch_size``.
        deterministic: Schedule runs in the order :meth:`claim` gives (the main loop's order).
        timeout: Seconds :meth:`wait` waits for one run; None: as long as the server runs.
        device: The server's CUDA device (outputs are on it), or None.
        lanes: The server's pipelines, each with a runner that takes runs as one :meth:`lane`.
    """

    def __init__(self, name: str, max_batch_size: int, *, deterministic: bool,
                 timeout: float | None, device: Any = None, lanes: int = 1) -> None:
        self.name = name
        self.max_batch_size = max_batch_size
        self.deterministic = deterministic
        self.timeout = timeout
        self.device = device
        self.cond = threading.Condition()
        self.state = ServerState.CREATED
        self.error: BaseException | None = None  # why the server failed
        self.runs: dict[str, Run] = {}
        self._epochs = Epochs()
        self._schedule = Schedule(deterministic, self._epochs, lanes)
        self._done: OrderedDict[str, Run] = OrderedDict()
        self._dropped: OrderedDict[str, str] = OrderedDict()  # run id -> why
        self.samples = 0  # samples produced
        self.wait_seconds = 0.0  # main-loop time spent in wait()
        self.starved_seconds = 0.0  # runners' time waiting in next(), summed over the pipelines

    # -- server lifecycle -----------------------------------------------------------------------

    def set_state(self, new: ServerState) -> None:
        with self.cond:
            self._move_server(new)
            self.cond.notify_all()

    def _move_server(self, new: ServerState) -> None:
        self.state = moved(self.state, new, f"server {self.name!r}")

    def fail(self, error: BaseException) -> None:
        """The server failed: it stays FAILED, and every run not yet READY fails with ``error``."""
        with self.cond:
            if self.state in (ServerState.FAILED, ServerState.STOPPED):
                return  # failed already, or an error after the server stopped (no one waits)
            self.error = error
            self._move_server(ServerState.FAILED)
            for run in self.runs.values():
                if run.state not in (RunState.READY, RunState.FAILED):
                    run.fail(error, self.name)
            self.cond.notify_all()

    def failed_error(self) -> ServerFailedError:
        err = ServerFailedError(f"server {self.name!r} failed earlier and stays failed: {self.error}")
        err.__cause__ = self.error
        return err

    def check_startable(self) -> None:
        """Raises unless the server may start (it is CREATED or STOPPED)."""
        with self.cond:
            if self.state is ServerState.FAILED:
                raise self.failed_error()
            if self.state is ServerState.STOPPING:
                raise ServerStateError(f"server {self.name!r} is stopping")

    def clear(self) -> None:
        """The server stopped: forget every run (references to them raise RunDroppedError)."""
        with self.cond:
            for run in self.runs.values():
                run.request = None
                if run.state is not RunState.FAILED:
                    self._note_dropped(run.id, "the server was stopped before it ran")
            self.runs.clear()
            self._schedule.clear()
            self._done.clear()
            if self.state is ServerState.STOPPING:
                self._move_server(ServerState.STOPPED)
            self.cond.notify_all()

    # -- proxies and the listener ---------------------------------------------------------------

    def accept(self, request: Request) -> None:
        """Takes a run's inputs. Stale runs (a loader's earlier epoch) and duplicates are dropped;
        a run of more samples than the pipeline's ``batch_size`` fails with
        :class:`~mmproxy.errors.BatchSizeError` (every run comes through here, from a proxy in
        this process or from the listener; a dataset that knows its batches are too large says
        so earlier, when its loader is made)."""
        n = len(request.inputs[0]) if request.inputs else 0
        with self.cond:
            if self.state is not ServerState.RUNNING:
                if self.state is ServerState.FAILED:
                    raise self.failed_error()
                raise ServerStateError(f"server {self.name!r} is {self.state.value}; "
                                       "start it (or enter its `with` block) before using it")
            if self._epochs.is_stale(request.tag):
                self._note_dropped(request.run_id, self._epochs.stale_reason(request.tag))
                return
            run = self.runs.get(request.run_id)
            if run is None:
                run = self.runs[request.run_id] = Run(request.run_id)
            elif run.state is not RunState.PENDING or run.request is not None:
                return  # a duplicate
            run.tag, run.keys = request.tag, list(request.keys)
            if n > self.max_batch_size:
                run.fail(BatchSizeError(
                    f"server {self.name!r}: a batch of {n} samples (run {run.id}) is larger than "
                    f"the pipeline's batch_size={self.max_batch_size}; raise the pipeline's "
                    "batch_size or lower the loader's"), self.name)
                self._schedule.forget({run.id})  # never run: not in the claimed order either
            else:
                run.request = request
                self._schedule.arrived(run)
            self.cond.notify_all()

    # -- loaders --------------------------------------------------------------------------------

    def begin_epoch(self, loader_id: str, epoch: int) -> None:
        """Drops the runs of a loader's earlier epochs (an abandoned epoch leaves nothing)."""
        with self.cond:
            self._epochs.begin(loader_id, epoch)
            stale = [r for r in self.runs.values() if self._epochs.is_stale(r.tag)]
            for run in stale:
                del self.runs[run.id]
                self._note_dropped(run.id, self._epochs.stale_reason(run.tag))
                if run.state is not RunState.SCHEDULED:  # the runner still owns a scheduled one
                    run.request, run.outputs = None, ()
            self._schedule.forget({r.id for r in stale})

    def claim(self, run_ids: list[str], tag: Tag = None) -> None:
        """Deterministic mode: the main loop says which runs go next, in order. ``tag`` is the
        (loader, epoch) they belong to, so that a run claimed before its inputs arrived is
        dropped with its epoch like any other."""
        with self.cond:
            for run_id in run_ids:
                if not self._schedule.is_claimed(run_id) and (
                        run_id not in self.runs or self.runs[run_id].state is RunState.PENDING):
                    run = self.runs.setdefault(run_id, Run(run_id))
                    if run.tag is None:
                        run.tag = tag
                    self._schedule.claim(run_id)
            self.cond.notify_all()

    @property
    def lanes(self) -> int:
        """The server's pipelines (the schedule deals runs to them)."""
        return self._schedule.lanes

    # -- resolvers ------------------------------------------------------------------------------

    def wait(self, run_id: str) -> Run:
        """Blocks until run ``run_id`` is READY; raises its error if it failed, and at once when
        it can never be served (server failed or stopped, run dropped)."""
        start = time.perf_counter()
        deadline = None if self.timeout is None else start + self.timeout
        with self.cond:
            try:
                while True:
                    run = self.runs.get(run_id) or self._done.get(run_id)
                    if run is not None and run.state is RunState.READY:
                        return run
                    if run is not None and run.state is RunState.FAILED:
                        if self.runs.pop(run.id, None) is not None:
                            self._keep_done(run)
                        raise fresh_copy(run.error)
                    if self.state is ServerState.FAILED:
                        raise self.failed_error()
                    if self.state is not ServerState.RUNNING:
                        raise ServerStateError(
                            f"server {self.name!r} is {self.state.value}; run {run_id} "
                            "cannot be produced (start the server before iterating)")
                    if run is None and run_id in self._dropped:
                        raise RunDroppedError(f"server {self.name!r}: run {run_id} was dropped: "
                                              f"{self._dropped[run_id]}")
                    if run is None:  # its inputs are on their way: wait for them
                        run = self.runs[run_id] = Run(run_id)
                    if deadline is not None and time.perf_counter() > deadline:
                        if run.request is None and run.state is RunState.PENDING:
                            self.runs.pop(run.id, None)  # the placeholder made for this wait
                        raise WaitTimeoutError(
                            f"server {self.name!r}: run {run_id} not ready after "
                            f"{self.timeout} s (state {run.state.value})")
                    self.cond.wait(_POLL)
            finally:
                self.wait_seconds += time.perf_counter() - start

    def release(self, run: Run) -> None:
        """A batch has taken the run's outputs: keep it briefly (its other outputs may follow)."""
        with self.cond:
            evicted = self._keep_done(run) if self.runs.pop(run.id, None) is not None else []
        # freed outside the lock: a run's GPU outputs and its inputs' buffers take a while to
        # free, and the runners and the listener need the table meanwhile
        del evicted

    # -- the runner thread ----------------------------------------------------------------------

    def lane(self, index: int) -> Lane:
        """The run table as pipeline ``index`` of the server's runs it."""
        return Lane(self, index)

    def next(self, block: bool, stop: threading.Event, lane: int = 0) -> Run | None:
        """The next run for pipeline ``lane`` to feed (now SCHEDULED), or None (nothing yet, or
        ``stop`` set).

        In the :mod:`schedule's <mmproxy._server.schedule>` order.
        """
        start = time.perf_counter()
        with self.cond:
            try:
                while not stop.is_set():
                    run = self._schedule.take(lane)
                    if run is not None:
                        run.move(RunState.SCHEDULED, self.name)
                        return run
                    if not block:
                        return None
                    self.cond.wait(_POLL)
                return None
            finally:
                if block:
                    self.starved_seconds += time.perf_counter() - start

    def finish(self, run: Run, outputs: tuple[Any, ...], event: Any, *, kept: list[int] | None = None,
               dropped: dict[int, str] | None = None) -> None:
        """The run's outputs are ready (without the ``dropped`` samples, when given)."""
        with self.cond:
            run.outputs, run.event, run.request = outputs, event, None
            if kept is not None:
                run.kept, run.dropped = kept, dropped or {}
            run.move(RunState.READY, self.name)
            self.samples += len(run.keys) - len(run.dropped)
            self.cond.notify_all()

    def fail_run(self, run: Run, error: BaseException) -> None:
        """The run failed (the server did not): the resolver raises ``error`` for it."""
        with self.cond:
            run.fail(error, self.name)
            self.cond.notify_all()

    # -- helpers (called with the lock held) ----------------------------------------------------

    def _keep_done(self, run: Run) -> list[Run]:
        """Keeps ``run`` among the released ones; returns those it pushes out, for the caller
        to drop once it has let go of the lock."""
        self._done[run.id] = run
        evicted = []
        while len(self._done) > _DONE_KEPT:
            old = self._done.popitem(last=False)[1]
            self._note_dropped(old.id, f"its outputs were taken, and only the last {_DONE_KEPT} "
                               "released runs are kept (a batch resolved again long after)")
            evicted.append(old)
        return evicted

    def _note_dropped(self, run_id: str, why: str) -> None:
        self._dropped[run_id] = why
        while len(self._dropped) > _DROPPED_KEPT:
            self._dropped.popitem(last=False)


class Lane:
    """The run table as one of a server's pipelines (its runner) uses it: a
    :class:`~mmproxy._server.run.RunSource` whose :meth:`next` takes that pipeline's runs."""

    def __init__(self, table: RunTable, index: int) -> None:
        self.table, self.index, self.name = table, index, table.name

    def next(self, block: bool, stop: threading.Event) -> Run | None:
        return self.table.next(block, stop, self.index)

    def finish(self, run: Run, outputs: tuple[Any, ...], event: Any, *, kept: list[int] | None = None,
               dropped: dict[int, str] | None = None) -> None:
        self.table.finish(run, outputs, event, kept=kept, dropped=dropped)

    def fail_run(self, run: Run, error: BaseException) -> None:
        self.table.fail_run(run, error)

    def fail(self, error: BaseException) -> None:
        self.table.fail(error)
