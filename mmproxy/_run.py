"""Run: one batch of one server: its samples, inputs, outputs and state.

A run changes state only through :meth:`Run.move`, along the moves of its lifecycle
(:mod:`mmproxy._lifecycle`). Runs live in their server's :class:`~mmproxy._runs.RunTable`, which
moves them under its lock.
"""

from __future__ import annotations

from typing import Any

from mmproxy._lifecycle import RunState, moved
from mmproxy._transport import Request

__all__ = ["Run", "RunState"]


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
