"""Stage: the one protocol of the worker-side pipeline's steps (``next``, ``reset``,
``state_dict``), each a small object that owns its state and knows only its source.
docs/internals.md, ``mmproxy.datasets.stages._stage``, has the rest.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from mmproxy.errors import StateError

__all__ = ["VERSION_KEY", "Draws", "Stage", "generator", "pack_addresses", "unpack_addresses"]

VERSION_KEY = "version"

T = TypeVar("T", covariant=True)


class Stage(ABC, Generic[T]):
    """The one protocol of the stages, and their state checked in one place.

    A stage is made over its source (the stage before it, none for a shard plan) and is given
    then whatever else it needs; it speaks to its source through this protocol alone:

    - :meth:`next`: the next item; ``StopIteration`` at the end of the stage's pass.
    - :meth:`reset`: back to a state :meth:`state_dict` made, or (None) on to the next pass;
      the mixer and the stages after it have one pass per epoch, and raise.
    - :meth:`state_dict`: the state now, its source's nested under the source's name.

    ``remaining(state)`` says what a state has left (an elastic resume). Subclasses set ``NAME``
    (how errors name the stage), ``KEYS`` (their state's keys, the source's included) and, when
    the meaning of their state changes, ``VERSION``.
    """

    NAME: ClassVar[str]
    KEYS: ClassVar[tuple[str, ...]]
    VERSION: ClassVar[int] = 1

    def __iter__(self) -> Stage[T]:
        return self

    def __next__(self) -> T:
        return self.next()

    @abstractmethod
    def next(self) -> T:
        """The next item; raises ``StopIteration`` once the pass is over."""

    def reset(self, state: Mapping[str, Any] | None = None) -> None:
        """Back to where ``state`` (of this stage, checked first) was saved; with None, on to
        the start of the next pass: the source's next pass (a shard plan's next order). A stage
        of one pass per epoch raises :class:`~mmproxy.errors.StateError` for None."""
        if state is None:
            self._next_pass()
        else:
            self._load(self._unpack(state))

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The state now: a plain dict of the ``KEYS`` and the version (:meth:`_pack`)."""

    @abstractmethod
    def remaining(self, state: Mapping[str, Any]) -> Sequence[Any]:
        """The work items a state of this stage has left (per source, above the mixer)."""

    @abstractmethod
    def _load(self, state: Mapping[str, Any]) -> None:
        """:meth:`reset` to ``state``, a state of this stage's version with exactly its keys."""

    def _next_pass(self) -> None:
        """:meth:`reset` without a state: by default there is no next pass (the epoch's chain
        is built again for the next epoch)."""
        raise StateError(f"the {self.NAME} has one pass per epoch: reset it to a state, or "
                         "build the next epoch's chain")

    def _pack(self, **values: Any) -> dict[str, Any]:
        """The state with this stage's version; ``values`` are exactly its ``KEYS``."""
        if set(values) != set(self.KEYS):
            raise AssertionError(f"{self.NAME}: state keys {sorted(values)} are not {self.KEYS}")
        return {VERSION_KEY: self.VERSION, **values}

    @classmethod
    def _unpack(cls, state: Any) -> Mapping[str, Any]:
        """``state`` once checked: a mapping of this stage's version with exactly its keys."""
        if not isinstance(state, Mapping):
            raise StateError(f"the {cls.NAME} state is a {type(state).__name__}, not a dict")
        if state.get(VERSION_KEY) != cls.VERSION:
            raise StateError(f"the {cls.NAME} state is of version {state.get(VERSION_KEY)!r}; "
                             f"this code reads version {cls.VERSION}")
        unknown = sorted(set(state) - {VERSION_KEY, *cls.KEYS})
        missing = sorted(set(cls.KEYS) - set(state))
        if unknown or missing:
            raise StateError(f"the {cls.NAME} state does not fit this dataset: unknown keys "
                             f"{unknown}, missing keys {missing}")
        return state


def generator(*key: int) -> np.random.Generator:
    """A random generator seeded by ``key`` (seed, epoch, source, rank, worker, ...): the same
    draws wherever and whenever it is made with the same key."""
    return np.random.Generator(np.random.PCG64(list(key)))


class Draws:
    """One kind of draw from a generator (``draw(rng, count)``: ``count`` values, as an array),
    made a block at a time and given one by one.

    ``draw`` must consume the generator's stream value by value, so that one call for ``count``
    values gives what ``count`` calls for one would, and leaves the generator where they would
    (true of ``rng.random(count)`` and ``rng.integers(high, size=count)``). The values are then
    those of drawing one at a time, and :attr:`state` is the generator's state after the values
    given so far, as if each had been drawn alone: a saved state resumes to the same values.
    A block costs about one draw made alone; :attr:`state` redraws the values given from the
    block's start (on a generator of its own), once per call.

    Args:
        rng: The generator.
        draw: Makes ``count`` values from a generator.
        block: Values drawn at once.
    """

    def __init__(self, rng: np.random.Generator, draw: Callable[[np.random.Generator, int], Any],
                 block: int = 1024) -> None:
        self.rng, self._draw, self._block = rng, draw, block
        self._values: list[Any] = []
        self._next = 0
        self._start: Mapping[str, Any] = {}  # the generator's state before the block

    def __call__(self) -> Any:
        """The next value."""
        if self._next == len(self._values):
            self._start = self.rng.bit_generator.state
            self._values, self._next = self._draw(self.rng, self._block).tolist(), 0
        value = self._values[self._next]
        self._next += 1
        return value

    @property
    def state(self) -> Mapping[str, Any]:
        """The generator's state after the values given so far."""
        if not self._values:
            return self.rng.bit_generator.state
        scratch = np.random.Generator(type(self.rng.bit_generator)(0))
        scratch.bit_generator.state = self._start
        if self._next:
            self._draw(scratch, self._next)
        return scratch.bit_generator.state

    @state.setter
    def state(self, state: Mapping[str, Any]) -> None:
        self.rng.bit_generator.state = state
        self._values, self._next = [], 0

    def settle(self) -> np.random.Generator:
        """The generator, where the values given so far leave it (the rest of the block
        dropped): for a draw of another kind from it."""
        if self._values:
            self.state = self.state
        return self.rng


def pack_addresses(addresses: Sequence[tuple[int, str, int]]) -> tuple[list[str], list[tuple]]:
    """``(source, shard, index)`` addresses as a shard table and ``(source, shard number,
    index)`` triples: each shard name is stored once."""
    ids: dict[str, int] = {}
    for _, url, _ in addresses:
        ids.setdefault(url, len(ids))
    return list(ids), [(source, ids[url], index) for source, url, index in addresses]


def unpack_addresses(urls: Sequence[str], packed: Sequence[Sequence[int]]
                     ) -> list[tuple[int, str, int]]:
    """The addresses :func:`pack_addresses` packed."""
    return [(int(source), urls[u], int(index)) for source, u, index in packed]
