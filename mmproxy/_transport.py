"""Transport: how a batch of inputs travels from a DataLoader worker to a server.

The worker writes the batch (a small pickled header, then every payload, 64-byte aligned) into an
anonymous ``memfd`` with one ``writev`` call, sends the file descriptor over the server's Unix
datagram socket (``SCM_RIGHTS``) and closes its copy. The server maps the memfd and hands DALI
numpy views into the mapping, so payloads are never pickled and never copied in the main process.

Lifetime: a memfd has no name, so nothing appears in ``/dev/shm`` and nothing can leak there. Its
memory is freed when the last holder lets go: the worker closes its descriptor after sending, the
kernel holds it while in flight (and frees it if the socket closes first), and the server keeps
the mapping until the pipeline run that reads it has produced its outputs, so DALI's ``no_copy``
never reads recycled memory. The socket lives in a private ``0700`` directory.
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmproxy.errors import TransportError

_ALIGN = 64
_IOV_MAX = 1024
_MAGIC = b"MMPX"


@dataclass
class Request:
    """One run's inputs, as the server receives them."""

    run_id: str
    tag: tuple[str, int] | None
    keys: list[str | None]
    inputs: list[list[np.ndarray]]  # per pipeline input, one array per sample
    hold: Any = None  # keeps the mapping alive until the run is done


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack(run_id: str, tag: tuple[str, int] | None, keys: list[str | None],
         inputs: list[list[np.ndarray]]) -> int:
    """Writes a run's inputs into a new memfd and returns its descriptor (caller closes it)."""
    layout = []
    payloads: list[np.ndarray] = []
    offset = 0
    for arrays in inputs:
        shapes, offsets = [], []
        dtype = arrays[0].dtype.str if arrays else "|u1"
        for a in arrays:
            if a.dtype.str != dtype:
                raise TransportError(f"all samples of one input must share a dtype: {dtype} vs {a.dtype.str}")
            a = np.ascontiguousarray(a)
            shapes.append(a.shape)
            offsets.append(offset)
            payloads.append(a)
            offset = _align(offset + a.nbytes)
        layout.append((dtype, shapes, offsets))
    header = pickle.dumps((run_id, tag, keys, layout), protocol=pickle.HIGHEST_PROTOCOL)
    base = _align(12 + len(header))
    buffers: list[Any] = [_MAGIC + struct.pack("<Q", len(header)), header, bytes(base - 12 - len(header))]
    position = 0
    for a in payloads:
        if a.nbytes:
            buffers.append(a.reshape(-1).view(np.uint8))
        position += a.nbytes
        pad = _align(position) - position
        if pad:
            buffers.append(bytes(pad))
            position += pad
    fd = os.memfd_create("mmproxy", os.MFD_CLOEXEC)
    try:
        total = base + position
        written = 0
        for i in range(0, len(buffers), _IOV_MAX):
            written += os.writev(fd, buffers[i:i + _IOV_MAX])
        if written != total:
            raise TransportError(f"short write to shared memory: {written} of {total} bytes")
    except BaseException:
        os.close(fd)
        raise
    return fd


def unpack(fd: int) -> Request:
    """Maps a memfd written by :func:`pack` and returns views of its payloads."""
    size = os.fstat(fd).st_size
    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    if mm[:4] != _MAGIC:
        raise TransportError("received a buffer that mmproxy did not write")
    (hlen,) = struct.unpack_from("<Q", mm, 4)
    run_id, tag, keys, layout = pickle.loads(mm[12:12 + hlen])
    base = _align(12 + hlen)
    inputs = []
    for dtype, shapes, offsets in layout:
        dt = np.dtype(dtype)
        inputs.append([np.ndarray(shape, dt, buffer=mm, offset=base + off)
                       for shape, off in zip(shapes, offsets)])
    return Request(run_id, tag, keys, inputs, hold=mm)


class Listener:
    """The server's end: a Unix datagram socket that receives memfd descriptors."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.settimeout(0.05)

    def receive(self) -> int | None:
        """Returns a received descriptor, or None after a short timeout."""
        try:
            _, fds, flags, _ = socket.recv_fds(self._sock, 16, 1)
        except (TimeoutError, BlockingIOError):
            return None
        if flags & socket.MSG_CTRUNC or not fds:
            for fd in fds:
                os.close(fd)
            raise TransportError("a worker's inputs arrived without their buffer "
                                 "(is the main process out of file descriptors?)")
        return fds[0]

    def close(self) -> None:
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def forget(self) -> None:
        """In a forked child: drop the inherited descriptor (the path stays the parent's).

        Otherwise the child would keep the socket alive after the server closes it, and sends
        after a server restart would queue into a socket that nobody reads.
        """
        self._sock.close()


_clients: dict[str, socket.socket] = {}
_clients_pid = 0
_clients_lock = threading.Lock()


def send(path: str, fd: int, server_name: str) -> None:
    """Sends a memfd to the server listening at ``path`` (one socket per process and server)."""
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
                socket.send_fds(sock, [_MAGIC], [fd])
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
