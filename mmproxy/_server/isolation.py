"""Isolation: finding the samples of a failed run that the pipeline cannot process.

The search checks the server's stop event before each attempt and leaves with :class:`Stopped`,
so ``stop_thread()`` is not held up.
docs/internals.md, ``mmproxy._server.isolation``, has the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from mmproxy._server.dali import Pipe, named_sample, summary
from mmproxy._server.run import Run, RunSource
from mmproxy.errors import PipelineError, with_remote_cause

__all__ = ["Isolation", "Stopped", "describe"]

Outputs = tuple[tuple[Any, ...], Any]  # a run's outputs as torch, and their CUDA event


class Stopped(Exception):
    """The server was stopped during the search: the runner leaves at once."""


class Isolation:
    """Searches failed runs of one server's pipeline.

    Args:
        pipe: The pipeline adapter.
        table: The server's runs (finished or failed there): its run table, or the table with a
            Prepare stage before it.
        outputs: Takes the oldest scheduled run's outputs (the runner's conversion to torch).
        stop: Set when the server stops.
    """

    def __init__(self, pipe: Pipe, table: RunSource, outputs: Callable[[], Outputs],
                 stop: threading.Event) -> None:
        self.pipe, self.table, self.outputs, self.stop = pipe, table, outputs, stop
        self.name = table.name

    def __call__(self, run: Run, error: BaseException | None) -> None:
        """Finishes ``run``, which failed with ``error`` (None: not yet run on this pipeline),
        without the samples the pipeline cannot process, or fails it naming one."""
        if self.stop.is_set() or run.request is None:
            raise Stopped
        everything = list(range(len(run.keys) or len(run.request.inputs[0])))
        if error is None:
            outputs, error = self._attempt(run, everything)
            if error is None:
                self.table.finish(run, *outputs)
                return
        skip = run.request.skip
        bad: dict[int, BaseException] = {}
        self._find_bad(run, everything, error, bad, first_only=not skip)
        if not bad:  # the batch fails, but none of its parts does: once more, whole
            outputs, again = self._attempt(run, everything)
            if again is None:
                self.table.finish(run, *outputs)
                return
            self._fail(run, error, f"the pipeline failed on run {run.id} "
                                   f"({describe(run, everything)}), though every part of the "
                                   "batch runs alone")
            return
        if not skip:
            i, err = next(iter(bad.items()))
            self._fail(run, err, f"the pipeline cannot process sample {_name(run, i)} "
                                 f"(sample {i} of run {run.id})")
            return
        kept = [i for i in everything if i not in bad]
        if kept:
            outputs, again = self._attempt(run, kept)
            if again is not None:
                self._fail(run, again, f"run {run.id} failed again without its bad samples")
                return
        else:  # nothing left: the loader drops the whole batch and reports its samples
            outputs = (tuple([] for _ in range(self.pipe.num_outputs)), None)
        dropped = {i: f"pipeline failed in server {self.name!r}: {summary(e)}"
                   for i, e in sorted(bad.items())}
        self.table.finish(run, *outputs, kept=kept, dropped=dropped)

    def _fail(self, run: Run, error: BaseException, what: str) -> None:
        self.table.fail_run(run, with_remote_cause(PipelineError(
            f"server {self.name!r}: {what}: {summary(error)}"), error))

    def _attempt(self, run: Run, rows: list[int]) -> tuple[Any, BaseException | None]:
        """Runs the samples ``rows`` of ``run`` alone: (outputs, None) or (None, the error)."""
        if self.stop.is_set() or run.request is None:
            raise Stopped
        try:
            self.pipe.feed(run.request.inputs, rows)
            return self.outputs(), None
        except Exception as err:  # noqa: BLE001
            if not self.pipe.survives_errors:
                self.pipe.rebuild()
            return None, err

    def _find_bad(self, run: Run, rows: list[int], error: BaseException,
                  bad: dict[int, BaseException], first_only: bool) -> None:
        """``rows`` of ``run`` fail together with ``error``; adds the samples at fault to ``bad``."""
        while len(rows) > 1:
            hint = named_sample(error, len(rows))
            if hint is not None:
                _, alone = self._attempt(run, [rows[hint]])
                if alone is not None:
                    bad[rows[hint]] = alone
                    if first_only:
                        return
                    rows = rows[:hint] + rows[hint + 1:]
                    _, rest = self._attempt(run, rows)
                    if rest is None:
                        return
                    error = rest
                    continue
            half = len(rows) // 2
            for part in (rows[:half], rows[half:]):
                _, err = self._attempt(run, part)
                if err is not None:
                    self._find_bad(run, part, err, bad, first_only)
                    if first_only and bad:
                        return
            return
        if rows:
            bad[rows[0]] = error


def _name(run: Run, i: int) -> str:
    key = run.keys[i] if i < len(run.keys) else None
    return str(key) if key is not None else f"#{i}"


def describe(run: Run, rows: list[int]) -> str:
    """The samples ``rows`` of ``run`` by name, the first eight."""
    names = [_name(run, i) for i in rows[:8]]
    more = f" and {len(rows) - 8} more" if len(rows) > 8 else ""
    return "samples " + ", ".join(names) + more
