"""What remote shards' failures say, against real servers started here: TLS failures that no
retry mends fail at once and say what to set (``SSL_CERT_FILE``, ``AWS_CA_BUNDLE``); secrets
are masked by where they stand (a signed URL's query, a URL's user info, a header), so a short
credential such as moto's ``x`` leaves the words of a message alone."""
# ruff: noqa: F811 - the fixtures imported from test_remote are the tests' parameters

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest
from mmproxy.datasets import MultiModalDataset
from mmproxy.datasets.remote import RemoteError, RemoteOptions, redact
from mmproxy.datasets.shards import expand
from remote_helpers import (  # noqa: F401 - fixtures
    SECRET,
    aws,
    fresh_s3_state,
    http,
    image_server,
    local,
    read_whole,
    s3,
    s3_endpoint,
    shard_dir,
)
from tls_helpers import LOOPBACK, certificate, https_server, signed_certificate, trust  # noqa: F401

import mmproxy
from mmproxy.apps.bench.remote import Fault, ShardServer

pytestmark = pytest.mark.timeout(120)

def timed_failure(url: str, **options) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(RemoteError) as raised:
        read_whole(url, **options)
    return str(raised.value), time.monotonic() - start


UNTRUSTED = (r"TLS: the certificate of the server did not verify \(self-signed certificate\): "
             r"to trust it, set SSL_CERT_FILE=/path/ca\.pem, a file of the CA certificates to "
             r"trust \(or SSL_CERT_DIR, a folder of them\); trusted now: ")


def test_an_https_certificate_that_does_not_verify_fails_at_once_and_ssl_cert_file_trusts_it(
        shard_dir, local, image_server, trust, tmp_path, caplog):
    """A self-signed certificate: no retry (the defaults would take about 14 s), a message that
    says why and how to trust it, a ShardError naming the shard (redacted); with SSL_CERT_FILE
    at the certificate, urllib's default settings trust it and the shard is read."""
    pem, private = certificate(tmp_path, "self")
    with https_server(shard_dir, pem, private) as (url, server):
        text, took = timed_failure(f"{url}/r-0.tar")
        assert took < 1.0 and re.match(UNTRUSTED, text), (took, text)
        shard = f"{url}/r-0.tar?X-Amz-Signature={SECRET}"
        ds = MultiModalDataset([shard], {"image": ("jpg", image_server.proxy)}, batch_size=4,
                               remote=RemoteOptions())
        start = time.monotonic()
        with caplog.at_level(logging.WARNING), pytest.raises(mmproxy.ShardError) as raised:
            list(ds.loader(image_server, num_workers=0))
        assert time.monotonic() - start < 1.0
        assert re.match(rf"shard {re.escape(url)}/r-0\.tar\?X-Amz-Signature=\*\*\*: cannot be "
                        rf"read: RemoteError: {UNTRUSTED}", str(raised.value)), str(raised.value)
        assert SECRET not in str(raised.value) and not caplog.records  # no retry warned of
        assert server.requests["r-0.tar"] == 0  # no GET went out unverified
        trust(pem)
        assert read_whole(f"{url}/r-0.tar") == Path(local[0]).read_bytes()


@pytest.mark.parametrize("kind, why, fix", [
    ("other-host", r"IP address mismatch, certificate is not valid for '127\.0\.0\.1'",
     r"the shard's URL must name a host the certificate is for"),
    ("expired", r"certificate has expired",
     r"the server needs a certificate in date \(or this machine's clock is wrong\)"),
])
def test_a_trusted_certificate_for_another_host_or_out_of_date_fails_at_once(
        shard_dir, trust, tmp_path, kind, why, fix):
    """Trusted (SSL_CERT_FILE) but not valid for this host or this time: said so at once, with
    what mends it (not SSL_CERT_FILE)."""
    pem, private = certificate(tmp_path, kind, ip="127.0.0.2" if kind == "other-host" else LOOPBACK,
                               expired=kind == "expired")
    trust(pem)
    with https_server(shard_dir, pem, private) as (url, _):
        text, took = timed_failure(f"{url}/r-0.tar")
    assert took < 1.0
    assert re.fullmatch(rf"TLS: the certificate of the server did not verify \({why}\): {fix}",
                        text), text


@contextlib.contextmanager
def closing_server():
    """A server on 127.0.0.1 that closes each connection as soon as it takes it (a handshake
    cut short); yields its port."""
    listener = socket.create_server((LOOPBACK, 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                listener.accept()[0].close()

    thread = threading.Thread(target=accept, name="closing-server", daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def test_a_refused_handshake_fails_at_once_and_a_cut_one_is_retried(http, caplog):
    """https:// to a plain HTTP server: the handshake cannot succeed (wrong version number),
    said at once; a connection closed during the handshake may be a passing failure: retried."""
    url = http.url.replace("http://", "https://", 1)
    text, took = timed_failure(f"{url}/r-0.tar")
    assert took < 1.0
    assert re.fullmatch(r"TLS: the server does not speak TLS on that port \(wrong version number: "
                        r"an http:// server\?\)", text), text
    with closing_server() as port, caplog.at_level(logging.WARNING):
        text, _ = timed_failure(f"https://{LOOPBACK}:{port}/r-0.tar", retries=2, backoff=0.01)
    assert text.endswith("(gave up after 3 attempts)") and "TLS:" not in text, text
    assert len([r for r in caplog.records if "retry" in r.getMessage()]) == 2


def test_an_s3_endpoint_whose_certificate_does_not_verify_names_aws_ca_bundle(
        shard_dir, local, aws, trust, tmp_path):
    """S3 trusts the system's CA certificates (SSL_CERT_FILE's, when set) and AWS_CA_BUNDLE's: a
    GET of an endpoint a private CA signed fails at once naming AWS_CA_BUNDLE, and reads the
    shard once it is set."""
    ca, pem, private = signed_certificate(tmp_path, "s3")
    with https_server(shard_dir.parent, pem, private) as (url, server):
        aws({"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "AKIA-TEST",
             "AWS_DEFAULT_REGION": "us-east-1"})
        text, took = timed_failure("s3://bucket/r-0.tar")
        assert took < 1.0 and re.fullmatch(
            r"TLS: the certificate of the S3 endpoint did not verify \(.+\): to trust it, set "
            r"AWS_CA_BUNDLE=/path/ca\.pem, a file of the CA certificates to trust", text), text
        assert not server.requests
        aws({"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "AKIA-TEST",
             "AWS_DEFAULT_REGION": "us-east-1", "AWS_CA_BUNDLE": str(ca)})
        assert read_whole("s3://bucket/r-0.tar") == Path(local[0]).read_bytes()
        assert server.requests["bucket/r-0.tar"] == 1


# -- secrets masked by where they stand ------------------------------------------------------------


def short_credentials(aws, env, monkeypatch):
    aws(env)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")


def test_short_credentials_leave_the_words_of_messages_alone(s3, aws, monkeypatch, image_server):
    """moto's credentials are ``x``: a missing key and a missing bucket read as S3 words them,
    and an unknown profile as mmproxy does, not "does not e***ist"."""
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
    assert str(raised.value) == (
        "the AWS profile 'experiments' (AWS_PROFILE) is in neither the AWS credentials file nor "
        "the config file (~/.aws/credentials, ~/.aws/config; AWS_SHARED_CREDENTIALS_FILE, "
        "AWS_CONFIG_FILE)")


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
            client = boto3.session.Session().client(  # a session of its own reads this environment
                "s3", config=botocore.config.Config(signature_version=version))
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
    from mmproxy.datasets.remote._answers import masked

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
    assert masked(f"Invalid header value b'Bearer {SECRET}\\n'") == (
        "Invalid header value b'Bearer ***'")
    assert masked(f"sent bearer {SECRET}, then Authorization=Bearer {SECRET}; done") == (
        "sent bearer ***, then Authorization=***; done")


def test_a_header_with_a_newline_is_refused_and_its_value_never_shown():
    """A token read from a file keeps its newline: RemoteOptions refuses it, naming the header
    but not its value, before any GET (http.client's own refusal quotes the value)."""
    for name, value in (("Authorization", f"Bearer {SECRET}\n"), ("X-Key", f"{SECRET}\r"),
                        ("X-Key", f"a\0{SECRET}")):
        with pytest.raises(ValueError, match=rf"^headers: the value of '{name}' holds a CR, LF "
                           r"or NUL \(a newline read from a file\?\): strip it$") as raised:
            RemoteOptions(headers={name: value})
        assert SECRET not in str(raised.value)
    with pytest.raises(ValueError, match=r"^headers: the name 'X-Key\\n' is empty or holds a CR"):
        RemoteOptions(headers={"X-Key\n": "v"})


# -- object stores' settings: each message names the variable to set ------------------------------


REGION = ("<?xml version='1.0' encoding='UTF-8'?>\n<Error><Code>AuthorizationHeaderMalformed</Code>"
          "<Message>The authorization header is malformed; the region 'us-east-1' is wrong; "
          "expecting 'eu-west-1'</Message><Region>eu-west-1</Region></Error>")
REDIRECT = ("<?xml version='1.0' encoding='UTF-8'?>\n<Error><Code>PermanentRedirect</Code>"
            "<Message>The bucket you are attempting to access must be addressed using the "
            "specified endpoint.</Message></Error>")
CONFLICT = ("<?xml version='1.0' encoding='UTF-8'?>\n<Error><Code>InvalidObjectState</Code>"
            "<Message>The operation is not valid for the object's storage class</Message></Error>")


class _S3Says(BaseHTTPRequestHandler):
    """An S3 endpoint answering each key with an error of S3's: ``/b/region`` 400
    AuthorizationHeaderMalformed, ``/b/redirect`` 301 PermanentRedirect (no Location),
    ``/b/archived`` 409 InvalidObjectState."""

    answers = {"/b/region": (400, REGION), "/b/redirect": (301, REDIRECT),
               "/b/archived": (409, CONFLICT)}

    def do_GET(self):  # noqa: N802 - http.server's name
        status, text = self.answers[self.path.partition("?")[0]]
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_s3_errors_keep_s3s_words_and_a_wrong_region_says_to_set_aws_region(aws):
    server = ThreadingHTTPServer((LOOPBACK, 0), _S3Says)
    thread = threading.Thread(target=server.serve_forever, name="s3-says", daemon=True)
    thread.start()
    try:
        aws({"AWS_ENDPOINT_URL": f"http://{LOOPBACK}:{server.server_address[1]}",
             "AWS_ACCESS_KEY_ID": "AKIA-TEST", "AWS_DEFAULT_REGION": "us-east-1"})
        said = {}
        for key in ("region", "redirect", "archived"):
            with pytest.raises(RemoteError) as raised:
                read_whole(f"s3://b/{key}", retries=0)
            said[key] = str(raised.value)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert said == {
        "region": "S3 AuthorizationHeaderMalformed (HTTP 400): The authorization header is "
                  "malformed; the region 'us-east-1' is wrong; expecting 'eu-west-1': set "
                  "AWS_REGION to the bucket's region (eu-west-1)",
        "redirect": "S3: the endpoint redirects without a Location (the bucket is in another "
                    "region): set AWS_REGION to the bucket's region",
        "archived": "S3 InvalidObjectState (HTTP 409): The operation is not valid for the "
                    "object's storage class"}


def test_a_missing_secret_key_or_ca_bundle_names_its_variable(aws, monkeypatch, tmp_path, s3):
    urls, env = s3
    aws(env)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(RemoteError) as raised:
        read_whole(urls[0], retries=0)
    assert str(raised.value) == ("S3: AWS_ACCESS_KEY_ID is set without AWS_SECRET_ACCESS_KEY: set "
                                 "AWS_SECRET_ACCESS_KEY too")
    aws({**env, "AWS_CA_BUNDLE": str(tmp_path / "ca.pem")})
    with pytest.raises(RemoteError) as raised:
        read_whole(urls[0], retries=0)
    assert str(raised.value) == (f"AWS_CA_BUNDLE names {tmp_path / 'ca.pem'}, which cannot be "
                                 "read (No such file or directory): set it to a file of the CA "
                                 "certificates to trust")
    with pytest.raises(mmproxy.ShardError, match=r"^cannot list s3://bench/: AWS_CA_BUNDLE names "):
        expand("s3://bench/")


def test_a_listing_child_that_fails_shows_its_stderr_masked(monkeypatch, tmp_path):
    """The listing's child dies with a traceback quoting a token: the message keeps the
    traceback's words, not the token."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "obstore.py").write_text(
        f"raise RuntimeError('GET https://h/b?token={SECRET} sent Bearer {SECRET}')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "hide"))
    from mmproxy.datasets.remote import _stores

    monkeypatch.setattr(_stores, "_started", [])  # lists in a child, as a fresh main process does
    with pytest.raises(mmproxy.ShardError) as raised:
        expand("s3://b/")
    text = str(raised.value)
    assert text.startswith("cannot list s3://b/: the listing failed: ") and SECRET not in text
    assert "RuntimeError: GET https://h/b?token=*** sent Bearer ***" in text, text


def test_a_permanent_failure_mid_body_is_a_remote_error_the_reader_names(
        shard_dir, local, aws, monkeypatch, image_server):
    """An object's body failing, mid-stream, in a way no retry mends (sorted so here: a real
    cut of the tests' S3 stand-in, said to be a TLS refusal): a RemoteError, which the reader
    turns into a ShardError naming the shard, or a skip record."""
    from mmproxy.datasets.remote import _objects

    monkeypatch.setattr(_objects, "sort", lambda err, scheme: ("tls", "TLS: refused mid-body"))
    with ShardServer(shard_dir.parent) as endpoint:
        s3_endpoint(aws, endpoint)
        endpoint.fail("bucket/r-0.tar", Fault("cut", after=3000), times=None)
        with pytest.raises(RemoteError, match=r"^TLS: refused mid-body$"):
            read_whole("s3://bucket/r-0.tar", retries=0)
        ds = MultiModalDataset(["s3://bucket/r-0.tar", local[1]],
                               {"image": ("jpg", image_server.proxy)}, batch_size=4,
                               on_error="skip", max_skipped=None, remote=RemoteOptions(retries=0))
        loader = ds.loader(image_server, num_workers=0)
        assert sum(len(batch["image"]) for batch in loader) >= 8
        [record] = loader.skipped.records
        assert (record.shard, record.reason) == (
            "s3://bucket/r-0.tar", "unreadable shard: RemoteError: TLS: refused mid-body")
