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

import enum
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import torch

from mmproxy import _convert, _transport
from mmproxy import proxy as _proxy
from mmproxy._resolve import resolve
from mmproxy.errors import (
    BatchSizeError,
    PipelineError,
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
    __slots__ = ("error", "event", "id", "outputs", "request", "state", "tag")

    def __init__(self, run_id: str) -> None:
        self.id = run_id
        self.state = RunState.PENDING
        self.request: _transport.Request | None = None
        self.tag: tuple[str, int] | None = None
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
            ``source``; their names become the proxy's arguments, in declaration order.
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

        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"expected an NVIDIA DALI pipeline, got {type(pipeline).__name__}")
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
        self._listener: _transport.Listener | None = None
        self._runs: dict[str, _Run] = {}
        self._arrived: OrderedDict[str, _Run] = OrderedDict()
        self._claims: deque[str] = deque()
        self._epochs: dict[str, int] = {}
        self._done: OrderedDict[str, _Run] = OrderedDict()
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
                return
            run = self._runs.get(request.run_id)
            if run is None:
                run = self._runs[request.run_id] = _Run(request.run_id)
            elif run.state is not RunState.PENDING or run.request is not None:
                return  # a duplicate
            run.request = request
            run.tag = request.tag
            self._arrived[run.id] = run
            self._cond.notify_all()

    def _begin_epoch(self, loader_id: str, epoch: int) -> None:
        """Drops the runs of a loader's earlier epochs (an abandoned epoch leaves nothing)."""
        with self._cond:
            self._epochs[loader_id] = epoch
            stale = [r for r in self._runs.values() if self._is_stale(r.tag)]
            for run in stale:
                del self._runs[run.id]
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
                        raise run.error  # type: ignore[misc]
                    if self._state is ServerState.FAILED:
                        raise self._failed_error()
                    if self._state is not ServerState.RUNNING:
                        raise ServerStateError(
                            f"server {self.name!r} is {self._state.value}; run {ref.run_id} "
                            "cannot be produced (start the server before iterating)")
                    if run is None:
                        run = self._runs[ref.run_id] = _Run(ref.run_id)
                    if deadline is not None and time.perf_counter() > deadline:
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
        pipe = self._pipe
        queue_depth = pipe.prefetch_queue_depth
        depth = queue_depth if isinstance(queue_depth, int) else min(queue_depth.values())
        copy = not pipe.exec_dynamic
        stream = None
        if self._device is not None:
            torch.cuda.set_device(self._device)
            stream = torch.cuda.Stream(self._device)
        inflight: deque[_Run] = deque()
        run: _Run | None = None
        try:
            while True:
                while len(inflight) < depth and not self._stop.is_set():
                    run = self._next(block=not inflight)
                    if run is None:
                        break
                    req = run.request
                    assert req is not None
                    for name, arrays in zip(self._input_names, req.inputs):
                        pipe.feed_input(name, arrays)
                    pipe._run_once()
                    inflight.append(run)
                if not inflight:
                    if self._stop.is_set():
                        return
                    continue
                run = inflight[0]
                if stream is not None:
                    with torch.cuda.stream(stream):
                        outs = pipe.outputs(cuda_stream=stream)
                        data = tuple(_convert.to_torch(o, copy=False, want_pad=i in self._pad,
                                                       stream=stream)
                                     for i, o in enumerate(outs))
                        event = torch.cuda.Event()
                        event.record(stream)
                else:
                    outs = pipe.outputs()
                    data = tuple(_convert.to_torch(o, copy=copy, want_pad=i in self._pad)
                                 for i, o in enumerate(outs))
                    event = None
                inflight.popleft()
                with self._cond:
                    run.outputs, run.event, run.request = data, event, None
                    run.state = RunState.READY
                    self.samples += _convert.batch_len(data[0])
                    self._cond.notify_all()
                run = None
        except BaseException as err:  # noqa: BLE001 - every error must reach the main loop
            failed = inflight[0] if inflight else run
            keys = [k for k in (failed.request.keys if failed and failed.request else []) if k]
            where = f" on run {failed.id}" if failed else ""
            if keys:
                shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
                where += f" (samples {shown})"
            self._fail(with_remote_cause(
                PipelineError(f"server {self.name!r}: the pipeline failed{where}: {_summary(err)}"),
                err))

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


def _summary(err: BaseException) -> str:
    """The informative line of a DALI error (the one after 'encountered:'), else the first one."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if "encountered:" in lines:
        rest = lines[lines.index("encountered:") + 1:]
        if rest:
            return rest[0]
    return lines[0] if lines else type(err).__name__


def _after_fork_in_child() -> None:
    # Whatever a worker inherits from the main process must be inert there:
    # - it must never destroy a pipeline (a CUDA call in a forked child aborts it), so the child
    #   keeps a reference to each for the rest of its life;
    # - it must not hold the servers' sockets open (see Listener.forget).
    for server in list(_proxy._local_servers.values()):
        _inherited.append(server._pipe)
        if server._listener is not None:
            server._listener.forget()


_inherited: list[Any] = []
os.register_at_fork(after_in_child=_after_fork_in_child)
