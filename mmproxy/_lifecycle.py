"""Lifecycles: the states of a server and of a run, and their legal moves.

A server goes ``CREATED -> RUNNING -> STOPPING -> STOPPED`` (and back to RUNNING on restart) or
to ``FAILED``, where it stays. A run goes ``PENDING -> SCHEDULED -> READY | FAILED`` (or straight
from PENDING to FAILED, when its server fails or its batch is refused before it is fed). Every
move goes through :func:`moved`, which raises :class:`~mmproxy.errors.ServerStateError` for an
illegal one; the run table makes the moves under its lock.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from mmproxy.errors import ServerStateError

__all__ = ["RunState", "ServerState", "moved"]


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
