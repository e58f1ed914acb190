"""Server: runs a DALI pipeline (or copies of it side by side) in the main process behind its
own threads. docs/internals.md, ``mmproxy.server``, has the rest.
"""

from __future__ import annotations

import itertools
import numbers
import os
import threading
from typing import Any, Literal

from mmproxy import _process
from mmproxy._loader.resolve import resolve
from mmproxy._server.dali import Pipe
from mmproxy._server.prepare import PreparedRuns
from mmproxy._server.runner import Runner
from mmproxy._server.runs import Run, RunSource, RunState, RunTable, ServerState
from mmproxy._wire import transport as _transport
from mmproxy.errors import ServerFailedError, ServerStateError, with_remote_cause
from mmproxy.proxy import DALIProxy, SampleSeeded

__all__ = ["AUTO_PIPELINES_MAX", "DALIServer", "RunState", "ServerState", "auto_pipelines"]

_names = itertools.count()
_JOIN_TIMEOUT = 5.0


class DALIServer:
    """Runs a DALI pipeline for DataLoader workers; a drop-in for DALI's ``DALIServer``.

    Args:
        pipeline: A DALI pipeline whose inputs are ``fn.external_source`` nodes without a
            ``source``; their names become the proxy's arguments, in declaration order. Or a
            function that builds one (called once now, and again whenever a pipeline must be
            rebuilt after an error; see "Bad samples" below). Or either of those with the inputs
            the proxy draws from each sample's seed, as :class:`~mmproxy.proxy.SampleSeeded`
            (what ``image_train_pipeline(sample_seeded=True)`` and ``video_pipeline`` return).
        deterministic: Run batches in the order the main loop consumes them, not in the order
            workers collate them, so a seeded pipeline gives the same outputs run after run.
        name: Used in every message; defaults to ``server<N>``.
        pad: Pad outputs whose shape differs between samples into a
            :class:`~mmproxy.refs.PaddedBatch` instead of returning a list of tensors. ``True``
            pads every output; a collection of output indices pads only those.
        pipelines: How many copies of the pipeline the server runs side by side, each with
            its own DALI threads (the pipeline's ``num_threads``), seed (the pipeline's + its
            index) and runner thread; a run goes to a free one: one DALI executor tops out
            below what the GPU can do (docs/pipelines.md). Copies are built by the function
            given as ``pipeline``, else from the built pipeline's own graph. ``"auto"``: one on
            a CPU; on a GPU, as many as the process's cores hold at the pipeline's
            ``num_threads``, at most :data:`AUTO_PIPELINES_MAX`. Outputs do not depend on which
            copy ran a batch when the randomness is drawn per sample (``SampleSeeded``); with
            ``deterministic``, runs go to the copies in turn, in the order the loader claims
            them, so random operators of the pipeline's own repeat run after run too. A ``Prepare``
            stage (the NVDEC decoder) is shared: each copy hands it up to two runs ahead.
        timeout: Seconds to wait for one run's outputs before raising
            :class:`~mmproxy.errors.WaitTimeoutError`. A run's inputs are already on their way
            when the main loop asks for it, so the wait is bounded by the pipeline's own time;
            the default (300 s) only turns a bug into an error instead of a hang. ``None``
            waits as long as the server is alive.

    Inputs a decoder of the pipeline reads (an ``external_source`` feeding ``fn.decoders.*``)
    are checked at the proxy call: a decoded array, or bytes that are not an image file of a
    format DALI reads, raise :class:`~mmproxy.errors.ProxyArgumentError` there, naming the sample.

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
                 pipelines: int | Literal["auto"] = 1,
                 timeout: float | None = 300.0) -> None:
        self.name = name or f"server{next(_names)}"
        self.uid = os.urandom(8).hex()
        _check_pipelines(pipelines, self.name)
        seeded = pipeline if isinstance(pipeline, SampleSeeded) else SampleSeeded(pipeline, None)
        self._pipe = Pipe(seeded.pipeline, self.name)
        count = (auto_pipelines(self._pipe.device_id, self._pipe.num_threads)
                 if pipelines == "auto" else int(pipelines))
        self._pipes = [self._pipe] + [self._pipe.copy(k) for k in range(1, count)]
        self._pad = set(range(self._pipe.num_outputs)) if pad is True else set(pad or ())
        device = None
        if self._pipe.device_id is not None:
            import torch

            device = torch.device("cuda", self._pipe.device_id)
        self.table = RunTable(self.name, self._pipe.max_batch_size,
                              deterministic=bool(deterministic), timeout=timeout, device=device,
                              lanes=count)
        self._owner_pid = os.getpid()
        # a pipeline with a Prepare stage takes what the stage makes; the proxy sends the stage's
        self._prepare = seeded.prepare
        sent = self._prepare.inputs if self._prepare is not None else self._pipe.input_names
        self._proxy = DALIProxy(self.name, self.uid, sent, self._pipe.num_outputs,
                                _transport.address(self.uid), seeded.sample_random,
                                seeded.arguments,
                                {n: kind for n, kind in self._pipe.encoded_inputs.items() if n in sent})
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener: _transport.Listener | None = None
        _process.register_local(self.uid, self)

    # -- public API -----------------------------------------------------------------------------

    @property
    def proxy(self) -> DALIProxy:
        """The picklable callable to use in datasets (e.g. as a torchvision ``transform``)."""
        return self._proxy

    @property
    def state(self) -> ServerState:
        return self.table.state

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._pipe.input_names

    @property
    def pipelines(self) -> int:
        """How many instances of the pipeline the server runs side by side."""
        return len(self._pipes)

    @property
    def max_batch_size(self) -> int:
        """The pipeline's ``batch_size``: the most samples one run may hold."""
        return self.table.max_batch_size

    @property
    def deterministic(self) -> bool:
        return self.table.deterministic

    @property
    def timeout(self) -> float | None:
        return self.table.timeout

    @property
    def samples(self) -> int:
        """Samples the pipeline has produced."""
        return self.table.samples

    @property
    def wait_seconds(self) -> float:
        """Main-loop time spent waiting for this server's outputs."""
        return self.table.wait_seconds

    @property
    def starved_seconds(self) -> float:
        """Time the pipelines sat idle waiting for inputs from workers (or, deterministic, for
        their turn), summed over the pipelines."""
        return self.table.starved_seconds

    @property
    def _runs(self) -> dict[str, Run]:
        return self.table.runs

    def __repr__(self) -> str:
        return f"DALIServer(name={self.name!r}, inputs={self.input_names}, state={self.state.value})"

    def __enter__(self) -> DALIServer:
        self.start_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_thread()

    def start_thread(self) -> None:
        """Starts the server's threads; a no-op when running. A failed server raises, and so
        does a server this process inherited from the one it forked from."""
        if os.getpid() != self._owner_pid:
            raise ServerStateError(
                f"server {self.name!r} runs in process {self._owner_pid}, and this process "
                f"({os.getpid()}) is a fork of it: a server serves the process that made it. "
                "Start it and iterate its loaders there, or make the server and its loaders in "
                "this process")
        if self.table.state is ServerState.RUNNING:
            return
        self.table.check_startable()
        try:
            self._listener = _transport.Listener(self._proxy.address, self.name)
        except FileExistsError:
            raise ServerStateError(f"server {self.name!r}: {os.path.dirname(self._proxy.address)} "
                                   "already exists; refusing to listen in a folder mmproxy did "
                                   "not make for this server") from None
        self._stop = threading.Event()  # this start's: a thread of an earlier start stays stopped
        self.table.set_state(ServerState.RUNNING)
        if self._prepare is not None:
            self._prepare.start()
        self._threads = [threading.Thread(target=self._listen, args=(self._listener, self._stop),
                                          name=f"mmproxy-{self.name}-listen", daemon=True)]
        for k, pipe in enumerate(self._pipes):
            runs: RunSource = self.table.lane(k)
            if self._prepare is not None:
                runs = PreparedRuns(runs, self._prepare, pipe.input_names, pipe.num_outputs)
            runner = Runner(pipe, runs, self._pad, self.table.device, self._stop)
            suffix = "" if len(self._pipes) == 1 else f"_{k}"
            self._threads.append(threading.Thread(target=runner, name=f"mmproxy-{self.name}-run{suffix}",
                                                  daemon=True))
        for t in self._threads:
            t.start()

    def stop_thread(self) -> None:
        """Stops the threads and forgets pending runs; idempotent; takes well under a second."""
        with self.table.cond:
            running = self.table.state is ServerState.RUNNING
        if running:
            self.table.set_state(ServerState.STOPPING)
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(_JOIN_TIMEOUT)
        self._threads = []
        if self._prepare is not None:
            self._prepare.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.table.clear()

    def produce_data(self, obj: Any) -> Any:
        """Returns ``obj`` with this server's batch references replaced by their data.

        References of other servers are left as they are.
        """
        return resolve(obj, {self.uid: self.table})

    # -- the listener thread --------------------------------------------------------------------

    def _listen(self, listener: _transport.Listener, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                fds = listener.receive()
                if fds is None:
                    continue
                try:
                    request = _transport.unpack(fds)
                finally:
                    _transport.close_all(fds)
                self.table.accept(request)
        except ServerStateError:
            pass
        except BaseException as err:  # noqa: BLE001 - every error must reach the main loop
            self.table.fail(with_remote_cause(
                ServerFailedError(f"server {self.name!r}: receiving inputs failed: {err}"), err))
        finally:
            # Closing here (stopped or failed) makes workers blocked on a full socket fail fast.
            listener.close()

    def __del__(self) -> None:
        try:
            if os.getpid() != self._owner_pid:
                return  # a forked child never touches a server it inherited
            if self.table.state is ServerState.RUNNING:
                self.stop_thread()
            for pipe in self._pipes:
                pipe.close()  # now, not when the collector (maybe in a forked child) finds it
        except Exception:  # noqa: BLE001 - a silent safety net only
            pass


AUTO_PIPELINES_MAX = 4  # the image graph on an H200: six pipelines of 2 threads ran below four of 3


def _check_pipelines(pipelines: Any, name: str) -> None:
    if isinstance(pipelines, str) and pipelines == "auto":
        return
    if isinstance(pipelines, bool) or not isinstance(pipelines, numbers.Integral) or pipelines < 1:
        raise ValueError(f"server {name!r}: pipelines must be a whole number >= 1 or 'auto', "
                         f"got {pipelines!r}")


def auto_pipelines(device_id: int | None, num_threads: int) -> int:
    """What ``pipelines="auto"`` gives a pipeline on ``device_id`` (None: the CPU) with
    ``num_threads`` DALI threads: one on a CPU (the pipelines would share its cores); on a GPU,
    as many as the process's cores hold at ``num_threads`` each, from one to
    :data:`AUTO_PIPELINES_MAX`."""
    if device_id is None:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(AUTO_PIPELINES_MAX, cores // max(1, num_threads)))


def _after_fork_in_child() -> None:
    # A forked child keeps every server it inherited (those still registered, even one that only
    # a garbage cycle holds) for the rest of its life, so it never frees a pipeline or CUDA
    # outputs, and drops their sockets (see Listener.forget).
    for server in _process.local_servers():
        _process.keep(server)
        if server._listener is not None:
            server._listener.forget()


_process.on_fork_in_child(_after_fork_in_child)
