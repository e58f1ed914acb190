"""Epochs: which epoch each loader of a server is in, and what that makes of a run's tag.

Each run is tagged with (loader id, epoch) by the worker that collated it. When a loader starts
an epoch, runs tagged with an earlier epoch of that loader are *stale* (a batch kept from an
abandoned epoch: dropped, and a reference to one says why), and runs tagged with a later one are
*early* (the next epoch's first batches, which persistent workers prepare before the loader
starts it: run after the current epoch's). A run without a tag (made outside an
:class:`mmproxy.DataLoader`) is neither.
"""

from __future__ import annotations

__all__ = ["Epochs", "Tag"]

Tag = tuple[str, int] | None  # (loader id, epoch) of a run


class Epochs:
    """The current epoch of each loader of one server (guarded by the run table's lock)."""

    def __init__(self) -> None:
        self._current: dict[str, int] = {}  # loader id -> its current epoch

    def begin(self, loader_id: str, epoch: int) -> None:
        self._current[loader_id] = epoch

    def is_stale(self, tag: Tag) -> bool:
        """Whether the run belongs to an epoch its loader has left."""
        return tag is not None and tag[1] < self._current.get(tag[0], tag[1])

    def is_early(self, tag: Tag) -> bool:
        """Whether the run belongs to an epoch its loader has not started yet."""
        return tag is not None and tag[1] > self._current.get(tag[0], tag[1])

    def stale_reason(self, tag: Tag) -> str:
        """Why a stale run was dropped, in words."""
        loader, epoch = tag or ("?", -1)
        return (f"it belongs to epoch {epoch} of loader {loader}, which has started epoch "
                f"{self._current.get(loader)} (a batch kept from an abandoned epoch)")
