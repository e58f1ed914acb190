"""Runner: the server thread that feeds runs to the pipeline, and finds the samples it cannot process.

It keeps up to ``prefetch_queue_depth`` runs in flight: takes the next run from the run table,
feeds it and schedules it; takes the oldest run's outputs and marks it READY. With ``feed_ahead``
it also feeds one more run's inputs (when one has arrived) before it waits for outputs, and
schedules it the moment DALI hands a run's outputs over (before they are converted to torch and
handed to the loader; a synchronous executor's at the next turn, as its ``_run_once`` computes the
whole run), so that DALI waits for its next run only as long as a ``_run_once`` takes, as under
DALI's own iterator, not for the conversion, the hand-over and the feed (~0.8 ms a batch of 256
JPEGs on the H200 machine; measured on the H200 it changed nothing in throughput, so it is off by
default, BENCHMARKS.md). Inputs the pipeline refuses (``feed_input`` or ``_run_once`` raising)
fail their run alone: the runs before it are finished, the pipeline is rebuilt before anything
else runs on it (it may hold part of those inputs), and every run that was behind it, or that
failed on the way, runs again from its inputs. When a run fails:

1. the runs queued behind it are finished first (the dynamic executor keeps them), or, with the
   classic executors, which invalidate the pipeline, it is rebuilt and every one of them is run
   again (the synchronous executor may even report an error against the run before the one that
   caused it);
2. each failed run is *isolated*: the sample a DALI error names (``sample #i``) is run alone to
   confirm it, otherwise the batch is bisected; parts that fail are split again down to single
   samples, so a batch of ``n`` with one bad sample costs about ``1 + log2(n)`` extra runs of
   shrinking size;
3. if every sample of the run may be skipped (:class:`~mmproxy._context.SampleId` ``skip``), the
   good ones run once more as one batch and the run is READY with the bad ones listed in
   ``Run.dropped`` (the resolver removes their rows from every field of the batch); otherwise the
   run fails with a :class:`~mmproxy.errors.PipelineError` naming the first bad sample. A run whose
   parts all succeed alone is run whole once more (a transient failure); if it fails again, it
   fails with the pipeline's own error. The server stays healthy.

The search checks the server's stop event between attempts, so ``stop_thread()`` is not held up.

Anything else (an error outside a run) fails the server.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

from mmproxy import _context
from mmproxy._dali import Pipe, named_sample, summary
from mmproxy._runs import Run, RunTable
from mmproxy.errors import PipelineError, with_remote_cause

__all__ = ["Runner"]


class _Stopped(Exception):
    """The server was stopped while the runner was finding bad samples: it leaves at once."""


class Runner:
    """The body of a server's runner thread.

    Args:
        pipe: The pipeline adapter.
        table: The server's run table.
        pad: Output indices to pad (see :class:`~mmproxy.DALIServer`).
        device: The CUDA device of a GPU pipeline, or None.
        stop: Set when the server stops.
        feed_ahead: Feed the run after those in flight before waiting for outputs (see above).
    """

    def __init__(self, pipe: Pipe, table: RunTable, pad: set[int], device: Any,
                 stop: threading.Event, feed_ahead: bool = False) -> None:
        self.pipe, self.table, self.pad, self.device, self.stop = pipe, table, pad, device, stop
        self.feed_ahead = feed_ahead
        self.name = table.name
        self._stream: Any = None
        self._ahead: Run | None = None  # fed, not scheduled: the next run DALI will take
        self._early_refusal: tuple[Run, BaseException] | None = None  # see _schedule_early

    def __call__(self) -> None:
        if self.device is not None:
            import torch

            torch.cuda.set_device(self.device)
            self._stream = torch.cuda.Stream(self.device)
        inflight: deque[Run] = deque()
        # The run fed ahead is scheduled from inside Pipe.outputs (see _schedule_early), unless
        # the executor is synchronous: its _run_once computes the whole run before returning.
        early = self.feed_ahead and self.pipe.runs_async
        try:
            while True:
                if self._ahead is not None and len(inflight) < self.pipe.queue_depth:
                    fed = self._ahead  # (when stopping too: it is drained with the rest)
                    try:
                        inflight.append(self._schedule_ahead())
                    except Exception as err:  # noqa: BLE001 - as a refusal by feed()
                        self._refused(fed, err, inflight)
                while len(inflight) < self.pipe.queue_depth and not self.stop.is_set():
                    run = self.table.next(block=not inflight, stop=self.stop)
                    if run is None:
                        break
                    self._feed(run, inflight)
                if self.feed_ahead and inflight and self._ahead is None and not self.stop.is_set():
                    run = self.table.next(block=False, stop=self.stop)
                    if run is not None:
                        self._feed(run, inflight, schedule=False)
                if not inflight:
                    if self.stop.is_set():
                        return
                    continue
                run = inflight.popleft()
                try:
                    outputs = self._outputs(then=partial(self._schedule_early, inflight)
                                            if early else None)
                except Exception as err:  # noqa: BLE001 - a bad sample, or the pipeline itself
                    later = list(inflight)
                    inflight.clear()
                    refused, self._early_refusal = self._early_refusal, None
                    if refused is not None:
                        # The run fed ahead was refused, and its inputs may still wait in DALI's
                        # queue: the pipeline is rebuilt first, then every run runs again.
                        if self._ahead is not None:
                            later.append(self._ahead)
                            self._ahead = None
                        self._fail_refused(*refused)
                        for again in (run, *later):
                            self._isolate(again, None)
                        continue
                    if self._ahead is not None:  # behind them in DALI's queue: runs after them
                        if self.pipe.survives_errors:
                            later.append(self._schedule_ahead())
                        else:  # the rebuild drops its inputs; the search feeds them again
                            later.append(self._ahead)
                            self._ahead = None
                    self._recover(run, err, later)
                    continue
                self.table.finish(run, *outputs)
                if self._early_refusal is not None:
                    refused, self._early_refusal = self._early_refusal, None
                    self._refused(*refused, inflight)
        except _Stopped:
            return  # stop_thread() forgets the runs; nothing to report
        except BaseException as err:  # noqa: BLE001 - every error must reach the main loop
            if self.stop.is_set():
                return  # an error while stopping (e.g. inputs released under it) is not a failure
            self.table.fail(with_remote_cause(
                PipelineError(f"server {self.name!r}: the pipeline failed: {summary(err)}"), err))
        finally:
            self._stream = None  # nothing CUDA-owning outlives the thread

    def _feed(self, run: Run, inflight: deque[Run], schedule: bool = True) -> None:
        """Feeds ``run``, scheduled (in flight) or not (ahead); a refusal fails it."""
        assert run.request is not None
        try:
            self.pipe.feed(run.request.inputs, schedule=schedule)
        except Exception as err:  # noqa: BLE001 - inputs the pipeline refuses
            self._refused(run, err, inflight)
            return
        if schedule:
            inflight.append(run)
        else:
            self._ahead = run

    def _schedule_ahead(self) -> Run:
        """Schedules the run fed ahead; returns it (it is no longer ahead even if this raises)."""
        run, self._ahead = self._ahead, None
        assert run is not None
        self.pipe.schedule()
        return run

    def _schedule_early(self, inflight: deque[Run]) -> None:
        """Schedules the run fed ahead the moment DALI gives up a run's outputs, before they are
        converted and handed over, so that DALI is one run short only for a ``_run_once``. A
        refusal is dealt with once those outputs are finished (see ``__call__``)."""
        if self._ahead is None:
            return
        fed = self._ahead
        try:
            inflight.append(self._schedule_ahead())
        except Exception as err:  # noqa: BLE001 - as a refusal by feed()
            self._early_refusal = (fed, err)

    def _outputs(self, then: Callable[[], None] | None = None) -> tuple[tuple[Any, ...], Any]:
        return self.pipe.outputs(self.pad, self._stream, then=then)

    def _refused(self, run: Run, error: BaseException, inflight: deque[Run]) -> None:
        """The pipeline refused ``run``'s inputs: the runs before it are finished, the pipeline is
        rebuilt (it may hold part of the refused inputs, so nothing runs on it before) and the run
        fails with DALI's message; a run before it that failed is then searched from its inputs
        (after a classic executor's first failure, the runs behind it are run again too)."""
        failed: list[Run] = []
        while inflight:
            earlier = inflight.popleft()
            if failed and not self.pipe.survives_errors:
                failed.append(earlier)
                continue
            try:
                self.table.finish(earlier, *self._outputs())
            except Exception:  # noqa: BLE001 - searched once the pipeline is rebuilt
                failed.append(earlier)
        self._fail_refused(run, error)
        for earlier in failed:
            self._isolate(earlier, None)

    def _fail_refused(self, run: Run, error: BaseException) -> None:
        """Rebuilds the pipeline and fails ``run``, whose inputs it refused."""
        self.pipe.rebuild()
        self.table.fail_run(run, with_remote_cause(PipelineError(
            f"server {self.name!r}: the pipeline refused the inputs of run {run.id} "
            f"({_describe(run, list(range(len(run.keys))))}): {summary(error)}"), error))

    def _recover(self, run: Run, error: BaseException, later: list[Run]) -> None:
        """``run`` failed; ``later`` runs were queued behind it. Finishes all of them."""
        failed: list[tuple[Run, BaseException | None]]
        if self.pipe.survives_errors:
            failed = [(run, error)]
            for other in later:
                try:
                    self.table.finish(other, *self._outputs())
                except Exception as err:  # noqa: BLE001
                    failed.append((other, err))
        else:
            self.pipe.rebuild()
            failed = [(r, None) for r in (run, *later)]
        for bad_run, first_error in failed:
            self._isolate(bad_run, first_error)

    def _attempt(self, run: Run, rows: list[int]) -> tuple[Any, BaseException | None]:
        """Runs the samples ``rows`` of ``run`` alone: (outputs, None) or (None, the error)."""
        if self.stop.is_set() or run.request is None:
            raise _Stopped
        try:
            self.pipe.feed(run.request.inputs, rows)
            return self._outputs(), None
        except Exception as err:  # noqa: BLE001
            if not self.pipe.survives_errors:
                self.pipe.rebuild()
            return None, err

    def _isolate(self, run: Run, error: BaseException | None) -> None:
        """Finds the samples of ``run`` the pipeline cannot process and runs the others."""
        if self.stop.is_set() or run.request is None:
            raise _Stopped
        everything = list(range(len(run.keys) or len(run.request.inputs[0])))
        if error is None:
            outputs, error = self._attempt(run, everything)
            if error is None:
                self.table.finish(run, *outputs)
                return
        skip = all(isinstance(k, _context.SampleId) and k.skip for k in run.keys)
        bad: dict[int, BaseException] = {}
        self._find_bad(run, everything, error, bad, first_only=not skip)
        if not bad:  # the batch fails, but none of its parts does: once more, whole
            outputs, again = self._attempt(run, everything)
            if again is None:
                self.table.finish(run, *outputs)
                return
            self.table.fail_run(run, with_remote_cause(PipelineError(
                f"server {self.name!r}: the pipeline failed on run {run.id} "
                f"({_describe(run, everything)}), though every part of the batch runs alone: "
                f"{summary(error)}"), error))
            return
        if not skip:
            i, err = next(iter(bad.items()))
            self.table.fail_run(run, with_remote_cause(PipelineError(
                f"server {self.name!r}: the pipeline cannot process sample {_name(run, i)} "
                f"(sample {i} of run {run.id}): {summary(err)}"), err))
            return
        kept = [i for i in everything if i not in bad]
        if kept:
            outputs, again = self._attempt(run, kept)
            if again is not None:
                self.table.fail_run(run, with_remote_cause(PipelineError(
                    f"server {self.name!r}: run {run.id} failed again without its bad samples: "
                    f"{summary(again)}"), again))
                return
        else:  # nothing left: the loader drops the whole batch and reports its samples
            outputs = (tuple([] for _ in range(self.pipe.num_outputs)), None)
        dropped = {i: f"pipeline failed in server {self.name!r}: {summary(e)}"
                   for i, e in sorted(bad.items())}
        self.table.finish(run, *outputs, kept=kept, dropped=dropped)

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


def _describe(run: Run, rows: list[int]) -> str:
    names = [_name(run, i) for i in rows[:8]]
    more = f" and {len(rows) - 8} more" if len(rows) > 8 else ""
    return "samples " + ", ".join(names) + more
