"""GET: one GET of a remote shard (HTTP(S) or S3) from a byte offset, its failures sorted.

:func:`open_source` returns a :class:`Response` whose ``readinto`` writes the body straight into
the caller's buffer. Every failure is raised as :class:`Transient` (worth a retry: a reset or cut
connection, a read timeout, a 5xx or throttling answer) or :class:`Permanent` (a missing shard,
refused credentials, a shard that changed on the server); the retrying belongs to the caller
(:mod:`mmproxy.datasets.remote`). Texts of both name no URL (the caller adds the shard's redacted
URL) and never hold a credential.
docs/internals.md, ``mmproxy.datasets.remote._get``, has the rest.
"""

from __future__ import annotations

from mmproxy.datasets.remote._answers import Permanent, Response, Transient
from mmproxy.datasets.remote._http import HttpBody
from mmproxy.datasets.remote._s3 import list_s3, s3_get
from mmproxy.datasets.remote._s3_clients import prepare_s3

__all__ = ["Permanent", "Response", "Transient", "list_s3", "open_source", "prepare_s3"]


def open_source(url: str, start: int, etag: str | None, read_timeout: float,
                connect_timeout: float) -> Response:
    """GETs ``url`` from byte ``start``; with ``etag``, refuses a shard that has changed since."""
    if url[:5].lower() == "s3://":
        return s3_get(url, start, etag, read_timeout, connect_timeout)
    return HttpBody(url, start, etag, read_timeout, connect_timeout)
