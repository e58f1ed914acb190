"""Remote shards: ``http(s)://`` and ``s3://`` shards streamed into memory (or the node cache)
and read like local ones: zero copy, members yielded as their bytes arrive.

From the socket to DALI, in a DataLoader worker (or the main process with ``num_workers=0``)::

    GET (urllib / boto3) -> download thread: readinto() a shared mapping of
      - an anonymous memfd sized to the shard, or
      - the node cache's part file (renamed into place when complete)
    worker's thread: tar headers parsed from the same mapping, waiting for each member's last
      byte -> samples whose fields are memoryviews of the mapping (no copy)
    proxy -> transport: the mapping is registered (``mmproxy.worker.register_file_mapping``), so
      the server gets the memfd / file descriptor and offsets and maps the same pages

The body lands once, in the mapping, straight from the socket (``readinto``); nothing is copied
after that on the worker side. Bytes are published to the reader read by read (64 KB first, then
twice as much each time up to 1 MB), so a sample is ready as soon as the read holding its last
byte is in, not the whole shard.
A cached shard is read like a local file. The download runs at network speed in its own thread
(so a shard finishes for the cache even if the reader stops early), and the reader waits only
for the bytes it needs.

Retries: a reset or cut connection, a stall (no byte for ``read_timeout`` seconds), a 5xx or
throttling answer is retried ``retries`` times with exponential backoff (``backoff`` seconds,
doubling, with jitter), resuming where the bytes stopped (a ``Range`` request, checked against
the shard's ETag); the count starts again after every answer that brings bytes. After the last
one, or at once for a missing shard or refused credentials, :class:`RemoteError` names the reason;
:class:`~mmproxy.datasets.MultiModalDataset` records it in ``__skipped__`` (skip mode) or raises
:class:`~mmproxy.errors.ShardError` with the URL (raise mode). URLs in messages and logs are
:func:`redact`-ed, and S3 credentials come only from the AWS environment and config files.

Memory: a streamed (uncached) shard is anonymous shared memory until the worker and the server
let go of its mapping (the transport keeps the last few mappings of each); with large shards,
set a ``cache_dir`` so that shards live in the page cache, which the kernel can reclaim.
"""

from __future__ import annotations

import logging
import mmap
import os
import random
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from mmproxy import worker

from ._cache import NodeCache
from ._sources import Permanent, Response, Transient, open_source, prepare_s3

__all__ = ["RemoteError", "RemoteOptions", "RemoteShard", "is_remote", "open_remote", "prepare",
           "redact"]

SCHEMES = ("http", "https", "s3")
_FIRST_CHUNK = 64 << 10  # the first read of a body; each next one is twice as big, up to:
_CHUNK = 1 << 20
_MAX_BACKOFF = 30.0
_SECRET_PARAM = re.compile(r"sig|token|credential|secret|password|key", re.I)
log = logging.getLogger(__name__)


def _env_bytes() -> int | None:
    text = os.environ.get("MMPROXY_CACHE_BYTES", "").strip().upper()
    if not text:
        return None
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:].rstrip("B"))
    try:
        return int(float(text.rstrip("B").rstrip("KMGT")) * (scale or 1))
    except ValueError:
        raise ValueError(f"MMPROXY_CACHE_BYTES={text!r} is not a size like 500G") from None


@dataclass(frozen=True)
class RemoteOptions:
    """How remote shards are read.

    Args:
        cache_dir: The node-local shard cache (one folder per node, shared by all its processes);
            default: the ``MMPROXY_CACHE_DIR`` environment variable; None: no cache.
        cache_bytes: The cache's size bound; default: ``MMPROXY_CACHE_BYTES`` (like ``500G``);
            None: leave 5% of the disk free.
        retries: Retries after a failure (a fresh count after every answer that brings bytes).
        backoff: Seconds before the first retry; doubles on each (at most 30 s), with jitter.
        read_timeout: Seconds without a byte before a connection counts as stalled.
        connect_timeout: Seconds to connect (S3; HTTP uses ``read_timeout`` for both).
    """

    cache_dir: str | None = field(default_factory=lambda: os.environ.get("MMPROXY_CACHE_DIR") or None)
    cache_bytes: int | None = field(default_factory=_env_bytes)
    retries: int = 5
    backoff: float = 0.5
    read_timeout: float = 60.0
    connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff < 0 or self.read_timeout <= 0 or self.connect_timeout <= 0:
            raise ValueError(f"retries and backoff must be >= 0, timeouts > 0: {self}")
        if self.cache_bytes is not None and self.cache_bytes <= 0:
            raise ValueError(f"cache_bytes must be positive, got {self.cache_bytes}")


class RemoteError(OSError):
    """A remote shard that cannot be read (missing, refused, or still failing after the retries)."""


def is_remote(url: str) -> bool:
    """Whether ``url`` is an ``http://``, ``https://`` or ``s3://`` shard."""
    return url.split("://", 1)[0].lower() in SCHEMES and "://" in url


def prepare(urls: list[str]) -> None:
    """Readies this process for ``urls`` before DataLoader workers fork from it: with ``s3://``
    shards, boto3 is loaded with the S3 model and the credentials (ImportError without boto3)."""
    if any(url[:5].lower() == "s3://" for url in urls):
        prepare_s3()


def redact(url: str) -> str:
    """``url`` fit for messages and logs: no user info, no signature or token in the query."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    query = urlencode([(k, "***" if _SECRET_PARAM.search(k) else v)
                       for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


class RemoteShard:
    """An open remote shard: ``view`` (read-only, the whole shard) fills while ``wait(end)``
    blocks until bytes ``[0, end)`` are there (raising :class:`RemoteError` if they never come).

    Pass ``members`` (a sequence over the same bytes that waits as it is sliced) to a tar parser.
    """

    def __init__(self, view: memoryview, download: _Download | None = None) -> None:
        self.view = view
        self._download = download
        self.members = _Waiting(view, self.wait) if download else view

    def wait(self, end: int) -> None:
        if self._download is not None:
            self._download.wait(end)

    def close(self) -> None:
        """Stops an uncached download; a cached one runs on to fill the cache."""
        if self._download is not None:
            self._download.detach()


@contextmanager
def open_remote(url: str, options: RemoteOptions) -> Iterator[RemoteShard]:
    """Opens a remote shard for reading (see the module docstring); the mapping is registered
    with the transport, so its members travel to servers by reference."""
    if not is_remote(url):
        raise ValueError(f"not a remote shard URL: {redact(url)}")
    if urlsplit(url).username is not None:
        raise RemoteError("credentials do not belong in shard URLs (they would show in logs): "
                          "use the AWS environment or config files for S3, a signed URL for HTTP")
    shard = _open(url, options)
    try:
        yield shard
    finally:
        shard.close()


def _open(url: str, options: RemoteOptions) -> RemoteShard:
    if options.cache_dir is None:
        return _stream(url, options, None, "")
    cache = NodeCache(options.cache_dir, options.cache_bytes)
    name = cache.name(url)
    fd = cache.lookup(name)
    if fd is None:
        lock = cache.lock(name)  # waits while another process downloads this shard
        try:
            fd = cache.lookup(name)
        except BaseException:
            cache.unlock(lock)
            raise
        if fd is None:
            return _stream(url, options, cache, name, lock)  # which owns the lock from here
        cache.unlock(lock)
    return RemoteShard(_map_readonly(fd))


def _map_readonly(fd: int) -> memoryview:
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise RemoteError("the shard is empty")
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        worker.register_file_mapping(mapping, fd)
    finally:
        os.close(fd)
    return memoryview(mapping)


def _stream(url: str, options: RemoteOptions, cache: NodeCache | None, name: str,
            lock: int | None = None) -> RemoteShard:
    """Starts the download into a cache part (when it fits; ``lock`` is the shard's) or a memfd;
    returns once the shard's size is known."""
    attempts = _Attempts(url, options)
    response: Response | None = None
    fd: int | None = None
    try:
        response = attempts.connect(0, None)
        size = response.size
        if size == 0:
            raise RemoteError("the shard is empty")
        if cache is not None and lock is not None:
            fd = cache.reserve(name, size) if size is not None else None
            if fd is None:  # it does not fit: stream it past the cache
                log.warning("shard %s (%s bytes) does not fit in the cache %s (cache_bytes=%s, "
                            "or the disk is full): read without it", redact(url), size,
                            cache.folder, cache.bound)
                cache.unlock(lock)
                lock = None
        if fd is None:
            fd = os.memfd_create("mmproxy-shard", os.MFD_CLOEXEC)
        if size is None:  # no length given: the whole body first, then the mapping
            _Download(url, attempts, response, None, fd).run()
            response = None
            own, fd = fd, None
            return RemoteShard(_map_readonly(own))
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
        worker.register_file_mapping(mapping, fd)
    except BaseException:
        if response is not None:
            response.close()
        if lock is not None and cache is not None:
            cache.abandon(name)
            cache.unlock(lock)
        raise
    finally:
        if fd is not None:
            os.close(fd)
    done = _Finish(cache, name, lock) if cache is not None and lock is not None else None
    download = _Download(url, attempts, response, memoryview(mapping), None, done)
    download.start()
    return RemoteShard(memoryview(mapping).toreadonly(), download)


class _Finish:
    """What a cached download does at its end: commit (or abandon) the part, release the lock."""

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


class _Attempts:
    """The retry policy of one shard: a count of failures since the last progress, backoff."""

    def __init__(self, url: str, options: RemoteOptions) -> None:
        self.url, self.options = url, options
        self.failures = 0
        self.stopped = threading.Event()
        self.etag: str | None = None

    def connect(self, start: int, size: int | None) -> Response:
        """A response from byte ``start`` of the shard, retrying as the policy allows."""
        while True:
            try:
                response = open_source(self.url, start, self.etag, self.options.read_timeout,
                                       self.options.connect_timeout)
            except Transient as err:
                self.failed(err)
                continue
            except Permanent as err:
                raise RemoteError(str(err)) from None
            if size is not None and response.size not in (None, size):
                response.close()
                raise RemoteError(f"the shard changed on the server while it was read (size "
                                  f"{size}, now {response.size})")
            if self.etag is None:
                self.etag = response.etag
            return response

    def failed(self, err: Transient) -> None:
        """Counts a failure: sleeps before the next attempt, or raises after the last."""
        self.failures += 1
        if self.failures > self.options.retries:
            raise RemoteError(f"{err} (gave up after {self.failures} attempts)") from None
        delay = min(self.options.backoff * 2 ** (self.failures - 1), _MAX_BACKOFF)
        delay *= random.uniform(0.5, 1.0)
        log.warning("shard %s: %s; retry %d of %d in %.2f s", redact(self.url), err,
                    self.failures, self.options.retries, delay)
        if self.stopped.wait(delay):
            raise _Stopped


class _Stopped(Exception):
    """The reader let go of an uncached shard: its download ends."""


class _Download:
    """Fills ``view`` (or, with no size known, appends to ``fd``) from the response, resuming
    after failures; readers ``wait`` for the bytes they need."""

    def __init__(self, url: str, attempts: _Attempts, response: Response,
                 view: memoryview | None, fd: int | None = None,
                 done: Callable[[bool], None] | None = None) -> None:
        self.url, self.attempts, self.response = url, attempts, response
        self.view, self.fd, self.done = view, fd, done
        self.size = response.size
        self.written = 0
        self.error: BaseException | None = None
        self.finished = False
        self.changed = threading.Condition()

    def start(self) -> None:
        threading.Thread(target=self.run, name="mmproxy-download", daemon=True).start()

    def run(self) -> None:
        ok = False
        try:
            self._fill()
            ok = True
        except _Stopped:
            pass
        except BaseException as err:  # noqa: BLE001 - handed to the reader
            self.error = err
        finally:
            self.response.close()
            if self.done is not None:
                try:
                    self.done(ok)
                except OSError as err:
                    self.error = self.error or RemoteError(f"cannot finish the cached copy: {err}")
            with self.changed:
                self.finished = True
                self.changed.notify_all()
        if self.error is not None and self.view is None:
            raise self.error

    def _fill(self) -> None:
        scratch = memoryview(bytearray(_CHUNK)) if self.view is None else None
        chunk = _FIRST_CHUNK
        while self.size is None or self.written < self.size:
            if scratch is not None:
                buffer = scratch
            else:
                buffer = self.view[self.written:self.written + chunk]  # type: ignore[index]
                chunk = min(2 * chunk, _CHUNK)
            try:
                n = self.response.readinto(buffer)
                if n == 0:
                    if self.size is None:
                        return
                    raise Transient(f"the connection closed at byte {self.written} of {self.size}")
            except Transient as err:
                self.response.close()
                self.attempts.failed(err)
                self.response = self.attempts.connect(self.written, self.size)
                continue
            if self.fd is not None and scratch is not None:
                os.write(self.fd, scratch[:n])
            self.attempts.failures = 0
            with self.changed:
                self.written += n
                self.changed.notify_all()
            if self.attempts.stopped.is_set():
                raise _Stopped

    def wait(self, end: int) -> None:
        """Blocks until bytes ``[0, end)`` are written (to the end: and the download is
        finished, its cached copy in place); raises the download's error if they never will be."""
        last = self.size is not None and end >= self.size
        if self.written >= end and not last:
            return
        with self.changed:
            while (self.written < end or last) and not self.finished:
                self.changed.wait()
        if self.written < end:
            if self.error is not None:
                raise self.error
            raise RemoteError(f"the shard ended at byte {self.written}, before byte {end}")

    def detach(self) -> None:
        """The reader is done: an uncached download stops, a cached one completes."""
        if self.done is None:
            self.attempts.stopped.set()


class _Waiting:
    """A read-only sequence over a filling shard: slicing waits for the slice's bytes."""

    def __init__(self, view: memoryview, wait: Callable[[int], None]) -> None:
        self._view, self._wait = view, wait

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, item: slice) -> memoryview:
        self._wait(min(item.stop, len(self._view)))
        return self._view[item]
