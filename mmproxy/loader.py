"""Loader: a torch ``DataLoader`` that swaps every server's batch references for real data.

It takes one server, a sequence of servers, or a name-to-server mapping (empty for a dataset whose
fields are all plain functions: its batches pass through as they are). It starts the servers on
iteration, tags every run with (loader, epoch) so that a new epoch drops the runs of an abandoned
one, and in deterministic mode claims the next batch's runs one batch ahead so that the servers
work while the training step runs. docs/internals.md, ``mmproxy.loader``, has the rest.
"""

from __future__ import annotations

import gc
import inspect
import multiprocessing
import os
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch.utils.data

from mmproxy import _context
from mmproxy._loader import indexed as _indexed
from mmproxy._loader import workers as _workers
from mmproxy._loader.iterator import LoaderIter
from mmproxy._loader.progress import Progress, hand_out, rank_and_world
from mmproxy.errors import StateError
from mmproxy.protocols import ChecksLoader, FollowsLoaderEpoch
from mmproxy.server import DALIServer
from mmproxy.skips import SkipReport
from mmproxy.state import LoaderState

__all__ = ["DataLoader"]

Servers = DALIServer | Sequence[DALIServer] | Mapping[str, DALIServer]
_SIGNATURE = inspect.signature(torch.utils.data.DataLoader.__init__)
# dataset -> the loader that began its first epoch in this process (None once warned)
_FIRST_EPOCH: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


def _note_first_epoch(dataset: Any, loader_id: str) -> None:
    """Warns (once a dataset) when a second loader begins a first epoch over a dataset whose
    order and draws follow the loader's epoch: it repeats the first loader's first epoch."""
    if not (isinstance(dataset, FollowsLoaderEpoch) and dataset.follows_loader_epoch):
        return
    try:
        first = _FIRST_EPOCH.setdefault(dataset, loader_id)
    except TypeError:  # a dataset that cannot be weakly referenced or hashed: not followed
        return
    if first is not None and first != loader_id:
        _FIRST_EPOCH[dataset] = None
        warnings.warn(
            "another mmproxy.DataLoader over this dataset began its first epoch already: each "
            "loader numbers its epochs from 1, so this one repeats that epoch's order and random "
            "draws. Make the loader once and iterate it every epoch (or fix the dataset's epoch "
            "with dataset.set_epoch)", UserWarning, stacklevel=3)


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
    return {s.uid: s for s in items}


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
        dali_server: One server, a sequence of servers, or a mapping of name to server; an
            empty sequence for a dataset that sends nothing to a server (text, labels).
        *args: Passed to ``torch.utils.data.DataLoader``.
        freeze_gc: On the first iteration of the first loader in the process that has it (before
            that loader's workers start), run ``gc.collect()`` once and then ``gc.freeze()``
            what is alive: the modules, the model, the pipelines. The main loop's allocations
            (the servers' threads, the batches in flight) make Python run full collections, and
            a full collection walks every object not frozen while every Python thread waits:
            with torch and DALI loaded, a pause long enough to leave DALI unfed and lower the
            epoch's rate (benchmarks/HISTORY.md, "The garbage collector's heap frozen"). Frozen
            objects are still freed when their last reference goes; only reference cycles among
            them that become garbage later stay until ``gc.unfreeze()``. The one ``gc.collect()`` runs every
            pending finalizer then (in a process holding much cyclic garbage, a long pause
            once). Nothing happens while the collector is disabled (``gc.disable()``); a
            loader's later first iteration tries again. ``False`` leaves the collector as it is.
        **kwargs: Passed to ``torch.utils.data.DataLoader``.
    """

    def __init__(self, dali_server: Servers, *args: Any, freeze_gc: bool = True,
                 **kwargs: Any) -> None:
        if isinstance(dali_server, torch.utils.data.Dataset):
            raise TypeError("mmproxy.DataLoader's first argument is the server (or servers), then "
                            "the dataset: mmproxy.DataLoader(server, dataset, ...), or "
                            "dataset.loader(server, ...) for a MultiModalDataset; a dataset "
                            "with no server field: mmproxy.DataLoader([], dataset, ...)")
        bound = _SIGNATURE.bind(None, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}) or {})
        self._servers = _as_servers(dali_server)
        self._freeze_gc = freeze_gc
        self._loader_id = os.urandom(6).hex()
        self._epoch = multiprocessing.RawValue("q", 0)
        self._init = _workers.WorkerInit(self._loader_id, self._epoch, arguments.get("worker_init_fn"),
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
            name = type(_indexed.unwrapped(self.dataset)).__name__
            raise TypeError(
                f"{name} does not say where its workers stand (its batches carry no "
                "mmproxy.worker.stamp), so this loader cannot resume it mid-epoch; "
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
            _workers.shutdown(self._iterator)
            self._iterator = None
        self._progress = None
        if all(s.done for s in states):
            self._epoch.value, self._resume = epoch, None
        else:
            self._epoch.value, self._resume = epoch - 1, states

    def __iter__(self) -> LoaderIter:  # type: ignore[override]
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
        elif self._epoch.value == 1:
            _note_first_epoch(self.dataset, self._loader_id)
        if self.num_workers == 0:  # this process makes the batches: its slot, of this loader
            _context.set_resume(self._loader_id, None if hand is None else hand[0])
        self._report = self._progress.report
        for server in self._servers.values():
            server.table.begin_epoch(self._loader_id, self._epoch.value)
        return LoaderIter(super().__iter__(), {uid: s.table for uid, s in self._servers.items()},
                          (self._loader_id, self._epoch), in_main=self.num_workers == 0,
                          dataset=self.dataset, progress=self._progress,
                          length=self.__len__, forget=self._forget)

    def _forget(self, it: Any) -> None:
        """Drops torch's iterator ``it`` if it is this loader's (persistent workers: the next
        epoch starts new ones)."""
        if self._iterator is it:
            self._iterator = None
