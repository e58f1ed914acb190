"""S3 clients: this process's boto3 sessions and clients (one per AWS environment and timeout),
TLS settings and kept-alive connections for presigned GETs, all made again after a fork.

TLS is verified as boto3 verifies it, presigned GETs and boto3's own alike: with the CA bundle
of ``AWS_CA_BUNDLE`` (or ``ca_bundle`` in the AWS config file) when set, else botocore's default
(certifi's); ``SSL_CERT_FILE`` is not boto3's setting, so it is not this one's either.
"""

from __future__ import annotations

import http.client
import os
import select
import ssl
import threading
from typing import Any

from mmproxy.datasets.remote._answers import Permanent

from mmproxy.errors import install_hint

__all__ = ["clients", "prepare_s3", "s3_client", "tls_trust"]


class _Clients:
    """This process's boto3 S3 clients, one per timeout pair and AWS environment (endpoint,
    profile, credentials), made after any fork from a session that a forked worker inherits
    from its parent when :func:`prepare_s3` ran there (its service model and credentials loaded
    once, not once per worker)."""

    def __init__(self) -> None:
        self.pid = -1
        self.lock = threading.Lock()
        self.sessions: dict[tuple[Any, ...], Any] = {}
        self.clients: dict[tuple[Any, ...], Any] = {}
        self.contexts: dict[int, ssl.SSLContext] = {}  # a session's TLS settings
        self.idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}  # kept alive
        self.slow: set[tuple[str | None, str]] = set()  # (endpoint, bucket) asked via get_object

    def session(self) -> Any:
        """The boto3 session of this AWS environment."""
        if self.pid != os.getpid():  # connections are not shared with a forked parent
            self.pid, self.lock, self.clients, self.idle = os.getpid(), threading.Lock(), {}, {}
        env = tuple(sorted(kv for kv in os.environ.items() if kv[0].startswith("AWS_")))
        with self.lock:
            if env not in self.sessions:
                self.sessions[env] = _make_session()
            return self.sessions[env]

    def get(self, read_timeout: float, connect_timeout: float) -> Any:
        """The S3 client of this AWS environment with these timeouts."""
        session = self.session()
        import botocore.config

        with self.lock:
            key = (id(session), read_timeout, connect_timeout)
            if key not in self.clients:
                config = botocore.config.Config(read_timeout=read_timeout,
                                                connect_timeout=connect_timeout,
                                                retries={"total_max_attempts": 1},
                                                signature_version="s3v4")
                self.clients[key] = session.client("s3", config=config)
            return self.clients[key]

    def ssl_context(self, session: Any) -> ssl.SSLContext:
        """The TLS settings of presigned GETs: verified as boto3 would (:func:`_ca_bundle`)."""
        with self.lock:
            context = self.contexts.get(id(session))
            if context is None:  # the same environment and files as the session's
                context = self.contexts[id(session)] = ssl.create_default_context(
                    cafile=_ca_bundle())
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


def _make_session() -> Any:
    try:
        import boto3
    except ImportError:
        raise Permanent(f"s3:// shards need boto3: {install_hint('boto3')}") from None
    session = boto3.session.Session()
    session.get_credentials()  # found once, here
    session.client("s3")  # loads the service model into the session's cache
    return session


def _ca_bundle() -> str | None:
    """The CA bundle boto3 verifies S3 endpoints with: ``AWS_CA_BUNDLE`` (or ``ca_bundle`` in
    the AWS config file), else botocore's default."""
    import botocore.httpsession
    import botocore.session

    bundle = (botocore.session.get_session().get_config_variable("ca_bundle")
              or botocore.httpsession.get_cert_path(True))
    return bundle if isinstance(bundle, str) else None


def tls_trust() -> str:
    """How to make boto3 (and so this process's S3 GETs) trust an endpoint's certificate, and
    what it trusts now."""
    return (f"to trust it, set AWS_CA_BUNDLE=/path/ca.pem, a file of the CA certificates to "
            f"trust (or ca_bundle in the AWS config file); trusted now: "
            f"{_ca_bundle() or 'the system CA certificates'}")


def prepare_s3() -> None:
    """Loads boto3, the S3 model and the credentials in this process, so that DataLoader workers
    forked from it make their clients in milliseconds. Raises ImportError without boto3."""
    try:
        clients.session()
    except Permanent as err:
        raise ImportError(str(err)) from None


clients = _Clients()


def s3_client(timeout: float) -> Any:
    """This process's S3 client; Permanent when boto3 refuses the AWS environment (a profile,
    region or endpoint) or is missing."""
    try:
        return clients.get(timeout, timeout)
    except Permanent:
        raise
    except Exception as err:  # noqa: BLE001 - a profile, region or endpoint boto3 refuses
        raise Permanent(f"{type(err).__name__}: {err}") from None
