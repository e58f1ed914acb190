"""NVDEC's backlog, published by the server's clip decoder and read by the workers' clip draws.

``video_pipeline(decoder="mixed", cpu_share="auto")`` balances the clips between the NVDEC
engines and the workers' cores by load instead of by a fixed share. The server's
:class:`~mmproxy.pipelines._nvdec.ClipDecoder` writes how many seconds of NVDEC work wait in its
queue (clips queued times the decode threads' recent time a clip, over the threads); a worker's
:class:`~mmproxy.pipelines._clip_draw.ClipDraw` decodes a clip itself with PyAV when that wait is
longer than its own recent time to decode a clip, and sends it to NVDEC otherwise::

    server: ClipDecoder ── seconds of NVDEC work queued ──> [one page of shared memory]
    worker: ClipDraw reads it per clip: wait > my PyAV time a clip ? decode here : send to NVDEC

The page is an anonymous memory file (``memfd``) of the server process; a worker opens it as
``/proc/<server pid>/fd/<fd>`` (any start method; nothing to clean up in ``/dev/shm``), once per
process. One writer, one aligned 8-byte value: a reader sees an old value or a new one, never a
torn one. A worker that cannot open the page (the server is gone) reads a wait of 0: every clip
goes to NVDEC, as with ``decoder="nvdec"``.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["Backlog"]

_SIZE = 4096


class Backlog:
    """Seconds of NVDEC work waiting in the server: written by the server, read by workers.

    Made in the server process; pickles as where to find the page, so every worker reads the
    server's value.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.fd = os.memfd_create("mmproxy-nvdec-backlog", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, _SIZE)
        weakref.finalize(self, _close, self.fd, self.pid)  # the page goes with the last reference
        self._owner = True
        self._view: np.ndarray | None = None
        self._view_pid = -1
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"pid": self.pid, "fd": self.fd}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.pid, self.fd = state["pid"], state["fd"]
        self._owner = False
        self._view, self._view_pid = None, -1
        self._lock = threading.Lock()

    def _values(self) -> np.ndarray | None:
        """The page as float64 values, mapped once per process; None where it cannot be opened."""
        if self._view_pid == os.getpid():
            return self._view
        with self._lock:
            if self._view_pid != os.getpid():
                self._view, self._view_pid = self._map(), os.getpid()
        return self._view

    def _map(self) -> np.ndarray | None:
        mine = self._owner and os.getpid() == self.pid  # the server's own page: it writes
        if mine:
            fd = self.fd
        else:
            try:
                fd = os.open(f"/proc/{self.pid}/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None  # the server's process is gone
        try:
            page = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED,
                             mmap.PROT_READ | (mmap.PROT_WRITE if mine else 0))
        finally:
            if not mine:
                os.close(fd)
        return np.frombuffer(page, np.float64, count=1)

    def seconds(self) -> float:
        """The seconds of NVDEC work queued in the server (0 where the page cannot be read)."""
        values = self._values()
        return float(values[0]) if values is not None else 0.0

    def publish(self, seconds: float) -> None:
        """Sets the seconds of NVDEC work queued (the server's clip decoder only)."""
        values = self._values()
        if values is None or not values.flags.writeable:
            raise RuntimeError("only the server process that made the backlog page writes it")
        values[0] = seconds


def _close(fd: int, pid: int) -> None:
    """Closes the server's descriptor of the page, in the server's process only (a forked child's
    copy of the number may name another file of the child's by then)."""
    if os.getpid() == pid:
        os.close(fd)
