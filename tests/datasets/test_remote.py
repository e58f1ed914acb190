"""Remote shards over HTTP and S3: the local keys and pixels, kept-alive S3 connections, retries,
timeouts that name the server, streaming, listing, skip records, and credentials never shown.
(GCS, Azure and the Hugging Face Hub's tokens: test_object_stores.py.)"""

# ruff: noqa: F811 - the fixtures imported from the helpers are the tests' parameters

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mmproxy.datasets import MultiModalDataset
from mmproxy.datasets.remote import RemoteError, RemoteOptions, open_remote, redact
from mmproxy.datasets.shards import read_local_tar, read_remote_tar
from remote_helpers import (  # noqa: F401 - fixtures
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
    read_whole,
    run,
    s3,
    s3_endpoint,
    same,
    shard_dir,
    silent_server,
)

import mmproxy
from mmproxy.apps.bench.remote import Fault, ShardServer
from mmproxy.testing import image_bytes, synth_image, write_tar

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("workers", [0, 2])
def test_http_and_s3_give_the_local_keys_and_pixels(local, http, s3, aws, image_server, workers):
    [expected], _ = run(local, image_server, workers)
    assert len(expected) == N_SHARDS * PER_SHARD
    [got], _ = run(http_urls(http), image_server, workers)
    assert same(got, expected)
    aws(s3[1])
    [got], _ = run(s3[0], image_server, workers)
    assert same(got, expected)






def test_s3_gets_replace_a_connection_the_server_closed_while_idle(shard_dir, local, aws,
                                                                   caplog):
    """GETs of one bucket go through one store (its connections kept alive); one the server
    closed while it was idle is replaced without a failure or a retry; every GET is signed in
    its headers, none in its URL."""
    with ShardServer(shard_dir.parent, keep_alive=0.3) as endpoint:
        s3_endpoint(aws, endpoint)
        assert read_whole("s3://bucket/r-0.tar", retries=0) == Path(local[0]).read_bytes()
        assert read_whole("s3://bucket/r-1.tar", retries=0) == Path(local[1]).read_bytes()
        time.sleep(0.8)  # the server closes it
        with caplog.at_level(logging.WARNING):
            assert read_whole("s3://bucket/r-2.tar", retries=0) == Path(local[2]).read_bytes()
        assert not caplog.records
        assert not any("X-Amz-Signature=" in query for _, query in endpoint.queries)


def test_s3_a_cut_body_is_resumed_from_its_last_byte(shard_dir, local, aws):
    """A body cut short: with no retry left, said with the byte it stopped at (the last whole
    piece obstore handed over: 64 KiB ones); with retries, the next GET asks for the rest (a
    range) and the shard is whole."""
    with ShardServer(shard_dir.parent) as endpoint:
        s3_endpoint(aws, endpoint)
        endpoint.fail("bucket/r-0.tar", Fault("cut", after=5000))
        with pytest.raises(RemoteError, match=r"connection closed at byte 0 of \d+"):
            read_whole("s3://bucket/r-0.tar", retries=0)
        endpoint.fail("bucket/r-0.tar", Fault("cut", after=5000))
        got = read_whole("s3://bucket/r-0.tar", backoff=0.01)
        assert got == Path(local[0]).read_bytes() and endpoint.requests["bucket/r-0.tar"] == 3
        assert read_whole("s3://bucket/r-1.tar", retries=0) == Path(local[1]).read_bytes()


def test_s3_a_garbled_answer_does_not_show_the_signed_url(shard_dir, aws, caplog):
    """A broken server echoing the request: the message names the failure, not the URL (whose
    query holds the signature and the access key id)."""
    with ShardServer(shard_dir.parent) as endpoint:
        s3_endpoint(aws, endpoint, AWS_SESSION_TOKEN="TOKEN/do+not=show")
        endpoint.fail("bucket/r-0.tar", Fault("garbage"))
        with caplog.at_level(logging.WARNING), pytest.raises(RemoteError) as raised:
            read_whole("s3://bucket/r-0.tar", retries=0)
    for text in (str(raised.value), caplog.text):
        assert "Signature" not in text and "AKIA-TEST" not in text and "TOKEN" not in text
    assert re.fullmatch(r"S3: HTTP error: error sending request \(gave up after 1 attempts\)",
                        str(raised.value)), str(raised.value)


def test_s3_without_credentials_is_a_named_error(shard_dir, aws, monkeypatch):
    """No credentials anywhere (the instance metadata service unreachable too): a RemoteError
    (a skip record in skip mode) naming what to set, not a raw obstore exception."""
    with ShardServer(shard_dir.parent) as endpoint:
        s3_endpoint(aws, endpoint)
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        monkeypatch.setenv("AWS_METADATA_ENDPOINT", endpoint.url + "/no-metadata")
        with pytest.raises(RemoteError, match="S3: no credentials found: set AWS_ACCESS_KEY_ID"):
            read_whole("s3://bucket/r-0.tar", retries=0)
    assert not any(name.startswith("bucket/") for name, _ in endpoint.queries)  # none unsigned


def test_members_are_views_of_one_registered_mapping(http, local):
    """The fields are memoryviews into the shard's mapping (no copy), as for local shards."""
    remote = list(read_remote_tar(http_urls(http)[0], RemoteOptions()))
    plain = list(read_local_tar(local[0]))
    assert [s["__key__"] for s in remote] == [s["__key__"] for s in plain]
    for r, p in zip(remote, plain):
        assert isinstance(r["jpg"], memoryview) and r["jpg"].readonly
        assert bytes(r["jpg"]) == bytes(p["jpg"])
    first, last = remote[0]["jpg"], remote[-1]["jpg"]
    assert first.obj is last.obj  # slices of one mapping


def test_a_cut_connection_is_resumed_and_the_epoch_is_complete(local, http, image_server, caplog):
    [expected], _ = run(local, image_server)
    http.fail("r-1.tar", Fault("cut", after=7000))
    http.fail("r-2.tar", Fault("cut", after=3000), times=2)
    with caplog.at_level(logging.WARNING):
        [got], loader = run(http_urls(http), image_server)
    assert same(got, expected) and loader.skipped.skipped == 0
    assert http.requests["r-1.tar"] == 2 and http.requests["r-2.tar"] == 3
    assert "connection closed at byte 7000" in caplog.text


def test_a_503_is_retried(local, http, image_server):
    [expected], _ = run(local, image_server)
    http.fail("r-0.tar", Fault("status", status=503))
    [got], loader = run(http_urls(http), image_server, workers=2)
    assert same(got, expected) and loader.skipped.skipped == 0
    assert http.requests["r-0.tar"] == 2


def test_a_stall_hits_the_read_timeout_and_is_retried(local, http, image_server):
    [expected], _ = run(local, image_server)
    http.fail("r-3.tar", Fault("stall", after=4000, seconds=30))
    start = time.monotonic()
    [got], _ = run(http_urls(http), image_server, remote=RemoteOptions(backoff=0.01, read_timeout=0.5))
    assert same(got, expected)
    assert time.monotonic() - start < 10
    assert http.requests["r-3.tar"] == 2


def test_a_server_that_never_answers_is_named_within_seconds(image_server, caplog):
    """No answer within connect_timeout: a warning per retry from the first second, and then a
    RemoteError, a ShardError naming the shard (its URL redacted) or a skip record; the long
    read_timeout (for a body that flows) is not waited for."""
    with silent_server() as url:
        shard = f"{url}/a.tar?X-Amz-Signature={SECRET}"
        start, wall = time.monotonic(), time.time()
        with caplog.at_level(logging.WARNING), pytest.raises(RemoteError) as raised:
            read_whole(shard, **QUICK)
        assert time.monotonic() - start < 5
        assert re.fullmatch(r"no answer within 0\.5 s: the server takes connections but does not "
                            r"answer \(gave up after 3 attempts\)", str(raised.value))
        first = next(r for r in caplog.records if "retry 1 of 2" in r.getMessage())
        assert first.created - wall < 2 and "no answer within 0.5 s" in first.getMessage()
        assert SECRET not in caplog.text and "X-Amz-Signature=***" in caplog.text
        fields = {"image": ("jpg", image_server.proxy)}
        ds = MultiModalDataset([shard], fields, batch_size=4, remote=RemoteOptions(**QUICK))
        with pytest.raises(mmproxy.ShardError, match=r"^shard http://127\.0\.0\.1:\d+/a\.tar\?"
                           r"X-Amz-Signature=\*\*\*: cannot be read: .*no answer within 0\.5 s"):
            list(ds.loader(image_server, num_workers=0))
        assert time.monotonic() - start < 15


def test_a_stopped_http_server_is_named_within_seconds(shard_dir, tmp_path):
    """``python -m http.server`` stopped with SIGSTOP (the kernel still takes connections)."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1",
                             "0"], cwd=shard_dir, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        port = re.search(r"port (\d+)", proc.stdout.readline())[1]
        url = f"http://127.0.0.1:{port}/r-0.tar"
        assert read_whole(url, **QUICK) == (shard_dir / "r-0.tar").read_bytes()
        os.kill(proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RemoteError, match=r"no answer within 0\.5 s: .*gave up after 3"):
            read_whole(url, **QUICK)
        assert time.monotonic() - start < 5
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)


def test_an_s3_endpoint_that_never_answers_is_named_within_seconds(aws):
    with silent_server() as url:
        aws({"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "AKIA-TEST",
             "AWS_DEFAULT_REGION": "us-east-1"})
        start = time.monotonic()
        with pytest.raises(RemoteError, match=r"no answer within 0\.5 s: .*gave up after 3"):
            read_whole("s3://bucket/r-0.tar", **QUICK)
        assert time.monotonic() - start < 5


def test_fork_workers_after_reading_s3_in_the_main_process_fail_with_what_to_do(
        s3, aws, image_server):
    """obstore's I/O thread does not survive a fork: workers forked from a process that read
    an ``s3://`` shard itself are told so, and to use spawn, at their first shard (no hang);
    spawned workers read every shard."""
    urls, env = s3
    aws(env)
    assert len(read_whole(urls[0], **FAST)) > 0  # the main process's obstore thread now runs
    ds = MultiModalDataset(urls, {"image": ("jpg", image_server.proxy)}, batch_size=4,
                           shuffle_shards=False, remote=RemoteOptions(**FAST))
    start = time.monotonic()
    with pytest.raises(mmproxy.ShardError, match=r"shard s3://bench/r-0\.tar: cannot be read: "
                       r"RemoteError: this process was forked from one that had read s3:// "
                       r"shards itself.*multiprocessing_context='spawn'"):
        for _ in ds.loader(image_server, num_workers=1, multiprocessing_context="fork"):
            pass
    assert time.monotonic() - start < 30
    seen = sum(len(b["image"]) for b in ds.loader(image_server, num_workers=1,
                                                   multiprocessing_context="spawn"))
    assert seen == N_SHARDS * PER_SHARD


def test_listing_a_prefix_of_an_endpoint_that_never_answers_keeps_the_users_timeout(aws):
    """The dataset lists an ``s3://`` prefix with its RemoteOptions' connect_timeout, not the
    default's 10 s (nor the listing's one-minute cap)."""
    with silent_server() as url:
        aws({"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "AKIA-TEST",
             "AWS_DEFAULT_REGION": "us-east-1"})
        start = time.monotonic()
        with pytest.raises(mmproxy.ShardError, match=r"^cannot list s3://bucket/: "):
            MultiModalDataset("s3://bucket/", {"label": ("cls", int)}, batch_size=4,
                              remote=RemoteOptions(**QUICK))
        assert time.monotonic() - start < 8


def test_the_defaults_give_up_on_a_server_that_stops_answering_within_two_minutes():
    """Worst case with the defaults: the read under way stalls for read_timeout, each retry
    waits connect_timeout for an answer, plus the backoffs (at their longest, no jitter)."""
    options = RemoteOptions()
    backoffs = sum(min(options.backoff * 2 ** k, 30.0) for k in range(options.retries))
    worst = options.read_timeout + options.retries * options.connect_timeout + backoffs
    assert options.give_up_after == worst < 120
    assert options.connect_timeout <= 10  # the first warning comes within seconds
    assert options.connect_timeout * 3 <= options.read_timeout


def test_streaming_yields_samples_before_the_whole_shard(tmp_path):
    """The first sample arrives while the server still holds back the rest of the shard."""
    rng = np.random.default_rng(0)
    write_tar(tmp_path / "big.tar", [{"__key__": f"b{i:02d}", "bin": rng.bytes(50_000)}
                                     for i in range(16)])
    with ShardServer(tmp_path) as server:
        server.fail("big.tar", Fault("stall", after=300_000, seconds=1.5))
        start = time.monotonic()
        samples = read_remote_tar(f"{server.url}/big.tar", RemoteOptions(read_timeout=5))
        first = next(samples)
        assert time.monotonic() - start < 1.0 and first["__key__"] == "b00"
        assert len([first, *samples]) == 16
        assert time.monotonic() - start >= 1.4
        assert server.requests["big.tar"] == 1


def test_a_shard_of_unknown_length_is_read_whole_then_mapped(http, local):
    http.fail("r-1.tar", Fault("unsized"))
    remote = [s["__key__"] for s in read_remote_tar(http_urls(http)[1], RemoteOptions())]
    assert remote == [s["__key__"] for s in read_local_tar(local[1])]


def test_a_shard_of_unknown_length_loses_no_byte_to_short_writes(http, local, monkeypatch):
    """A write that took only part of a chunk dropped the rest from the middle of the shard."""
    import mmproxy.datasets.remote._download as download

    class HalfWrites:
        """os for the download: each write takes half of what it is given (a byte at least)."""

        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            return os.write(fd, data[:max(1, len(data) // 2)])

    http.fail("r-2.tar", Fault("unsized"))
    monkeypatch.setattr(download, "os", HalfWrites())
    assert read_whole(http_urls(http)[2]) == Path(local[2]).read_bytes()


def test_after_the_last_retry_skip_records_and_raise_names_the_url(http, image_server, caplog):
    urls = http_urls(http)
    http.fail("r-2.tar", Fault("status", status=500), times=None)
    http.fail("r-3.tar", Fault("stall", after=2000, seconds=30), times=None)
    opts = RemoteOptions(retries=2, backoff=0.01, read_timeout=0.3)
    with caplog.at_level(logging.WARNING):
        [got], loader = run(urls, image_server, on_error="skip", remote=opts)
    assert {k.split("-")[0] for k in got} == {"s0", "s1"}
    records = {r.shard: r.reason for r in loader.skipped.records}
    assert set(records) == {urls[2], urls[3]}
    assert "HTTP 500" in records[urls[2]] and "gave up after 3 attempts" in records[urls[2]]
    assert "read timed out" in records[urls[3]]
    assert http.requests["r-2.tar"] == 3
    with pytest.raises(mmproxy.ShardError, match="r-2.tar: cannot be read: .*HTTP 500"):
        run(urls[2:3], image_server, remote=opts)


def test_missing_shards_are_records_in_skip_mode(http, s3, aws, image_server):
    [got], loader = run([*http_urls(http)[:1], f"{http.url}/missing.tar"], image_server,
                        on_error="skip")
    assert len(got) == PER_SHARD
    [record] = loader.skipped.records
    assert record.shard.endswith("/missing.tar") and "HTTP 404" in record.reason
    aws(s3[1])
    [got], loader = run([s3[0][0], "s3://bench/missing.tar"], image_server, on_error="skip")
    assert len(got) == PER_SHARD
    [record] = loader.skipped.records
    assert record.shard == "s3://bench/missing.tar" and "NoSuchKey" in record.reason
    with pytest.raises(mmproxy.ShardError, match="s3://bench/missing.tar: cannot be read"):
        run(["s3://bench/missing.tar"], image_server)


def test_most_remote_shards_missing_fails_the_epoch_in_the_api_and_the_cli(tmp_path, image_server):
    """8 of 20 shards on the server, 240 samples: the 12 missing ones (60% of the shards) fail
    the epoch, named with their reasons, through the API and through ``mmproxy demo`` (exit 1,
    not "skipped 0 samples and 12 unreadable shard(s)")."""
    (tmp_path / "srv" / "mm").mkdir(parents=True)
    for s in range(8):
        write_tar(tmp_path / "srv" / "mm" / f"mm-{s:06d}.tar",
                  [{"__key__": f"m{s}-{i:02d}", "jpg": image_bytes(synth_image(s * 30 + i, 48, 64)),
                    "cls": str(i)} for i in range(30)])
    head = (r"12 unreadable shard\(s\) of the 20 tried this epoch \(60\.0%\), more than "
            r"(--max-skipped|max_skipped)=10\.0%")
    with ShardServer(tmp_path / "srv") as server:
        pattern = f"{server.url}/mm/mm-{{000000..000019}}.tar"
        ds = MultiModalDataset(pattern, {"image": ("jpg", image_server.proxy),
                                         "label": ("cls", int)}, batch_size=8, on_error="skip",
                               remote=RemoteOptions(**FAST))
        with pytest.raises(mmproxy.SkipLimitError, match=f"^{head}") as raised:
            for _ in ds.loader(image_server, num_workers=2):
                pass
        assert re.search(r"the first 3 of 12 shards:\n    http://127\.0\.0\.1:\d+/mm/mm-0000\d\d"
                         r"\.tar: unreadable shard: RemoteError: HTTP 404", str(raised.value))
        env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")
        proc = subprocess.run([sys.executable, "-m", "mmproxy.cli", "demo", "--data", pattern,
                               "--quiet", "--device", "cpu", "--batch-size", "8"], env=env,
                              capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(f"mmproxy demo: error: {head}", proc.stderr), proc.stderr
    assert "HTTP 404" in proc.stderr and "the first 3 of 12 shards:" in proc.stderr


def test_an_s3_prefix_or_glob_is_listed_and_an_http_one_is_refused(s3, aws, image_server, http):
    """``s3://BUCKET/PREFIX/`` names its .tar objects (not deeper ones, as a local folder's
    ``*.tar``), a glob the keys it matches within its levels; what lists nothing, or a bucket
    that is not there, is a ShardError naming the URL (not "NoSuchKey (HTTP 404)" per shard);
    HTTP cannot list, and says so."""
    import boto3
    from mmproxy.datasets.shards import expand

    urls, env = s3
    aws(env)
    client = boto3.client("s3")
    for key in ("sub/x-0.tar", "sub/deeper/y-0.tar", "notes.txt"):
        client.put_object(Bucket="bench", Key=key, Body=b"")
    assert expand("s3://bench/") == expand("s3://bench") == expand("s3://bench/r-*.tar") == urls
    assert expand("s3://bench/r-[12].tar") == urls[1:3]
    assert expand("s3://bench/r-?.tar::s3://bench/sub/") == [*urls, "s3://bench/sub/x-0.tar"]
    assert expand("s3://bench/*/x-*.tar") == ["s3://bench/sub/x-0.tar"]
    assert expand("s3://bench/{sub,sub/deeper}/*.tar") == ["s3://bench/sub/x-0.tar",
                                                           "s3://bench/sub/deeper/y-0.tar"]
    with pytest.raises(mmproxy.ShardError, match=r"^no shard matches s3://bench/q-\*\.tar "
                       r"\(5 object\(s\) listed, none matching\)$"):
        expand("s3://bench/q-*.tar")
    with pytest.raises(mmproxy.ShardError, match=r"^no shard matches s3://bench/r-0\.tar/ "
                       r"\(nothing listed; a prefix ending in / names its \.tar, \.tar\.gz and "
                       r"\.tgz objects\)$"):
        expand("s3://bench/r-0.tar/")
    with pytest.raises(mmproxy.ShardError, match=r"^cannot list s3://nowhere/: S3 NoSuchBucket "
                       r"\(HTTP 404\)"):
        expand("s3://nowhere/")
    [got], _ = run("s3://bench/", image_server, workers=2)
    assert len(got) == N_SHARDS * PER_SHARD
    for folder in (f"{http.url}/", f"{http.url}/r-*.tar"):
        with pytest.raises(mmproxy.ShardError, match=r"names a folder or a glob, which HTTP cannot "
                           r"list: folders and globs work for local paths and s3://, gs:// "
                           r"and az:// only"):
            MultiModalDataset(folder, {"image": ("jpg", image_server.proxy)}, batch_size=4)


def test_s3_client_retries_cuts_stalls_and_5xx(shard_dir, local, aws, image_server, caplog):
    """The real S3 client against a faulty endpoint: the same resumes and retries, and no
    credential in any message or log line."""
    [expected], _ = run(local, image_server)
    with ShardServer(shard_dir.parent) as endpoint:
        aws({"AWS_ENDPOINT_URL": endpoint.url, "AWS_ACCESS_KEY_ID": "AKIA-TEST",
             "AWS_DEFAULT_REGION": "us-east-1"})
        urls = [f"s3://bucket/r-{s}.tar" for s in range(N_SHARDS)]
        endpoint.fail("bucket/r-0.tar", Fault("cut", after=5000))
        endpoint.fail("bucket/r-1.tar", Fault("status", status=503))
        endpoint.fail("bucket/r-2.tar", Fault("stall", after=3000, seconds=30))
        opts = RemoteOptions(backoff=0.01, read_timeout=0.5)
        with caplog.at_level(logging.WARNING):
            [got], _ = run(urls, image_server, remote=opts)
        assert same(got, expected)
        assert [endpoint.requests[f"bucket/r-{s}.tar"] for s in range(N_SHARDS)] == [2, 2, 2, 1]
        # every GET signed in its headers (SigV4), resumed ones too: no signature in a URL
        assert not any("X-Amz-Signature=" in query for _, query in endpoint.queries)
        endpoint.fail("bucket/r-3.tar", Fault("status", status=503), times=None)
        opts = RemoteOptions(retries=1, backoff=0.01, read_timeout=0.5)
        with caplog.at_level(logging.WARNING):
            _, loader = run(urls, image_server, on_error="skip", remote=opts)
            with pytest.raises(mmproxy.ShardError) as raised:
                run(urls[3:], image_server, remote=opts)
    [record] = loader.skipped.records
    assert record.shard == urls[3] and "503" in record.reason
    assert "s3://bucket/r-3.tar" in str(raised.value)
    for text in (caplog.text, str(record), str(raised.value), repr(raised.value.__cause__)):
        assert SECRET not in text and "Signature" not in text


def test_s3_a_missing_key_or_refused_credentials_fail_at_once_with_what_to_do(shard_dir, aws):
    """A 404 or a 403 is not retried: one GET each, the 403 said with the variables to set."""
    with ShardServer(shard_dir.parent) as endpoint:
        s3_endpoint(aws, endpoint)
        with pytest.raises(RemoteError, match=r"^S3: not found \(HTTP 404\)$"):
            read_whole("s3://bucket/missing.tar")
        endpoint.fail("bucket/r-1.tar", Fault("status", status=403))
        with pytest.raises(RemoteError, match=r"^S3: credentials refused \(.*403.*\): set "
                           r"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
            read_whole("s3://bucket/r-1.tar")
        assert read_whole("s3://bucket/r-2.tar")
    assert [name for name, _ in endpoint.queries] == ["bucket/missing.tar", "bucket/r-1.tar",
                                                      "bucket/r-2.tar"]


def test_credentials_never_show(http, image_server):
    signed = f"{http.url}/missing.tar?X-Amz-Credential=AKIA&X-Amz-Signature={SECRET}&v=1"
    assert redact(signed) == f"{http.url}/missing.tar?X-Amz-Credential=***&X-Amz-Signature=***&v=1"
    _, loader = run([http_urls(http)[0], signed], image_server, on_error="skip")
    [record] = loader.skipped.records
    assert SECRET not in str(record) and "HTTP 404" in record.reason
    with pytest.raises(RemoteError, match="credentials do not belong in shard URLs") as raised:
        with open_remote(f"http://user:{SECRET}@127.0.0.1:1/x.tar", RemoteOptions()):
            pass
    assert SECRET not in str(raised.value)
