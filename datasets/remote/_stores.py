"""Stores: this process's obstore stores for ``s3://``, ``gs://`` and ``az://`` buckets (one per
bucket, environment and timeouts), a failure sorted into words, and listing a prefix.

Only the standard library and obstore are imported here: the main process lists in a child that
runs this file (``python _stores.py list URL TIMEOUT``), because obstore's I/O thread does not
survive a fork and DataLoader workers fork from the main process (:func:`list_objects`).
docs/internals.md, ``mmproxy.datasets.remote._stores``, has the rest.
"""

from __future__ import annotations

import configparser
import contextlib
import fnmatch
import json
import os
import re
import subprocess
import sys
import threading
from datetime import timedelta
from typing import Any, Literal

__all__ = ["EXTRAS", "SCHEMES", "bucket_key", "forked", "list_objects", "missing", "sort", "started",
           "store"]

SCHEMES = ("s3", "gs", "az")
EXTRAS = {"s3": "s3", "gs": "gcs", "az": "azure"}  # mmproxy's extra for each scheme
_NAMES = {"s3": "S3", "gs": "GCS", "az": "Azure"}
_ENV = ("AWS_", "GOOGLE_", "AZURE_", "AZURITE_", "SSL_CERT_FILE")  # what a store is made from
CREDENTIALS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or AWS_PROFILE "
          "with its keys in ~/.aws/credentials",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to the path of a service account's key (a JSON "
          "file), or run `gcloud auth application-default login`",
    "az": "set AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_TOKEN, "
          "or a service principal's AZURE_CLIENT_ID, AZURE_CLIENT_SECRET and AZURE_TENANT_ID)",
}
_TRUST = {"s3": "AWS_CA_BUNDLE", "gs": "SSL_CERT_FILE", "az": "SSL_CERT_FILE"}
# S3's words for a request signed for, or sent to, another region than the bucket's
_REGION_CODES = frozenset({"AuthorizationHeaderMalformed", "PermanentRedirect",
                           "IllegalLocationConstraintException"})
# obstore's failures (the source it names) for a setting it lacks, and what to set
_MISSING = {
    "s3": {"MissingSecretAccessKey": "AWS_ACCESS_KEY_ID is set without AWS_SECRET_ACCESS_KEY: "
                                     "set AWS_SECRET_ACCESS_KEY too",
           "MissingAccessKeyId": "AWS_SECRET_ACCESS_KEY is set without AWS_ACCESS_KEY_ID: set "
                                 "AWS_ACCESS_KEY_ID too",
           "BareRedirect": "the endpoint redirects without a Location (the bucket is in another "
                           "region): set AWS_REGION to the bucket's region"},
    "az": {"MissingAccount": "no storage account: set AZURE_STORAGE_ACCOUNT_NAME (and its "
                             "credentials)"},
}
_STATUS = re.compile(r"status code: (\d{3})")

_lock = threading.Lock()
_stores: dict[tuple[Any, ...], Any] = {}
_started: list[int] = []  # the process whose obstore I/O thread runs (the first GET or list starts it)


def missing(scheme: str) -> str:
    """What a process without obstore is told for a ``scheme://`` shard."""
    return (f"{scheme}:// shards need obstore: pip install obstore (mmproxy's "
            f"[{EXTRAS.get(scheme, 's3')}] extra)")


def bucket_key(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, key)`` of ``s3://BUCKET/KEY`` (``gs://``, ``az://``); the key may be
    empty or a pattern (not split at ``?``: a wildcard here)."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return scheme.lower(), bucket, key


# Words in the names of the environment variables that choose where a scheme's objects come
# from (an endpoint, an emulator, an account, a credentials file), not the secrets themselves.
_WHERE = ("ENDPOINT", "URL", "EMULATOR", "ACCOUNT", "HOST", "PROFILE", "CREDENTIALS")
_SECRET = ("KEY", "SECRET", "TOKEN", "PASSWORD", "SAS")
_SCHEME_ENV = {"s3": ("AWS_",), "gs": ("GOOGLE_", "STORAGE_EMULATOR_HOST"),
               "az": ("AZURE_", "AZURITE_")}


def origin(scheme: str) -> str:
    """What, beside its URL, names the store an object of ``scheme`` comes from here: the
    environment's endpoint, emulator, account and credentials file settings (and for S3 the AWS
    files' endpoint); ``""`` for a scheme whose URL says it all. The node cache keys shards by
    both, so that ``s3://bucket/a.tar`` of two endpoints are two shards."""
    prefixes = _SCHEME_ENV.get(scheme)
    if prefixes is None:
        return ""
    where = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(prefixes)
                   and any(w in k for w in _WHERE) and not any(w in k for w in _SECRET))
    if scheme == "s3":
        with contextlib.suppress(ValueError):  # a missing profile is said when the shard is read
            where.append(f"endpoint={_aws_files().get('endpoint', '')}")
    return "\n".join(where)


def started() -> None:
    """Marks this process as one whose obstore I/O thread runs (before its first GET or list)."""
    if os.getpid() not in _started:
        _started.append(os.getpid())


def forked() -> bool:
    """Whether this process was forked from one whose obstore I/O thread ran: obstore's thread is
    gone here, and its calls would wait for it for ever."""
    return bool(_started) and os.getpid() not in _started


def store(scheme: str, bucket: str, connect_timeout: float, read_timeout: float) -> Any:
    """The store of ``bucket``, made once per process, environment and timeouts. Raises
    ImportError without obstore, ValueError for a configuration obstore refuses."""
    env = tuple(sorted(kv for kv in os.environ.items() if kv[0].startswith(_ENV)))
    key = (os.getpid(), scheme, bucket, env, connect_timeout, read_timeout)
    with _lock:
        found = _stores.get(key)
        if found is None:
            found = _stores[key] = _make(scheme, bucket, connect_timeout, read_timeout)
        return found


def _make(scheme: str, bucket: str, connect_timeout: float, read_timeout: float) -> Any:
    from obstore.store import from_url

    # obstore has one timeout for the answer and each read of the body: the shorter, so that a
    # server that does not answer is told apart in connect_timeout (a stall is resumed anyway)
    client: dict[str, Any] = {
        "allow_http": True, "user_agent": "mmproxy",
        "connect_timeout": timedelta(seconds=connect_timeout),
        "read_timeout": timedelta(seconds=min(connect_timeout, read_timeout)),
        "timeout": timedelta(days=1)}  # a whole GET: none of its own (the reads have theirs)
    bundle = os.environ.get(_TRUST[scheme])
    if bundle:
        try:
            with open(bundle, "rb") as f:
                client["root_certificate"] = f.read()
        except OSError as err:
            raise ValueError(f"{_TRUST[scheme]} names {bundle}, which cannot be read "
                             f"({err.strerror or err}): set it to a file of the CA certificates "
                             "to trust") from None
    config = _aws_files() if scheme == "s3" else {}
    retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=connect_timeout)}  # mmproxy's
    make: Any = from_url  # its overloads want literal types
    return make(f"{scheme}://{bucket}", client_options=client, retry_config=retry, **config)


def _aws_files() -> dict[str, str]:
    """What the AWS config and credentials files give the profile (``AWS_PROFILE``, else
    ``default``) that the environment does not: static keys, region, endpoint."""
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    files = [(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"), profile),
             (os.environ.get("AWS_CONFIG_FILE", "~/.aws/config"),
              profile if profile == "default" else f"profile {profile}")]
    names = {"aws_access_key_id": "access_key_id", "aws_secret_access_key": "secret_access_key",
             "aws_session_token": "session_token", "region": "region",
             "endpoint_url": "endpoint"}
    out: dict[str, str] = {}
    seen = False
    for path, section in files:
        parser = configparser.ConfigParser()
        try:
            parser.read(os.path.expanduser(path))
        except configparser.Error:
            continue
        if parser.has_section(section):
            seen = True
            for name, value in parser.items(section):
                env = {"region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
                       "endpoint_url": ("AWS_ENDPOINT_URL", "AWS_ENDPOINT")}.get(name, ())
                if name in names and not any(e in os.environ for e in env):
                    out.setdefault(names[name], value)
    if not seen and profile != "default":
        raise ValueError(f"the AWS profile {profile!r} (AWS_PROFILE) is in neither the AWS "
                         "credentials file nor the config file (~/.aws/credentials, ~/.aws/config; "
                         "AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE)")
    if "AWS_ACCESS_KEY_ID" in os.environ:  # keys come from the environment, or from the files
        out.pop("access_key_id", None), out.pop("secret_access_key", None)
        out.pop("session_token", None)
    return out


Kind = Literal["transient", "permanent", "missing", "changed", "refused", "no-credentials", "tls",
               "timeout", "cut"]
_IMDS = ("169.254.169.254", "token request", "metadata")  # where credentials are looked for last


def sort(err: BaseException, scheme: str) -> tuple[Kind, str]:
    """An obstore failure as ``(kind, words)``: the words are its first line without the request's
    URL, and what to do where the kind says so (credentials, a CA bundle). Kinds ``timeout`` (no
    byte within the timeout) and ``cut`` (the body ended early) are worth a retry, as is
    ``transient``."""
    name = _NAMES.get(scheme, scheme)
    whole = str(err)
    text = whole.split("\n\nDebug source:", 1)[0].strip()
    text = text.splitlines()[0] if text else type(err).__name__
    kind = type(err).__name__
    status = _STATUS.search(text)
    code = int(status[1]) if status else None
    brief = re.sub(r"Error performing \w+ \S+ in [\d.]+\S*( after \d+ retries[^-]*)?\s*-?\s*", "",
                   text)
    brief = re.sub(r"^Generic \w+ error: ", "", brief)
    if status:
        brief = "HTTP " + re.sub(r"status code: (\d{3}) ([^:<]*).*", r"\1 \2", text[status.start():])
        brief = brief.strip()
    said = re.search(r"<Code>([^<]*)</Code>\s*<Message>([^<\n]*)", whole)  # the store's own words
    if said and code is not None:
        words = f"{name} {said[1]} (HTTP {code}): {said[2].strip()}"
        if code == 404:
            return "missing", words
        if code in (401, 403):
            return "refused", f"{words}: {CREDENTIALS[scheme]}, with access to the bucket"
        if said[1] in _REGION_CODES:
            region = re.search(r"<Region>([^<]+)</Region>", whole)
            where = f" ({region[1].strip()})" if region else ""
            return "permanent", f"{words}: set AWS_REGION to the bucket's region{where}"
        if code < 500 and code not in (408, 425, 429):
            return "permanent", words
    for source, words in _MISSING.get(scheme, {}).items():
        if source in whole:
            return "permanent", f"{name}: {words}"
    if any(word in text for word in _IMDS):
        return "no-credentials", f"{name}: no credentials found: {CREDENTIALS[scheme]}"
    if kind == "NotFoundError" or code == 404:
        return "missing", f"{name}: not found (HTTP 404)"
    if kind == "PreconditionError" or code == 412:
        return "changed", "the shard changed on the server while it was read"
    if kind in ("PermissionDeniedError", "UnauthenticatedError") or code in (401, 403):
        return "refused", (f"{name}: credentials refused ({brief}): {CREDENTIALS[scheme]}, with "
                           f"access to the bucket")
    if "certificate" in whole.lower() or "UnknownIssuer" in whole:
        return "tls", (f"TLS: the certificate of the {name} endpoint did not verify ({brief}): "
                       f"to trust it, set {_TRUST[scheme]}=/path/ca.pem, a file of the CA "
                       f"certificates to trust")
    if kind in ("UnknownConfigurationKeyError", "InvalidPathError", "NotSupportedError"):
        return "permanent", f"{name}: {brief}"
    if code is not None and not (code >= 500 or code in (408, 425, 429)):
        return "permanent", f"{name}: {brief}"
    if "TimedOut" in whole or "kind: Timeout" in whole or "timed out" in text:
        return "timeout", f"{name}: {brief}"
    if "IncompleteBody" in whole or "UnexpectedEof" in whole:
        return "cut", f"{name}: {brief}"
    return "transient", f"{name}: {brief}"


def list_objects(url: str, timeout: float) -> tuple[list[str], int]:
    """The shards an ``s3://``, ``gs://`` or ``az://`` prefix or glob names, sorted, and how many
    objects the listing saw: for ``BUCKET/PREFIX/`` (or ``BUCKET``) its ``.tar``, ``.tar.gz``
    and ``.tgz`` objects (not those under deeper prefixes), for a glob the keys it matches
    (``*``, ``?`` and ``[...]`` within one level of ``/``). Lists in a child process unless this
    one's obstore thread already runs. Raises ``OSError(kind, words)`` (:func:`sort`)."""
    if os.getpid() in _started:
        return _list(url, timeout)
    try:
        done = subprocess.run([sys.executable, "-s", __file__, "list", url, str(timeout)],
                              capture_output=True, text=True, timeout=max(60.0, 6 * timeout),
                              check=False)
    except subprocess.TimeoutExpired:
        raise OSError("transient", f"the listing took over {max(60.0, 6 * timeout):g} s") from None
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        from mmproxy.datasets.remote._answers import masked  # here: the child has no mmproxy

        raise OSError("permanent",
                      f"the listing failed: {masked(done.stderr.strip()[-500:])}") from None
    if "error" in answer:
        raise OSError(answer["error"], answer["words"])
    return answer["shards"], answer["listed"]


def _list(url: str, timeout: float) -> tuple[list[str], int]:
    scheme, bucket, pattern = bucket_key(url)
    try:
        import obstore
    except ImportError:
        raise OSError("import", missing(scheme)) from None
    suffixes = (".tar", ".tar.gz", ".tgz")
    patterns = ([pattern + "*" + suffix for suffix in suffixes]
                if not pattern or pattern.endswith("/") else [pattern])
    wild = min((i for i, c in enumerate(patterns[0]) if c in "*?["), default=len(patterns[0]))
    folder = patterns[0][:wild].rpartition("/")[0]  # obstore lists whole levels of "/"
    deep = "/" in patterns[0][wild:]
    try:
        found = store(scheme, bucket, timeout, timeout)
    except ValueError as err:  # an AWS profile that is not there, a CA bundle
        raise OSError("permanent", str(err)) from None
    except Exception as err:  # noqa: BLE001 - a configuration obstore refuses
        raise OSError(*sort(err, scheme)) from None
    try:
        started()
        if deep:
            keys = [meta["path"] for chunk in obstore.list(found, folder or None)
                    for meta in chunk]
        else:
            keys = [meta["path"] for meta in
                    obstore.list_with_delimiter(found, folder or None)["objects"]]
    except Exception as err:  # noqa: BLE001 - sorted into words
        raise OSError(*sort(err, scheme)) from None
    every = [p.split("/") for p in patterns]
    shards = [f"{scheme}://{bucket}/{key}" for key in sorted(keys)
              if any(len(key.split("/")) == len(levels)
                     and all(map(fnmatch.fnmatchcase, key.split("/"), levels)) for levels in every)]
    return shards, len(keys)


def _main(argv: list[str]) -> None:
    """``list URL TIMEOUT``: the listing as one line of JSON on stdout."""
    _, url, timeout = argv
    try:
        shards, listed = _list(url, float(timeout))
        print(json.dumps({"shards": shards, "listed": listed}))
    except OSError as err:
        print(json.dumps({"error": err.args[0], "words": err.args[1]}))
    sys.stdout.flush()
    os._exit(0)  # obstore's thread is not waited for


if __name__ == "__main__":
    _main(sys.argv[1:])
