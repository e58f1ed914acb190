"""The node cache of remote shards: one download per shard for every process, its bound and
eviction, a cache that cannot be written, and a failed download."""

# ruff: noqa: F811 - the fixtures imported from the helpers are the tests' parameters

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from mmproxy.datasets import MultiModalDataset
from mmproxy.datasets.remote import RemoteError, RemoteOptions, open_remote
from mmproxy.datasets.shards import read_remote_tar
from remote_helpers import (  # noqa: F401 - fixtures
    CACHE_BYTES,
    FAST,
    N_SHARDS,
    PER_SHARD,
    QUICK,
    SECRET,
    aws,
    fresh_s3_state,
    http,
    http_urls,
    image_server,
    local,
    run,
    s3,
    s3_endpoint,
    same,
    shard_dir,
    silent_server,
)

from mmproxy.apps.bench.remote import Fault, ShardServer
from mmproxy.testing import write_tar

pytestmark = pytest.mark.timeout(120)


# -- the node cache --------------------------------------------------------------------------------


def cache_files(folder):
    finished = [p for p in Path(folder).iterdir() if not p.name.startswith(".")]
    return finished, list((Path(folder) / ".partial").iterdir())


def test_cache_second_epoch_reads_no_byte_from_the_server(local, http, image_server, tmp_path):
    [expected], _ = run(local, image_server)
    opts = RemoteOptions(cache_dir=str(tmp_path / "cache"), cache_bytes=CACHE_BYTES, **FAST)
    epochs, _ = run(http_urls(http), image_server, workers=2, epochs=2, remote=opts)
    assert same(epochs[0], expected) and same(epochs[1], expected)
    assert [http.requests[f"r-{s}.tar"] for s in range(N_SHARDS)] == [1] * N_SHARDS
    finished, partial = cache_files(tmp_path / "cache")
    assert len(finished) == N_SHARDS and partial == []


def test_cache_keeps_the_same_url_of_two_endpoints_apart(local, aws, tmp_path):
    """``s3://bucket/r-0.tar`` of two S3 endpoints is two shards: the second endpoint's bytes
    are read, not the first one's from the cache, and each is then a hit of its own."""
    opts = RemoteOptions(cache_dir=str(tmp_path / "cache"), cache_bytes=CACHE_BYTES, **FAST)
    for root, shard in (("one", 0), ("two", 1)):  # r-0.tar of the second holds shard 1's samples
        (tmp_path / root / "bucket").mkdir(parents=True)
        (tmp_path / root / "bucket" / "r-0.tar").write_bytes(Path(local[shard]).read_bytes())
    url = "s3://bucket/r-0.tar"

    def keys():
        return [s["__key__"] for s in read_remote_tar(url, opts)]

    with ShardServer(tmp_path / "one") as one, ShardServer(tmp_path / "two") as two:
        for endpoint, shard in ((one, 0), (two, 1), (one, 0), (two, 1)):
            s3_endpoint(aws, endpoint)
            assert keys() == [f"s{shard}-{i}" for i in range(PER_SHARD)]
        assert one.requests["bucket/r-0.tar"] == two.requests["bucket/r-0.tar"] == 1
    assert len(cache_files(tmp_path / "cache")[0]) == 2


def _read_all(urls, cache, order):
    keys, opts = [], RemoteOptions(cache_dir=cache, cache_bytes=CACHE_BYTES)
    for i in order:
        keys += [s["__key__"] for s in read_remote_tar(urls[i], opts)]
    return keys


def test_cache_one_download_per_shard_for_many_processes(http, tmp_path):
    """Four processes read the same shards at the same time: each shard is fetched once."""
    urls = http_urls(http)
    for s in range(N_SHARDS):  # slow answers, so that the readers meet on every shard
        http.fail(f"r-{s}.tar", Fault("stall", after=1000, seconds=0.3))
    cache = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        results = pool.starmap(_read_all, [(urls, cache, order) for order in
                                           ([0, 1, 2, 3], [0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2])])
    for keys in results:
        assert sorted(keys) == sorted(f"s{s}-{i}" for s in range(N_SHARDS) for i in range(PER_SHARD))
    assert [http.requests[f"r-{s}.tar"] for s in range(N_SHARDS)] == [1] * N_SHARDS
    finished, partial = cache_files(cache)
    assert len(finished) == N_SHARDS and partial == []


def test_cache_two_workers_drawing_the_same_shards_download_each_once(http, image_server, tmp_path):
    opts = RemoteOptions(cache_dir=str(tmp_path / "cache"), cache_bytes=CACHE_BYTES, **FAST)
    ds = MultiModalDataset(http_urls(http), {"image": ("jpg", image_server.proxy)}, batch_size=4,
                           resampled=True, epoch_length=16, remote=opts)
    seen = sum(len(b["image"]) for b in ds.loader(image_server, num_workers=2))
    assert seen == 16 * 4
    assert max(http.requests.values()) == 1
    finished, partial = cache_files(tmp_path / "cache")
    assert len(finished) == len(http.requests) and partial == []


def test_cache_bound_is_respected_with_eviction(local, http, tmp_path):
    urls = http_urls(http)
    size = max(os.path.getsize(p) for p in local)
    cache = str(tmp_path / "cache")
    opts = RemoteOptions(cache_dir=cache, cache_bytes=int(2.5 * size))
    for url in urls:
        assert len(list(read_remote_tar(url, opts))) == PER_SHARD
        finished, partial = cache_files(cache)
        assert sum(p.stat().st_size for p in finished) <= opts.cache_bytes and partial == []
    assert sorted(p.name[-5:] for p in cache_files(cache)[0]) == ["2.tar", "3.tar"]  # LRU kept
    list(read_remote_tar(urls[3], opts))  # a hit: no request, and r-3 is now the newest
    list(read_remote_tar(urls[0], opts))  # a miss: evicts r-2, the least recently used
    assert sorted(p.name[-5:] for p in cache_files(cache)[0]) == ["0.tar", "3.tar"]
    assert [http.requests[f"r-{s}.tar"] for s in range(N_SHARDS)] == [2, 1, 1, 1]
    tiny = RemoteOptions(cache_dir=cache, cache_bytes=size // 2)  # too big for the cache:
    assert len(list(read_remote_tar(urls[1], tiny))) == PER_SHARD  # streamed past it
    assert http.requests["r-1.tar"] == 2 and cache_files(cache)[1] == []


def test_cache_without_a_bound_keeps_5_percent_of_the_disk_free(http, tmp_path, monkeypatch,
                                                                caplog):
    """With no cache_bytes, a shard goes in while the disk keeps 5% free, and past it (read in
    full, with a warning that says why) when it would not."""
    from mmproxy.datasets.remote import _cache

    real, free = os.statvfs, {"blocks": 0}

    def statvfs(path):  # a disk of 1,000 blocks of 4 KiB with free["blocks"] of them free
        st = real(path)
        return os.statvfs_result((st.f_bsize, 4096, 1000, free["blocks"], free["blocks"])
                                 + tuple(st)[5:])

    monkeypatch.setattr(_cache.os, "statvfs", statvfs)
    urls, cache = http_urls(http), str(tmp_path / "cache")
    opts = RemoteOptions(cache_dir=cache, cache_bytes=None)
    free["blocks"] = 50  # 5% of the disk free: no room for a shard
    with caplog.at_level(logging.WARNING):
        assert len(list(read_remote_tar(urls[0], opts))) == PER_SHARD
    assert cache_files(cache) == ([], [])
    [warning] = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]
    assert "r-0.tar" in warning and "keeps 5% of the disk free" in warning
    free["blocks"] = 50 + 1000 // 4  # 5% kept, and a quarter of the disk for the cache
    assert len(list(read_remote_tar(urls[1], opts))) == PER_SHARD
    assert [p.name[-5:] for p in cache_files(cache)[0]] == ["1.tar"]


@pytest.fixture
def unwritable_folder(tmp_path):
    """A folder this process cannot write: a read-only one of ours, or (as root, whom
    permissions do not stop) one of the kernel's."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:
        folder = Path("/sys/kernel")
    try:
        (folder / ".partial").mkdir()
    except OSError:
        yield folder
    else:
        pytest.skip(f"{folder} can be written here")
    finally:
        (tmp_path / "read-only").chmod(0o755)


def test_cache_a_read_only_cache_folder_streams_past_it_with_one_warning(
        local, http, s3, aws, image_server, unwritable_folder, caplog):
    """Every shard is read (HTTP and S3), not every one "unreadable"; the warning names the
    folder and why, once per process."""
    [expected], _ = run(local, image_server)
    opts = RemoteOptions(cache_dir=str(unwritable_folder), **FAST)
    aws(s3[1])
    with caplog.at_level(logging.WARNING):
        for urls in (http_urls(http), s3[0]):
            [got], loader = run(urls, image_server, remote=opts, on_error="skip")
            assert same(got, expected) and loader.skipped.skipped == 0
    warnings = [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"the shard cache {unwritable_folder} cannot be used (")
    assert "streamed without it" in warnings[0]


def test_cache_a_failed_download_leaves_nothing_and_frees_the_lock(http, tmp_path):
    url, cache = http_urls(http)[0], str(tmp_path / "cache")
    opts = RemoteOptions(cache_dir=cache, cache_bytes=CACHE_BYTES, retries=1, backoff=0.01)
    http.fail("r-0.tar", Fault("cut", after=0), times=2)  # no byte: no progress, no fresh count
    with pytest.raises(RemoteError, match="gave up after 2 attempts"):
        list(read_remote_tar(url, opts))
    assert cache_files(cache) == ([], [])
    assert len(list(read_remote_tar(url, opts))) == PER_SHARD  # the lock is free again
    assert len(cache_files(cache)[0]) == 1 and http.requests["r-0.tar"] == 3


def test_a_server_given_up_on_is_not_retried_for_its_next_shards():
    """A server that stopped answering costs one shard's retries: the next shards of that server
    (with the same options) fail at their first failure, so a run of many shards on it reaches
    its skip limit in seconds per shard instead of a minute each; another server's are retried."""
    from mmproxy.datasets.remote._download import Attempts

    options = RemoteOptions(**QUICK)
    with silent_server() as url, silent_server() as other:
        start = time.monotonic()
        with pytest.raises(RemoteError, match=r"gave up after 3 attempts"):
            Attempts(f"{url}/a.tar", "a", options).connect(0, None)
        first = time.monotonic() - start
        start = time.monotonic()
        with pytest.raises(RemoteError, match=r"not retried: the server's shard before it was "
                                              r"given up on \d+ s ago"):
            Attempts(f"{url}/b.tar", "b", options).connect(0, None)
        assert time.monotonic() - start < first / 2
        with pytest.raises(RemoteError, match=r"gave up after 3 attempts"):
            Attempts(f"{other}/c.tar", "c", options).connect(0, None)


@pytest.mark.timeout(60)
def test_a_shard_served_without_a_length_is_let_go_when_read(tmp_path):
    """A server that gives no Content-Length (the body until it closes): the shard is read into
    a memfd whole, registered for sending by reference, and its registration goes when the
    shard is closed, as a streamed shard's does (it held the whole shard's memory per worker)."""
    import http.server

    from mmproxy._wire import mappings as _mappings

    body = (tmp_path / "s.tar")
    write_tar(body, [{"__key__": f"k{i}", "bin": bytes([i]) * 3000} for i in range(4)])
    data = body.read_bytes()

    class NoLength(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoLength)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/s.tar"
        with open_remote(url, RemoteOptions(cache_dir=None)) as shard:
            assert bytes(shard.view) == data
            start = np.frombuffer(shard.view, np.uint8).__array_interface__["data"][0]
            assert start in _mappings.files.table()[0].tolist()
        assert start not in _mappings.files.table()[0].tolist()
    finally:
        server.shutdown()
        server.server_close()
