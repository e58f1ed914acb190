"""GET: one GET of a remote shard from a byte offset, its failures sorted, for any scheme.

:func:`open_source` returns a :class:`Response` whose ``readinto`` writes the body into the
caller's buffer. Every failure is raised as :class:`Transient` (worth a retry: a reset or cut
connection, a read timeout, a 5xx or throttling answer) or :class:`Permanent` (a missing shard,
refused credentials, a shard that changed on the server); the retrying belongs to the caller
(:mod:`mmproxy.datasets.remote`). Texts of both name no URL (the caller adds the shard's redacted
URL) and never hold a credential. docs/internals.md, ``mmproxy.datasets.remote._get``, has the rest.
"""

from __future__ import annotations

from collections.abc import Mapping

from mmproxy.datasets.remote._answers import Permanent, Response, Transient
from mmproxy.datasets.remote._http import HttpBody
from mmproxy.datasets.remote._objects import ObjectBody, prepare_stores
from mmproxy.datasets.remote._stores import SCHEMES as STORES

__all__ = ["STORES", "Permanent", "Response", "Transient", "open_source", "prepare_stores"]


def open_source(url: str, start: int, etag: str | None, read_timeout: float,
                connect_timeout: float, headers: Mapping[str, str]) -> Response:
    """GETs ``url`` from byte ``start``; with ``etag``, refuses a shard that has changed since;
    ``headers`` go with an ``http(s)://`` GET to the shard's host."""
    if url.partition("://")[0].lower() in STORES:
        return ObjectBody(url, start, etag, read_timeout, connect_timeout)
    return HttpBody(url, start, etag, read_timeout, connect_timeout, headers)
