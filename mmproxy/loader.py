"""Loader: a torch ``DataLoader`` that swaps every server's batch references for real data.

It takes one server, a sequence of servers, or a name-to-server mapping. It starts the servers on
iteration, tags every run with (loader, epoch) so that a new epoch drops the runs of an abandoned
one, and in deterministic mode claims the next batch's runs one batch ahead so that the servers
work while the training step runs.

It also keeps the epoch's :class:`~mmproxy.skips.SkipReport` (:attr:`DataLoader.skipped`): the
``"__skipped__"`` records of every batch, the samples servers dropped, the records that workers
send on their own (a dict holding only ``"__skipped__"`` and ``"__shards_tried__"``: samples
skipped after a worker's last batch, or while no batch could be made), and the shards the
workers tried (``"__shards_tried__"``, taken out of each batch). With a dataset that declares
``max_skipped`` (like :class:`~mmproxy.datasets.MultiModalDataset`), an epoch that reads nothing,
skips too many samples or finds too many shards unreadable raises (see :mod:`mmproxy.skips`).
"""

from __future__ import annotations

import gc
import inspect
import multiprocessing
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch.utils.data

from mmproxy import _context, _indexed, _process, _walk
from mmproxy._context import Stamped
from mmproxy._progress import Progress, hand_out, rank_and_world
from mmproxy._resolve import claim, resolve_batch
from mmproxy.errors import StateError, WorkerDiedError
from mmproxy.protocols import ChecksLoader, LimitsSkips
from mmproxy.refs import DALIOutputBatchRef
from mmproxy.server import DALIServer
from mmproxy.skips import SHARDS_TRIED, SKIPPED, SkipReport
from mmproxy.state import LoaderState, ResumePoint

__all__ = ["DataLoader"]

Servers = DALIServer | Sequence[DALIServer] | Mapping[str, DALIServer]
_SIGNATURE = inspect.signature(torch.utils.data.DataLoader.__init__)


def _as_servers(servers: Servers) -> dict[str, DALIServer]:
    if isinstance(servers, DALIServer):
        items = [servers]
    elif isinstance(servers, Mapping):
        items = list(servers.values())
    else:
        items = list(servers)
    for s in items:
        if not isinstance(s, DALIServer):
            raise TypeError(f"DataLoader expects DALIServer objects, got {type(s).__name__}")
    if not items:
        raise ValueError("DataLoader needs at least one server")
    return {s.uid: s for s in items}


class _WorkerInit:
    """Runs in each worker: tags the worker's runs with this loader's id and live epoch, and
    hands it its starting position when the loader resumes."""

    def __init__(self, loader_id: str, epoch: Any, user: Callable[[int], None] | None,
                 persistent: bool) -> None:
        self.loader_id, self.epoch, self.user, self.persistent = loader_id, epoch, user, persistent
        self.resume: dict[int, ResumePoint] | None = None

    def __call__(self, worker_id: int) -> None:
        _context.set_loader_tag((self.loader_id, self.epoch), self.persistent)
        _context.set_resume(self.loader_id,
                            None if self.resume is None else self.resume.get(worker_id))
        if self.user is not None:
            self.user(worker_id)


_gc_frozen = False  # set once the process's heap was frozen (by any loader)


def _freeze_gc_once() -> None:
    """``gc.collect()`` then ``gc.freeze()``, once per process (see ``DataLoader``'s ``freeze_gc``).
    Nothing when the collector is disabled: a later loader's first iteration tries again."""
    global _gc_frozen
    if _gc_frozen or not gc.isenabled():
        return
    _gc_frozen = True
    gc.collect()
    gc.freeze()


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` that returns batches with real data from DALI servers.

    Args:
        dali_server: One server, a sequence of servers, or a mapping of name to server.
        *args: Passed to ``torch.utils.data.DataLoader``.
        freeze_gc: On the first iteration of the first loader in the process that has it (before
            that loader's workers start), run ``gc.collect()`` once and then ``gc.freeze()``
            what is alive: the modules, the model, the pipelines. The main loop's allocations
            (the servers' threads, the batches in flight) make Python run full collections, and
            a full collection walks every object not frozen while every Python thread waits:
            with torch and DALI loaded, 118-137 ms on the H200 (BENCHMARKS.md), in which the
            servers cannot feed DALI. Frozen objects are still freed when their last reference
            goes; only reference cycles among them that become garbage later stay until
            ``gc.unfreeze()``. The one ``gc.collect()`` runs every pending finalizer then (in a
            process holding much cyclic garbage, a long pause once). Nothing happens while the
            collector is disabled (``gc.disable()``); a loader's later first iteration tries
            again. ``False`` leaves the collector as it is.
        **kwargs: Passed to ``torch.utils.data.DataLoader``.
    """

    def __init__(self, dali_server: Servers, *args: Any, freeze_gc: bool = True,
                 **kwargs: Any) -> None:
        if isinstance(dali_server, torch.utils.data.Dataset):
            raise TypeError("mmproxy.DataLoader's first argument is the server (or servers), then "
                            "the dataset: mmproxy.DataLoader(server, dataset, ...), or "
                            "dataset.loader(server, ...) for a MultiModalDataset")
        bound = _SIGNATURE.bind(None, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}) or {})
        self._servers = _as_servers(dali_server)
        self._freeze_gc = freeze_gc
        self._loader_id = os.urandom(6).hex()
        self._epoch = multiprocessing.RawValue("q", 0)
        self._init = _WorkerInit(self._loader_id, self._epoch, arguments.get("worker_init_fn"),
                                 bool(arguments.get("persistent_workers")))
        arguments["worker_init_fn"] = self._init
        arguments["dataset"] = _indexed.indexed(arguments["dataset"])  # names samples in messages
        super().__init__(**arguments)
        self._report = SkipReport()
        self._progress: Progress | None = None
        self._resume: list[LoaderState] | None = None
        if isinstance(self.dataset, ChecksLoader):
            self.dataset.check_loader(self)  # e.g. a dataset that batches refuses batch_size

    @property
    def servers(self) -> list[DALIServer]:
        return list(self._servers.values())

    @property
    def skipped(self) -> SkipReport:
        """What the current (or last) epoch delivered and skipped, and why."""
        return self._report

    def ensure_server_listening(self) -> None:
        """Starts every server that is not running (DALI's name for it)."""
        for server in self._servers.values():
            server.start_thread()

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands (torchdata ``StatefulDataLoader``'s meaning): after k batches
        of an epoch, a loader built the same way and given this state continues with batch k+1;
        after the epoch's last batch (or before the first), with the next epoch. Small and
        picklable: the epoch, the batches delivered, and per worker the position of the dataset
        (:func:`mmproxy.worker.stamp`), as :class:`~mmproxy.state.LoaderState` writes it. In a
        multi-rank job each rank saves its own."""
        if self._resume is not None:  # loaded, not yet iterated: where the loaded state stands
            return hand_out(self._resume, self.dataset,
                            max(1, self.num_workers))[1].state().to_dict()
        if self._progress is None:
            return LoaderState(int(self._epoch.value), True, *rank_and_world(),
                               max(1, self.num_workers)).to_dict()
        progress = self._progress
        if not progress.done and progress.batches and not progress.positions:
            raise TypeError(
                f"{type(self.dataset).__name__} does not say where its workers stand (its batches "
                "carry no mmproxy.worker.stamp), so this loader cannot resume it mid-epoch; "
                "MultiModalDataset does, or save the state at an epoch's end")
        return progress.state().to_dict()

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continues from :meth:`state_dict` at the next ``iter(loader)``.

        ``state`` is this rank's state, or the list of every rank's states (gathered, e.g. with
        ``torch.distributed.all_gather_object``). With the same number of ranks and workers the
        batches are those of the uninterrupted run; with other numbers (elastic) the dataset
        redistributes what the epoch has left (``dataset.reshard``): every remaining sample once,
        in a new order.
        """
        states = [LoaderState.from_dict(s)
                  for s in ([state] if isinstance(state, Mapping) else list(state))]
        if not states:
            raise StateError("load_state_dict got an empty list of states")
        epochs = {s.epoch for s in states}
        if len(epochs) > 1:
            raise ValueError(f"the ranks' states are from different epochs: {sorted(epochs)}")
        epoch = epochs.pop()
        if self._iterator is not None:  # persistent workers start over from the state
            _LoaderIter.shutdown(self._iterator)
            self._iterator = None
        self._progress = None
        if all(s.done for s in states):
            self._epoch.value, self._resume = epoch, None
        else:
            self._epoch.value, self._resume = epoch - 1, states

    def __iter__(self) -> _LoaderIter:  # type: ignore[override]
        if self._freeze_gc:
            _freeze_gc_once()
        self.ensure_server_listening()
        self._epoch.value += 1
        workers = max(1, self.num_workers)
        self._init.resume = None
        self._progress = Progress(int(self._epoch.value), workers)
        hand = None
        if self._resume is not None:
            hand, self._progress = hand_out(self._resume, self.dataset, workers)
            self._resume = None
            self._init.resume = hand
        if self.num_workers == 0:  # this process makes the batches: its slot, of this loader
            _context.set_resume(self._loader_id, None if hand is None else hand[0])
        self._report = self._progress.report
        for server in self._servers.values():
            server.table.begin_epoch(self._loader_id, self._epoch.value)
        return _LoaderIter(self, super().__iter__())


class _LoaderIter:
    def __init__(self, loader: DataLoader, it: Iterator[Any]) -> None:
        self._loader = loader
        self._it = it
        self._tables = {uid: server.table for uid, server in loader._servers.items()}
        self._in_main = loader.num_workers == 0
        self._ahead = any(t.deterministic for t in self._tables.values())
        self._next: list[tuple[Any, Any]] = []  # (batch, stamp) fetched one step ahead
        self._report = loader._report
        self._progress = loader._progress
        self._seq = 0  # items taken from torch's iterator
        dataset = loader.dataset
        self._checked = isinstance(dataset, LimitsSkips)
        self._max_skipped = dataset.max_skipped if isinstance(dataset, LimitsSkips) else None
        _live_iterators.add(self)

    def __iter__(self) -> _LoaderIter:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def close(self) -> None:
        """Shuts this iterator's workers down now, instead of when it is garbage-collected."""
        if self._loader._iterator is self._it:
            self._loader._iterator = None  # persistent workers: the next epoch starts new ones
        self.shutdown(self._it)

    @staticmethod
    def shutdown(it: Any) -> None:
        """Shuts down the workers of torch's iterator ``it``."""
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is None:
            return
        try:
            shutdown()
        except RuntimeError as err:
            # After a worker died, torch's SIGCHLD handler reports it again when the other workers
            # exit during the shutdown; the shutdown itself has finished (in torch's `finally`).
            if "DataLoader worker" not in str(err):
                raise

    def _fetch(self) -> tuple[Any, tuple[int, Stamped] | None]:
        """The next batch from torch's iterator with its worker's stamp (if any); records sent on
        their own are taken on the way."""
        while True:
            batch = self._fetch_any()
            self._seq += 1
            stamp = None
            if isinstance(batch, Stamped):
                stamp, batch = (self._seq, batch), batch.item
            if isinstance(batch, dict) and SKIPPED in batch and batch.keys() <= _RECORDS_ONLY:
                self._took(stamp)
                self._report.add(0, batch[SKIPPED], batch.get(SHARDS_TRIED, 0))
                self._check()
                continue
            return batch, stamp

    def _took(self, stamp: tuple[int, Stamped] | None) -> None:
        if stamp is not None and self._progress is not None:
            self._progress.took(*stamp)

    def _fetch_any(self) -> Any:
        if self._in_main:
            _context.set_loader_tag((self._loader._loader_id, self._loader._epoch))
        try:
            return next(self._it)
        except (ConnectionError, EOFError) as err:
            # torch hands tensors over through the worker; a worker killed mid-handover shows up
            # as a broken connection here rather than as torch's "exited unexpectedly"
            codes = [w.exitcode for w in getattr(self._it, "_workers", [])]
            raise WorkerDiedError(f"a DataLoader worker died while handing over a batch "
                                  f"(worker exit codes {codes}): {err!r}") from err
        finally:
            if self._in_main:
                _context.set_loader_tag(None)

    def _check(self) -> None:
        if self._checked:
            self._report.check(self._max_skipped)

    def _claim(self, batch: Any) -> None:
        claim(_walk.collect(batch, DALIOutputBatchRef), self._tables,
              (self._loader._loader_id, int(self._loader._epoch.value)))

    def _resolve(self, batch: Any) -> Any | None:
        """The batch with data, or None when every sample in it was dropped."""
        batch, size, dropped = resolve_batch(batch, self._tables, strict=True)
        records = batch.get(SKIPPED, dropped) if isinstance(batch, dict) else dropped
        tried = batch.pop(SHARDS_TRIED, 0) if isinstance(batch, dict) else 0
        self._report.add(_count(batch) if size is None else size, records, tried)
        self._check()
        return None if size == 0 else batch

    def __next__(self) -> Any:
        try:
            while True:
                try:
                    raw: Any = self._step()
                except StopIteration:
                    raw = _END
                if raw is _END:  # outside the except: an error here is not "during StopIteration"
                    if self._checked:
                        self._report.check(self._max_skipped, final=True)
                    if self._progress is not None:
                        self._progress.done = True
                    raise StopIteration
                raw, stamp = raw
                batch = self._resolve(raw)
                self._took(stamp)
                if batch is not None:
                    if self._progress is not None:
                        self._progress.batches += 1
                    return batch
        except StopIteration:
            raise
        except BaseException:
            # An error ends the epoch: the workers go now, not when the iterator is collected
            # (the traceback keeps it alive, and torch's shutdown joins with 5 s timeouts).
            self.close()
            raise

    def _step(self) -> tuple[Any, tuple[int, Stamped] | None]:
        if not self._ahead:
            return self._fetch()
        if not self._next:
            batch = self._fetch()
            self._claim(batch[0])
        else:
            batch = self._next.pop()
        try:
            upcoming = self._fetch()
        except StopIteration:
            pass
        else:
            self._claim(upcoming[0])
            self._next.append(upcoming)
        return batch


_END = object()
_RECORDS_ONLY = frozenset({SKIPPED, SHARDS_TRIED})  # what a worker sends besides its batches


def _count(batch: Any) -> int:
    """Samples in a batch without server references: the rows of its first tensor or list."""
    if isinstance(batch, dict):
        values = [v for k, v in batch.items() if k != SKIPPED]
    else:
        values = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
        if isinstance(value, list):
            return len(value)
    return 0


# A forked worker of a later loader inherits the iterators of earlier ones; if it garbage-collected
# them, torch's iterator would try to shut down workers that are not its children. The child keeps
# them alive (inert) instead.
_live_iterators: weakref.WeakSet[_LoaderIter] = weakref.WeakSet()


def _keep_inherited_iterators() -> None:
    for it in list(_live_iterators):
        _process.keep(it._it)


_process.on_fork_in_child(_keep_inherited_iterators)
