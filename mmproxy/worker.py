"""Worker API: what a dataset running in a DataLoader worker can ask of mmproxy.

A dataset (like :class:`mmproxy.datasets.MultiModalDataset`) uses these to follow the loader's
epochs, to name the samples it sends to servers, and to send bytes of files it has mapped by
reference instead of copying them.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mmproxy import _context
from mmproxy._context import SampleId, Stamped, naming, sample_key
from mmproxy._wire import transport as _transport
from mmproxy.state import ResumePoint

__all__ = ["ResumePoint", "SampleId", "Stamped", "in_persistent_worker", "loader_epoch",
           "naming", "next_epoch", "register_file_mapping", "release_file_mapping", "resume_state",
           "sample_key", "stamp", "wants_state"]


def loader_epoch() -> int | None:
    """The epoch of the :class:`mmproxy.DataLoader` this worker serves (1, 2, ...), or None
    outside one."""
    tag = _context.current_tag()
    return tag[1] if tag else None


def in_persistent_worker() -> bool:
    """Whether this is a persistent worker of an mmproxy DataLoader (it will see the next epoch)."""
    return _context.in_persistent_worker()


@contextmanager
def next_epoch() -> Iterator[None]:
    """Runs submitted inside belong to the loader's next epoch (to prepare its first batch)."""
    with _context.next_epoch():
        yield


def register_file_mapping(mapping: mmap.mmap, fd: int) -> None:
    """Bytes inside ``mapping`` (a read-only map of the file ``fd``) are sent to servers by
    reference: the file's descriptor and an offset, not a copy. ``fd`` is duplicated, so the
    caller may close its own. The file must not be rewritten in place while it is read."""
    _transport.register_file_mapping(mapping, fd)


def release_file_mapping(mapping: mmap.mmap) -> None:
    """Ends :func:`register_file_mapping` for ``mapping`` (e.g. a streamed shard read to its end):
    its descriptor is closed, so its memory can be freed once samples already sent are done;
    views of it sent later are copied."""
    _transport.release_file_mapping(mapping)


def wants_state() -> bool:
    """Whether this process serves an mmproxy DataLoader, which keeps the dataset's position
    (:func:`stamp`) for :meth:`mmproxy.DataLoader.state_dict`."""
    return _context.current_tag() is not None


def stamp(item: Any, worker: int, state: Callable[[], Any]) -> Any:
    """``item`` with this worker's position right after it (``state()``, small and picklable),
    for the loader to keep; ``item`` itself outside an mmproxy DataLoader. ``worker`` is the
    worker whose samples these are (the one :func:`resume_state` named, or this worker's id)."""
    return Stamped(item, worker, state()) if wants_state() else item


def resume_state(epoch: int) -> ResumePoint | None:
    """Where this worker starts ``epoch`` when the loader resumes from a saved state, else None.

    A :class:`ResumePoint`: ``worker`` (whose samples to read: the loader may hand one worker's
    position to another, to keep the order of batches) and ``state`` (the dataset state that
    worker last stamped, or that the dataset's ``reshard`` made for it; None for its start).
    The loader does not read inside ``state``. Given once: later epochs start fresh.
    """
    return _context.take_resume(epoch)
