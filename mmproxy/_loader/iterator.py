"""Loader iterator: one epoch of an mmproxy DataLoader, from torch's iterator to batches with data.

After each batch and at the epoch's end the skip limit is judged (a dataset that declares
``max_skipped``: :class:`~mmproxy.protocols.LimitsSkips`); an epoch that reads nothing, skips too
many samples or finds too many shards unreadable raises there (:mod:`mmproxy.skips`). Any error
ends the epoch and shuts the workers down at once.
docs/internals.md, ``mmproxy._loader.iterator``, has the rest.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mmproxy import _context
from mmproxy._context import Stamped
from mmproxy._loader import walk as _walk
from mmproxy._loader import workers as _workers
from mmproxy._loader.progress import Progress
from mmproxy._loader.resolve import claim, resolve_batch
from mmproxy._server.runs import RunTable
from mmproxy.errors import WorkerDiedError
from mmproxy.protocols import LimitsSkips
from mmproxy.refs import DALIOutputBatchRef
from mmproxy.skips import SHARDS_TRIED, SKIPPED

__all__ = ["LoaderIter"]

_END = object()
_RECORDS_ONLY = frozenset({SKIPPED, SHARDS_TRIED})  # what a worker sends besides its batches
_Fetched = tuple[Any, tuple[int, Stamped] | None]  # a batch, and (item number, stamp) if stamped


class LoaderIter:
    """The iterator ``iter(loader)`` returns (see the module docstring).

    Args:
        it: torch's iterator over the loader.
        tables: The run table of each server, by uid.
        tag: The loader's id and its shared epoch counter (its runs' tag).
        in_main: Whether batches are made in this process (``num_workers=0``).
        dataset: The loader's dataset (judged against its skip limit when it declares one).
        progress: The epoch's progress (its report collects the skips).
        length: ``len(loader)``.
        forget: Called with ``it`` when this iterator closes (the loader drops it, so that
            persistent workers start afresh next epoch).
    """

    def __init__(self, it: Iterator[Any], tables: dict[str, RunTable], tag: tuple[str, Any],
                 *, in_main: bool, dataset: Any, progress: Progress,
                 length: Callable[[], int], forget: Callable[[Any], None]) -> None:
        self._it, self._tables, self._tag, self._in_main = it, tables, tag, in_main
        self._progress, self._report = progress, progress.report
        self._length, self._forget = length, forget
        deterministic = [t for t in tables.values() if t.deterministic]
        self._claims_ahead = bool(deterministic)
        # batches fetched and claimed ahead: one, or enough to keep each of a server's
        # pipelines two runs deep
        self._ahead = max((2 * t.lanes - 1 for t in deterministic), default=1)
        self._next: collections.deque[_Fetched] = collections.deque()
        self._ended = False  # torch's iterator ran out while fetching ahead
        self._seq = 0  # items taken from torch's iterator
        self._max_skipped = dataset.max_skipped if isinstance(dataset, LimitsSkips) else None
        self._judged = isinstance(dataset, LimitsSkips)
        _workers.track(it)

    def __iter__(self) -> LoaderIter:
        return self

    def __len__(self) -> int:
        return self._length()

    def close(self) -> None:
        """Shuts this iterator's workers down now, instead of when it is garbage-collected."""
        self._forget(self._it)
        _workers.shutdown(self._it)

    def __next__(self) -> Any:
        try:
            while True:
                try:
                    raw: Any = self._step()
                except StopIteration:
                    raw = _END
                if raw is _END:  # outside the except: an error here is not "during StopIteration"
                    self._judge(final=True)
                    self._progress.done = True
                    raise StopIteration
                raw, stamp = raw
                batch = self._resolve(raw)
                self._took(stamp)
                if batch is not None:
                    self._progress.batches += 1
                    return batch
        except StopIteration:
            raise
        except BaseException:
            # An error ends the epoch: the workers go now, not when the iterator is collected
            # (the traceback keeps it alive, and torch's shutdown joins with 5 s timeouts).
            self.close()
            raise

    def _step(self) -> _Fetched:
        """The next batch; in deterministic mode, the ones after it are fetched and claimed too,
        so that each pipeline of a server has runs to take."""
        if not self._claims_ahead:
            return self._fetch()
        while not self._ended and len(self._next) <= self._ahead:
            try:
                batch = self._fetch()
            except StopIteration:
                self._ended = True
                break
            self._claim(batch[0])
            self._next.append(batch)
        if not self._next:
            raise StopIteration
        return self._next.popleft()

    def _fetch(self) -> _Fetched:
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
                self._judge()
                continue
            return batch, stamp

    def _fetch_any(self) -> Any:
        if self._in_main:
            _context.set_loader_tag(self._tag)
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

    def _took(self, stamp: tuple[int, Stamped] | None) -> None:
        if stamp is not None:
            self._progress.took(*stamp)

    def _claim(self, batch: Any) -> None:
        claim(_walk.collect(batch, DALIOutputBatchRef), self._tables,
              (self._tag[0], int(self._tag[1].value)))

    def _resolve(self, batch: Any) -> Any | None:
        """The batch with data, or None when every sample in it was dropped."""
        batch, size, dropped = resolve_batch(batch, self._tables, strict=True)
        records = batch.get(SKIPPED, dropped) if isinstance(batch, dict) else dropped
        tried = batch.pop(SHARDS_TRIED, 0) if isinstance(batch, dict) else 0
        self._report.add(_count(batch) if size is None else size, records, tried)
        self._judge()
        return None if size == 0 else batch

    def _judge(self, final: bool = False) -> None:
        """Raises when the epoch so far (or, ``final``, the whole epoch) breaks the skip limit."""
        if self._judged:
            self._report.check(self._max_skipped, final=final)


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

