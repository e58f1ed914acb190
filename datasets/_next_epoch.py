"""Next epoch: its first item, made by a persistent worker while the loader finishes this epoch.

Once a persistent worker of an :class:`mmproxy.DataLoader` has given its last item of an epoch,
the loader will ask it for the next epoch (numbered one more). :meth:`NextEpoch.prepare` makes
that epoch's first item at once: its inputs reach the servers, which run them after this epoch's
runs, and the next epoch starts with outputs ready instead of a cold pipeline (as a DALI reader
keeps prefetching across epochs). :meth:`NextEpoch.take` hands the prepared epoch over when it is
the one asked for.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from mmproxy import worker

__all__ = ["NextEpoch"]


class NextEpoch:
    """The next epoch's first item and the rest of its items, made ahead (or nothing)."""

    def __init__(self) -> None:
        self._held: tuple[int, Any, Iterator[Any]] | None = None

    def take(self, epoch: int) -> Iterator[Any] | None:
        """The items of ``epoch`` when they were prepared (its first one included), else None;
        whatever was held is let go either way."""
        held, self._held = self._held, None
        if held is None or held[0] != epoch:
            return None
        return itertools.chain([held[1]], held[2])

    def prepare(self, epoch: int, items: Iterator[Any]) -> None:
        """Takes the first of ``items`` (epoch ``epoch``'s) now, under
        :func:`mmproxy.worker.next_epoch`. An error leaves nothing held: the epoch raises it
        again in its own time, when it is read."""
        try:
            with worker.next_epoch():
                first = next(items)
        except Exception:  # noqa: BLE001 - raised again, in its own epoch
            return
        self._held = (epoch, first, items)
