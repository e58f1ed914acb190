"""S3 clients: this process's boto3 sessions and clients (one per AWS environment and timeout),
TLS settings and kept-alive connections for presigned GETs, all made again after a fork."""

from __future__ import annotations

import http.client
import os
import select
import ssl
import threading
from typing import Any

from mmproxy._install import install_hint

from ._answers import Permanent

__all__ = ["clients", "prepare_s3", "s3_client", "scrub"]


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
        raise Permanent(f"s3:// shards need boto3: {install_hint('boto3')}") from None
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
        clients.session()
    except Permanent as err:
        raise ImportError(str(err)) from None


clients = _Clients()


def s3_client(timeout: float) -> tuple[Any, list[str]]:
    """(this process's S3 client, secrets never to show); Permanent when boto3 refuses the AWS
    environment (a profile, region or endpoint) or is missing."""
    try:
        return clients.get(timeout, timeout)
    except Permanent:
        raise
    except Exception as err:  # noqa: BLE001 - a profile, region or endpoint boto3 refuses
        secrets = [v for k, v in os.environ.items() if k.startswith("AWS_") and v
                   and ("SECRET" in k or "TOKEN" in k)]
        raise Permanent(scrub(f"{type(err).__name__}: {err}", secrets)) from None


def scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text
