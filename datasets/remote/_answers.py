"""Answers: what one GET of a remote shard gives (a :class:`Response`) or raises
(:class:`Transient`, :class:`Permanent`), and what the HTTP and S3 GETs share: the range and ETag
checks, a stdlib body's reads, failures in words, the TLS failures no retry mends, and texts fit
to show. docs/internals.md, ``mmproxy.datasets.remote._answers``, has the rest.
"""

from __future__ import annotations

import http.client
import re
import socket
import ssl
from collections.abc import Callable, Iterator
from typing import Any, Protocol
from urllib.parse import unquote_plus

__all__ = ["Permanent", "Response", "StdlibBody", "Transient", "changed", "content_range",
           "in_words", "masked", "no_answer", "redact", "retried", "tls_refusal"]

_RETRY_HTTP = frozenset({408, 425, 429})  # statuses worth a retry (besides 5xx)
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

# the name of a parameter or field that holds a secret: one that ends in a secret's word
_SECRET_NAME = re.compile(r"[\w.-]*?(?:signature|sig|credentials?|token|secret|password|passwd"
                          r"|auth|authorization|key|keyid)", re.I)
# a query's or fragment's name=value pair (after "?", "#", "&" or ";")
_QUERY_PAIR = re.compile(r"(?<![^?#&;])([^=?#&;]+)=([^#&;]*)")
# what a message may hold a secret in: a URL, a secret header's value, a quoted field's value,
# a name=value pair, a bearer token
_SHOWN = re.compile(r"""
    (?P<url> \b[a-z][a-z0-9+.-]*://[^\s"'<>]+ )
  | (?P<header> \b(?:(?:proxy-)?authorization|x-amz-security-token|cookie)\s*:\s* )
    [^\s"'][^\r\n"']*
  | (?P<field> (?P<open>["'])(?P<field_name>[\w.-]+)(?P=open)\s*:\s*b?(?P<quote>["']) )
    (?P<field_value> .*? )(?P=quote)
  | (?<![\w.%-])(?P<pair> (?P<pair_name>[\w.-]+)= )(?:bearer\s+)?[^\s&#"'<>,;]*
  | (?P<bearer> \bbearer\s+ )[^\s"'<>,;]+
""", re.I | re.X)


def _secret(name: str) -> bool:
    return _SECRET_NAME.fullmatch(name.strip()) is not None


def redact(url: str) -> str:
    """``url`` fit for messages and logs: its user info and the values of its query's and
    fragment's secret parameters masked (module docstring), the rest as it was (a local path,
    with no ``://``, all of it)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    cut = next((i for i, c in enumerate(rest) if c in "/?#"), len(rest))
    authority, tail = rest[:cut], rest[cut:]
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    cut = next((i for i, c in enumerate(tail) if c in "?#"), len(tail))
    query = _QUERY_PAIR.sub(lambda m: f"{m[1]}=***" if _secret(unquote_plus(m[1])) else m[0],
                            tail[cut:])
    return f"{scheme}://{authority}{tail[:cut]}{query}"


def masked(text: str) -> str:
    """``text`` (a message, another library's too) fit to show: every URL in it
    :func:`redact`-ed, and the values of secret headers, quoted fields and ``name=value`` pairs
    masked, as is every ``Bearer`` token (module docstring)."""
    return _SHOWN.sub(_shown, text)


def _shown(match: re.Match[str]) -> str:
    if match["url"]:
        return redact(match["url"])
    if match["header"]:
        return match["header"] + "***"
    if match["bearer"]:
        return match["bearer"] + "***"
    if match["field"]:
        value = "***" if _secret(match["field_name"]) else masked(match["field_value"])
        return match["field"] + value + match["quote"]
    return match["pair"] + "***" if _secret(match["pair_name"]) else match[0]


class _Failure(Exception):
    """A GET's failure; its text is :func:`masked`."""

    def __init__(self, text: str) -> None:
        super().__init__(masked(text))


class Transient(_Failure):
    """A failure worth a retry."""


class Permanent(_Failure):
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


# TLS failures a retry may mend: the connection cut or closed during the handshake, or the
# server's own error; any other failure of a handshake fails the same way again
_TLS_CUT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError, ssl.SSLWantReadError,
            ssl.SSLWantWriteError)
_TLS_SERVER_ERROR = "TLSV1_ALERT_INTERNAL_ERROR"
_MISMATCH = frozenset({62, 63, 64})  # X509_V_ERR_{HOSTNAME,EMAIL,IP_ADDRESS}_MISMATCH
_OUT_OF_DATE = frozenset({9, 10})  # X509_V_ERR_CERT_NOT_YET_VALID, X509_V_ERR_CERT_HAS_EXPIRED


def tls_refusal(err: BaseException, server: str, trust: Callable[[], str]) -> Permanent | None:
    """:class:`Permanent` for a TLS failure in ``err`` (or in what it wraps: urllib's
    errors) that no retry mends: the certificate of ``server`` (words such as "the
    server") did not verify, said with why and what to do (``trust()``: how this process is
    made to trust it, asked only then), or the handshake was refused (no TLS version or cipher
    in common, no TLS on that port). None for anything else, a cut or reset connection
    included (retried)."""
    tls = next((e for e in _wrapped(err) if isinstance(e, ssl.SSLError)), None)
    if tls is None or isinstance(tls, _TLS_CUT) or tls.reason == _TLS_SERVER_ERROR:
        return None
    if isinstance(tls, ssl.SSLCertVerificationError):
        why = str(tls.verify_message or tls.reason).rstrip(".")
        if tls.verify_code in _MISMATCH:
            fix = "the shard's URL must name a host the certificate is for"
        elif tls.verify_code in _OUT_OF_DATE:
            fix = "the server needs a certificate in date (or this machine's clock is wrong)"
        else:
            fix = trust()
        return Permanent(f"TLS: the certificate of {server} did not verify ({why}): {fix}")
    why = re.sub(r"^\[[^]]*\]\s*|\s*\(_ssl\.c:\d+\)$", "", tls.strerror or str(tls))
    if tls.reason == "WRONG_VERSION_NUMBER":
        return Permanent(f"TLS: {server} does not speak TLS on that port ({why}: an http:// "
                         "server?)")
    return Permanent(f"TLS: the handshake with {server} failed ({why})")


def _wrapped(err: BaseException) -> Iterator[BaseException]:
    """``err`` and the errors it wraps: explicit causes, an error's arguments, urllib's
    ``reason``, a ``kwargs`` dict's values; each once. Not contexts: an error raised while another
    was handled (a reconnection after a failed read) is not that error."""
    seen: set[int] = set()
    todo: list[object] = [err]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        kwargs = getattr(item, "kwargs", None)
        todo += [item.__cause__, getattr(item, "reason", None), *item.args,
                 *(kwargs.values() if isinstance(kwargs, dict) else ())]
