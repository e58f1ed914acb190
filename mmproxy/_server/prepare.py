"""Prepared runs: a pipeline's inputs made in the server process before the runner feeds them.

With a :class:`~mmproxy.Prepare` stage (``SampleSeeded(..., prepare=stage)``, e.g. the NVDEC
decoder) the proxy sends the stage's inputs, and :class:`PreparedRuns` hands each sample of a run
taken from the run table to the stage, then gives the runner the run once all are prepared. A
:class:`~mmproxy.DamagedSampleError` is a damaged sample (dropped in skip mode); any other error
fails the run, naming the stage. Prepared inputs stay referenced until the run's outputs are
complete on the GPU. docs/architecture.md, "Data flow", has the picture.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, wait
from typing import Any

from mmproxy._server.runs import Run, RunSource
from mmproxy.errors import DamagedSampleError, PipelineError, with_remote_cause
from mmproxy.protocols import Prepare

__all__ = ["DamagedSampleError", "Prepare", "PreparedRuns"]  # the first two re-exported

_POLL = 0.05
_AHEAD = 2  # runs handed to the stage ahead of the one the runner takes next


class PreparedRuns:
    """The run table as the runner uses it when the pipeline has a :class:`Prepare` stage (a
    :class:`~mmproxy._server.runs.RunSource`).

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
        if failed and not run.request.skip:
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
