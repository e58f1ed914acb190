"""Server: runs one DALI pipeline in the main process behind its own threads.

::

    DataLoader worker (any start method)                main process
    ─────────────────────────────────────               ─────────────────────────────────────────
    dataset: proxy(jpeg) -> SampleRef(call: inputs)
    collate: refs of one field -> one run
       proxy.submit(calls) ── memfd (+ shard fds) ──>  [listener thread] unpack -> Request(run id)
       returns BatchRef(server uid, run id)                  │   (a server in this process gets
    batch ── DataLoader result queue ──────────┐             │    the Request directly)
                                               │             v
                                               │   [runner thread] feed_input + run, keeps up to
                                               │     prefetch_queue_depth runs in flight; outputs
                                               │     -> torch -> Run(READY), notify
                                               v             │
                                  main loop: loader / produce_data(batch)
                                     BatchRef(run id) -> wait for Run -> tensors

Run ids are unique per process and never reused, so an output can only be paired with the batch
that asked for it. Each run is tagged with (loader id, epoch); when a loader starts a new epoch,
its older runs are dropped, so an abandoned epoch leaves nothing behind.

Lifecycles: the server goes ``CREATED -> RUNNING -> STOPPING -> STOPPED`` (and back to RUNNING on
restart) or to ``FAILED``, where it stays; a run goes ``PENDING -> SCHEDULED -> READY | FAILED``.
Every transition happens under ``self._cond``.
"""

from __future__ import annotations

import copy
import enum
import itertools
import os
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import torch

from mmproxy import _context, _convert, _transport
from mmproxy import proxy as _proxy
from mmproxy._resolve import resolve
from mmproxy.errors import (
    BatchSizeError,
    PipelineError,
    RunDroppedError,
    ServerFailedError,
    ServerStateError,
    WaitTimeoutError,
    with_remote_cause,
)
from mmproxy.refs import DALIOutputBatchRef

__all__ = ["DALIServer", "RunState", "ServerState"]

_names = itertools.count()
_JOIN_TIMEOUT = 5.0
_POLL = 0.05


class ServerState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


_TRANSITIONS = {
    ServerState.CREATED: {ServerState.RUNNING, ServerState.FAILED},
    ServerState.RUNNING: {ServerState.STOPPING, ServerState.FAILED},
    ServerState.STOPPING: {ServerState.STOPPED, ServerState.FAILED},
    ServerState.STOPPED: {ServerState.RUNNING},
    ServerState.FAILED: set(),
}


class RunState(enum.Enum):
    PENDING = "pending"
    SCHEDULED = "scheduled"
    READY = "ready"
    FAILED = "failed"


class _Run:
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
        self.request: _transport.Request | None = None
        self.tag: tuple[str, int] | None = None
        self.keys: list[Any] = []
        self.kept: list[int] | None = None  # None: every sample
        self.dropped: dict[int, str] = {}
        self.outputs: tuple[Any, ...] = ()
        self.event: Any = None
        self.error: BaseException | None = None


def _input_names(pipeline: Any) -> tuple[str, ...]:
    from nvidia.dali.external_source import ExternalSource

    if getattr(pipeline, "_deserialized", False):
        raise TypeError("cannot find the inputs of a deserialized pipeline; build it in Python")
    if not pipeline._py_graph_built:
        pipeline._build_graph()
    return tuple(op.name for op in pipeline._ops
                 if isinstance(op._op, ExternalSource) and getattr(op._op, "_callback", None) is None)


class DALIServer:
    """Runs a DALI pipeline for DataLoader workers; a drop-in for DALI's ``DALIServer``.

    Args:
        pipeline: A DALI pipeline whose inputs are ``fn.external_source`` nodes without a
            ``source``; their names become the proxy's arguments, in declaration order. Or a
            function that builds one (called once now, and again whenever a pipeline must be
            rebuilt after an error; see "Bad samples" below).
        deterministic: Run batches in the order the main loop consumes them, not in the order
            workers collate them, so a seeded pipeline gives the same outputs run after run.
        name: Used in every message; defaults to ``server<N>``.
        pad: Pad outputs whose shape differs between samples into a
            :class:`~mmproxy.refs.PaddedBatch` instead of returning a list of tensors. ``True``
            pads every output; a collection of output indices pads only those.
        timeout: Seconds to wait for one run's outputs before raising
            :class:`~mmproxy.errors.WaitTimeoutError`. A run's inputs are already on their way
            when the main loop asks for it, so the wait is bounded by the pipeline's own time;
            the default (300 s) only turns a bug into an error instead of a hang. ``None``
            waits as long as the server is alive.

    Bad samples: when a run fails, the server finds the sample(s) that caused it (the sample a
    decoder names, confirmed by running it alone, else by bisecting the batch), runs the rest of
    the batch, and stays healthy. Samples named with ``skip`` (a dataset in skip mode, see
    :func:`mmproxy.sample_key`) are dropped from the batch: the loader removes their rows from
    every field of the batch, so the batch is smaller and stays aligned, and reports them. Other
    samples fail their batch with a :class:`~mmproxy.errors.PipelineError` naming the sample.
    DALI's dynamic executor (the default) keeps working after an error; a pipeline of the classic
    executors does not, so the server rebuilds it (with ``pipeline`` when it is a function, else
    from the same graph). A seeded pipeline's random stream after a bad sample differs from a run
    without it (the retries draw from it; a rebuilt pipeline starts it again).

    Example::

        with DALIServer(pipe, name="image") as server:
            dataset = ImageFolder(root, transform=server.proxy, loader=read_bytes)
            for images, labels in mmproxy.DataLoader(server, dataset, batch_size=64):
                ...
    """

    def __init__(self, pipeline: Any, deterministic: bool = False, *, name: str | None = None,
                 pad: bool | tuple[int, ...] | list[int] = False,
                 timeout: float | None = 300.0) -> None:
        from nvidia.dali.pipeline import Pipeline

        self._factory: Callable[[], Any] | None = None
        if not isinstance(pipeline, Pipeline) and callable(pipeline):
            self._factory, pipeline = pipeline, pipeline()
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"expected an NVIDIA DALI pipeline or a function that builds one, got "
                            f"{type(pipeline).__name__}")
        self.name = name or f"server{next(_names)}"
        self.uid = os.urandom(8).hex()
        self.deterministic = bool(deterministic)
        self.timeout = timeout
        self._pipe = pipeline
        self._input_names = _input_names(pipeline)
        if not self._input_names:
            raise ValueError(f"server {self.name!r}: the pipeline has no fn.external_source input "
                             "without a source; the proxy would have nothing to send")
        pipeline.build()
        self._num_outputs = pipeline.num_outputs
        self._pad = set(range(self._num_outputs)) if pad is True else set(pad or ())
        self._device = (torch.device("cuda", pipeline.device_id)
                        if pipeline.device_id is not None and pipeline.device_id >= 0 else None)
        self._owner_pid = os.getpid()
        # The socket's private directory exists only while the server runs.
        self._sockdir = os.path.join(tempfile.gettempdir(), f"mmproxy-{self.uid}")
        self._proxy = _proxy.DALIProxy(self.name, self.uid, self._input_names, self._num_outputs,
                                       pipeline.max_batch_size,
                                       os.path.join(self._sockdir, "inputs.sock"))
        self._cond = threading.Condition()
        self._state = ServerState.CREATED
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stream: Any = None  # the runner's CUDA stream while it runs
        self._listener: _transport.Listener | None = None
        self._runs: dict[str, _Run] = {}
        self._arrived: OrderedDict[str, _Run] = OrderedDict()
        self._claims: deque[str] = deque()
        self._epochs: dict[str, int] = {}
        self._done: OrderedDict[str, _Run] = OrderedDict()
        self._dropped: OrderedDict[str, str] = OrderedDict()  # run id -> why it was dropped
        self.wait_seconds = 0.0  # main-loop time spent waiting on this server
        self.starved_seconds = 0.0  # time the pipeline sat idle waiting for inputs from workers
        self.samples = 0  # samples produced
        _proxy.register_local(self)

    # -- public API -----------------------------------------------------------------------------

    @property
    def proxy(self) -> _proxy.DALIProxy:
        """The picklable callable to use in datasets (e.g. as a torchvision ``transform``)."""
        return self._proxy

    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._input_names

    def __repr__(self) -> str:
        return f"DALIServer(name={self.name!r}, inputs={self._input_names}, state={self._state.value})"

    def __enter__(self) -> DALIServer:
        self.start_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_thread()

    def start_thread(self) -> None:
        """Starts the server's threads; a no-op when running. A failed server raises."""
        with self._cond:
            if self._state is ServerState.RUNNING:
                return
            if self._state is ServerState.FAILED:
                raise self._failed_error()
            if self._state is ServerState.STOPPING:
                raise ServerStateError(f"server {self.name!r} is stopping")
            try:
                os.mkdir(self._sockdir, mode=0o700)
            except FileExistsError:
                raise ServerStateError(f"server {self.name!r}: {self._sockdir} already exists; "
                                       "refusing to listen in a directory mmproxy did not make") from None
            self._listener = _transport.Listener(self._proxy.address)
            self._stop.clear()
            self._set_state(ServerState.RUNNING)
        self._threads = [
            threading.Thread(target=self._listen, name=f"mmproxy-{self.name}-listen", daemon=True),
            threading.Thread(target=self._run_loop, name=f"mmproxy-{self.name}-run", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def stop_thread(self) -> None:
        """Stops the threads and forgets pending runs; idempotent; takes well under a second."""
        with self._cond:
            if self._state is ServerState.RUNNING:
                self._set_state(ServerState.STOPPING)
            self._stop.set()
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(_JOIN_TIMEOUT)
        self._threads = []
        with self._cond:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            shutil.rmtree(self._sockdir, ignore_errors=True)
            for run in self._runs.values():
                run.request = None
                if run.state is not RunState.FAILED:
                    self._note_dropped(run.id, "the server was stopped before it ran")
            self._runs.clear()
            self._arrived.clear()
            self._claims.clear()
            self._done.clear()
            if self._state is ServerState.STOPPING:
                self._set_state(ServerState.STOPPED)
            self._cond.notify_all()

    def produce_data(self, obj: Any) -> Any:
        """Returns ``obj`` with this server's batch references replaced by their data.

        References of other servers are left as they are.
        """
        return resolve(obj, {self.uid: self})

    # -- called by proxies, loaders and resolve() -----------------------------------------------

    def _accept(self, request: _transport.Request) -> None:
        """Takes a run's inputs (from the listener, or directly from a proxy in this process)."""
        n = len(request.inputs[0]) if request.inputs else 0
        if n > self._proxy.max_batch_size:
            raise BatchSizeError(f"server {self.name!r}: run {request.run_id} has {n} samples, "
                                 f"more than the pipeline's batch_size={self._proxy.max_batch_size}")
        with self._cond:
            if self._state is not ServerState.RUNNING:
                if self._state is ServerState.FAILED:
                    raise self._failed_error()
                raise ServerStateError(f"server {self.name!r} is {self._state.value}; "
                                       "start it (or enter its `with` block) before using it")
            if self._is_stale(request.tag):
                self._note_dropped(request.run_id, self._stale_reason(request.tag))
                return
            run = self._runs.get(request.run_id)
            if run is None:
                run = self._runs[request.run_id] = _Run(request.run_id)
            elif run.state is not RunState.PENDING or run.request is not None:
                return  # a duplicate
            run.request = request
            run.tag = request.tag
            run.keys = list(request.keys)
            self._arrived[run.id] = run
            self._cond.notify_all()

    def _begin_epoch(self, loader_id: str, epoch: int) -> None:
        """Drops the runs of a loader's earlier epochs (an abandoned epoch leaves nothing)."""
        with self._cond:
            self._epochs[loader_id] = epoch
            stale = [r for r in self._runs.values() if self._is_stale(r.tag)]
            for run in stale:
                del self._runs[run.id]
                self._note_dropped(run.id, self._stale_reason(run.tag))
                self._arrived.pop(run.id, None)
                if run.state is not RunState.SCHEDULED:
                    run.request = None
                    run.outputs = ()
            if stale:
                dropped = {r.id for r in stale}
                self._claims = deque(c for c in self._claims if c not in dropped)

    def _claim(self, run_ids: list[str]) -> None:
        """Deterministic mode: the main loop says which runs go next, in order."""
        with self._cond:
            for run_id in run_ids:
                if run_id not in self._claims and (
                        run_id not in self._runs or self._runs[run_id].state is RunState.PENDING):
                    self._runs.setdefault(run_id, _Run(run_id))
                    self._claims.append(run_id)
            self._cond.notify_all()

    def _wait(self, ref: DALIOutputBatchRef) -> _Run:
        """Blocks until the run of ``ref`` is ready; raises if it failed or never can be."""
        start = time.perf_counter()
        deadline = None if self.timeout is None else start + self.timeout
        with self._cond:
            try:
                while True:
                    run = self._runs.get(ref.run_id) or self._done.get(ref.run_id)
                    if run is not None and run.state is RunState.READY:
                        return run
                    if run is not None and run.state is RunState.FAILED:
                        self._runs.pop(run.id, None)
                        self._done[run.id] = run
                        raise _fresh(run.error)
                    if self._state is ServerState.FAILED:
                        raise self._failed_error()
                    if self._state is not ServerState.RUNNING:
                        raise ServerStateError(
                            f"server {self.name!r} is {self._state.value}; run {ref.run_id} "
                            "cannot be produced (start the server before iterating)")
                    if run is None and ref.run_id in self._dropped:
                        raise RunDroppedError(f"server {self.name!r}: run {ref.run_id} was dropped: "
                                              f"{self._dropped[ref.run_id]}")
                    if run is None:
                        run = self._runs[ref.run_id] = _Run(ref.run_id)
                    if deadline is not None and time.perf_counter() > deadline:
                        if run.request is None and run.state is RunState.PENDING:
                            self._runs.pop(run.id, None)  # the placeholder made for this wait
                        raise WaitTimeoutError(
                            f"server {self.name!r}: run {ref.run_id} not ready after "
                            f"{self.timeout} s (state {run.state.value})")
                    self._cond.wait(_POLL)
            finally:
                self.wait_seconds += time.perf_counter() - start

    def _release(self, run: _Run) -> None:
        """A batch has taken the run's outputs: keep it briefly (its other outputs may follow)."""
        with self._cond:
            if self._runs.pop(run.id, None) is not None:
                self._done[run.id] = run
                while len(self._done) > 8:
                    self._done.popitem(last=False)

    # -- threads --------------------------------------------------------------------------------

    def _listen(self) -> None:
        listener = self._listener
        assert listener is not None
        try:
            while not self._stop.is_set():
                fds = listener.receive()
                if fds is None:
                    continue
                try:
                    request = _transport.unpack(fds)
                finally:
                    for fd in fds:
                        os.close(fd)
                self._accept(request)
        except ServerStateError:
            pass
        except BaseException as err:  # noqa: BLE001 - every error must reach the main loop
            self._fail(with_remote_cause(
                ServerFailedError(f"server {self.name!r}: receiving inputs failed: {err}"), err))
        finally:
            # Closing here (stopped or failed) makes workers blocked on a full socket fail fast.
            listener.close()

    def _next(self, block: bool) -> _Run | None:
        start = time.perf_counter()
        try:
            return self._next_locked(block)
        finally:
            if block:
                self.starved_seconds += time.perf_counter() - start

    def _next_locked(self, block: bool) -> _Run | None:
        with self._cond:
            while not self._stop.is_set():
                run = None
                if self.deterministic:
                    if self._claims and self._claims[0] in self._arrived:
                        run = self._arrived.pop(self._claims.popleft())
                elif self._arrived:
                    # The current epoch's runs before the next epoch's prefetched first batches.
                    run = next((r for r in self._arrived.values() if not self._is_ahead(r.tag)),
                               None) or next(iter(self._arrived.values()))
                    del self._arrived[run.id]
                if run is not None:
                    run.state = RunState.SCHEDULED  # under the lock, so it is never claimed again
                    return run
                if not block:
                    return None
                self._cond.wait(_POLL)
        return None

    def _run_loop(self) -> None:
        queue_depth = self._pipe.prefetch_queue_depth
        depth = queue_depth if isinstance(queue_depth, int) else min(queue_depth.values())
        if self._device is not None:
            torch.cuda.set_device(self._device)
            self._stream = torch.cuda.Stream(self._device)
        inflight: deque[_Run] = deque()
        try:
            while True:
                while len(inflight) < depth and not self._stop.is_set():
                    run = self._next(block=not inflight)
                    if run is None:
                        break
                    assert run.request is not None
                    try:
                        self._feed(run.request.inputs)
                    except Exception as err:  # noqa: BLE001 - inputs the pipeline refuses
                        self._refused(run, err, inflight)
                        continue
                    inflight.append(run)
                if not inflight:
                    if self._stop.is_set():
                        return
                    continue
                run = inflight.popleft()
                try:
                    outputs = self._outputs()
                except Exception as err:  # noqa: BLE001 - a bad sample, or the pipeline itself
                    later = list(inflight)
                    inflight.clear()
                    self._recover(run, err, later)
                    continue
                self._finish(run, outputs)
        except BaseException as err:  # noqa: BLE001 - every error must reach the main loop
            self._fail(with_remote_cause(
                PipelineError(f"server {self.name!r}: the pipeline failed: {_summary(err)}"), err))
        finally:
            self._stream = None

    # -- running, and recovering from a failed run ------------------------------------------------

    def _feed(self, inputs: list[list[Any]], rows: list[int] | None = None) -> None:
        for name, arrays in zip(self._input_names, inputs):
            self._pipe.feed_input(name, arrays if rows is None else [arrays[i] for i in rows])
        self._pipe._run_once()

    def _outputs(self) -> tuple[tuple[Any, ...], Any]:
        """The next run's outputs as torch (and the CUDA event that marks them ready)."""
        pipe, stream = self._pipe, self._stream
        if stream is None:
            outs = pipe.outputs()
            copy = not pipe.exec_dynamic
            return tuple(_convert.to_torch(o, copy=copy, want_pad=i in self._pad)
                         for i, o in enumerate(outs)), None
        with torch.cuda.stream(stream):
            outs = pipe.outputs(cuda_stream=stream)
            data = tuple(_convert.to_torch(o, copy=False, want_pad=i in self._pad, stream=stream)
                         for i, o in enumerate(outs))
            event = torch.cuda.Event()
            event.record(stream)
        return data, event

    def _finish(self, run: _Run, outputs: tuple[tuple[Any, ...], Any]) -> None:
        with self._cond:
            run.outputs, run.event = outputs
            run.request = None
            run.state = RunState.READY
            self.samples += _convert.batch_len(run.outputs[0])
            self._cond.notify_all()

    def _fail_run(self, run: _Run, error: BaseException) -> None:
        with self._cond:
            run.state, run.error, run.request = RunState.FAILED, error, None
            self._cond.notify_all()

    def _recover(self, run: _Run, error: BaseException, later: list[_Run]) -> None:
        """``run`` failed; ``later`` runs were queued behind it. Finishes all of them.

        The dynamic executor keeps the queued runs and stays usable; the classic executors
        invalidate the pipeline (and the synchronous one may report an error against the run
        before the one that caused it), so the pipeline is rebuilt and every run is run again.
        """
        failed: list[tuple[_Run, BaseException | None]]
        if self._pipe.exec_dynamic:
            failed = [(run, error)]
            for other in later:
                try:
                    self._finish(other, self._outputs())
                except Exception as err:  # noqa: BLE001
                    failed.append((other, err))
        else:
            self._rebuild()
            failed = [(r, None) for r in (run, *later)]
        for bad_run, first_error in failed:
            self._isolate(bad_run, first_error)

    def _refused(self, run: _Run, error: BaseException, inflight: deque[_Run]) -> None:
        """The pipeline refused ``run``'s inputs: the runs before it are finished, the pipeline is
        rebuilt (it may hold part of the refused inputs) and the run fails with DALI's message."""
        while inflight:
            earlier = inflight.popleft()
            try:
                self._finish(earlier, self._outputs())
            except Exception as err:  # noqa: BLE001
                self._recover(earlier, err, list(inflight))
                inflight.clear()
        self._rebuild()
        self._fail_run(run, with_remote_cause(PipelineError(
            f"server {self.name!r}: the pipeline refused the inputs of run {run.id} "
            f"({self._describe(run, list(range(len(run.keys))))}): {_summary(error)}"), error))

    def _attempt(self, run: _Run, rows: list[int]) -> tuple[Any, BaseException | None]:
        """Runs the samples ``rows`` of ``run`` alone: (outputs, None) or (None, the error)."""
        assert run.request is not None
        try:
            self._feed(run.request.inputs, rows)
            return self._outputs(), None
        except Exception as err:  # noqa: BLE001
            if not self._pipe.exec_dynamic:
                self._rebuild()
            return None, err

    def _isolate(self, run: _Run, error: BaseException | None) -> None:
        """Finds the samples of ``run`` the pipeline cannot process and runs the others."""
        assert run.request is not None
        everything = list(range(len(run.keys) or len(run.request.inputs[0])))
        if error is None:
            outputs, error = self._attempt(run, everything)
            if error is None:
                self._finish(run, outputs)
                return
        skip = all(isinstance(k, _context.SampleId) and k.skip for k in run.keys)
        bad: dict[int, BaseException] = {}
        self._find_bad(run, everything, error, bad, first_only=not skip)
        if not bad:  # the batch fails, but none of its parts does: not a sample's fault
            self._fail_run(run, with_remote_cause(PipelineError(
                f"server {self.name!r}: the pipeline failed on run {run.id} "
                f"({self._describe(run, everything)}), though every part of the batch runs alone: "
                f"{_summary(error)}"), error))
            return
        if not skip:
            i, err = next(iter(bad.items()))
            self._fail_run(run, with_remote_cause(PipelineError(
                f"server {self.name!r}: the pipeline cannot process sample {self._name(run, i)} "
                f"(sample {i} of run {run.id}): {_summary(err)}"), err))
            return
        kept = [i for i in everything if i not in bad]
        outputs = None
        if kept:
            outputs, err2 = self._attempt(run, kept)
            if err2 is not None:
                self._fail_run(run, with_remote_cause(PipelineError(
                    f"server {self.name!r}: run {run.id} failed again without its bad samples: "
                    f"{_summary(err2)}"), err2))
                return
        else:  # nothing left: the loader drops the whole batch and reports its samples
            outputs = (tuple([] for _ in range(self._num_outputs)), None)
        run.kept = kept
        run.dropped = {i: f"pipeline failed in server {self.name!r}: {_summary(e)}"
                       for i, e in sorted(bad.items())}
        self._finish(run, outputs)

    def _find_bad(self, run: _Run, rows: list[int], error: BaseException,
                  bad: dict[int, BaseException], first_only: bool) -> None:
        """``rows`` of ``run`` fail together with ``error``; adds the samples at fault to ``bad``.

        A sample that the error names (DALI's decoders say ``sample #i``) is tried
        alone first; otherwise, or when it runs fine alone, the rows are bisected.
        """
        while len(rows) > 1:
            hint = _named_sample(error, len(rows))
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

    def _rebuild(self) -> None:
        """A fresh pipeline after an error the executor does not survive."""
        if self._factory is not None:
            pipe = self._factory()
            if _input_names(pipe) != self._input_names:
                raise ServerStateError(f"server {self.name!r}: the pipeline function built a pipeline "
                                       f"with inputs {_input_names(pipe)}, not {self._input_names}")
            pipe.build()
            self._pipe._shutdown()
            self._pipe = pipe
            return
        # DALI keeps the Python graph (its operators' specs): a new backend is built from it.
        pipe = self._pipe
        pipe._shutdown()
        pipe._built = False
        pipe._backend_prepared = False
        pipe.build()

    def _name(self, run: _Run, i: int) -> str:
        key = run.keys[i] if i < len(run.keys) else None
        return str(key) if key is not None else f"#{i}"

    def _describe(self, run: _Run, rows: list[int]) -> str:
        names = [self._name(run, i) for i in rows[:8]]
        more = f" and {len(rows) - 8} more" if len(rows) > 8 else ""
        return "samples " + ", ".join(names) + more

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._state is ServerState.FAILED:
                return
            self._error = error
            self._state = ServerState.FAILED
            self._stop.set()
            for run in self._runs.values():
                if run.state is not RunState.READY:
                    run.state, run.error, run.request = RunState.FAILED, error, None
            self._cond.notify_all()

    # -- helpers --------------------------------------------------------------------------------

    def _note_dropped(self, run_id: str, why: str) -> None:
        self._dropped[run_id] = why
        while len(self._dropped) > 4096:
            self._dropped.popitem(last=False)

    def _stale_reason(self, tag: tuple[str, int] | None) -> str:
        loader, epoch = tag or ("?", -1)
        return (f"it belongs to epoch {epoch} of loader {loader}, which has started epoch "
                f"{self._epochs.get(loader)} (a batch kept from an abandoned epoch)")

    def _is_stale(self, tag: tuple[str, int] | None) -> bool:
        return tag is not None and tag[1] < self._epochs.get(tag[0], tag[1])

    def _is_ahead(self, tag: tuple[str, int] | None) -> bool:
        return tag is not None and tag[1] > self._epochs.get(tag[0], tag[1])

    def _set_state(self, new: ServerState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise ServerStateError(
                f"server {self.name!r}: illegal transition {self._state.value} -> {new.value}")
        self._state = new

    def _failed_error(self) -> ServerFailedError:
        err = ServerFailedError(f"server {self.name!r} failed earlier and stays failed: {self._error}")
        err.__cause__ = self._error
        return err

    def __del__(self) -> None:
        try:
            if os.getpid() == self._owner_pid and self._state is ServerState.RUNNING:
                self.stop_thread()
            shutil.rmtree(self._sockdir, ignore_errors=True)
        except Exception:  # noqa: BLE001 - a silent safety net only
            pass


_NAMED = re.compile(r"sample #(\d+)")


def _named_sample(err: BaseException, n: int) -> int | None:
    """The batch index a DALI error names (``Failed to decode sample #6``)."""
    match = _NAMED.search(str(err))
    if match is None:
        return None
    i = int(match.group(1))
    return i if i < n else None


def _summary(err: BaseException) -> str:
    """The informative line of a DALI error (the one after 'encountered:'), else the first one."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if "encountered:" in lines:
        rest = lines[lines.index("encountered:") + 1:]
        if rest:
            return rest[0]
    return lines[0] if lines else type(err).__name__


def _fresh(error: BaseException | None) -> BaseException:
    """A copy of a stored error to raise: raising the stored one would give it a traceback whose
    frames hold the server, a reference cycle through the server's own run table."""
    assert error is not None
    new = copy.copy(error)
    new.__cause__ = error.__cause__
    return new


def _after_fork_in_child() -> None:
    # Whatever a worker inherits from the main process must be inert there:
    # - it must never destroy a server's pipeline or CUDA outputs (a CUDA call in a forked child
    #   aborts it), so the child keeps every server it inherited (those still registered, even
    #   one that only a garbage cycle holds) for the rest of its life;
    # - it must not hold the servers' sockets open (see Listener.forget).
    for server in list(_proxy._local_servers.values()):
        _inherited.append(server)
        if server._listener is not None:
            server._listener.forget()


_inherited: list[Any] = []
os.register_at_fork(after_in_child=_after_fork_in_child)
