"""Protocols: the contracts between the loader, datasets, proxies and servers.

Each is a runtime-checkable :class:`typing.Protocol`; the engine asks ``isinstance(obj,
Protocol)``, never ``hasattr``. A dataset or a callable takes part by having the members named
here; nothing needs to subclass them. docs/internals.md, ``mmproxy.protocols``, has the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from mmproxy.state import LoaderState

__all__ = ["ChecksLoader", "FollowsLoaderEpoch", "LimitsSkips", "Prepare", "Proxy", "Reshardable"]


@runtime_checkable
class ChecksLoader(Protocol):
    """A dataset that checks the :class:`mmproxy.DataLoader` it is given, when the loader is made
    (before any batch): e.g. a dataset that batches itself refuses a torch ``batch_size``."""

    def check_loader(self, loader: Any) -> None:
        """Raises for a loader this dataset cannot serve, saying why."""


@runtime_checkable
class LimitsSkips(Protocol):
    """A dataset whose epochs the loader judges by their skip report (:mod:`mmproxy.skips`): an
    epoch that delivers nothing raises, and so does one that skips more than ``max_skipped`` of
    its samples (``None``: no limit on the fraction)."""

    max_skipped: float | None


@runtime_checkable
class FollowsLoaderEpoch(Protocol):
    """A dataset whose order and random draws follow the epoch of the loader that iterates it
    (``follows_loader_epoch`` is False once it fixes its own). Each loader numbers its epochs
    from 1, so a loader made anew every epoch would repeat the first epoch: the loader warns."""

    follows_loader_epoch: bool


@runtime_checkable
class Reshardable(Protocol):
    """A dataset that can finish a saved epoch on other numbers of ranks or workers (elastic
    resume)."""

    def reshard(self, saved: Sequence[LoaderState], *, rank: int, world: int,
                workers: int) -> list[Any]:
        """What each of ``workers`` workers of rank ``rank`` (of ``world``) starts from, given the
        saved states of every rank: one dataset state per worker (the loader carries it to the
        worker without reading it)."""


@runtime_checkable
class Proxy(Protocol):
    """A server's proxy: a picklable callable that names its server (:class:`mmproxy.DALIProxy`).
    Calling it in a worker returns references that the collate turns into a run on that server."""

    server_uid: str
    server_name: str

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        """References to the server's outputs for one sample's inputs."""


class Prepare(Protocol):
    """Turns each sample's inputs, as workers send them, into the pipeline's inputs, in the server
    process (e.g. encoded video decoded into GPU frames)."""

    inputs: tuple[str, ...]  # what the proxy sends per sample, in order

    def start(self) -> None:
        """Lets the stage take samples (again after :meth:`close`); the server calls it when it
        starts."""
        ...

    def submit(self, sample: dict[str, Any]) -> Future[dict[str, Any]]:
        """Starts preparing one sample (its inputs by name); the future gives the pipeline's
        inputs by name, or raises: :class:`~mmproxy.DamagedSampleError` for a sample whose data
        is at fault, anything else when the stage itself fails. Raises at once after
        :meth:`close`."""
        ...

    def close(self) -> None:
        """Stops the stage's threads (waiting a bounded time for them); :meth:`submit` raises
        until the next :meth:`start`."""
        ...
