"""Runner: the server thread that feeds runs to the pipeline and takes their outputs.
docs/internals.md, ``mmproxy._server.runner``, has the rest.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from mmproxy._server.dali import Pipe, summary
from mmproxy._server.isolation import Isolation, Outputs, Stopped, describe
from mmproxy._server.run import Run, RunSource
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
    """

    def __init__(self, pipe: Pipe, table: RunSource, pad: set[int], device: Any,
                 stop: threading.Event) -> None:
        self.pipe, self.table, self.pad, self.device, self.stop = pipe, table, pad, device, stop
        self.name = table.name
        # not a bound method of the runner: the isolation would make a cycle of the two, which a
        # forked child's collector could free with the CUDA objects it holds
        self._outputs = _Outputs(pipe, pad)
        self._isolate = Isolation(pipe, table, self._outputs, stop)

    def __call__(self) -> None:
        inflight: deque[Run] = deque()
        try:
            if self.device is not None:
                import torch

                torch.cuda.set_device(self.device)
                self._outputs.stream = torch.cuda.Stream(self.device)
            while True:
                self._fill(inflight)
                if not inflight:
                    if self.stop.is_set():
                        return
                    continue
                run = inflight.popleft()
                try:
                    taken = self._outputs.take()
                except Exception as err:  # noqa: BLE001 - a bad sample, or the pipeline itself
                    self._recover(run, err, _drained(inflight))
                    continue
                # the pipeline works on while these convert (a run table's error fails the server)
                refused = self._feed_ahead(inflight) if self.pipe.keeps_outputs else None
                failed = None
                try:
                    outputs = self._outputs.convert(taken)
                except Exception as err:  # noqa: BLE001 - outputs torch cannot take (memory)
                    failed = err
                else:
                    self.table.finish(run, *outputs)
                if refused is not None:  # before a search: the pipeline may hold part of them
                    self._refused(*refused, inflight)
                if failed is not None:
                    self._recover(run, failed, _drained(inflight))
        except Stopped:
            return  # stop_thread() forgets the runs; nothing to report
        except BaseException as err:  # noqa: BLE001 - every error must reach the main loop
            if self.stop.is_set():
                return  # an error while stopping (e.g. inputs released under it) is not a failure
            self.table.fail(with_remote_cause(
                PipelineError(f"server {self.name!r}: the pipeline failed: {summary(err)}"), err))
        finally:
            self._outputs.stream = None  # nothing CUDA-owning outlives the thread

    def _fill(self, inflight: deque[Run]) -> None:
        """Feeds runs until the pipeline holds ``prefetch_queue_depth`` of them (waiting for one
        only when none is in flight), or none has arrived, or the server stops."""
        while len(inflight) < self.pipe.queue_depth and not self.stop.is_set():
            run = self.table.next(block=not inflight, stop=self.stop)
            if run is None:
                return
            assert run.request is not None
            try:
                self.pipe.feed(run.request.inputs)
            except Exception as err:  # noqa: BLE001 - inputs the pipeline refuses
                self._refused(run, err, inflight)
                continue
            inflight.append(run)

    def _feed_ahead(self, inflight: deque[Run]) -> tuple[Run, BaseException] | None:
        """Feeds one run that has arrived (not waiting for one) while the pipeline holds fewer
        than ``prefetch_queue_depth``; a run whose inputs the pipeline refuses is returned, to
        be failed once the run being converted is finished (the refusal rebuilds the pipeline)."""
        if len(inflight) >= self.pipe.queue_depth:
            return None
        run = self.table.next(block=False, stop=self.stop)
        if run is None:
            return None
        assert run.request is not None
        try:
            self.pipe.feed(run.request.inputs)
        except Exception as err:  # noqa: BLE001 - inputs the pipeline refuses
            return run, err
        inflight.append(run)
        return None

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
        self.pipe.rebuild()
        self.table.fail_run(run, with_remote_cause(PipelineError(
            f"server {self.name!r}: the pipeline refused the inputs of run {run.id} "
            f"({describe(run, list(range(len(run.keys))))}): {summary(error)}"), error))
        for earlier in failed:
            self._isolate(earlier, None)

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


def _drained(inflight: deque[Run]) -> list[Run]:
    """The runs in flight, in order; none is left in ``inflight``."""
    runs = list(inflight)
    inflight.clear()
    return runs


class _Outputs:
    """Takes the oldest scheduled run's outputs as torch, on the runner thread's CUDA stream
    (at once, or :meth:`take` and later :meth:`convert`)."""

    def __init__(self, pipe: Pipe, pad: set[int]) -> None:
        self.pipe, self.pad = pipe, pad
        self.stream: Any = None

    def __call__(self) -> Outputs:
        return self.pipe.outputs(self.pad, self.stream)

    def take(self) -> Any:
        return self.pipe.take(self.stream)

    def convert(self, taken: Any) -> Outputs:
        return self.pipe.convert(taken, self.pad, self.stream)
