"""Run: one batch of one server (samples, inputs, outputs, state), the lifecycles of a server and
of a run, and :class:`RunSource`, what the runner takes runs from.

A server goes ``CREATED -> RUNNING -> STOPPING -> STOPPED`` (and back to RUNNING on restart) or
to ``FAILED``; a run goes ``PENDING -> SCHEDULED -> READY | FAILED``. Every move goes through
:func:`moved`, which raises :class:`~mmproxy.errors.ServerStateError` for an illegal one; the
run table (:class:`~mmproxy._server.runs.RunTable`) makes the moves under its lock.
"""

from __future__ import annotations

import enum
import threading
from typing import Any, Protocol, TypeVar

from mmproxy._wire.transport import Request
from mmproxy.errors import ServerStateError

__all__ = ["Run", "RunSource", "RunState", "ServerState", "moved"]


class ServerState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class RunState(enum.Enum):
    PENDING = "pending"
    SCHEDULED = "scheduled"
    READY = "ready"
    FAILED = "failed"


_MOVES: dict[enum.Enum, set[enum.Enum]] = {
    ServerState.CREATED: {ServerState.RUNNING, ServerState.FAILED},
    ServerState.RUNNING: {ServerState.STOPPING, ServerState.FAILED},
    ServerState.STOPPING: {ServerState.STOPPED, ServerState.FAILED},
    ServerState.STOPPED: {ServerState.RUNNING},
    ServerState.FAILED: set(),
    RunState.PENDING: {RunState.SCHEDULED, RunState.FAILED},
    RunState.SCHEDULED: {RunState.READY, RunState.FAILED},
    RunState.READY: set(),
    RunState.FAILED: set(),
}

State = TypeVar("State", ServerState, RunState)


def moved(state: State, new: State, what: str) -> State:
    """``new``, when ``what`` (a server, a run; named in the error) may go there from ``state``."""
    if new not in _MOVES[state]:
        raise ServerStateError(f"{what}: illegal transition {state.value} -> {new.value}")
    return new


class Run:
    """One batch of one server.

    ``keys`` names its samples (:class:`~mmproxy._context.SampleId` or None); ``kept`` lists the
    samples (indices into ``keys``) whose rows the outputs hold, in order, after samples the
    pipeline could not process were dropped; ``dropped`` maps those to the pipeline's message.
    """

    __slots__ = ("dropped", "error", "event", "id", "keys", "kept", "outputs", "request", "state",
                 "tag")

    def __init__(self, run_id: str) -> None:
        self.id = run_id
        self.state = RunState.PENDING
        self.request: Request | None = None
        self.tag: tuple[str, int] | None = None
        self.keys: list[Any] = []
        self.kept: list[int] | None = None  # None: every sample
        self.dropped: dict[int, str] = {}
        self.outputs: tuple[Any, ...] = ()
        self.event: Any = None
        self.error: BaseException | None = None

    def move(self, new: RunState, server: str) -> None:
        """Moves the run to ``new`` (``server`` names it in the error for an illegal move)."""
        self.state = moved(self.state, new, f"server {server!r}: run {self.id}")

    def fail(self, error: BaseException, server: str) -> None:
        """The run failed with ``error``: its inputs are let go, and its resolver raises it."""
        self.move(RunState.FAILED, server)
        self.error, self.request = error, None


class RunSource(Protocol):
    """What the runner thread (:mod:`mmproxy._server.runner`) and its search for bad samples
    (:mod:`mmproxy._server.isolation`) use of a server's runs: the :class:`RunTable` itself, or, for a
    pipeline with a Prepare stage, :class:`~mmproxy._server.prepare.PreparedRuns` over it."""

    name: str  # the server's name, for messages

    def next(self, block: bool, stop: threading.Event) -> Run | None:
        """The next run to feed (now SCHEDULED), or None (nothing yet, or ``stop`` set)."""
        ...

    def finish(self, run: Run, outputs: tuple[Any, ...], event: Any, *, kept: list[int] | None = None,
               dropped: dict[int, str] | None = None) -> None:
        """The run's outputs are ready (without the ``dropped`` samples, when given)."""
        ...

    def fail_run(self, run: Run, error: BaseException) -> None:
        """The run failed (the server did not)."""
        ...

    def fail(self, error: BaseException) -> None:
        """The server failed."""
        ...
