"""Sources: one GET of a remote shard (HTTP(S) or S3) from a byte offset, its failures sorted.

:func:`open_source` returns a :class:`Response` whose ``readinto`` writes the body straight into
the caller's buffer. Every failure is raised as :class:`Transient` (worth a retry: a reset or cut
connection, a read timeout, a 5xx or throttling answer) or :class:`Permanent` (a missing shard,
refused credentials, a shard that changed on the server); the retrying belongs to the caller
(:mod:`mmproxy.datasets.remote`). Texts of both name no URL (the caller adds the shard's redacted
URL) and never hold a credential.

Two timeouts: ``connect_timeout`` for connecting and then for the answer's first byte (a server
that accepts connections but does not answer, stopped or overloaded, is told apart in seconds),
``read_timeout`` for each read of the body once it flows.

HTTP(S) goes through ``urllib`` (proxies from the environment, redirects); S3 through boto3, which
takes its endpoint, region and credentials from the standard AWS environment variables and config
files (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_DEFAULT_REGION``, ``AWS_PROFILE``, ...). boto3's own retries are off: one retry policy, the
caller's, covers the request and the body alike.

An S3 GET is signed by boto3 in the process (a presigned URL, SigV4, no request) and sent over a
kept-alive ``http.client`` connection (verified with boto3's CA bundle): boto3's
``get_object`` and its body cost ~1.6 ms of CPU per 700 KB GET against ~0.8 ms for this
(BENCHMARKS.md, "S3 on the H200"), which DataLoader workers pay per shard. Any answer but the bytes
or a retryable failure (a missing key, refused credentials, a redirect to another region, a
changed shard) is asked again through ``get_object``, so that errors, redirects and messages are
boto3's; so is every GET of a bucket that needed it once, and every GET when a proxy is set.
"""

from __future__ import annotations

import fnmatch
import http.client
import os
import re
import select
import socket
import ssl
import threading
import urllib.error
import urllib.request
from typing import Any, Protocol
from urllib.parse import urlsplit

__all__ = ["Permanent", "Response", "Transient", "list_s3", "open_source", "prepare_s3"]

_RETRY_HTTP = frozenset({408, 425, 429})
_RETRY_S3 = frozenset({"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException",
                       "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable"})
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


def open_source(url: str, start: int, etag: str | None, read_timeout: float,
                connect_timeout: float) -> Response:
    """GETs ``url`` from byte ``start``; with ``etag``, refuses a shard that has changed since."""
    if url[:5].lower() == "s3://":
        return _s3(url, start, etag, read_timeout, connect_timeout)
    return _HttpBody(url, start, etag, read_timeout, connect_timeout)


def _no_answer(timeout: float) -> str:
    return f"no answer within {timeout:g} s (the server takes connections but does not answer)"


class _BodyTimeout:
    """An ``http.client`` connection whose timeout, the connect timeout until the answer's
    headers are in, becomes ``read_timeout`` for the body."""

    read_timeout: float
    sock: Any

    def getresponse(self) -> http.client.HTTPResponse:
        sock = self.sock  # the response keeps it when the connection lets go of it
        try:
            response = super().getresponse()  # type: ignore[misc]
        except TimeoutError:
            raise _NoAnswer from None
        if sock is not None:
            sock.settimeout(self.read_timeout)
        return response


class _NoAnswer(OSError):
    """The connect timeout passed while waiting for the answer's headers."""


class _Http(_BodyTimeout, http.client.HTTPConnection):
    pass


class _Https(_BodyTimeout, http.client.HTTPSConnection):
    pass


class _Handler(urllib.request.AbstractHTTPHandler):
    """urllib's HTTP(S) handlers, with connections of :class:`_BodyTimeout`."""

    def __init__(self, read_timeout: float) -> None:
        super().__init__()
        self.read_timeout = read_timeout

    def do_open(self, http_class: Any, req: urllib.request.Request,
                **kwargs: Any) -> http.client.HTTPResponse:
        timed = _Https if issubclass(http_class, http.client.HTTPSConnection) else _Http

        def connection(*args: Any, **more: Any) -> http.client.HTTPConnection:
            conn = timed(*args, **more)
            conn.read_timeout = self.read_timeout
            return conn

        return super().do_open(connection, req, **kwargs)


class _HttpHandler(_Handler, urllib.request.HTTPHandler):
    pass


class _HttpsHandler(_Handler, urllib.request.HTTPSHandler):
    pass


def _changed(etag: str | None, now: str | None) -> None:
    if etag is not None and now is not None and now != etag:
        raise Permanent("the shard changed on the server while it was read")


def _content_range(value: str | None, start: int) -> int | None:
    """The total size from a ``Content-Range`` answer to ``bytes=start-``."""
    match = _RANGE.fullmatch((value or "").strip())
    if match is None or int(match[1]) != start:
        raise Transient(f"the server answered a range request with Content-Range {value!r}")
    return None if match[3] == "*" else int(match[3])


class _StdlibBody:
    """The body of an ``http.client`` (or urllib) response, its failures as :class:`Transient`."""

    _resp: Any

    def readinto(self, buffer: memoryview) -> int:
        try:
            return self._resp.readinto(buffer)
        except (OSError, http.client.HTTPException, ValueError) as err:
            raise Transient(_oserror(err)) from None


class _HttpBody(_StdlibBody):
    def __init__(self, url: str, start: int, etag: str | None, read_timeout: float,
                 connect_timeout: float) -> None:
        headers = {"User-Agent": "mmproxy", "Accept-Encoding": "identity"}
        if start:
            headers["Range"] = f"bytes={start}-"
        opener = urllib.request.build_opener(_HttpHandler(read_timeout),
                                             _HttpsHandler(read_timeout))
        try:
            self._resp = opener.open(urllib.request.Request(url, headers=headers),
                                     timeout=connect_timeout)
        except _NoAnswer:
            raise Transient(_no_answer(connect_timeout)) from None
        except urllib.error.HTTPError as err:
            err.close()
            text = f"HTTP {err.code} {err.reason}"
            if err.code in _RETRY_HTTP or err.code >= 500:
                raise Transient(text) from None
            raise Permanent(text) from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, (TimeoutError, socket.timeout)):  # while connecting
                raise Transient(f"cannot connect within {connect_timeout:g} s") from None
            raise Transient(_oserror(err.reason)) from None
        except (OSError, http.client.HTTPException) as err:
            raise Transient(_oserror(err)) from None
        try:
            self.etag = self._resp.headers.get("ETag")
            _changed(etag, self.etag)
            length = self._resp.headers.get("Content-Length")
            if self._resp.status == 206:
                self.size = _content_range(self._resp.headers.get("Content-Range"), start)
            else:
                self.size = int(length) if length is not None else None
                self._skip(start)  # the server ignored the range: drop what we have
        except BaseException:
            self._resp.close()
            raise

    def _skip(self, count: int) -> None:
        scratch = memoryview(bytearray(min(count, 1 << 20) or 1))
        while count:
            n = self.readinto(scratch[:min(count, len(scratch))])
            if n == 0:
                raise Transient("the connection closed before the resumed offset")
            count -= n

    def close(self) -> None:
        self._resp.close()


def _oserror(err: object) -> str:
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


# -- S3 -------------------------------------------------------------------------------------------


class _Clients:
    """This process's boto3 S3 clients, one per timeout pair and AWS environment (endpoint,
    profile, credentials), made after any fork from a session that a forked worker inherits
    from its parent when :func:`prepare_s3` ran there (its service model and credentials loaded
    once, not once per worker)."""

    def __init__(self) -> None:
        self.pid = -1
        self.lock = threading.Lock()
        self.sessions: dict[tuple[Any, ...], tuple[Any, list[str]]] = {}
        self.clients: dict[tuple[Any, ...], tuple[Any, list[str]]] = {}
        self.contexts: dict[int, ssl.SSLContext] = {}  # a session's TLS settings
        self.idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}  # kept alive
        self.slow: set[tuple[str | None, str]] = set()  # (endpoint, bucket) asked via get_object

    def session(self) -> tuple[Any, list[str]]:
        """(boto3 session of this AWS environment, secrets never to show in a message)."""
        if self.pid != os.getpid():  # connections are not shared with a forked parent
            self.pid, self.lock, self.clients, self.idle = os.getpid(), threading.Lock(), {}, {}
        env = tuple(sorted(kv for kv in os.environ.items() if kv[0].startswith("AWS_")))
        with self.lock:
            if env not in self.sessions:
                self.sessions[env] = _make_session()
            return self.sessions[env]

    def get(self, read_timeout: float, connect_timeout: float) -> tuple[Any, list[str]]:
        """(client, secrets never to show in a message)."""
        session, secrets = self.session()
        import botocore.config

        with self.lock:
            key = (id(session), read_timeout, connect_timeout)
            if key not in self.clients:
                config = botocore.config.Config(read_timeout=read_timeout,
                                                connect_timeout=connect_timeout,
                                                retries={"total_max_attempts": 1},
                                                signature_version="s3v4")
                self.clients[key] = session.client("s3", config=config)
            return self.clients[key], secrets


    def ssl_context(self, session: Any) -> ssl.SSLContext:
        """The TLS settings of presigned GETs: verified as boto3 would (its ``ca_bundle``
        setting or ``AWS_CA_BUNDLE``, else its default bundle)."""
        import botocore.httpsession
        import botocore.session

        with self.lock:
            context = self.contexts.get(id(session))
            if context is None:  # the same environment and files as the session's
                bundle = (botocore.session.get_session().get_config_variable("ca_bundle")
                          or botocore.httpsession.get_cert_path(True))
                context = self.contexts[id(session)] = ssl.create_default_context(
                    cafile=bundle if isinstance(bundle, str) else None)
            return context

    def connection(self, scheme: str, netloc: str, context: ssl.SSLContext | None,
                   timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """An idle kept-alive connection to ``netloc`` (and True), or a new one (and False;
        ``context``: its TLS settings for https)."""
        while True:
            with self.lock:
                idle = self.idle.get((scheme, netloc))
                conn = idle.pop() if idle else None
            if conn is None:
                break
            if conn.sock is not None and not select.select([conn.sock], [], [], 0)[0]:
                return conn, True
            conn.close()  # readable while idle: the server closed it (or sent junk)
        if scheme == "https":
            return http.client.HTTPSConnection(netloc, timeout=timeout, context=context), False
        return http.client.HTTPConnection(netloc, timeout=timeout), False

    def give_back(self, scheme: str, netloc: str, conn: http.client.HTTPConnection) -> None:
        with self.lock:
            idle = self.idle.setdefault((scheme, netloc), [])
            if len(idle) < 8:
                idle.append(conn)
                return
        conn.close()


def _make_session() -> tuple[Any, list[str]]:
    try:
        import boto3
    except ImportError:
        raise Permanent("s3:// shards need boto3: pip install 'mmproxy[s3]'") from None
    session = boto3.session.Session()
    credentials = session.get_credentials()
    secrets = [value for value in (os.environ.get("AWS_SECRET_ACCESS_KEY"),
                                   os.environ.get("AWS_SESSION_TOKEN")) if value]
    if credentials is not None:
        frozen = credentials.get_frozen_credentials()
        secrets += [value for value in (frozen.secret_key, frozen.token) if value]
    session.client("s3")  # loads the service model into the session's cache
    return session, secrets


def prepare_s3() -> None:
    """Loads boto3, the S3 model and the credentials in this process, so that DataLoader workers
    forked from it make their clients in milliseconds. Raises ImportError without boto3."""
    try:
        _clients.session()
    except Permanent as err:
        raise ImportError(str(err)) from None


_clients = _Clients()


def _bucket_key(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    key = parts.path.lstrip("/")
    if not parts.netloc or not key:
        raise Permanent("an S3 shard URL is s3://BUCKET/KEY")
    return parts.netloc, key


def _client(timeout: float) -> tuple[Any, list[str]]:
    """(this process's S3 client, secrets never to show); Permanent when boto3 refuses the AWS
    environment (a profile, region or endpoint) or is missing."""
    try:
        return _clients.get(timeout, timeout)
    except Permanent:
        raise
    except Exception as err:  # noqa: BLE001 - a profile, region or endpoint boto3 refuses
        secrets = [v for k, v in os.environ.items() if k.startswith("AWS_") and v
                   and ("SECRET" in k or "TOKEN" in k)]
        raise Permanent(_scrub(f"{type(err).__name__}: {err}", secrets)) from None


def list_s3(url: str, timeout: float) -> tuple[list[str], int]:
    """The shards an ``s3://`` prefix or glob names, sorted, and how many objects the listing
    saw: for ``s3://BUCKET/PREFIX/`` (or ``s3://BUCKET``) its ``.tar`` objects (not those under
    deeper prefixes, as a local folder's ``*.tar``), for a glob the keys it matches (``*``,
    ``?`` and ``[...]`` within one level of ``/``, as :mod:`glob` does). Raises
    :class:`Permanent` when S3 refuses the listing."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, pattern = url[5:].partition("/")  # not urlsplit: "?" is a wildcard here
    if not pattern or pattern.endswith("/"):
        pattern += "*.tar"
    wild = min((i for i, c in enumerate(pattern) if c in "*?["), default=len(pattern))
    deep = "/" in pattern[wild:]  # a pattern with levels below its first wildcard
    client, secrets = _client(timeout)
    ask = {"Bucket": bucket, "Prefix": pattern[:wild], **({} if deep else {"Delimiter": "/"})}
    try:
        keys = [item["Key"] for page in client.get_paginator("list_objects_v2").paginate(**ask)
                for item in page.get("Contents", [])]
    except ClientError as err:
        raise Permanent(_answer(err, secrets)[2]) from None
    except BotoCoreError as err:
        raise Permanent(_scrub(f"{type(err).__name__}: {err}", secrets)) from None
    levels = pattern.split("/")
    return [f"s3://{bucket}/{key}" for key in sorted(keys)
            if len(key.split("/")) == len(levels)
            and all(map(fnmatch.fnmatchcase, key.split("/"), levels))], len(keys)


def _answer(err: Any, secrets: list[str]) -> tuple[str, int, str]:
    """A botocore ``ClientError``'s S3 code, HTTP status and text (scrubbed of ``secrets``)."""
    error = err.response.get("Error", {})
    code = str(error.get("Code", "?"))
    status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    text = f"S3 {code} (HTTP {status}): {error.get('Message', '')}".rstrip(": ")
    return code, status, _scrub(text, secrets)


def _s3(url: str, start: int, etag: str | None, read_timeout: float,
        connect_timeout: float) -> Response:
    """A GET of an S3 shard: presigned when it can, else boto3's (module docstring)."""
    bucket, key = _bucket_key(url)
    # boto3 has one read timeout, for the answer and the body alike: the shorter one, so that
    # a server that does not answer is told apart as fast as on the presigned path
    client, secrets = _client(connect_timeout)
    where = (client.meta.endpoint_url, bucket)
    if where not in _clients.slow and not _proxied(client.meta.endpoint_url):
        try:
            return _PresignedBody(client, bucket, key, start, etag, read_timeout,
                                  connect_timeout)
        except _AskBoto3 as ask:
            if ask.bucket:
                _clients.slow.add(where)
    return _S3Body(client, secrets, bucket, key, start, etag)


def _proxied(endpoint: str) -> bool:
    """Whether a proxy from the environment applies to ``endpoint`` (boto3 then sends)."""
    proxies = urllib.request.getproxies()
    parts = urlsplit(endpoint)
    return parts.scheme in proxies and not urllib.request.proxy_bypass(parts.hostname or "")


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


class _AskBoto3(Exception):
    """A presigned GET's answer that boto3 should handle (and word); ``bucket``: one that holds
    for the whole bucket (a redirect, a refusal), so that its next GETs go to boto3 at once."""

    def __init__(self, bucket: bool = False) -> None:
        super().__init__()
        self.bucket = bucket


_BUCKET_ANSWERS = frozenset({301, 307, 400, 403})  # another region, refused credentials


class _PresignedBody(_StdlibBody):
    """A GET of a URL presigned by boto3 (valid 15 minutes, used at once) over a kept-alive
    ``http.client`` connection of this process."""

    def __init__(self, client: Any, bucket: str, key: str, start: int, etag: str | None,
                 read_timeout: float, connect_timeout: float) -> None:
        try:  # credentials, parameters, CA bundle: boto3's own call then fails and words it
            url = urlsplit(client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=900))
            context = (_clients.ssl_context(_clients.session()[0]) if url.scheme == "https"
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
            conn, reused = _clients.connection(*self._where, context, connect_timeout)
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
                    raise Transient(_no_answer(connect_timeout)) from None
                sock.settimeout(read_timeout)
                break
            except (OSError, http.client.HTTPException) as err:
                conn.close()
                if reused and not isinstance(err, (TimeoutError, socket.timeout)):
                    continue  # an idle connection that died before answering: a fresh one
                raise Transient(_oserror(err)) from None
        self._conn: http.client.HTTPConnection | None = conn
        status = self._resp.status
        if status not in (200, 206):
            self._drop()
            if status in _RETRY_HTTP or status >= 500:
                raise Transient(f"HTTP {status} {self._resp.reason}".rstrip())
            raise _AskBoto3(bucket=status in _BUCKET_ANSWERS)
        try:
            self.etag = self._resp.getheader("ETag")
            _changed(etag, self.etag)
            if status == 206:
                self.size = _content_range(self._resp.getheader("Content-Range"), start)
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
            _clients.give_back(*self._where, conn)  # its body read to the end: reuse it
        else:
            resp.close()
            conn.close()


class _S3Body:
    def __init__(self, client: Any, secrets: list[str], bucket: str, key: str, start: int,
                 etag: str | None) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        self._secrets = secrets
        ask: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if start:
            ask["Range"] = f"bytes={start}-"
        if etag is not None:
            ask["IfMatch"] = etag
        try:
            answer = client.get_object(**ask)
        except ClientError as err:
            code, status, text = _answer(err, secrets)
            if status == 412:
                raise Permanent("the shard changed on the server while it was read") from None
            if status >= 500 or status == 429 or code in _RETRY_S3:
                raise Transient(text) from None
            raise Permanent(text) from None
        except BotoCoreError as err:
            raise self._sorted(err) from None
        self._body = answer["Body"]
        self.etag = answer.get("ETag")
        _changed(etag, self.etag)
        self.size = (int(answer["ContentLength"]) if not start
                     else _content_range(answer.get("ContentRange"), start))

    def _text(self, text: str) -> str:
        return _scrub(text, self._secrets)

    def _sorted(self, err: Exception) -> Exception:
        """A botocore error as Transient (network) or Permanent (configuration, checksum)."""
        from botocore.exceptions import HTTPClientError, IncompleteReadError

        text = self._text(f"{type(err).__name__}: {err}")
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
            raise Transient(self._text(f"{type(err).__name__}: {err}")) from None

    def close(self) -> None:
        self._body.close()
