"""S3: one GET of an ``s3://`` shard, and listing a prefix, through boto3's configuration.

boto3 takes its endpoint, region and credentials from the standard AWS environment variables and
config files (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION``, ``AWS_PROFILE``, ...). boto3's own retries are off: one retry policy, the
caller's (:mod:`mmproxy.datasets.remote`), covers the request and the body alike.
docs/internals.md, ``mmproxy.datasets.remote._s3``, has the rest.
"""

from __future__ import annotations

import fnmatch
import http.client
import socket
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from mmproxy.datasets._compressed import SUFFIXES
from mmproxy.datasets.remote._answers import (
    Permanent,
    Response,
    StdlibBody,
    Transient,
    changed,
    content_range,
    in_words,
    no_answer,
    retried,
    tls_refusal,
)
from mmproxy.datasets.remote._s3_clients import clients, s3_client, tls_trust

__all__ = ["list_s3", "s3_get"]

_RETRY_S3 = frozenset({"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException",
                       "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable"})


def _bucket_key(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    key = parts.path.lstrip("/")
    if not parts.netloc or not key:
        raise Permanent("an S3 shard URL is s3://BUCKET/KEY")
    return parts.netloc, key


def list_s3(url: str, timeout: float) -> tuple[list[str], int]:
    """The shards an ``s3://`` prefix or glob names, sorted, and how many objects the listing
    saw: for ``s3://BUCKET/PREFIX/`` (or ``s3://BUCKET``) its ``.tar``, ``.tar.gz`` and ``.tgz``
    objects (not those under deeper prefixes, as a local folder's shards), for a glob the keys it
    matches (``*``, ``?`` and ``[...]`` within one level of ``/``, as :mod:`glob` does). Raises
    :class:`Permanent` when S3 refuses the listing."""
    client = s3_client(timeout)  # Permanent without boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, pattern = url[5:].partition("/")  # not urlsplit: "?" is a wildcard here
    patterns = ([pattern + "*" + suffix for suffix in SUFFIXES]
                if not pattern or pattern.endswith("/") else [pattern])
    pattern = patterns[0]  # the same up to the wildcard as the others
    wild = min((i for i, c in enumerate(pattern) if c in "*?["), default=len(pattern))
    deep = "/" in pattern[wild:]  # a pattern with levels below its first wildcard
    ask = {"Bucket": bucket, "Prefix": pattern[:wild], **({} if deep else {"Delimiter": "/"})}
    try:
        keys = [item["Key"] for page in client.get_paginator("list_objects_v2").paginate(**ask)
                for item in page.get("Contents", [])]
    except ClientError as err:
        raise Permanent(_answer(err)[2]) from None
    except BotoCoreError as err:
        raise Permanent(f"{type(err).__name__}: {err}") from None
    every = [p.split("/") for p in patterns]
    return [f"s3://{bucket}/{key}" for key in sorted(keys)
            if any(len(key.split("/")) == len(levels)
                   and all(map(fnmatch.fnmatchcase, key.split("/"), levels)) for levels in every)
            ], len(keys)


def _answer(err: Any) -> tuple[str, int, str]:
    """A botocore ``ClientError``'s S3 code, HTTP status and text."""
    error = err.response.get("Error", {})
    code = str(error.get("Code", "?"))
    status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    text = f"S3 {code} (HTTP {status}): {error.get('Message', '')}".rstrip(": ")
    return code, status, text


def s3_get(url: str, start: int, etag: str | None, read_timeout: float,
        connect_timeout: float) -> Response:
    """A GET of an S3 shard: presigned when it can, else boto3's (module docstring)."""
    bucket, key = _bucket_key(url)
    # boto3 has one read timeout, for the answer and the body alike: the shorter one, so that
    # a server that does not answer is told apart as fast as on the presigned path
    client = s3_client(connect_timeout)
    where = (client.meta.endpoint_url, bucket)
    if where not in clients.slow and not _proxied(client.meta.endpoint_url):
        try:
            return _PresignedBody(client, bucket, key, start, etag, read_timeout,
                                  connect_timeout)
        except _AskBoto3 as ask:
            if ask.bucket:
                clients.slow.add(where)
    return _S3Body(client, bucket, key, start, etag)


def _proxied(endpoint: str) -> bool:
    """Whether a proxy from the environment applies to ``endpoint`` (boto3 then sends)."""
    proxies = urllib.request.getproxies()
    parts = urlsplit(endpoint)
    return parts.scheme in proxies and not urllib.request.proxy_bypass(parts.hostname or "")


class _AskBoto3(Exception):
    """A presigned GET's answer that boto3 should handle (and word); ``bucket``: one that holds
    for the whole bucket (a redirect, a refusal), so that its next GETs go to boto3 at once."""

    def __init__(self, bucket: bool = False) -> None:
        super().__init__()
        self.bucket = bucket


_BUCKET_ANSWERS = frozenset({301, 307, 400, 403})  # another region, refused credentials


class _PresignedBody(StdlibBody):
    """A GET of a URL presigned by boto3 (valid 15 minutes, used at once) over a kept-alive
    ``http.client`` connection of this process."""

    def __init__(self, client: Any, bucket: str, key: str, start: int, etag: str | None,
                 read_timeout: float, connect_timeout: float) -> None:
        try:  # credentials, parameters, CA bundle: boto3's own call then fails and words it
            url = urlsplit(client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=900))
            context = (clients.ssl_context(clients.session()) if url.scheme == "https"
                       else None)
        except Exception:  # noqa: BLE001
            raise _AskBoto3 from None
        headers = {"User-Agent": "mmproxy", "Accept-Encoding": "identity"}
        if start:
            headers["Range"] = f"bytes={start}-"
        if etag is not None:
            headers["If-Match"] = etag
        self._where = (url.scheme, url.netloc)
        target = f"{url.path}?{url.query}"
        while True:
            conn, reused = clients.connection(*self._where, context, connect_timeout)
            try:
                if conn.sock is None:
                    try:
                        conn.connect()
                    except TimeoutError:
                        raise Transient(f"cannot connect within {connect_timeout:g} s") from None
                sock = conn.sock  # the response keeps it when the connection lets go of it
                sock.settimeout(connect_timeout)  # until the answer's headers are in
                conn.request("GET", target, headers=headers)
                try:
                    self._resp = conn.getresponse()
                except TimeoutError:
                    conn.close()
                    raise Transient(no_answer(connect_timeout)) from None
                sock.settimeout(read_timeout)
                break
            except (OSError, http.client.HTTPException) as err:
                conn.close()
                if reused and not isinstance(err, (TimeoutError, socket.timeout)):
                    continue  # an idle connection that died before answering: a fresh one
                raise (_tls_refusal(err, f"{url.scheme}://{url.netloc}")
                       or Transient(in_words(err))) from None
        self._conn: http.client.HTTPConnection | None = conn
        status = self._resp.status
        if status not in (200, 206):
            self._drop()
            if retried(status):
                raise Transient(f"HTTP {status} {self._resp.reason}".rstrip())
            raise _AskBoto3(bucket=status in _BUCKET_ANSWERS)
        try:
            self.etag = self._resp.getheader("ETag")
            changed(etag, self.etag)
            if status == 206:
                self.size = content_range(self._resp.getheader("Content-Range"), start)
            elif start:  # a range asked for and ignored: boto3 then
                raise _AskBoto3
            else:
                length = self._resp.getheader("Content-Length")
                self.size = int(length) if length is not None else None
        except BaseException:
            self._drop()
            raise

    def _drop(self) -> None:
        self._resp.close()
        if self._conn is not None:
            self._conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None  # closed once: a connection is pooled at most once
        if conn is None:
            return
        resp = self._resp
        if resp.isclosed() and not resp.will_close and (resp.chunked or resp.length == 0):
            clients.give_back(*self._where, conn)  # its body read to the end: reuse it
        else:
            resp.close()
            conn.close()


def _tls_refusal(err: BaseException, endpoint: str) -> Permanent | None:
    """A TLS failure no retry mends, in words that name the endpoint and AWS_CA_BUNDLE."""
    return tls_refusal(err, f"the S3 endpoint {endpoint}", tls_trust)


class _S3Body:
    def __init__(self, client: Any, bucket: str, key: str, start: int,
                 etag: str | None) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        ask: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if start:
            ask["Range"] = f"bytes={start}-"
        if etag is not None:
            ask["IfMatch"] = etag
        try:
            answer = client.get_object(**ask)
        except ClientError as err:
            code, status, text = _answer(err)
            if status == 412:
                raise Permanent("the shard changed on the server while it was read") from None
            if status >= 500 or status == 429 or code in _RETRY_S3:
                raise Transient(text) from None
            raise Permanent(text) from None
        except BotoCoreError as err:
            raise (_tls_refusal(err, client.meta.endpoint_url) or self._sorted(err)) from None
        self._body = answer["Body"]
        self.etag = answer.get("ETag")
        changed(etag, self.etag)
        self.size = (int(answer["ContentLength"]) if not start
                     else content_range(answer.get("ContentRange"), start))

    def _sorted(self, err: Exception) -> Exception:
        """A botocore error as Transient (network) or Permanent (configuration, checksum)."""
        from botocore.exceptions import HTTPClientError, IncompleteReadError

        text = f"{type(err).__name__}: {err}"
        if isinstance(err, (HTTPClientError, IncompleteReadError, OSError)):
            return Transient(text)
        return Permanent(text)

    def readinto(self, buffer: memoryview) -> int:
        from botocore.exceptions import BotoCoreError

        try:
            return int(self._body.readinto(buffer))
        except (BotoCoreError, OSError) as err:
            raise self._sorted(err) from None
        except Exception as err:  # noqa: BLE001 - urllib3's own errors, should any slip through
            raise Transient(f"{type(err).__name__}: {err}") from None

    def close(self) -> None:
        self._body.close()
