"""NVDEC's backlog, published by the server's clip decoder and read by the workers' clip draws.
docs/internals.md, ``mmproxy.pipelines.video._backlog``, has the rest.
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
import weakref
from typing import Any

import numpy as np

__all__ = ["Backlog", "paced"]

_SIZE = 4096
_NAME = "mmproxy-nvdec-backlog"


class Backlog:
    """Seconds of NVDEC work waiting in the server: written by the server, read by workers.

    Pickles as where to find the page, so every worker reads the value of the process that
    published last before it started.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._home()

    def _home(self) -> None:
        """A page of this process's own, mapped for writing."""
        self.pid = os.getpid()
        self.fd = os.memfd_create(_NAME, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, _SIZE)
        weakref.finalize(self, _close, self.fd, self.pid)  # the page goes with the last reference
        page = mmap.mmap(self.fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._view: np.ndarray | None = np.frombuffer(page, np.float64, count=1)
        self._view_pid = self.pid
        self._writable = True

    def __getstate__(self) -> dict[str, Any]:
        return {"pid": self.pid, "fd": self.fd}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.pid, self.fd = state["pid"], state["fd"]
        self._lock = threading.Lock()
        self._view, self._view_pid, self._writable = None, -1, False

    def _values(self) -> np.ndarray | None:
        """The page as float64 values, mapped once per process; None where it cannot be opened."""
        if self._view_pid == os.getpid():
            return self._view
        with self._lock:
            if self._view_pid != os.getpid():
                self._writable = False
                self._view, self._view_pid = self._map(), os.getpid()
        return self._view

    def _map(self) -> np.ndarray | None:
        where = f"/proc/{self.pid}/fd/{self.fd}"
        try:
            if not os.readlink(where).startswith(f"/memfd:{_NAME}"):
                raise OSError(f"{where} is no longer the backlog's page")
            fd = os.open(where, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            warnings.warn(f"decoder='mixed': this process cannot read the server's NVDEC backlog "
                          f"({err}); it sends every clip to NVDEC", RuntimeWarning, stacklevel=4)
            return None
        try:
            page = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        return np.frombuffer(page, np.float64, count=1)

    def seconds(self) -> float:
        """The seconds of NVDEC work waiting in the server (0 where the page cannot be read)."""
        values = self._values()
        return float(values[0]) if values is not None else 0.0

    def publish(self, seconds: float) -> None:
        """Sets the seconds of NVDEC work waiting (the server's clip decoder); in a process
        other than the page's, on a new page of this process's."""
        if not (self._writable and self._view_pid == os.getpid()):
            with self._lock:
                if not (self._writable and self._view_pid == os.getpid()):
                    self._home()
        assert self._view is not None
        self._view[0] = seconds


def _close(fd: int, pid: int) -> None:
    """Closes the page's descriptor, in the process that made it only (a forked child's copy of
    the number may name another file of the child's by then)."""
    if os.getpid() == pid:
        os.close(fd)


def paced(pace: float, took: float, weight: float) -> float:
    """A running time a clip after one more clip that ``took`` seconds (the first sets it)."""
    return took if pace == 0 else pace + weight * (took - pace)
