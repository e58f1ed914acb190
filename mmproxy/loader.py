"""Loader: a torch ``DataLoader`` that swaps every server's batch references for real data.

It takes one server, a sequence of servers, or a name-to-server mapping. It starts the servers on
iteration, tags every run with (loader, epoch) so that a new epoch drops the runs of an abandoned
one, and in deterministic mode claims the next batch's runs one batch ahead so that the servers
work while the training step runs.
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

from mmproxy import _context, _walk
from mmproxy._resolve import claim, resolve
from mmproxy.errors import WorkerDiedError
from mmproxy.refs import DALIOutputBatchRef
from mmproxy.server import DALIServer

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
    """Runs in each worker: tags the worker's runs with this loader's id and live epoch."""

    def __init__(self, loader_id: str, epoch: Any, user: Callable[[int], None] | None,
                 persistent: bool) -> None:
        self.loader_id, self.epoch, self.user, self.persistent = loader_id, epoch, user, persistent

    def __call__(self, worker_id: int) -> None:
        _context.set_loader_tag((self.loader_id, self.epoch), self.persistent)
        if self.user is not None:
            self.user(worker_id)


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` that returns batches with real data from DALI servers.

    Args:
        dali_server: One server, a sequence of servers, or a mapping of name to server.
        *args: Passed to ``torch.utils.data.DataLoader``.
        **kwargs: Passed to ``torch.utils.data.DataLoader``.
    """

    def __init__(self, dali_server: Servers, *args: Any, **kwargs: Any) -> None:
        bound = _SIGNATURE.bind(None, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}) or {})
        self._servers = _as_servers(dali_server)
        self._loader_id = os.urandom(6).hex()
        self._epoch = multiprocessing.RawValue("q", 0)
        arguments["worker_init_fn"] = _WorkerInit(self._loader_id, self._epoch,
                                                  arguments.get("worker_init_fn"),
                                                  bool(arguments.get("persistent_workers")))
        super().__init__(**arguments)

    @property
    def servers(self) -> list[DALIServer]:
        return list(self._servers.values())

    def ensure_server_listening(self) -> None:
        """Starts every server that is not running (DALI's name for it)."""
        for server in self._servers.values():
            server.start_thread()

    def __iter__(self) -> _LoaderIter:  # type: ignore[override]
        self.ensure_server_listening()
        if self.num_workers > 0 and (self._iterator is None or not self.persistent_workers):
            # Collect garbage here, before workers fork: a DALI pipeline left in a garbage cycle
            # must be destroyed by this process, never by a forked child (that aborts it).
            gc.collect()
        self._epoch.value += 1
        for server in self._servers.values():
            server._begin_epoch(self._loader_id, self._epoch.value)
        return _LoaderIter(self, super().__iter__())


class _LoaderIter:
    def __init__(self, loader: DataLoader, it: Iterator[Any]) -> None:
        self._loader = loader
        self._it = it
        self._servers = loader._servers
        self._in_main = loader.num_workers == 0
        self._ahead = any(s.deterministic for s in self._servers.values())
        self._next: list[Any] = []  # the batch fetched one step ahead (deterministic mode)
        _live_iterators.add(self)

    def __iter__(self) -> _LoaderIter:
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def close(self) -> None:
        """Shuts this iterator's workers down now, instead of when it is garbage-collected."""
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is None:
            return
        try:
            shutdown()
        except RuntimeError as err:
            # After a worker died, torch's SIGCHLD handler reports it again when the other workers
            # exit during the shutdown; the shutdown itself has finished (in torch's `finally`).
            if "DataLoader worker" not in str(err):
                raise

    def _fetch(self) -> Any:
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

    def _claim(self, batch: Any) -> None:
        claim(_walk.collect(batch, DALIOutputBatchRef), self._servers)

    def __next__(self) -> Any:
        if not self._ahead:
            return resolve(self._fetch(), self._servers, strict=True)
        if not self._next:
            batch = self._fetch()
            self._claim(batch)
        else:
            batch = self._next.pop()
        try:
            upcoming = self._fetch()
        except StopIteration:
            pass
        else:
            self._claim(upcoming)
            self._next.append(upcoming)
        return resolve(batch, self._servers, strict=True)


# A forked worker of a later loader inherits the iterators of earlier ones; if it garbage-collected
# them, torch's iterator would try to shut down workers that are not its children. The child keeps
# them alive (inert) instead.
_live_iterators: weakref.WeakSet[_LoaderIter] = weakref.WeakSet()
_inherited: list[Any] = []


def _keep_inherited_iterators() -> None:
    _inherited.extend(it._it for it in list(_live_iterators))


os.register_at_fork(after_in_child=_keep_inherited_iterators)
