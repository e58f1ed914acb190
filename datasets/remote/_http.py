"""HTTP: one GET of an ``http(s)://`` shard through ``urllib`` (proxies from the environment,
redirects), with a timeout for the answer apart from the body's, and the request's headers.
docs/internals.md, ``mmproxy.datasets.remote._http``, has the rest.
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from mmproxy.datasets.remote._answers import (
    Permanent,
    StdlibBody,
    Transient,
    changed,
    content_range,
    in_words,
    no_answer,
    retried,
    tls_refusal,
)

__all__ = ["HttpBody", "hub_hosts", "hub_token"]

_HUB = ("huggingface.co", "hf.co")


def hub_hosts() -> set[str]:
    """The Hugging Face Hub's hosts: ``huggingface.co``, ``hf.co`` and ``HF_ENDPOINT``'s."""
    hosts = set(_HUB)
    endpoint = os.environ.get("HF_ENDPOINT")
    if endpoint:
        hosts.add(urlsplit(endpoint).netloc.lower())
    return hosts


def hub_token() -> str | None:
    """The Hub token as ``huggingface_hub`` finds it: ``HF_TOKEN``, else the token file
    (``HF_TOKEN_PATH``, else ``$HF_HOME/token``, ``HF_HOME`` by default
    ``~/.cache/huggingface``)."""
    token = os.environ.get("HF_TOKEN", "").strip()
    if token:
        return token
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    try:
        with open(os.environ.get("HF_TOKEN_PATH") or os.path.join(home, "token")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _origin(url: str) -> tuple[str, str, int | None]:
    """``url``'s scheme, host and port (the scheme's own when none is given)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port or {"http": 80, "https": 443}.get(scheme)


def _hub_over(url: str) -> bool:
    """Whether ``url`` is the Hub's and the token may go there: over https, or over http to an
    ``HF_ENDPOINT`` that is itself http."""
    parts = urlsplit(url)
    if parts.netloc.lower() not in hub_hosts():
        return False
    if parts.scheme.lower() == "https":
        return True
    endpoint = os.environ.get("HF_ENDPOINT") or ""
    return (urlsplit(endpoint).scheme.lower() == "http"
            and _origin(endpoint)[1:] == _origin(url)[1:])


def _has(headers: Mapping[str, str], name: str) -> bool:
    return any(k.lower() == name for k in headers)


def _headers(url: str, given: Mapping[str, str]) -> dict[str, str]:
    """The headers of a GET of ``url``: ``given``, and the Hub's token for the Hub's hosts
    (:func:`_hub_over`)."""
    headers = dict(given)
    if _hub_over(url) and not _has(headers, "authorization"):
        token = hub_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
    return headers


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


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, less ``private`` headers (and ``Authorization``) when they lead to
    another scheme, host or port: not to another server, nor in cleartext after https."""

    def __init__(self, private: set[str]) -> None:
        super().__init__()
        self.private = private | {"authorization", "proxy-authorization", "cookie"}

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            for name in [k for k in new.headers if k.lower() in self.private]:
                del new.headers[name]
        return new


class _HttpHandler(_Handler, urllib.request.HTTPHandler):
    pass


class _HttpsHandler(_Handler, urllib.request.HTTPSHandler):
    pass


def _failed(err: OSError | http.client.HTTPException, connect_timeout: float) -> Exception:
    """A GET that got no answer: Permanent for a TLS refusal, else Transient."""
    refusal = tls_refusal(err, "the server", _trust)
    if refusal is not None:
        return refusal
    if isinstance(err, urllib.error.URLError):
        if isinstance(err.reason, (TimeoutError, socket.timeout)):  # while connecting
            return Transient(f"cannot connect within {connect_timeout:g} s")
        return Transient(in_words(err.reason))
    return Transient(in_words(err))


def _trust() -> str:
    """How to make this process trust a server's certificate, and what it trusts now."""
    now = ssl.get_default_verify_paths()
    trusted = ", ".join(path for path in (now.cafile, now.capath) if path) or "nothing"
    return (f"to trust it, set SSL_CERT_FILE=/path/ca.pem, a file of the CA certificates to "
            f"trust (or SSL_CERT_DIR, a folder of them); trusted now: {trusted}")


def _refused(url: str, sent: bool) -> str:
    """What to do about a 401 or 403 answer to ``url`` (``sent``: with an Authorization header)."""
    if urlsplit(url).netloc.lower() in hub_hosts():
        if sent:
            return (": the Hub refused the token (HF_TOKEN): it needs read access to the "
                    "repository, and a gated one's terms accepted on its page")
        return (": the Hub wants a token: set HF_TOKEN (or run `hf auth login`), one with read "
                "access to the repository")
    if sent:
        return ": the server refused the credentials in RemoteOptions(headers=...)"
    return (": the server wants credentials: a signed URL, or "
            "RemoteOptions(headers={'Authorization': ...})")


class HttpBody(StdlibBody):
    def __init__(self, url: str, start: int, etag: str | None, read_timeout: float,
                 connect_timeout: float, given: Mapping[str, str]) -> None:
        private = _headers(url, given)
        headers = {"User-Agent": "mmproxy", "Accept-Encoding": "identity", **private}
        if start:
            headers["Range"] = f"bytes={start}-"
        opener = urllib.request.build_opener(_HttpHandler(read_timeout),
                                             _HttpsHandler(read_timeout),
                                             _Redirects({k.lower() for k in private}))
        try:
            self._resp = opener.open(urllib.request.Request(url, headers=headers),
                                     timeout=connect_timeout)
        except _NoAnswer:
            raise Transient(no_answer(connect_timeout)) from None
        except urllib.error.HTTPError as err:
            err.close()
            text = f"HTTP {err.code} {err.reason}"
            if retried(err.code):
                raise Transient(text) from None
            if err.code in (401, 403):
                text += _refused(url, _has(headers, "authorization"))
            raise Permanent(text) from None
        except (OSError, http.client.HTTPException) as err:  # urllib's URLError among them
            raise _failed(err, connect_timeout) from None
        except ValueError:  # http.client's refusal of a header; its text quotes the value
            raise Permanent("the request cannot be sent: a header's name or value is not valid "
                            "HTTP (a CR or LF in HF_TOKEN or RemoteOptions.headers?)") from None
        try:
            self.etag = self._resp.headers.get("ETag")
            changed(etag, self.etag)
            length = self._resp.headers.get("Content-Length")
            if self._resp.status == 206:
                self.size = content_range(self._resp.headers.get("Content-Range"), start)
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
