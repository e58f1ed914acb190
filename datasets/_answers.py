"""Answers: what one GET of a remote shard gives (a :class:`Response`) or raises
(:class:`Transient`, :class:`Permanent`), and what the HTTP and S3 GETs share: the range and ETag
checks, a stdlib body's reads, failures in words."""

from __future__ import annotations

import http.client
import re
import socket
from typing import Any, Protocol

__all__ = ["Permanent", "Response", "StdlibBody", "Transient", "changed", "content_range",
           "in_words", "no_answer", "retried"]

_RETRY_HTTP = frozenset({408, 425, 429})  # statuses worth a retry (besides 5xx)
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class Transient(Exception):
    """A failure worth a retry."""


class Permanent(Exception):
    """A failure no retry mends."""


class Response(Protocol):
    """An open GET: the shard's total size (None when the server does not say), its ETag, and
    the body from the offset asked for."""

    size: int | None
    etag: str | None

    def readinto(self, buffer: memoryview) -> int: ...

    def close(self) -> None: ...


def retried(status: int) -> bool:
    """Whether an HTTP status is worth a retry (a 5xx, a timeout, too early, too many)."""
    return status in _RETRY_HTTP or status >= 500


def no_answer(timeout: float) -> str:
    """The words for a server that took the connection but sent no answer within ``timeout``."""
    return f"no answer within {timeout:g} s: the server takes connections but does not answer"


def changed(etag: str | None, now: str | None) -> None:
    """Raises :class:`Permanent` when the shard's ETag is no longer the one first read."""
    if etag is not None and now is not None and now != etag:
        raise Permanent("the shard changed on the server while it was read")


def content_range(value: str | None, start: int) -> int | None:
    """The total size from a ``Content-Range`` answer to ``bytes=start-``."""
    match = _RANGE.fullmatch((value or "").strip())
    if match is None or int(match[1]) != start:
        raise Transient(f"the server answered a range request with Content-Range {value!r}")
    return None if match[3] == "*" else int(match[3])


class StdlibBody:
    """The body of an ``http.client`` (or urllib) response, its failures as :class:`Transient`."""

    _resp: Any

    def readinto(self, buffer: memoryview) -> int:
        try:
            return self._resp.readinto(buffer)
        except (OSError, http.client.HTTPException, ValueError) as err:
            raise Transient(in_words(err)) from None


def in_words(err: object) -> str:
    """A socket or ``http.client`` failure in words, never quoting the request (a signed URL)."""
    if isinstance(err, (TimeoutError, socket.timeout)):
        return "read timed out (stalled server: no byte within the read timeout)"
    if isinstance(err, http.client.IncompleteRead):
        partial = err.partial if isinstance(err.partial, int) else len(err.partial)
        return f"connection cut after {partial} more bytes"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    if isinstance(err, http.client.HTTPException):  # its text may quote the request (a signed URL)
        return f"bad answer ({type(err).__name__})"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
