"""Objects: one GET of an ``s3://``, ``gs://`` or ``az://`` shard from a byte offset, through
obstore, its failures sorted into :class:`Transient` and :class:`Permanent`.

Credentials, region and endpoint come from each cloud's environment and files as obstore reads
them (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``), the AWS config and credentials files' profile too;
obstore's own retries are off, so one retry policy, the caller's, covers the request and the body.
"""

from __future__ import annotations

from typing import Any

from mmproxy.datasets.remote._answers import Permanent, Transient, changed, no_answer
from mmproxy.datasets.remote._stores import bucket_key, forked, missing, sort, started, store

__all__ = ["ObjectBody", "prepare_stores"]

_CHUNK = 64 << 10  # obstore hands the body over in pieces of at least this much (a cut loses
# the piece under way: a resumed GET asks for it again)


def prepare_stores(scheme: str) -> None:
    """Imports obstore in this process before DataLoader workers fork from it (its stores are made
    in each worker); ImportError, with what to install for ``scheme://`` shards, without it."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        raise ImportError(missing(scheme)) from None


def _failure(err: BaseException, scheme: str, timeout: float, answered: bool) -> Exception:
    kind, words = sort(err, scheme)
    if kind == "timeout":
        return Transient("read timed out (stalled server: no byte within the read timeout)"
                         if answered else no_answer(timeout))
    if kind in ("transient", "cut"):
        return Transient(words)
    return Permanent(words)


class ObjectBody:
    """The body of an object from byte ``start``; with ``etag``, refused if the object changed."""

    def __init__(self, url: str, start: int, etag: str | None, read_timeout: float,
                 connect_timeout: float) -> None:
        scheme, bucket, key = bucket_key(url)
        if not bucket or not key:
            raise Permanent(f"a shard URL is {scheme}://BUCKET/KEY")
        if forked():
            raise Permanent(
                f"this process was forked from one that had read {scheme}:// shards itself, and "
                "obstore's I/O thread does not survive a fork: read them only in DataLoader "
                "workers, or start the workers with multiprocessing_context='spawn'")
        try:
            import obstore
        except ImportError:
            raise Permanent(missing(scheme)) from None
        self._scheme, self._timeout = scheme, min(read_timeout, connect_timeout)
        try:
            found = store(scheme, bucket, connect_timeout, read_timeout)
        except (ValueError, OSError) as err:  # an AWS profile that is not there, a CA bundle
            raise Permanent(str(err)) from None
        except Exception as err:  # noqa: BLE001 - a configuration obstore refuses
            raise Permanent(sort(err, scheme)[1]) from None
        options: Any = {}
        if start:
            options["range"] = {"offset": start}
        if etag is not None:
            options["if_match"] = etag
        started()
        try:
            result = obstore.get(found, key, options=options)
        except Exception as err:  # noqa: BLE001 - sorted into words
            raise _failure(err, scheme, connect_timeout, False) from None
        meta = result.meta
        self.size: int | None = int(meta["size"])
        self.etag: str | None = meta.get("e_tag")
        changed(etag, self.etag)
        self._stream: Any = result.stream(min_chunk_size=_CHUNK)
        self._piece = memoryview(b"")

    def readinto(self, buffer: memoryview) -> int:
        if not self._piece:
            if self._stream is None:
                return 0
            try:
                self._piece = memoryview(next(self._stream)).cast("B")
            except StopIteration:
                self._stream = None
                return 0
            except Exception as err:  # noqa: BLE001 - a cut or stalled body, sorted
                if sort(err, self._scheme)[0] == "cut":  # the caller says at which byte
                    self._stream = None
                    return 0
                raise _failure(err, self._scheme, self._timeout, True) from None
        n = min(len(buffer), len(self._piece))
        buffer[:n] = self._piece[:n]
        self._piece = self._piece[n:]
        return n

    def close(self) -> None:
        self._stream, self._piece = None, memoryview(b"")
