"""Pinned shards: the server's mappings of local shards page-locked for the GPU.

DALI copies each sample's bytes to the GPU (the audio path's PCM, the encoded JPEGs nvJPEG
decodes). From pageable memory, such a copy goes through the driver's staging buffers: the CPU
copies every byte once more and the transfer runs at a fraction of the bus's speed. Once a
shard's mapping is registered with CUDA (``cudaHostRegister``, read-only), the same copies run
as DMA straight from the page cache, with no CPU work.

A GPU server turns this on for its process (:func:`enable`); from then on
:func:`mmproxy._mappings.server_mapping` maps each new local shard through :func:`pinned_map`,
while the pinned bytes stay under a budget: a quarter of the machine's memory, or
``MMPROXY_PINNED_BYTES`` (0 turns pinning off). A mapping the driver refuses (no read-only
registration on this system, or the budget spent) is used as it is, unpinned; the first refusal
of the driver is reported once and ends pinning in the process.

A pinned mapping is a numpy array over an owner object; when the last view of it goes (the
server's cache lets go of its least recently used shard, and no run holds a view of it), the
owner unregisters it, then unmaps it, in that order. A copy from it cannot still be in flight
then: every run since it was last used went through the cache's other mappings first. A forked
child unmaps the mappings it inherited without touching CUDA.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import warnings
from typing import Any

import numpy as np

__all__ = ["enable", "enabled", "pinned_bytes", "pinned_map"]

_REGISTER_FLAGS = 0x01 | 0x08  # cudaHostRegisterPortable | cudaHostRegisterReadOnly
_lock = threading.Lock()
_device: int | None = None  # the GPU of the first GPU server; None: pinning off
_refused = False  # the driver refused once: off for good in this process
_pinned = 0  # bytes registered now
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _budget() -> int:
    text = os.environ.get("MMPROXY_PINNED_BYTES")
    if text is not None:
        try:
            return max(0, int(float(text)))
        except ValueError:
            raise ValueError(f"MMPROXY_PINNED_BYTES must be a number of bytes, got {text!r}") from None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def enable(device_id: int) -> None:
    """Pins the local shards this process maps from now on (a GPU server calls it)."""
    global _device
    with _lock:
        if _device is None and not _refused and _budget() > 0:
            _device = device_id


def enabled() -> bool:
    """Whether new shard mappings are pinned."""
    return _device is not None and not _refused


def pinned_bytes() -> int:
    """The bytes of shard mappings registered with CUDA now."""
    return _pinned


class _Mapping:
    """A read-only mapping of a whole file, registered with CUDA; unregistered (after the GPU's
    work so far) and unmapped when garbage. Exposes the bytes to numpy."""

    def __init__(self, fd: int, size: int) -> None:
        self.size, self.pid, self.registered = size, os.getpid(), False
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of a shard failed: {os.strerror(err)}")
        self.address: int = address
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "version": 3,
                                    "data": (address, True)}

    def register(self) -> bool:
        import torch

        try:
            with torch.cuda.device(_device):
                cudart = torch.cuda.cudart()
                err = cudart.cudaHostRegister(self.address, self.size, _REGISTER_FLAGS)
        except (RuntimeError, AssertionError) as e:  # no CUDA here
            _refuse(f"cannot pin shards for the GPU ({e})")
            return False
        code = int(getattr(err, "value", err))
        if code:
            cudart.cudaGetLastError()  # clear it: the next CUDA call must not see it
            _refuse(f"cudaHostRegister of a read-only shard mapping failed (CUDA error {code})")
            return False
        self.registered = True
        return True

    def __del__(self) -> None:
        global _pinned
        if self.registered and self.pid == os.getpid() and not sys.is_finalizing():
            import torch

            with torch.cuda.device(_device):
                torch.cuda.cudart().cudaHostUnregister(self.address)
            with _lock:
                _pinned -= self.size
        _libc.munmap(self.address, self.size)


def _refuse(why: str) -> None:
    global _refused
    if not _refused:
        _refused = True
        warnings.warn(f"mmproxy: {why}; shards are read from pageable memory from now on "
                      "(the GPU copies of their bytes cost CPU time)", RuntimeWarning, stacklevel=3)


def pinned_map(fd: int) -> np.ndarray | None:
    """The whole file ``fd`` mapped read-only and registered with CUDA, as a uint8 array; None
    when pinning is off, the file is empty, or the budget or the driver says no (the caller then
    maps it as usual)."""
    global _pinned
    size = os.fstat(fd).st_size
    if not enabled() or size == 0:
        return None
    with _lock:
        if _pinned + size > _budget():
            return None
        _pinned += size
    owner: Any = None
    try:
        owner = _Mapping(fd, size)
        if owner.register():
            return np.asarray(owner)
    except OSError as err:
        _refuse(str(err))
    with _lock:
        _pinned -= size
    return None
