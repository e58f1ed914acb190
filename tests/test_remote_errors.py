"""What remote shards' failures say, against real servers started here: secrets are masked by
where they stand (a signed URL's query, a URL's user info, a header), so a short credential
such as moto's ``x`` leaves the words of a message alone."""
# ruff: noqa: F811 - the fixtures imported from test_remote are the tests' parameters

from __future__ import annotations

import contextlib
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import pytest
from mmproxy.datasets import MultiModalDataset
from mmproxy.datasets.remote import RemoteError, RemoteOptions, redact
from mmproxy.datasets.shards import expand
from test_remote import (  # noqa: F401 - fixtures
    SECRET,
    aws,
    fresh_s3_state,
    image_server,
    local,
    read_whole,
    s3,
    s3_endpoint,
    shard_dir,
)

import mmproxy
from mmproxy.apps.bench.remote import ShardServer

pytestmark = pytest.mark.timeout(120)

LOOPBACK = "127.0.0.1"


# -- secrets masked by where they stand ------------------------------------------------------------


def short_credentials(aws, env, monkeypatch):
    aws(env)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")


def test_short_credentials_leave_the_words_of_messages_alone(s3, aws, monkeypatch, image_server):
    """moto's credentials are ``x``: a missing key, a missing bucket and an unknown profile
    read as S3 and boto3 word them, naming the bucket and key, not "does not e***ist"."""
    urls, env = s3
    short_credentials(aws, env, monkeypatch)
    ds = MultiModalDataset(["s3://bench/missing.tar"], {"image": ("jpg", image_server.proxy)},
                           batch_size=4, remote=RemoteOptions(retries=0))
    with pytest.raises(mmproxy.ShardError) as raised:
        list(ds.loader(image_server, num_workers=0))
    assert str(raised.value) == ("shard s3://bench/missing.tar: cannot be read: RemoteError: S3 "
                                 "NoSuchKey (HTTP 404): The specified key does not exist.")
    ds = MultiModalDataset([urls[0], "s3://nobucket/x-0.tar"],
                           {"image": ("jpg", image_server.proxy)}, batch_size=4, on_error="skip",
                           max_skipped=None, remote=RemoteOptions(retries=0))
    loader = ds.loader(image_server, num_workers=0)
    assert sum(len(batch["image"]) for batch in loader) == 8
    [record] = loader.skipped.records
    assert (record.shard, record.reason) == (
        "s3://nobucket/x-0.tar",
        "unreadable shard: RemoteError: S3 NoSuchBucket (HTTP 404): The specified bucket does "
        "not exist")
    with pytest.raises(mmproxy.ShardError, match=r"^cannot list s3://nowhere/: S3 NoSuchBucket "
                       r"\(HTTP 404\): The specified bucket does not exist$"):
        expand("s3://nowhere/")
    monkeypatch.setenv("AWS_PROFILE", "experiments")
    with pytest.raises(RemoteError) as raised:
        read_whole("s3://bench/r-0.tar", retries=0)
    assert str(raised.value) == "ProfileNotFound: The config profile (experiments) could not be found"


class EchoingServer(BaseHTTPRequestHandler):
    """Answers every GET 503 with its request's path in the reason phrase, as a broken server or
    proxy may."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(503, f"Unavailable: {self.path}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def echoing_server():
    server = ThreadingHTTPServer((LOOPBACK, 0), EchoingServer)
    thread = threading.Thread(target=server.serve_forever, name="echoing-server", daemon=True)
    thread.start()
    try:
        yield f"http://{LOOPBACK}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


SIGNED = ("X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE%2F20260101%2Fus-east-1"
          f"%2Fs3%2Faws4_request&X-Amz-Date=20260101T000000Z&X-Amz-Expires=900"
          f"&X-Amz-Security-Token=TOKEN%2Bdo%2Fnot%3Dshow&X-Amz-Signature={SECRET}")


def test_a_server_echoing_a_signed_url_shows_no_signature_token_or_credential(image_server, caplog):
    """A reason phrase that quotes the request (the signed URL): the error, the retry's warning
    and the ShardError keep the words and the parameters' names, never their values."""
    options = {"retries": 1, "backoff": 0.01}
    with echoing_server() as url:
        shard = f"{url}/r-0.tar?{SIGNED}"
        with caplog.at_level(logging.WARNING), pytest.raises(RemoteError) as raised:
            read_whole(shard, **options)
        ds = MultiModalDataset([shard], {"image": ("jpg", image_server.proxy)}, batch_size=4,
                               remote=RemoteOptions(**options))
        with pytest.raises(mmproxy.ShardError) as shard_error:
            list(ds.loader(image_server, num_workers=0))
    shown = ("/r-0.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***&X-Amz-Date=20260101T"
             "000000Z&X-Amz-Expires=900&X-Amz-Security-Token=***&X-Amz-Signature=***")
    assert str(raised.value) == f"HTTP 503 Unavailable: {shown} (gave up after 2 attempts)"
    warning = caplog.records[0].getMessage()  # the first read's retry (the loader's follows)
    assert warning.startswith(f"shard {url}{shown}: HTTP 503 Unavailable: {shown}; retry 1 of 1")
    assert str(shard_error.value).startswith(f"shard {url}{shown}: cannot be read: ")
    for text in (str(raised.value), caplog.text, str(shard_error.value)):
        assert SECRET not in text and "TOKEN" not in text and "AKIAEXAMPLE" not in text, text


def test_redact_masks_signed_urls_and_user_info_by_position(shard_dir, aws):
    """URLs presigned by boto3 (SigV4 with a session token, and SigV2): every signature,
    credential and token value masked, every other parameter as it was; a URL's user info
    masked whole, whatever the password."""
    import boto3
    import botocore.config

    with ShardServer(shard_dir.parent) as endpoint:
        s3_endpoint(aws, endpoint, AWS_SESSION_TOKEN="TOKEN/do+not=show")
        for version in ("s3v4", "s3"):
            client = boto3.client("s3", config=botocore.config.Config(signature_version=version))
            signed = client.generate_presigned_url(
                "get_object", Params={"Bucket": "bucket", "Key": "x/r-0.tar"}, ExpiresIn=900)
            query = dict(parse_qsl(urlsplit(signed).query))
            shown = redact(signed)
            assert shown.startswith(f"{endpoint.url}/bucket/x/r-0.tar?"), shown
            kept = dict(parse_qsl(urlsplit(shown).query))
            secret = {"X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "Signature",
                      "AWSAccessKeyId", "x-amz-security-token"} & set(query)
            assert len(secret) >= 3, query
            assert kept == {k: "***" if k in secret else v for k, v in query.items()}, shown
    assert redact("https://alice:x@example.com:8443/a.tar?v=1") == "https://***@example.com:8443/a.tar?v=1"
    assert redact("https://tok3n@example.com/a.tar") == "https://***@example.com/a.tar"
    assert redact("/data/key=1/x.tar") == "/data/key=1/x.tar"  # a local path: as it is


def test_masked_messages_keep_their_words_and_lose_their_secrets():
    """Text from another library: URLs in it redacted, an Authorization header's value and the
    secret fields of a dict's repr masked; words with "x" in them, and ordinary parameters,
    untouched."""
    from mmproxy.datasets._answers import masked

    assert masked("The specified key does not exist. prefix=train/x-0 max-keys") == (
        "The specified key does not exist. prefix=train/x-0 max-keys")
    assert masked(f'Could not connect to "http://u:pw@h:1/b/k.tar?{SIGNED}", next') == (
        'Could not connect to "http://***@h:1/b/k.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256'
        '&X-Amz-Credential=***&X-Amz-Date=20260101T000000Z&X-Amz-Expires=900'
        '&X-Amz-Security-Token=***&X-Amz-Signature=***", next')
    header = ("Authorization: AWS4-HMAC-SHA256 Credential=AKIAEXAMPLE/20260101/us-east-1/s3/"
              f"aws4_request, SignedHeaders=host, Signature={SECRET}")
    assert masked(f"refused\n{header}\nretry") == "refused\nAuthorization: ***\nretry"
    fields = ("{'Authorization': b'AWS4 Signature=" + SECRET + "', 'X-Amz-Security-Token': 'T0K', "
              "'Location': 'https://h/k?Signature=" + SECRET + "&v=2', 'Host': 'h'}")
    assert masked(fields) == ("{'Authorization': b'***', 'X-Amz-Security-Token': '***', "
                              "'Location': 'https://h/k?Signature=***&v=2', 'Host': 'h'}")
    assert masked("AWSAccessKeyId=AKIA&Signature=abc%2B&Expires=1") == (
        "AWSAccessKeyId=***&Signature=***&Expires=1")
