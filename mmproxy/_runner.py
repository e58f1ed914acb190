"""Runner: the server thread that feeds runs to the pipeline and takes their outputs.

Its loop is *fill -> outputs -> finish, or recover*: it fills the pipeline with up to
``prefetch_queue_depth`` iterations (takes the next run from the run table, feeds and schedules
it), takes the oldest iteration's outputs as torch and marks its run READY. With ``join``, a run
smaller than the pipeline's ``batch_size`` (a worker's last batch of an epoch) takes the runs
already waiting behind it into the same iteration while they fit (an iteration of a GPU pipeline
costs nearly as much for a quarter of a batch as for a whole one); each run gets its own rows of
the outputs, and a joined iteration that fails is run again as its runs, one by one.

Inputs the pipeline refuses (``feed_input`` or ``_run_once`` raising) fail their run alone: the
runs before it are finished, the pipeline is rebuilt before anything else runs on it (it may
hold part of those inputs), and a run before it that failed is searched from its inputs. When a
run's outputs fail:

1. the runs queued behind it are finished first (the dynamic executor keeps them), or, with the
   classic executors, which invalidate the pipeline, it is rebuilt and every one of them is run
   again (the synchronous executor may even report an error against the run before the one that
   caused it);
2. each failed run is searched for the samples the pipeline cannot process
   (:mod:`mmproxy._isolation`), which finishes it without them or fails it naming one.

Anything else (an error outside a run) fails the server.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any

from mmproxy import _convert
from mmproxy._dali import Pipe, summary
from mmproxy._isolation import Isolation, Outputs, Stopped, describe
from mmproxy._run import Run, RunSource
from mmproxy.errors import PipelineError, with_remote_cause

__all__ = ["Runner"]


class Runner:
    """The body of a server's runner thread.

    Args:
        pipe: The pipeline adapter.
        table: The server's runs: its run table, or the table with a Prepare stage before it.
        pad: Output indices to pad (see :class:`~mmproxy.DALIServer`).
        device: The CUDA device of a GPU pipeline, or None.
        stop: Set when the server stops.
        join: Join small runs waiting at the same time into one iteration (above).
    """

    def __init__(self, pipe: Pipe, table: RunSource, pad: set[int], device: Any,
                 stop: threading.Event, join: bool = False) -> None:
        self.pipe, self.table, self.pad, self.device, self.stop = pipe, table, pad, device, stop
        self.join = join
        self.name = table.name
        self._stream: Any = None
        self._isolate = Isolation(pipe, table, self._outputs, stop)
        self._held: deque[Run] = deque()  # taken from the table, fed alone next
        self.joined = 0  # runs that shared an iteration with an earlier one

    def __call__(self) -> None:
        if self.device is not None:
            import torch

            torch.cuda.set_device(self.device)
            self._stream = torch.cuda.Stream(self.device)
        inflight: deque[list[Run]] = deque()  # the iterations scheduled, each of its runs
        try:
            while True:
                self._fill(inflight)
                if not inflight:
                    if self.stop.is_set():
                        return
                    continue
                runs = inflight.popleft()
                try:
                    outputs = self._outputs()
                except Exception as err:  # noqa: BLE001 - a bad sample, or the pipeline itself
                    later = list(inflight)
                    inflight.clear()
                    self._recover(runs, err, later)
                    continue
                self._finish(runs, outputs)
        except Stopped:
            return  # stop_thread() forgets the runs; nothing to report
        except BaseException as err:  # noqa: BLE001 - every error must reach the main loop
            if self.stop.is_set():
                return  # an error while stopping (e.g. inputs released under it) is not a failure
            self.table.fail(with_remote_cause(
                PipelineError(f"server {self.name!r}: the pipeline failed: {summary(err)}"), err))
        finally:
            self._stream = None  # nothing CUDA-owning outlives the thread

    def _fill(self, inflight: deque[list[Run]]) -> None:
        """Feeds iterations until the pipeline holds ``prefetch_queue_depth`` of them (waiting
        for a run only when none is in flight), or no run has arrived, or the server stops."""
        while len(inflight) < self.pipe.queue_depth and not self.stop.is_set():
            runs = self._take(block=not inflight)
            if not runs:
                return
            try:
                self.pipe.feed(_inputs(runs))
            except Exception as err:  # noqa: BLE001 - inputs the pipeline refuses
                self._refused(runs, err, inflight)
                continue
            inflight.append(runs)

    def _take(self, block: bool) -> list[Run]:
        """The next iteration's runs: a run held back alone; else the next run, with the runs
        waiting behind it while they fit (``join``)."""
        if self._held:
            return [self._held.popleft()]
        run = self.table.next(block=block, stop=self.stop)
        if run is None:
            return []
        runs, size = [run], _size(run)
        while self.join and size < self.pipe.max_batch_size:
            other = self.table.next(block=False, stop=self.stop)
            if other is None:
                break
            if size + _size(other) > self.pipe.max_batch_size:
                self._held.append(other)
                break
            runs.append(other)
            size += _size(other)
            self.joined += 1
        return runs

    def _outputs(self) -> Outputs:
        return self.pipe.outputs(self.pad, self._stream)

    def _finish(self, runs: list[Run], outputs: Outputs) -> None:
        """Gives each run of an iteration its rows of ``outputs``."""
        if len(runs) == 1:
            self.table.finish(runs[0], *outputs)
            return
        data, event = outputs
        bounds = list(itertools.accumulate((_size(r) for r in runs), initial=0))
        if self._stream is None:
            parts = [tuple(_convert.rows(o, a, b) for o in data) for a, b in itertools.pairwise(bounds)]
        else:  # the copies a part needs go after the iteration on the runner's stream
            import torch

            with torch.cuda.stream(self._stream):
                parts = [tuple(_convert.rows(o, a, b) for o in data)
                         for a, b in itertools.pairwise(bounds)]
                event = torch.cuda.Event()
                event.record(self._stream)
        for run, part in zip(runs, parts):
            self.table.finish(run, part, event)

    def _refused(self, runs: list[Run], error: BaseException, inflight: deque[list[Run]]) -> None:
        """The pipeline refused the inputs of ``runs``: the iterations before them are finished,
        the pipeline is rebuilt (it may hold part of the refused inputs, so nothing runs on it
        before) and a run alone fails with DALI's message (joined runs are fed again one by
        one); a run before it that failed is then searched from its inputs (after a classic
        executor's first failure, the runs behind it are run again too)."""
        failed: list[Run] = []
        while inflight:
            earlier = inflight.popleft()
            if failed and not self.pipe.survives_errors:
                failed.extend(earlier)
                continue
            try:
                self._finish(earlier, self._outputs())
            except Exception:  # noqa: BLE001 - searched once the pipeline is rebuilt
                failed.extend(earlier)
        self.pipe.rebuild()
        if len(runs) > 1:
            self._held.extendleft(reversed(runs))
        else:
            run = runs[0]
            self.table.fail_run(run, with_remote_cause(PipelineError(
                f"server {self.name!r}: the pipeline refused the inputs of run {run.id} "
                f"({describe(run, list(range(len(run.keys))))}): {summary(error)}"), error))
        for earlier_run in failed:
            self._isolate(earlier_run, None)

    def _recover(self, runs: list[Run], error: BaseException, later: list[list[Run]]) -> None:
        """The iteration of ``runs`` failed; ``later`` iterations were queued behind it. Finishes
        all of them (the runs of a joined iteration that failed are searched one by one)."""
        failed: list[tuple[list[Run], BaseException | None]]
        if self.pipe.survives_errors:
            failed = [(runs, error)]
            for other in later:
                try:
                    self._finish(other, self._outputs())
                except Exception as err:  # noqa: BLE001
                    failed.append((other, err))
        else:
            self.pipe.rebuild()
            failed = [(r, None) for r in (runs, *later)]
        for bad_runs, first_error in failed:
            for bad_run in bad_runs:
                self._isolate(bad_run, first_error if len(bad_runs) == 1 else None)


def _size(run: Run) -> int:
    """A run's samples."""
    assert run.request is not None
    return len(run.request.inputs[0]) if run.request.inputs else 0


def _inputs(runs: list[Run]) -> list[list[Any]]:
    """The inputs of one iteration: each input's samples of every run, in order."""
    requests = [r.request for r in runs]
    assert all(q is not None for q in requests)
    if len(runs) == 1:
        return runs[0].request.inputs  # type: ignore[union-attr,return-value]
    return [[a for q in requests for a in q.inputs[i]]  # type: ignore[union-attr]
            for i in range(len(requests[0].inputs))]  # type: ignore[union-attr]
