"""Mappings: the files whose bytes travel to a server by reference, on both sides.

In a worker, :data:`files` registers read-only mappings of files (local shards, streamed shards
in a memfd): bytes inside one are sent as the file's descriptor and an offset
(:func:`mmproxy._wire.transport.pack`), with the file's identity. In the server, :func:`server_mapping`
maps each file received once per file version and keeps the last ones, so later batches of the
same shard cost nothing: not even a system call, when the identity sent is one mapped already.
"""

from __future__ import annotations

import mmap
import os
import resource
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from mmproxy import _process

__all__ = ["KEPT_FILES", "KEPT_MEMFDS", "MAX_FILES", "FileMappings", "files", "server_mapping"]

# Shard mappings a worker keeps registered (and may reference in one batch). A shuffle buffer of
# B samples keeps each sample for B draws on average, and a few far longer: with 16 shards of 64
# samples registered and B = 256, 1 sample in 60 outlived its shard's registration and had its
# bytes copied (e^-4 of them); with 64 shards, e^-16. A local shard's registration costs two
# descriptors and no memory (a streamed shard's memfd is released when the shard is read).
MAX_FILES = 64

# A file version: device, inode, size, modification time, each as an unsigned 64-bit number
Identity = tuple[int, int, int, int]
_U64 = (1 << 64) - 1


def _address(a: Any) -> int:
    return int(np.frombuffer(a, np.uint8).__array_interface__["data"][0]) if len(a) else 0


class FileMappings:
    """This process's registered read-only file mappings, by address (most recent last).

    An entry holds the mapping and a descriptor of its file, so while registered the address
    range cannot be reused by anything else; evicted mappings live on in the samples that still
    view them, and their payloads are then copied like any other.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # start -> end, fd, mapping, the file's identity (:func:`identity`)
        self.entries: OrderedDict[int, tuple[int, int, mmap.mmap, Identity]] = OrderedDict()
        self._table = _table(self.entries)

    def add(self, mapping: mmap.mmap, fd: int) -> None:
        start = _address(mapping)
        own = os.dup(fd)
        ident = identity(own)
        with self.lock:
            if start in self.entries:
                os.close(self.entries.pop(start)[1])
            self.entries[start] = (start + len(mapping), own, mapping, ident)
            while len(self.entries) > MAX_FILES:
                os.close(self.entries.popitem(last=False)[1][1])
            self._table = _table(self.entries)

    def remove(self, mapping: mmap.mmap) -> None:
        start = _address(mapping)
        with self.lock:
            entry = self.entries.pop(start, None)
            if entry is not None:
                os.close(entry[1])
                self._table = _table(self.entries)

    def table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The registered files sorted by address: start and end addresses and descriptors
        (int64), and identities (uint64, a row each) (what :func:`mmproxy._wire.layout.place`
        searches a whole input's arrays in)."""
        return self._table

    def after_fork(self) -> None:
        # A forked child keeps the entries (its mappings and descriptors are copies), not a lock
        # some other thread of the parent may have held.
        self.lock = threading.Lock()


def _table(entries: OrderedDict[int, tuple[int, int, mmap.mmap, Identity]]
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    starts = sorted(entries)
    return (np.array(starts, np.int64), np.array([entries[s][0] for s in starts], np.int64),
            np.array([entries[s][1] for s in starts], np.int64),
            np.array([entries[s][3] for s in starts], np.uint64).reshape(len(starts), 4))


def identity(fd: int) -> Identity:
    """The version of the file open as ``fd``: what the server keeps one mapping for."""
    st = os.fstat(fd)
    return (st.st_dev & _U64, st.st_ino & _U64, st.st_size & _U64, st.st_mtime_ns & _U64)


files = FileMappings()
_process.on_fork_in_child(files.after_fork)


_mapped_files: OrderedDict[Identity, mmap.mmap] = OrderedDict()
_mapped_memfds: OrderedDict[Identity, mmap.mmap] = OrderedDict()
_mapped_lock = threading.Lock()


def _kept_files() -> int:
    """How many local files the server keeps mapped: enough for every shard a loader's workers
    have in flight (each worker's shuffle buffer spans several shards), so that no batch maps and
    unmaps a shard again; each kept mapping holds a descriptor (Python's mmap keeps a copy of
    it), so at most a quarter of the process's descriptor limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(32, min(4096, soft // 4)) if soft != resource.RLIM_INFINITY else 4096


KEPT_FILES = _kept_files()
KEPT_MEMFDS = 4  # streamed remote shards: a kept mapping would hold the shard's memory


def _mapped(key: Identity) -> mmap.mmap | None:
    with _mapped_lock:
        for cache in (_mapped_files, _mapped_memfds):
            mapping = cache.get(key)
            if mapping is not None:
                cache.move_to_end(key)
                return mapping
    return None


def server_mapping(fd: int, sent: Identity | None = None) -> mmap.mmap:
    """The server's read-only mapping of a shard, one per file version: the last
    :data:`KEPT_FILES` files kept, but only the last :data:`KEPT_MEMFDS` memfds. ``sent``: the
    identity the sender read from the same open file, looked up without a system call (each
    one lets another thread take the interpreter, and a shuffled run names dozens of shards).

    A shard mapped again for each batch costs a map, an unmap (which interrupts every core the
    process runs threads on, to flush their TLBs) and page faults in DALI's threads on first
    touch, for every shard of every batch."""
    mapping = _mapped(sent) if sent is not None else None  # the common case: no system call
    if mapping is not None:
        return mapping
    key = identity(fd)  # what the file is now, not what the header says
    mapping = _mapped(key)
    if mapping is not None:
        return mapping
    memfd = os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    cache, bound = (_mapped_memfds, KEPT_MEMFDS) if memfd else (_mapped_files, KEPT_FILES)
    with _mapped_lock:
        mapping = cache.get(key)
        if mapping is None:
            mapping = cache[key] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            while len(cache) > bound:
                cache.popitem(last=False)
    return mapping
