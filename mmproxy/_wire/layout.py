"""Layout: where a run's arrays lie and whose samples they are, as a few numpy columns.
docs/internals.md, ``mmproxy._wire.layout``, has the rest.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmproxy._context import SampleId
from mmproxy._wire.mappings import FileMappings
from mmproxy.errors import TransportError

ALIGN = 64
_SEED_LIMIT = 2**64


def _pointer_reader() -> Callable[[np.ndarray], int] | None:
    """A fast reader of an array's data address, or None. ``a.__array_interface__`` builds a dict
    (about 3 us an array: a fifth of a worker's cost of sending a JPEG); numpy's C structure
    holds the address in the field after the object header, read here through ctypes (0.2 us).
    Where that field is not found (another interpreter or numpy), None: the interface is used."""
    probes = [np.zeros(n, np.uint8)[1:] for n in (16, 4096)]  # views: their address is not the base's
    read = ctypes.c_void_p.from_address
    for offset in range(8, 65, 8):
        if all(read(id(p) + offset).value == p.__array_interface__["data"][0] for p in probes):
            return lambda a: read(id(a) + offset).value or 0
    return None


_POINTER = _pointer_reader()


def _addresses(arrays: list[np.ndarray]) -> np.ndarray:
    """Each array's data address (0 for one that owns its memory: it lies in no file); the fast
    reader for plain arrays, the interface for the others."""
    read = _POINTER
    return np.array([0 if a.base is None else read(a) if read and type(a) is np.ndarray
                     else a.__array_interface__["data"][0] for a in arrays], np.uint64).view(np.int64)


def align(n: int) -> int:
    """``n`` rounded up to the payload alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Placed:
    """One input's arrays, one entry per sample in each column.

    Attributes:
        dtype: The dtype of every array (``dtype.str``, byte order included).
        files: int64: the index of the file holding the bytes in the request's file table, or -1
            for the memfd's payload area.
        offsets: int64: where the bytes start in that file, or in the payload area.
        nbytes: int64: how many bytes.
        shapes: None when every array is 1-D (its length is ``nbytes`` / the item size); an
            int64 ``[samples, ndim]`` array when all have one other ndim; else each shape.
    """

    dtype: str
    files: np.ndarray
    offsets: np.ndarray
    nbytes: np.ndarray
    shapes: np.ndarray | list[tuple[int, ...]] | None

    def __reduce__(self) -> tuple[Any, ...]:
        # the columns as bytes: pickling an array costs more than the rest of the header
        shapes: Any = self.shapes
        if isinstance(shapes, np.ndarray):
            shapes = (shapes.shape[1], _raw(shapes))
        return (_placed, (self.dtype, _raw(self.files), _raw(self.offsets), _raw(self.nbytes),
                          shapes))


def _raw(column: np.ndarray) -> bytes:
    return np.ascontiguousarray(column, np.int64).tobytes()


def _column(raw: bytes) -> np.ndarray:
    if len(raw) % 8:
        raise TransportError("a batch's header has a column cut short")
    return np.frombuffer(raw, np.int64)


def _placed(dtype: str, files: bytes, offsets: bytes, nbytes: bytes, shapes: Any) -> Placed:
    where = _column(files)
    if isinstance(shapes, tuple):
        ndim, raw = shapes
        if len(raw) != 8 * ndim * len(where):
            raise TransportError("a batch's header has a column cut short")
        shapes = _column(raw).reshape(len(where), ndim)
    return Placed(dtype, where, _column(offsets), _column(nbytes), shapes)


def place(inputs: list[list[np.ndarray]], registry: FileMappings
          ) -> tuple[list[Placed], list[np.ndarray], list[int], np.ndarray]:
    """Where each input's arrays will lie: ``(placed, payloads, fds, identities)``.

    Arrays inside a file of ``registry`` (which the caller holds locked) are sent by reference
    (``fds``: the request's file table, descriptors the registry owns, and ``identities``: a row
    of four uint64 a file, :func:`mmproxy._wire.mappings.identity`); the others are copied,
    in order, into the payload area (``payloads``: C-contiguous, each at an aligned offset).
    Only views are looked for in the files (an array that owns its memory is in none), all of
    an input's at once.

    Raises:
        TransportError: The samples of one input do not share a dtype.
    """
    starts, ends, fds, identities = registry.table()
    present = np.zeros(len(starts), bool)  # the registry's files this run references
    prepared: list[tuple[list[np.ndarray], str, np.ndarray, np.ndarray, np.ndarray, Any]] = []
    for arrays in inputs:
        dtype = _dtype(arrays)
        arrays = [a if a.flags.c_contiguous else np.asarray(a, order="C") for a in arrays]
        nbytes = np.array([a.nbytes for a in arrays], np.int64)
        address = _addresses(arrays)
        entry = np.searchsorted(starts, address, side="right") - 1
        if len(starts):
            inside = (entry >= 0) & (nbytes > 0) & (address != 0) & (address + nbytes <= ends[entry])
            present[entry[inside]] = True
        else:
            inside = np.zeros(len(arrays), bool)
        offsets = np.where(inside, address - starts[entry] if len(starts) else 0, 0)
        prepared.append((arrays, dtype, entry, inside, offsets, nbytes))
    table = np.cumsum(present) - 1  # a registry entry's index in the request's file table
    placed: list[Placed] = []
    payloads: list[np.ndarray] = []
    position = 0
    for arrays, dtype, entry, inside, offsets, nbytes in prepared:
        files = np.where(inside, table[entry] if len(starts) else -1, -1)
        if not inside.all():
            copied = np.flatnonzero(~inside)
            room = (nbytes[copied] + ALIGN - 1) // ALIGN * ALIGN
            offsets[copied] = position + np.cumsum(room) - room
            position += int(room.sum())
            payloads.extend([arrays[i] for i in copied.tolist()])
        placed.append(Placed(dtype, files, offsets, nbytes, _shapes([a.shape for a in arrays])))
    return placed, payloads, fds[present].tolist(), identities[present]


def _dtype(arrays: list[np.ndarray]) -> str:
    kinds = {a.dtype for a in arrays}
    if not kinds:
        return "|u1"
    names = sorted({k.str for k in kinds})
    if len(names) > 1:
        raise TransportError(f"all samples of one input must share a dtype: {' vs '.join(names)}")
    return names[0]


def _shapes(shapes: list[tuple[int, ...]]) -> np.ndarray | list[tuple[int, ...]] | None:
    ndims = {len(s) for s in shapes}
    if ndims <= {1}:
        return None
    if len(ndims) > 1:
        return shapes
    return np.array(shapes, np.int64).reshape(len(shapes), ndims.pop())


def padded(payloads: list[np.ndarray]) -> list[Any]:
    """The buffers that write ``payloads`` where :func:`place` put them: each array, then the
    zeros up to the next aligned offset."""
    buffers: list[Any] = []
    for a in payloads:
        n = a.nbytes
        if n:
            buffers.append(a)
        if n % ALIGN:
            buffers.append(_PADS[ALIGN - n % ALIGN])
    return buffers


_PADS = tuple(bytes(n) for n in range(ALIGN))


def arrays(placed: Placed, memfd: bytes | mmap.mmap, base: int, files: list[mmap.mmap]) -> list[np.ndarray]:
    """The arrays of one input, as views of the memfd's payload area (its bytes read, or its
    mapping; from byte ``base``) and of the request's files.

    Raises:
        TransportError: The layout does not fit the buffers (a header mmproxy did not write).
    """
    dtype = np.dtype(placed.dtype)
    n = len(placed.files)
    if len(placed.offsets) != n or len(placed.nbytes) != n or (
            placed.shapes is not None and len(placed.shapes) != n):
        raise TransportError("a batch's header has columns of different lengths")
    if n and (placed.files.max() >= len(files) or placed.files.min() < -1):
        raise TransportError(f"a batch's header names file {int(placed.files.max())} of "
                             f"{len(files)} sent")
    buffers = [memfd, *files]
    sizes = np.array([len(memfd) - base, *(len(f) for f in files)], np.int64)
    starts = np.where(placed.files < 0, base + placed.offsets, placed.offsets)
    ends = placed.offsets + placed.nbytes
    if n and ((placed.offsets < 0).any() or (placed.nbytes % dtype.itemsize).any()
              or (ends > sizes[placed.files + 1]).any()):
        raise TransportError("a batch's header places arrays outside the buffers sent")
    which = (placed.files + 1).tolist()
    if placed.shapes is None:
        flat = [np.frombuffer(b, np.uint8) for b in buffers]
        views = [flat[w][s:e] for w, s, e in zip(which, starts.tolist(), (starts + placed.nbytes).tolist())]
        return views if dtype == np.uint8 else [v.view(dtype) for v in views]
    shapes = placed.shapes.tolist() if isinstance(placed.shapes, np.ndarray) else placed.shapes
    return [np.ndarray(tuple(shape), dtype, buffer=buffers[w], offset=s)
            for w, s, shape in zip(which, starts.tolist(), shapes)]


@dataclass(frozen=True)
class KeyColumns:
    """The keys of a run's samples (:class:`~mmproxy._context.SampleId`), as columns.

    Attributes:
        names: Each sample's key.
        shards: The shards named (each once), and ``shard``, int64: each sample's index in it.
        seeds: uint64: each sample's seed, where ``seeded`` (bool) says it has one.

    The skip flag is the run's, sent once beside the columns (keys of one run share it).
    """

    names: list[str]
    shards: list[str | None]
    shard: np.ndarray
    seeds: np.ndarray
    seeded: np.ndarray

    def __reduce__(self) -> tuple[Any, ...]:
        return (_key_columns, (self.names, self.shards, _raw(self.shard), self.seeds.tobytes(),
                               self.seeded.tobytes()))

    def keys(self, skip: bool) -> list[SampleId]:
        """The keys, as they were packed, with the run's skip flag."""
        shards = self.shards
        n = len(self.names)
        if not len(self.shard) == len(self.seeds) == len(self.seeded) == n or (
                n and not 0 <= int(self.shard.min()) <= int(self.shard.max()) < len(shards)):
            raise TransportError("a batch's header has key columns that do not match")
        seeds = self.seeds.tolist()
        if not self.seeded.all():
            seeds = [s if k else None for s, k in zip(seeds, self.seeded.tolist())]
        # tuples made in C (a named tuple's own constructor is Python, called once a key)
        return list(map(_new_key, zip(self.names, map(shards.__getitem__, self.shard.tolist()),
                                      itertools.repeat(skip), seeds)))


_new_key = functools.partial(tuple.__new__, SampleId)  # no field count check: the zip gives 4
assert len(SampleId._fields) == 4


def _key_columns(names: list[str], shards: list[str | None], shard: bytes, seeds: bytes,
                 seeded: bytes) -> KeyColumns:
    if len(seeds) % 8:
        raise TransportError("a batch's header has a column cut short")
    return KeyColumns(names, shards, _column(shard), np.frombuffer(seeds, np.uint64),
                      np.frombuffer(seeded, bool))


_NONE = type(None)


def key_columns(keys: list[Any]) -> KeyColumns | list[Any]:
    """``keys`` as columns when each is a :class:`~mmproxy._context.SampleId` whose fields the
    columns keep exactly (a ``str`` key, a ``str`` or None shard, one ``bool`` flag for all, an
    ``int`` seed in ``[0, 2**64)`` or None); otherwise the list itself, which is pickled as it
    is."""
    if not keys or set(map(type, keys)) != {SampleId}:
        return keys
    names, shards, skips, seeds = zip(*keys)
    if (set(map(type, names)) != {str} or not set(map(type, shards)) <= {str, _NONE}
            or set(skips) not in ({True}, {False}) or set(map(type, skips)) != {bool}
            or not set(map(type, seeds)) <= {int, _NONE}):
        return keys
    seeded = [s is not None for s in seeds] if None in seeds else [True] * len(seeds)
    numbers = [s if s is not None else 0 for s in seeds] if None in seeds else seeds
    if min(numbers) < 0 or max(numbers) >= _SEED_LIMIT:
        return keys
    table = {s: i for i, s in enumerate(dict.fromkeys(shards))}
    return KeyColumns(list(names), list(table), np.array(list(map(table.__getitem__, shards)),
                                                         np.int64),
                      np.array(numbers, np.uint64), np.array(seeded, bool))
