"""Run: one batch of one server: its samples, inputs, outputs and state; and :class:`RunSource`,
what the runner takes runs from.

A run changes state only through :meth:`Run.move`, along the moves of its lifecycle
(:mod:`mmproxy._lifecycle`). Runs live in their server's :class:`~mmproxy._runs.RunTable`, which
moves them under its lock.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from mmproxy._lifecycle import RunState, moved
from mmproxy._transport import Request

__all__ = ["Run", "RunSource", "RunState"]


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
    """What the runner thread (:mod:`mmproxy._runner`) and its search for bad samples
    (:mod:`mmproxy._isolation`) use of a server's runs: the :class:`RunTable` itself, or, for a
    pipeline with a Prepare stage, :class:`~mmproxy._prepare.PreparedRuns` over it."""

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
