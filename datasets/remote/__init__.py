"""Remote shards: ``http(s)://``, ``s3://``, ``gs://`` and ``az://`` shards streamed into
memory (or the node cache) and read like local ones: zero copy, members yielded as they arrive.

HTTP goes through urllib, the object stores through obstore. TLS: ``https://`` servers are
verified with Python's settings (``SSL_CERT_FILE`` or ``SSL_CERT_DIR``, else the system's CA
certificates), object stores with the system's and ``AWS_CA_BUNDLE`` (S3) or ``SSL_CERT_FILE``;
a certificate that does not verify fails at once, saying which variable to set. docs/remote.md
has each scheme; docs/internals.md, ``mmproxy.datasets.remote``, the rest.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from mmproxy.datasets.remote import _stores
from mmproxy.datasets.remote._answers import redact
from mmproxy.datasets.remote._cache import Finish, NodeCache, reserve, unusable
from mmproxy.datasets.remote._download import MAX_BACKOFF, Attempts, Download, RemoteError, Waiting
from mmproxy.datasets.remote._get import STORES, Response, prepare_stores

from mmproxy import worker

__all__ = ["RemoteError", "RemoteOptions", "RemoteShard", "is_remote", "open_remote", "prepare",
           "redact"]

SCHEMES = ("http", "https", *STORES)
_BREAKS = re.compile(r"[\r\n\0]")  # what no header may hold: it would end the header


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
        read_timeout: Seconds without a byte of the body before a connection counts as stalled.
        connect_timeout: Seconds to connect, and then to get the answer's first byte (obstore,
            for ``s3://``, ``gs://`` and ``az://``, has one timeout for the answer and the body's
            reads: the shorter of the two).
        headers: Request headers of ``http(s)://`` GETs (``{"Authorization": "Bearer ..."}``),
            sent to the shard's server only, not past a redirect to another host, port or
            scheme; the Hugging Face Hub's hosts get ``Authorization: Bearer $HF_TOKEN`` over
            https (or an http ``HF_ENDPOINT``) unless given one here.
    """

    cache_dir: str | None = field(default_factory=lambda: os.environ.get("MMPROXY_CACHE_DIR") or None)
    cache_bytes: int | None = field(default_factory=_env_bytes)
    retries: int = 5
    backoff: float = 0.5
    read_timeout: float = 30.0
    connect_timeout: float = 10.0
    headers: Mapping[str, str] = field(default_factory=dict, repr=False, hash=False)

    def __post_init__(self) -> None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.headers.items()):
            raise ValueError("headers must map names to values, both str")
        for name, value in self.headers.items():  # the value is never shown: it may be a secret
            if _BREAKS.search(name) or not name.strip():
                raise ValueError(f"headers: the name {name!r} is empty or holds a CR, LF or NUL")
            if _BREAKS.search(value):
                raise ValueError(f"headers: the value of {name!r} holds a CR, LF or NUL (a "
                                 "newline read from a file?): strip it")
        object.__setattr__(self, "headers", dict(self.headers))
        if self.retries < 0 or self.backoff < 0 or self.read_timeout <= 0 or self.connect_timeout <= 0:
            raise ValueError(f"retries and backoff must be >= 0, timeouts > 0: {self}")
        if self.cache_bytes is not None and self.cache_bytes <= 0:
            raise ValueError(f"cache_bytes must be positive, got {self.cache_bytes}")

    @property
    def give_up_after(self) -> float:
        """The longest a shard's download takes to fail once its server stops answering (a
        stopped, hung or unreachable server): the read under way waits ``read_timeout``, every
        retry ``connect_timeout`` for an answer, plus the backoffs between them."""
        waits = sum(min(self.backoff * 2 ** k, MAX_BACKOFF) for k in range(self.retries))
        return self.read_timeout + self.retries * self.connect_timeout + waits


def is_remote(url: str) -> bool:
    """Whether ``url`` is an ``http://``, ``https://``, ``s3://``, ``gs://`` or ``az://`` shard."""
    return url.split("://", 1)[0].lower() in SCHEMES and "://" in url


def prepare(urls: list[str]) -> None:
    """Readies this process for ``urls`` before DataLoader workers fork from it: with
    object-store shards, obstore is imported (ImportError, with what to install, without it)."""
    schemes = [url.partition("://")[0].lower() for url in urls]
    stores = [scheme for scheme in schemes if scheme in STORES]
    if stores:
        prepare_stores(stores[0])


class RemoteShard:
    """An open remote shard: ``view`` (read-only, the whole shard) fills while ``wait(end)``
    blocks until bytes ``[0, end)`` are there (raising :class:`RemoteError` if they never come).

    Pass ``members`` (a sequence over the same bytes that waits as it is sliced) to a tar parser.
    """

    def __init__(self, view: memoryview, download: Download | None = None,
                 streamed: mmap.mmap | None = None) -> None:
        self.view = view
        self._download = download
        self._streamed = streamed  # a memfd's mapping: released when the shard is closed
        self.members = Waiting(view, self.wait) if download else view

    def wait(self, end: int) -> None:
        if self._download is not None:
            self._download.wait(end)

    def close(self) -> None:
        """Stops an uncached download (a cached one runs on to fill the cache) and releases a
        streamed shard's registration, so its memory goes with the last sample that views it."""
        if self._download is not None:
            self._download.detach()
        if self._streamed is not None:
            worker.release_file_mapping(self._streamed)
            self._streamed = None


@contextmanager
def open_remote(url: str, options: RemoteOptions) -> Iterator[RemoteShard]:
    """Opens a remote shard for reading (see the module docstring); the mapping is registered
    with the transport, so its members travel to servers by reference."""
    if not is_remote(url):
        raise ValueError(f"not a remote shard URL: {redact(url)}")
    if urlsplit(url).username is not None:
        raise RemoteError("credentials do not belong in shard URLs (they would show in logs): "
                          "use each cloud's environment or files for object stores, a signed URL "
                          "or RemoteOptions(headers=...) for HTTP")
    shard = _open(url, options)
    try:
        yield shard
    finally:
        shard.close()


def _open(url: str, options: RemoteOptions) -> RemoteShard:
    if options.cache_dir is None:
        return _stream(url, options, None, "")
    try:
        cache = NodeCache(options.cache_dir, options.cache_bytes)
        name = cache.name(url, _stores.origin(url.partition("://")[0].lower()))
        fd = cache.lookup(name)
        lock = cache.lock(name) if fd is None else None  # waits while another downloads it
    except OSError as err:  # a read-only or full folder, one not ours: the shard goes past it
        unusable(options.cache_dir, err)
        return _stream(url, options, None, "")
    if fd is None:
        assert lock is not None
        try:
            fd = cache.lookup(name)  # another process may have finished it meanwhile
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
            raise RemoteError("the shard is 0 bytes long (not a tar)")
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        worker.register_file_mapping(mapping, fd)
    finally:
        os.close(fd)
    return memoryview(mapping)


def _stream(url: str, options: RemoteOptions, cache: NodeCache | None, name: str,
            lock: int | None = None) -> RemoteShard:
    """Starts the download into a cache part (when it fits; ``lock`` is the shard's) or a memfd;
    returns once the shard's size is known."""
    attempts = Attempts(url, redact(url), options)
    response: Response | None = None
    fd: int | None = None
    try:
        response = attempts.connect(0, None)
        size = response.size
        if size == 0:
            raise RemoteError("the shard is 0 bytes long (not a tar)")
        if cache is not None and lock is not None:
            fd = reserve(cache, name, size, redact(url))
            if fd is None:  # it does not go in the cache: stream it past
                cache.unlock(lock)
                lock = None
        memfd = fd is None
        if fd is None:
            fd = os.memfd_create("mmproxy-shard", os.MFD_CLOEXEC)
        if size is None:  # no length given: the whole body first, then the mapping
            Download(url, attempts, response, None, fd).run()
            response = None
            own, fd = fd, None
            view = _map_readonly(own)  # a memfd's registration goes when the shard is closed
            return RemoteShard(view, streamed=view.obj if memfd else None)  # type: ignore[arg-type]
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
    done = Finish(cache, name, lock) if cache is not None and lock is not None else None
    download = Download(url, attempts, response, memoryview(mapping), None, done)
    download.start()
    return RemoteShard(memoryview(mapping).toreadonly(), download,
                       streamed=mapping if done is None else None)
