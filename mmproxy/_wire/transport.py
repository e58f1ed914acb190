"""Transport: how a batch of inputs travels from a DataLoader worker to a server.

Payloads that already live in a mapped file (the members of a local shard, see
:func:`register_file_mapping`) are not copied at all: the worker sends the shard's descriptor
along with the memfd and only the members' offsets; the server maps the shard read-only (one
mapping per shard, kept for later batches) and DALI reads the page cache directly
(:mod:`mmproxy._wire.mappings` holds both sides' mappings).
docs/internals.md, ``mmproxy._wire.transport``, has the rest.
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import struct
import threading
import warnings
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmproxy._context import run_skips
from mmproxy._wire import layout as _layout
from mmproxy._wire import mappings as _mappings
from mmproxy._wire import sockdir as _sockdir
from mmproxy.errors import TransportError

_IOV_MAX = 1024
_MAGIC = b"MMPX"
_MAX_FDS = 1 + _mappings.MAX_FILES


@dataclass
class Request:
    """One run's inputs, as the server receives them."""

    run_id: str
    tag: tuple[str, int] | None
    keys: list[Any]  # SampleId or None per sample
    inputs: list[list[np.ndarray]]  # per pipeline input, one array per sample (views of the
    # memfd's or a shard's mapping: they keep the mapping alive until the run is done)
    skip: bool = False  # the run's error policy: a failing sample is dropped, not raised


def release_file_mapping(mapping: mmap.mmap) -> None:
    """Stops sending bytes of ``mapping`` by reference (its registry entry and descriptor go, so
    a memfd's memory is freed once nothing else maps it); views sent later are copied."""
    _mappings.files.remove(mapping)


def register_file_mapping(mapping: mmap.mmap, fd: int) -> None:
    """Lets this process send bytes inside ``mapping`` (a read-only map of the file ``fd``) by
    reference; ``fd`` is duplicated, so the caller may close its own."""
    _mappings.files.add(mapping, fd)


def pack(run_id: str, tag: tuple[str, int] | None, keys: list[Any],
         inputs: list[list[np.ndarray]]) -> tuple[int, list[int]]:
    """Writes a run's inputs into a new memfd: the header (the run, its keys as columns, where
    each array lies: :mod:`mmproxy._wire.layout`), then the payloads that are not sent by reference.

    Returns the memfd (the caller closes it) and the descriptors of registered files whose bytes
    are sent by reference (owned by the registry: send them, do not close them).
    """
    with _mappings.files.lock:
        placed, payloads, files, identities = _layout.place(inputs, _mappings.files)
    header = pickle.dumps((run_id, tag, run_skips(keys), _layout.key_columns(keys), placed,
                           identities.tobytes()), protocol=pickle.HIGHEST_PROTOCOL)
    base = _layout.align(12 + len(header))
    buffers = [_MAGIC + struct.pack("<Q", len(header)), header, bytes(base - 12 - len(header)),
               *_layout.padded(payloads)]
    fd = os.memfd_create("mmproxy", os.MFD_CLOEXEC)
    try:
        total = base + sum(_layout.align(a.nbytes) for a in payloads)
        written = 0
        for i in range(0, len(buffers), _IOV_MAX):
            written += os.writev(fd, buffers[i:i + _IOV_MAX])
        if written != total:
            raise TransportError(f"short write to shared memory: {written} of {total} bytes")
    except BaseException:
        os.close(fd)
        raise
    return fd, files


# A run's memfd up to this size (its header, and payloads not sent by reference) is read into
# memory; a larger one is mapped.
_READ_MAX = 256 << 10


def unpack(fds: list[int]) -> Request:
    """Maps a memfd written by :func:`pack` (and the files it references); returns views of the
    payloads and the keys as they were packed. The caller closes ``fds``."""
    size = os.fstat(fds[0]).st_size
    mm: bytes | mmap.mmap
    if size <= _READ_MAX:  # read, not mapped: no map and unmap (which interrupts every core
        mm = os.pread(fds[0], size, 0)  # running this process's threads) for each run
        if len(mm) != size:
            raise TransportError(f"short read from shared memory: {len(mm)} of {size} bytes")
    else:
        mm = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
    if mm[:4] != _MAGIC:
        raise TransportError("received a buffer that mmproxy did not write")
    (hlen,) = struct.unpack_from("<Q", mm, 4)
    run_id, tag, skip, keys, placed, identities = pickle.loads(mm[12:12 + hlen])
    base = _layout.align(12 + hlen)
    sent = np.frombuffer(identities, np.uint64).tolist()
    if len(sent) != 4 * (len(fds) - 1):
        raise TransportError(f"a batch's header names {len(sent) // 4} files, {len(fds) - 1} "
                             "were sent")
    files = [_mappings.server_mapping(fd, tuple(sent[4 * i:4 * i + 4]))  # type: ignore[arg-type]
             for i, fd in enumerate(fds[1:])]
    inputs = [_layout.arrays(p, mm, base, files) for p in placed]
    if isinstance(keys, _layout.KeyColumns):
        keys = keys.keys(bool(skip))
    if any(len(arrays) != len(keys) for arrays in inputs):
        raise TransportError(f"a batch's header has {len(keys)} keys for inputs of "
                             f"{sorted({len(a) for a in inputs})} samples")
    return Request(run_id, tag, keys, inputs, bool(skip))


def close_all(fds: list[int]) -> None:
    """Closes a batch's descriptors, a system call for each range of consecutive numbers (a
    shuffled run brings dozens, mostly numbered in a row), not one each: every system call lets
    another thread take the interpreter."""
    if not fds:
        return
    numbers = sorted(fds)
    first = previous = numbers[0]
    for fd in numbers[1:] + [-1]:
        if fd == previous + 1:
            previous = fd
            continue
        if previous == first:
            os.close(first)
        else:
            os.closerange(first, previous + 1)
        first = previous = fd


def address(server_uid: str) -> str:
    """The socket address of server ``server_uid``: a file in its private folder."""
    return _sockdir.path(server_uid)


# Room for the descriptors of one batch and the sender's credentials (struct ucred).
_ANCILLARY = socket.CMSG_SPACE(_MAX_FDS * 4) + socket.CMSG_SPACE(struct.calcsize("iII"))


class Listener:
    """The server's end: a Unix datagram socket that receives memfd descriptors, in a private
    folder made for it (and removed with it).

    Raises:
        FileExistsError: The socket's folder exists already.
        OSError: No socket can be made.
    """

    def __init__(self, address: str, server_name: str) -> None:
        self.address = address
        self.server_name = server_name
        self._uid = os.getuid()
        self._warned = False
        _sockdir.make(address)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self._sock.bind(address)
        except BaseException:
            self._sock.close()
            _sockdir.remove(address)
            raise
        self._sock.settimeout(0.05)

    def receive(self) -> list[int] | None:
        """Returns the descriptors of one batch (memfd first), or None after a short timeout
        or when the datagram came from another user's process."""
        try:
            _, ancillary, flags, _ = self._sock.recvmsg(16, _ANCILLARY)
        except (TimeoutError, BlockingIOError):
            return None
        fds: list[int] = []
        uid = None
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array("i", data[:len(data) - len(data) % 4]))
            elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                _, uid, _ = struct.unpack_from("iII", data)
        if uid != self._uid:
            for fd in fds:
                os.close(fd)
            if not self._warned:
                self._warned = True
                warnings.warn(f"server {self.server_name!r}: dropped a datagram sent by user id "
                              f"{uid}, not this process's user ({self._uid}); later ones are "
                              "dropped silently", RuntimeWarning, stacklevel=2)
            return None
        if flags & socket.MSG_CTRUNC or not fds:
            for fd in fds:
                os.close(fd)
            raise TransportError("a worker's inputs arrived without their buffers "
                                 "(is the main process out of file descriptors?)")
        return fds

    def close(self) -> None:
        """Closes the socket and removes its folder (idempotent)."""
        self._sock.close()
        _sockdir.remove(self.address)

    def forget(self) -> None:
        """In a forked child: drop the inherited descriptor (the folder stays the parent's).

        Otherwise the child would keep the socket alive after the server closes it, and sends
        after a server restart would queue into a socket that nobody reads.
        """
        self._sock.close()


_clients: dict[str, socket.socket] = {}
_clients_pid = 0
_clients_lock = threading.Lock()


def send(path: str, fds: list[int], server_name: str) -> None:
    """Sends a batch's descriptors to the server at address ``path`` (one socket per process and
    server)."""
    global _clients_pid
    with _clients_lock:
        if _clients_pid != os.getpid():  # a forked child must not share its parent's sockets
            _clients.clear()
            _clients_pid = os.getpid()
        for attempt in (0, 1):
            sock = _clients.get(path)
            try:
                if sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    sock.connect(path)
                    _clients[path] = sock
                socket.send_fds(sock, [_MAGIC], fds)
                return
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError,
                    BrokenPipeError) as err:
                _clients.pop(path, None)
                if sock is not None:
                    sock.close()
                if attempt:
                    raise TransportError(
                        f"server {server_name!r} is not accepting inputs (not started, stopped or "
                        f"failed): {err}") from err
