"""Prepared runs: a pipeline's inputs made in the server process before the runner feeds them.

A pipeline may come with a :class:`Prepare` stage (``SampleSeeded(pipeline, ..., prepare=stage)``;
the video pipeline's NVDEC decoder is one). The proxy then sends the stage's inputs
(``Prepare.inputs``) instead of the pipeline's, and the runner takes its runs through
:class:`PreparedRuns`, which hands each sample to the stage as soon as the run is taken from the
run table and gives the run to the runner once every sample of it is prepared::

    RunTable ──next()──> PreparedRuns: up to two runs taken early, each sample
                           Prepare.submit(sample) -> Future   [the stage's own threads]
                         the oldest run, all its samples done: inputs replaced by the prepared
                           ones (by the pipeline's input names) ──> runner: feed, outputs, finish

A sample whose preparation raises :class:`DamagedSampleError` (the stage says the sample's data is
at fault: a clip that does not decode) is a damaged sample, as a sample the pipeline cannot
process is: with every sample of the run skippable (a dataset in skip mode) it is dropped and
named, the others run, and the loader removes its rows from every field; otherwise the run fails
with a :class:`~mmproxy.errors.PipelineError` naming it. Any other error of the stage (a driver
error, CUDA out of memory, a bug) is the stage failing, not the sample: the run fails with a
``PipelineError`` naming the stage, the sample and the cause, in skip mode too. Prepared inputs
stay referenced until the run's outputs are complete on the GPU (its CUDA event), so the stage's
threads never reuse memory the pipeline may still read.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, wait
from typing import Any, Protocol

from mmproxy import _context
from mmproxy._runs import Run, RunSource
from mmproxy.errors import PipelineError, SampleError, with_remote_cause

__all__ = ["DamagedSampleError", "Prepare", "PreparedRuns"]

_POLL = 0.05
_AHEAD = 2  # runs handed to the stage ahead of the one the runner takes next


class DamagedSampleError(SampleError):
    """Raised by a :class:`Prepare` stage for a sample whose data it cannot prepare (a clip that
    does not decode): the sample is dropped in skip mode. Any other error is the stage's own."""


class Prepare(Protocol):
    """Turns each sample's inputs, as workers send them, into the pipeline's inputs, in the server
    process (e.g. encoded video decoded into GPU frames)."""

    inputs: tuple[str, ...]  # what the proxy sends per sample, in order

    def start(self) -> None:
        """Lets the stage take samples (again after :meth:`close`); the server calls it when it
        starts."""
        ...

    def submit(self, sample: dict[str, Any]) -> Future[dict[str, Any]]:
        """Starts preparing one sample (its inputs by name); the future gives the pipeline's
        inputs by name, or raises: :class:`DamagedSampleError` for a sample whose data is at
        fault, anything else when the stage itself fails. Raises at once after :meth:`close`."""
        ...

    def close(self) -> None:
        """Stops the stage's threads (waiting a bounded time for them); :meth:`submit` raises
        until the next :meth:`start`."""
        ...


class PreparedRuns:
    """The run table as the runner uses it when the pipeline has a :class:`Prepare` stage (a
    :class:`~mmproxy._runs.RunSource`).

    Args:
        table: The server's run table (the lane of the pipeline this runner feeds: a server of
            several pipelines has one of these a pipeline, all handing samples to one stage).
        prepare: The stage.
        input_names: The pipeline's inputs, in the order the runner feeds them.
        num_outputs: The pipeline's outputs (a run whose samples all fail has empty ones).

    The stage is handed the samples of up to two runs ahead of the one the runner takes next.
    """

    def __init__(self, table: RunSource, prepare: Prepare, input_names: Sequence[str],
                 num_outputs: int) -> None:
        self.table, self.prepare, self.input_names = table, prepare, tuple(input_names)
        self.num_outputs = num_outputs
        self.name = table.name
        self._pending: deque[tuple[Run, list[Future[dict[str, Any]]]]] = deque()
        self._reduced: dict[str, tuple[list[Any], list[int], dict[int, str]]] = {}
        self._held: deque[tuple[Any, Any]] = deque()  # (CUDA event, prepared inputs)

    def next(self, block: bool, stop: threading.Event) -> Run | None:
        """The next run, its inputs prepared (see :meth:`RunTable.next`)."""
        while not stop.is_set():
            self._take(stop)
            if not self._pending:
                if not block:
                    return None
                run = self.table.next(block=True, stop=stop)
                if run is not None:
                    self._start(run)
                continue
            run, futures = self._pending[0]
            done, _ = wait(futures, timeout=_POLL if block else 0)
            if len(done) < len(futures):
                if not block:
                    return None
                continue
            self._pending.popleft()
            if self._ready(run, futures):
                return run
        return None

    def finish(self, run: Run, outputs: tuple[Any, ...], event: Any, *, kept: list[int] | None = None,
               dropped: dict[int, str] | None = None) -> None:
        """As :meth:`RunTable.finish`, with the samples dropped before the feed added back."""
        self._hold(run, event)
        reduced = self._reduced.pop(run.id, None)
        if reduced is not None:  # the runner saw only the prepared samples: back to the batch's
            keys, mine, before = reduced
            run.keys = keys
            inner = range(len(mine)) if kept is None else kept
            dropped = dict(sorted({**before, **{mine[i]: why for i, why in
                                                (dropped or {}).items()}}.items()))
            kept = [mine[i] for i in inner]
        self.table.finish(run, outputs, event, kept=kept, dropped=dropped)

    def fail_run(self, run: Run, error: BaseException) -> None:
        reduced = self._reduced.pop(run.id, None)
        if reduced is not None:
            run.keys = reduced[0]
        self.table.fail_run(run, error)

    def fail(self, error: BaseException) -> None:
        self.table.fail(error)

    # -- helpers --------------------------------------------------------------------------------

    def _take(self, stop: threading.Event) -> None:
        """Starts preparing the runs that have arrived, up to two ahead of the runner."""
        while len(self._pending) < _AHEAD:
            run = self.table.next(block=False, stop=stop)
            if run is None:
                return
            self._start(run)

    def _start(self, run: Run) -> None:
        assert run.request is not None
        inputs = run.request.inputs
        names = self.prepare.inputs
        futures = [self.prepare.submit({name: inputs[k][i] for k, name in enumerate(names)})
                   for i in range(len(inputs[0]) if inputs else 0)]
        self._pending.append((run, futures))

    def _ready(self, run: Run, futures: list[Future[dict[str, Any]]]) -> bool:
        """Puts the prepared inputs in ``run``; False when no sample is left for the runner
        (the run is finished or failed here)."""
        if run.request is None:  # dropped meanwhile (its loader started a new epoch)
            return False
        rows: dict[int, dict[str, Any]] = {}
        failed: dict[int, BaseException] = {}
        keys = list(run.keys)
        for i, future in enumerate(futures):
            error = (future.exception() if not future.cancelled() else
                     RuntimeError("its preparation was cancelled (the stage was closed)"))
            if error is None:
                rows[i] = future.result()
            elif isinstance(error, DamagedSampleError):
                failed[i] = error
            else:  # the stage failed, not the sample
                self.table.fail_run(run, with_remote_cause(PipelineError(
                    f"server {self.name!r}: the Prepare stage {type(self.prepare).__name__} failed "
                    f"on sample {_key(keys, i)} (sample {i} of run {run.id}): "
                    f"{type(error).__name__}: {error}"), error))
                return False
        if failed and not all(isinstance(k, _context.SampleId) and k.skip for k in keys):
            i, error = next(iter(failed.items()))
            self.table.fail_run(run, with_remote_cause(PipelineError(
                f"server {self.name!r}: cannot prepare sample {_key(keys, i)} (sample {i} of run "
                f"{run.id}): {error}"), error))
            return False
        kept = sorted(rows)
        run.request.inputs = [[rows[i][name] for i in kept] for name in self.input_names]
        if not failed:
            return True
        dropped = {i: f"could not be prepared in server {self.name!r}: {e}"
                   for i, e in failed.items()}
        if not kept:
            self.table.finish(run, tuple([] for _ in range(self.num_outputs)), None, kept=[],
                              dropped=dropped)
            return False
        self._reduced[run.id] = (keys, kept, dropped)
        run.keys = [keys[i] for i in kept]
        return True

    def _hold(self, run: Run, event: Any) -> None:
        """Keeps ``run``'s prepared inputs until ``event`` (its outputs on the GPU) completes."""
        while self._held and self._held[0][0].query():
            self._held.popleft()
        if event is not None and run.request is not None:
            self._held.append((event, run.request.inputs))


def _key(keys: list[Any], i: int) -> str:
    return str(keys[i]) if i < len(keys) and keys[i] is not None else f"#{i}"
