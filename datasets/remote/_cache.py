"""Node cache: remote shards kept in a local folder, shared by every process of a node.

Layout of ``cache_dir``: finished shards as ``<sha256 of the URL and its store>-<file name>``,
downloads in progress under ``.partial/`` with the same name, and one empty ``.lock`` file.
Locks are Linux open-file-description byte-range locks on ``.lock`` (``F_OFD_SETLK``): byte 0
guards the space accounting, and each shard has its own byte (from its name's hash), so any
number of shards need one file and a lock dies with the process that held it.
docs/internals.md, ``mmproxy.datasets.remote._cache``, has the rest.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path

__all__ = ["Finish", "NodeCache", "reserve", "unusable"]

log = logging.getLogger("mmproxy.datasets.remote")  # the remote shards' logger

_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux
_SPACE = 0  # the lock byte of the space accounting


class NodeCache:
    """The cache in ``folder``, holding at most ``bound`` bytes (None: leave 5% of the disk free).

    Args:
        folder: The cache folder (made if missing); one per node, shared by every process.
        bound: The most bytes its shards (finished and partial) may take.
    """

    def __init__(self, folder: str | os.PathLike[str], bound: int | None) -> None:
        self.folder = Path(folder)
        self.partial = self.folder / ".partial"
        self.partial.mkdir(parents=True, exist_ok=True)
        self.lock_path = self.folder / ".lock"
        self.lock_path.touch(exist_ok=True)
        self.bound = bound

    def name(self, url: str, origin: str = "") -> str:
        """The shard's file name in the cache: from its URL and ``origin``, what else names the
        store it comes from (an object store's endpoint or account)."""
        tail = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[-80:]
        named = f"{origin}\n{url}" if origin else url
        return hashlib.sha256(named.encode()).hexdigest()[:32] + "-" + tail

    def lookup(self, name: str) -> int | None:
        """A read-only descriptor of the finished shard ``name`` (marked as just used), or None."""
        path = self.folder / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        return fd

    def lock(self, name: str) -> int:
        """Takes the shard's lock, waiting while another process holds it; returns the lock's
        descriptor (give it to :meth:`unlock`)."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            _lock(fd, _byte(name), wait=True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def unlock(self, fd: int) -> None:
        """Releases a lock from :meth:`lock` (closing its descriptor releases it)."""
        os.close(fd)

    def reserve(self, name: str, size: int) -> int | None:
        """Makes room for ``size`` bytes and creates the shard's part file with its blocks
        allocated; returns its descriptor, or None when the shard does not fit (or the disk is
        full). Hold the shard's lock."""
        part = self.partial / name
        with self._space():
            used = 0
            finished: list[tuple[float, int, Path]] = []
            for entry in os.scandir(self.folder):
                if entry.is_file(follow_symlinks=False) and not entry.name.startswith("."):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat()
                        finished.append((st.st_mtime, st.st_size, Path(entry.path)))
                        used += st.st_size
            for entry in os.scandir(self.partial):
                if entry.name != name and not self._held(entry.name):
                    _unlink(Path(entry.path))  # a crashed writer's part
                    continue
                with contextlib.suppress(FileNotFoundError):
                    used += entry.stat().st_size if entry.name != name else 0
            bound = self.bound if self.bound is not None else self._free_bound(used)
            finished.sort()
            while finished and used + size > bound:
                _, freed, path = finished.pop(0)
                _unlink(path)
                used -= freed
            if used + size > bound:
                return None
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:
                os.close(fd)
                _unlink(part)
                return None
            return fd

    def commit(self, name: str) -> None:
        """Moves the finished part into place (atomically: readers see all of it or nothing)."""
        os.rename(self.partial / name, self.folder / name)

    def abandon(self, name: str) -> None:
        """Deletes the part of a download that failed."""
        _unlink(self.partial / name)

    def _free_bound(self, used: int) -> int:
        st = os.statvfs(self.folder)
        return used + st.f_bavail * st.f_frsize - st.f_blocks * st.f_frsize // 20

    def _held(self, name: str) -> bool:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            _lock(fd, _byte(name), wait=False)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _space(self) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CLOEXEC)
        try:
            _lock(fd, _SPACE, wait=True)
            yield
        finally:
            os.close(fd)


def _byte(name: str) -> int:
    """The shard's lock byte: from its name's hash, never the space lock's."""
    return 1 + int(name[:15], 16)


def _lock(fd: int, byte: int, *, wait: bool) -> None:
    command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, command, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    except OSError as err:
        if err.errno in (11, 13):  # EAGAIN / EACCES: held by another
            raise BlockingIOError(err.errno, "locked") from None
        raise


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def reserve(cache: NodeCache, name: str, size: int | None, shown: str) -> int | None:
    """The part file of shard ``name`` (``shown``: its redacted URL) in the cache, or None when
    it does not go there (no size known; too big, or the disk full: a warning; the folder not
    writable: a warning, once). Hold the shard's lock."""
    if size is None:
        return None
    try:
        fd = cache.reserve(name, size)
    except OSError as err:
        unusable(str(cache.folder), err)
        return None
    if fd is None:
        bound = (f"cache_bytes={cache.bound}" if cache.bound is not None else
                 "no cache_bytes given: the cache keeps 5% of the disk free")
        log.warning("shard %s (%s bytes) does not fit in the cache %s (%s; or the disk is "
                    "full): read without it", shown, size, cache.folder, bound)
    return fd


_warned: set[str] = set()  # cache folders this process said it cannot use


def unusable(folder: str, err: OSError) -> None:
    """Says once per process and folder that the cache cannot be used, and why."""
    if folder not in _warned:
        _warned.add(folder)
        why = f"{err.strerror} ({err.filename})" if err.strerror and err.filename else str(err)
        log.warning("the shard cache %s cannot be used (%s): shards are streamed without it "
                    "(set RemoteOptions(cache_dir=...) or MMPROXY_CACHE_DIR to a folder this "
                    "process can write, or none)", folder, why)


class Finish:
    """What a cached download does at its end: commit (or abandon) the part, release the lock.

    Args:
        cache: The cache.
        name: The shard's name in it.
        lock: The shard's lock (:meth:`NodeCache.lock`), released at the end.
    """

    def __init__(self, cache: NodeCache, name: str, lock: int) -> None:
        self.cache, self.name, self.lock = cache, name, lock

    def __call__(self, ok: bool) -> None:
        try:
            if ok:
                self.cache.commit(self.name)
            else:
                self.cache.abandon(self.name)
        finally:
            self.cache.unlock(self.lock)
