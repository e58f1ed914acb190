"""Download: one remote shard fetched by a thread into a mapping, with the retry policy.

:class:`Download` fills the mapping (or appends to a descriptor when the size is unknown) from a
:class:`~mmproxy.datasets.remote._get.Response`, resuming after failures as :class:`Attempts`
allows; readers :meth:`~Download.wait` for the bytes they need, and :class:`Waiting` is a view
whose slicing waits, for a tar parser. See :mod:`mmproxy.datasets.remote` for the whole path.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Protocol

from mmproxy.datasets.remote._get import Permanent, Response, Transient, open_source

__all__ = ["MAX_BACKOFF", "Attempts", "Download", "Policy", "RemoteError", "Stopped", "Waiting"]

_FIRST_CHUNK = 64 << 10  # the first read of a body; each next one is twice as big, up to:
_CHUNK = 1 << 20
MAX_BACKOFF = 30.0  # seconds: the longest wait between two attempts
DOWN_FOR = 120.0  # seconds after giving up on a server during which its next shards are not retried
log = logging.getLogger("mmproxy.datasets.remote")
# (policy, server) -> when a shard of that server was given up on (in this process): its next
# shards fail at their first failure instead of being retried, so a server that stopped answering
# costs one shard's retries, not every shard's
_down: dict[tuple[int, str], float] = {}
_down_lock = threading.Lock()


class Policy(Protocol):
    """The retry policy's settings (:class:`~mmproxy.datasets.remote.RemoteOptions` has them)."""

    @property
    def retries(self) -> int: ...

    @property
    def backoff(self) -> float: ...

    @property
    def read_timeout(self) -> float: ...

    @property
    def connect_timeout(self) -> float: ...

    @property
    def headers(self) -> Mapping[str, str]: ...


class RemoteError(OSError):
    """A remote shard that cannot be read (missing, refused, or still failing after the retries)."""



class Attempts:
    """The retry policy of one shard: a count of failures since the last progress, backoff."""

    def __init__(self, url: str, label: str, options: Policy) -> None:
        self.url, self.label, self.options = url, label, options
        self._server = (id(options), urllib.parse.urlsplit(url).netloc)
        self.failures = 0
        self.stopped = threading.Event()
        self.etag: str | None = None

    def connect(self, start: int, size: int | None) -> Response:
        """A response from byte ``start`` of the shard, retrying as the policy allows."""
        while True:
            try:
                response = open_source(self.url, start, self.etag, self.options.read_timeout,
                                       self.options.connect_timeout, self.options.headers)
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
            with _down_lock:
                _down.pop(self._server, None)  # it answers again
            return response

    def failed(self, err: Transient) -> None:
        """Counts a failure: sleeps before the next attempt, or raises after the last (at once
        when this server's last shard was given up on less than :data:`DOWN_FOR` ago)."""
        self.failures += 1
        now = time.monotonic()
        with _down_lock:
            since = now - _down.get(self._server, -DOWN_FOR)
        if since < DOWN_FOR:
            raise RemoteError(f"{err} (not retried: the server's shard before it was given up on "
                              f"{since:.0f} s ago)") from None
        if self.failures > self.options.retries:
            with _down_lock:
                _down[self._server] = now
            raise RemoteError(f"{err} (gave up after {self.failures} attempts)") from None
        delay = min(self.options.backoff * 2 ** (self.failures - 1), MAX_BACKOFF)
        delay *= random.uniform(0.5, 1.0)
        log.warning("shard %s: %s; retry %d of %d in %.2f s", self.label, err,
                    self.failures, self.options.retries, delay)
        if self.stopped.wait(delay):
            raise Stopped


class Stopped(Exception):
    """The reader let go of an uncached shard: its download ends."""


class Download:
    """Fills ``view`` (or, with no size known, appends to ``fd``) from the response, resuming
    after failures; readers ``wait`` for the bytes they need."""

    def __init__(self, url: str, attempts: Attempts, response: Response,
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
        except Stopped:
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
            except Permanent as err:  # the reader catches OSError: a RemoteError
                raise RemoteError(str(err)) from None
            if self.fd is not None and scratch is not None:
                left = scratch[:n]
                while left:  # a write may take only part of it
                    left = left[os.write(self.fd, left):]
            self.attempts.failures = 0
            with self.changed:
                self.written += n
                self.changed.notify_all()
            if self.attempts.stopped.is_set():
                raise Stopped

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


class Waiting:
    """A read-only sequence over a filling shard: slicing waits for the slice's bytes."""

    def __init__(self, view: memoryview, wait: Callable[[int], None]) -> None:
        self._view, self._wait = view, wait

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, item: slice) -> memoryview:
        self._wait(min(item.stop, len(self._view)))
        return self._view[item]
