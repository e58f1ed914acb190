"""Helpers and fixtures the remote tests share: shards served over HTTP and S3, an AWS environment
of their own, and a loader run over them."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from urllib.parse import urlsplit

import numpy as np
import pytest
from mmproxy.datasets import MultiModalDataset
from mmproxy.datasets.remote import RemoteOptions, open_remote
from mmproxy.pipelines import image_eval_pipeline

import mmproxy
from mmproxy.apps.bench.remote import ShardServer, s3_server
from mmproxy.testing import image_bytes, synth_image, write_tar

N_SHARDS, PER_SHARD = 4, 8


SECRET = "SECRET-do-not-show-3f9a"


FAST = {"backoff": 0.01, "read_timeout": 2.0}
# A cache bound of its own: the default (leave 5% of the disk free) depends on the machine.
CACHE_BYTES = 1 << 30


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote") / "bucket"
    root.mkdir()
    for s in range(N_SHARDS):
        write_tar(root / f"r-{s}.tar",
                  [{"__key__": f"s{s}-{i}", "jpg": image_bytes(synth_image(s * 100 + i, 48, 64)),
                    "cls": str(s * PER_SHARD + i)} for i in range(PER_SHARD)])
    return root


@pytest.fixture(scope="module")
def local(shard_dir):
    return [str(shard_dir / f"r-{s}.tar") for s in range(N_SHARDS)]


@pytest.fixture(scope="module")
def image_server():
    pipe = image_eval_pipeline(batch_size=8, size=16, dtype="uint8", device="cpu", num_threads=1)
    with mmproxy.DALIServer(pipe, name="image") as server:
        yield server


@pytest.fixture
def http(shard_dir):
    with ShardServer(shard_dir) as server:
        yield server


def http_urls(server):
    return [f"{server.url}/r-{s}.tar" for s in range(N_SHARDS)]


@pytest.fixture(scope="module")
def s3(local):
    with s3_server(local) as (urls, env):
        yield urls, env


@pytest.fixture
def aws(monkeypatch, tmp_path):
    """An AWS environment of our own: no config files, credentials nobody else has."""
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))

    def use(env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)

    return use


def run(urls, server, workers=0, epochs=1, **kw):
    """{key: image} of every epoch, and the loader (its skip report)."""
    kw.setdefault("remote", RemoteOptions(**FAST))
    ds = MultiModalDataset(urls, {"image": ("jpg", server.proxy), "label": ("cls", int)},
                           batch_size=4, shuffle_shards=False, max_skipped=None, **kw)
    # obstore's I/O thread does not survive a fork, and this process has read object stores
    stores = any(u.partition("://")[0] in ("s3", "gs", "az") for u in ([urls] if isinstance(
        urls, str) else urls))
    context = {"multiprocessing_context": "spawn"} if workers and stores else {}
    loader = ds.loader(server, num_workers=workers, persistent_workers=workers > 0 and epochs > 1,
                       **context)
    out = []
    for _ in range(epochs):
        images = {}
        for batch in loader:
            for key, image in zip(batch.get("__key__", []), batch.get("image", [])):
                assert key not in images
                images[key] = image.numpy()
        out.append(images)
    return out, loader


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@contextlib.contextmanager
def silent_server():
    """A server on 127.0.0.1 that accepts connections and never answers (as a stopped or hung
    one does); yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    held, stop = [], threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, name="silent-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        listener.close()


QUICK = {"retries": 2, "backoff": 0.01, "connect_timeout": 0.5, "read_timeout": 60.0}


@pytest.fixture(autouse=True)
def fresh_s3_state():
    """Each test starts with no object store (nor its kept connections) made by an earlier one."""
    from mmproxy.datasets.remote import _stores

    _stores._stores.clear()


def read_whole(url, **options):
    with open_remote(url, RemoteOptions(**options)) as shard:
        shard.wait(len(shard.view))
        return bytes(shard.view)


def s3_endpoint(aws, endpoint, **more):
    aws({"AWS_ENDPOINT_URL": endpoint.url, "AWS_ACCESS_KEY_ID": "AKIA-TEST",
         "AWS_DEFAULT_REGION": "us-east-1", **more})
    return ("http", urlsplit(endpoint.url).netloc)
