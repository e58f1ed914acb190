"""Request headers of remote shards, against real servers started here: private headers (the
Hub's token, ``RemoteOptions(headers=...)``) stay with the server they were meant for, across
redirects to another scheme, host or port; an ``authorization`` header in any case counts as
credentials sent."""
# ruff: noqa: F811 - the fixtures imported from remote_helpers and tls_helpers are the tests' parameters

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from mmproxy.datasets.remote import RemoteError
from remote_helpers import SECRET, http, local, read_whole, shard_dir  # noqa: F401 - fixtures
from tls_helpers import LOOPBACK, certificate, trust  # noqa: F401 - fixtures

from mmproxy.apps.bench.remote import Fault

pytestmark = pytest.mark.timeout(120)


# -- headers and redirects: private headers stay with their server --------------------------------


class _Sniffing(ThreadingHTTPServer):
    """An HTTP server that also speaks TLS on the same port (``context``): a connection whose
    first byte starts a TLS handshake is wrapped, any other one is read as plain HTTP."""

    daemon_threads = True
    context: ssl.SSLContext | None = None

    def get_request(self):
        sock, address = super().get_request()
        if self.context is not None and sock.recv(1, socket.MSG_PEEK) == b"\x16":
            sock = self.context.wrap_socket(sock, server_side=True)
        return sock, address


class _Recording(BaseHTTPRequestHandler):
    """Serves the files of ``root``; ``/go/NAME`` answers 302 to ``to + "/NAME"``; each GET's
    scheme, path and headers (names in lower case) recorded in ``seen``."""

    root = Path()
    to = ""
    seen: list[tuple[str, str, dict[str, str]]] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        scheme = "https" if isinstance(self.connection, ssl.SSLSocket) else "http"
        self.seen.append((scheme, self.path, {k.lower(): v for k, v in self.headers.items()}))
        if self.path.startswith("/go/"):
            self.send_response(302, "Found")
            self.send_header("Location", f"{self.to}/{self.path[4:]}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = (self.root / self.path.lstrip("/")).read_bytes()
        self.send_response(200, "OK")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def recording_server(root: Path, pem: Path | None = None, private: Path | None = None):
    """A :class:`_Recording` server of ``root`` on 127.0.0.1 (http, and https on the same port
    with ``pem``); yields its ``host:port`` and its handler (``to``, ``seen``)."""
    handler = type("Recording", (_Recording,), {"root": root, "seen": []})
    server = _Sniffing((LOOPBACK, 0), handler)
    if pem is not None:
        server.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.context.load_cert_chain(pem, private)
    thread = threading.Thread(target=server.serve_forever, name="recording", daemon=True)
    thread.start()
    try:
        yield f"{LOOPBACK}:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


PRIVATE = ("authorization", "x-key")


def sent(seen, *names):
    """Which of ``names`` each recorded GET carried: ``[(scheme, path, {name: value})]``."""
    return [(scheme, path, {n: h[n] for n in names if n in h}) for scheme, path, h in seen]


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """No Hub settings of the machine's: ``hub_env(endpoint)`` sets HF_ENDPOINT and HF_TOKEN."""
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))

    def use(endpoint: str) -> None:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setenv("HF_TOKEN", SECRET)

    return use


def test_a_redirect_from_https_to_http_on_the_same_host_carries_no_private_header(
        shard_dir, local, trust, hub_env, tmp_path):
    """The Hub (HF_ENDPOINT, https) redirecting to http on its own host and port: the token and
    RemoteOptions' headers went over TLS, and do not follow in cleartext; a redirect within https
    keeps them. An http:// URL of an https Hub gets no token."""
    pem, private = certificate(tmp_path, "dual")
    trust(pem)
    with recording_server(shard_dir, pem, private) as (host, handler):
        hub_env(f"https://{host}")
        headers = {"X-Key": "mine"}
        handler.to = f"http://{host}"
        assert read_whole(f"https://{host}/go/r-0.tar", headers=headers) == Path(
            local[0]).read_bytes()
        handler.to = f"https://{host}"
        assert read_whole(f"https://{host}/go/r-1.tar", headers=headers) == Path(
            local[1]).read_bytes()
        assert read_whole(f"http://{host}/r-2.tar") == Path(local[2]).read_bytes()
    mine = {"authorization": f"Bearer {SECRET}", "x-key": "mine"}
    assert sent(handler.seen, *PRIVATE) == [
        ("https", "/go/r-0.tar", mine), ("http", "/r-0.tar", {}),
        ("https", "/go/r-1.tar", mine), ("https", "/r-1.tar", mine),
        ("http", "/r-2.tar", {})]


def test_a_redirect_to_another_host_carries_none_of_the_remote_options_headers(shard_dir, local,
                                                                               hub_env):
    """RemoteOptions' headers, an Authorization among them, go to the shard's server and not to
    the one it redirects to (another port: another server)."""
    with recording_server(shard_dir) as (host, first), recording_server(shard_dir) as (other,
                                                                                       second):
        first.to = f"http://{other}"
        headers = {"Authorization": "Bearer mine", "X-Key": "mine"}
        assert read_whole(f"http://{host}/go/r-0.tar", headers=headers) == Path(
            local[0]).read_bytes()
    assert sent(first.seen, *PRIVATE) == [
        ("http", "/go/r-0.tar", {"authorization": "Bearer mine", "x-key": "mine"})]
    assert sent(second.seen, *PRIVATE) == [("http", "/r-0.tar", {})]


def test_a_lowercase_authorization_header_counts_as_credentials_sent(http):
    http.fail("r-0.tar", Fault("status", status=401))
    with pytest.raises(RemoteError) as raised:
        read_whole(f"{http.url}/r-0.tar", headers={"authorization": f"Bearer {SECRET}"})
    assert str(raised.value) == ("HTTP 401 Unauthorized: the server refused the credentials in "
                                 "RemoteOptions(headers=...)")
    assert http.authorizations == [f"Bearer {SECRET}"]
