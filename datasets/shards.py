"""Shards: shard lists, where a worker sits, and the zero-copy tar readers.
docs/internals.md, ``mmproxy.datasets.shards``, has the rest.
"""

from __future__ import annotations

import glob
import mmap
import os
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast
from urllib.parse import urlsplit

import webdataset as wds
from mmproxy.datasets._compressed import HEAD, SUFFIXES, Decompressed, compression, decompress
from mmproxy.datasets._tar import members, streamed_members
from mmproxy.datasets.remote import RemoteOptions, RemoteShard, is_remote, open_remote, redact
from mmproxy.datasets.remote._stores import SCHEMES as STORES
from mmproxy.datasets.remote._stores import list_objects

from mmproxy import worker
from mmproxy.errors import ShardError

__all__ = ["current_epoch", "expand", "folder_shards", "is_local", "is_remote", "local_glob",
           "read_local_tar", "read_remote_tar", "require_files", "split_reason", "worker_info"]


def expand(urls: str | Sequence[str], timeout: float | None = None) -> list[str]:
    """Expands brace patterns (``data-{000..009}.tar``), ``::``-separated lists, globs of local
    paths (``/data/*.tar``: the regular files matching, sorted; one that matches none is a
    :class:`ShardError`), ``~`` at the start of a local path, and ``s3://``, ``gs://`` and
    ``az://`` prefixes and globs (listed with obstore). A local path that exists is taken as
    written, ``[`` in its name or not; see :func:`local_glob` for a glob under a folder whose
    name holds ``[``. ``timeout``: an object store's listing's connect and read timeout
    (default: :class:`~mmproxy.datasets.remote.RemoteOptions`'s ``connect_timeout``)."""
    items = [urls] if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for item in items:
        for url in wds.shardlists.expand_urls(item):
            if is_remote(url):
                out.extend(_expand_remote(url, timeout))
                continue
            if is_local(url) and url.startswith("~"):
                url = os.path.expanduser(url)  # as a shell would (a quoted '~/...' is not)
            if not (is_local(url) and any(c in url for c in "*?[") and not os.path.exists(url)):
                out.append(url)
                continue
            matches = local_glob(url)
            if not matches:
                raise ShardError(f"no shard matches {url} ({_why_none(url)})")
            out.extend(matches)
    if not out:
        raise ShardError(f"the shard list {urls!r} is empty")
    return out


def require_files(shards: Sequence[str], named_by: str) -> None:
    """Raises ``FileNotFoundError`` when local shards among ``shards`` are not files, naming the
    first three, how many of how many, and what named them (``named_by``: ``"--data"``,
    ``"urls"``), so that no run goes on with part of the data. Remote and ``pipe:`` shards are
    not checked here (they are read, retried and counted when the epoch comes to them)."""
    missing = [s for s in shards if is_local(s) and not os.path.isfile(s)]
    if not missing:
        return
    folders = [s for s in missing if os.path.isdir(s)]
    hint = (f"; {folders[0]} is a folder: name its shards, e.g. {_folder_glob(folders[0])}"
            if folders else "")
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    raise FileNotFoundError(f"no shard at {', '.join(missing[:3])}{more} ({len(missing)} of the "
                            f"{len(shards)} that {named_by} names){hint}")


def folder_shards(folder: str) -> list[str]:
    """The shards of a local folder: its files named ``*.tar``, ``*.tar.gz`` or ``*.tgz`` (not
    those of its subfolders), sorted."""
    return sorted(path for suffix in SUFFIXES
                  for path in local_glob(os.path.join(folder, "*" + suffix)))


def _folder_glob(folder: str) -> str:
    """A pattern that names the shards of ``folder``: ``*.tar``, or the suffixes its shards have
    (``*.tar.gz``; ``*.{tar,tgz}``, a brace pattern :func:`expand` takes)."""
    found = folder_shards(folder)
    have = [suffix[1:] for suffix in SUFFIXES if any(p.endswith(suffix) for p in found)] or ["tar"]
    return os.path.join(folder, f"*.{have[0]}" if len(have) == 1 else f"*.{{{','.join(have)}}}")


def _expand_remote(url: str, timeout: float | None) -> list[str]:
    """The shards a remote URL names: itself, or for an object-store prefix ending in ``/`` (or a
    bucket) its ``.tar``, ``.tar.gz`` and ``.tgz`` objects and for a glob the objects it
    matches, listed with obstore (``_stores.list_objects``). HTTP cannot list a folder: an
    ``http(s)://`` URL ending in ``/`` or holding ``*`` or ``[`` is refused. Raises
    :class:`~mmproxy.errors.ShardError`."""
    path = urlsplit(url).path
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in STORES:
        if path.endswith("/") or any(c in path for c in "*["):
            raise ShardError(f"{redact(url)} names a folder or a glob, which HTTP cannot list: "
                             "folders and globs work for local paths and s3://, gs:// and az:// "
                             "only; name the shards, e.g. with a brace pattern like "
                             ".../shard-{000000..000099}.tar")
        return [url]
    key = rest.partition("/")[2]
    if key and not key.endswith("/") and not any(c in key for c in "*?["):
        return [url]
    try:
        found, listed = list_objects(url, timeout if timeout is not None else
                                     RemoteOptions(cache_dir=None).connect_timeout)
    except OSError as err:
        raise ShardError(f"cannot list {redact(url)}: {err.args[-1]}") from None
    if not found:
        seen = f"{listed} object(s) listed, none matching" if listed else "nothing listed"
        rule = ("; a prefix ending in / names its .tar, .tar.gz and .tgz objects"
                if not key or key.endswith("/") else "")
        raise ShardError(f"no shard matches {url} ({seen}{rule})")
    return found


def local_glob(pattern: str) -> list[str]:
    """The regular files (not folders) that a local glob matches, sorted. The longest leading
    folder of ``pattern`` that exists as written is taken literally, so ``/data/run[1]/*.tar``
    globs the folder ``run[1]`` (when it exists; else ``[1]`` is a pattern, as in :mod:`glob`)."""
    folder = os.path.dirname(pattern)
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    if folder:
        pattern = glob.escape(folder) + pattern[len(folder):]
    return sorted(path for path in glob.glob(pattern) if os.path.isfile(path))


def _why_none(pattern: str) -> str:
    """Why a local glob matched no file: it matched only folders, or its folder has no match, or
    its folder does not exist."""
    folders = [p for p in glob.glob(pattern) if os.path.isdir(p)]
    if folders:
        return (f"it matches {len(folders)} folder(s), e.g. {folders[0]}; a shard is a .tar, "
                ".tar.gz or .tgz file: add /*.tar")
    folder = os.path.dirname(pattern)
    if folder and not any(c in folder for c in "*?[") and not os.path.isdir(folder):
        return f"there is no folder {folder}"
    return "no file there has a matching name"


def worker_info() -> tuple[int, int, int, int]:
    """(rank, world size, worker, number of workers), as webdataset sees them."""
    return wds.utils.pytorch_worker_info()


def current_epoch(explicit: int | None) -> int:
    """The epoch: set explicitly, or the mmproxy DataLoader's live epoch, or 0."""
    if explicit is not None:
        return explicit
    epoch = worker.loader_epoch()
    return 0 if epoch is None else epoch


def is_local(url: str) -> bool:
    """Whether ``url`` names a local file (not ``pipe:``, not a ``scheme://`` URL); remote ones
    (:func:`is_remote`) are read by :func:`read_remote_tar`."""
    return not url.startswith("pipe:") and "://" not in url


def read_local_tar(url: str, name: str | None = None, *,
                   register: bool = True) -> Iterator[dict[str, Any]]:
    """Samples of a local tar, grouped by key like webdataset's; fields are memoryviews of a
    read-only mapping of the file (no copy), or of the tar a gzip shard holds (decompressed
    into memory first). Raises ``tarfile.ReadError`` for a damaged shard, or a gzip stream cut
    short or corrupt (after the samples before that point). ``name`` is the shard's ``__url__``
    (default: ``url``).

    The mapping is registered with the transport (unless ``register`` is False) while the shard
    is read, so a worker sends the server the shard's descriptor and the members' offsets instead
    of copying their bytes.
    """
    with open(url, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise tarfile.ReadError("the file is 0 bytes long (not a tar; an empty tar is 1,024 "
                                    "zero bytes)")
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        kind = compression(mapping[:HEAD])
        if register and kind is None:
            worker.register_file_mapping(mapping, f.fileno())
    if kind is None:
        yield from _grouped(memoryview(mapping), name or url)
        return
    shard = decompress(memoryview(mapping), kind)
    del mapping  # the compressed bytes go once decompressed
    yield from _decompressed(shard, name or url, register)


def read_remote_tar(url: str, options: RemoteOptions) -> Iterator[dict[str, Any]]:
    """Samples of a remote shard (``http(s)://``, ``s3://``, ``gs://``, ``az://``), like
    :func:`read_local_tar`'s: streamed (each sample as soon as its bytes are in), or from the
    node cache (see :mod:`mmproxy.datasets.remote`); a gzip shard decompressed as it streams in,
    and read once whole. Raises :class:`~mmproxy.datasets.remote.RemoteError` for a shard that cannot be
    fetched."""
    with open_remote(url, options) as remote:
        remote.wait(min(HEAD, len(remote.view)))
        kind = compression(bytes(remote.view[:HEAD]))
        if kind is None:
            yield from _grouped(remote.view, url, remote)
            return
        shard = decompress(remote.members, kind)
        del remote  # its compressed bytes go before the tar is read
    yield from _decompressed(shard, url, register=True)


def _decompressed(shard: Decompressed, url: str, register: bool) -> Iterator[dict[str, Any]]:
    """The samples of a decompressed shard's tar (:func:`_grouped`), its mapping registered
    while it is read (``register``); then the error of a stream cut short or corrupt, in place
    of the tar's own error at the end of what was decompressed."""
    try:
        if register:
            worker.register_file_mapping(shard.mapping, shard.fd)
    finally:
        os.close(shard.fd)
    try:
        yield from _grouped(memoryview(shard.mapping), url)
    except tarfile.ReadError:
        if shard.error is None:
            raise
    finally:
        if register:  # memory: its samples still held are copied when sent, as a streamed shard's
            worker.release_file_mapping(shard.mapping)
    if shard.error is not None:
        raise shard.error


DUPLICATES = "__duplicates__"  # a raw sample's extensions that more than one member holds
SPLIT = "__split__"  # in a raw sample whose key named members earlier in the tar, others between
KEY_RUNS = "__key_runs__"  # in a raw sample of a whole shard: its _KeyRuns, asked on a missing field


def split_reason(sample: Mapping[str, Any]) -> str | None:
    """Why a raw sample cannot be read, if its key names members apart in its tar (other
    samples' members between): the datasets' "split sample" reason. None when its members follow
    each other, or when that is not known (its shard still streaming in, not yet at the key's
    later members)."""
    runs = sample.get(KEY_RUNS)
    if SPLIT not in sample and not (runs is not None and runs.split(sample["__key__"])):
        return None
    here = ", ".join(repr(k) for k in sorted(k for k in sample if not k.startswith("__")))
    return (f"split sample: its {here} file(s) lie apart from its other files in the tar, other "
            "samples' files between them; a sample's files must follow each other (write the tar "
            "sorted by name, e.g. GNU tar --sort=name -cf SHARD.tar -C FOLDER ., or with mmproxy "
            "make-shards)")


def _key_ext(name: str) -> tuple[str | None, str]:
    """webdataset's key and extension of a member (base_plus_ext's regex): around the first dot
    of the last path component, which is the name's first dot when no "/" follows it; its regex
    only where that is not so, or the name has no dot or starts with one (key None: not a
    sample's member)."""
    prefix, dot, suffix = name.partition(".")
    if not (dot and prefix and "/" not in suffix):
        return wds.tariterators.base_plus_ext(name)
    return prefix, suffix


class _KeyRuns:
    """Which keys of a whole shard name members in more than one run (other samples' members
    between): made on the first question, which comes only where a sample misses a field, so
    that the first part of a split sample is named as such too. One walk over the names."""

    def __init__(self, view: memoryview, url: str) -> None:
        self.view, self.url = view, url
        self._split: set[str] | None = None

    def __eq__(self, other: object) -> bool:  # one shard's, however often it is read
        return isinstance(other, _KeyRuns) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __repr__(self) -> str:
        return f"_KeyRuns({self.url!r})"

    def split(self, key: str) -> bool:
        if self._split is None:
            seen: set[str] = set()
            split: set[str] = set()
            last = None
            try:
                for name, _, _ in members(self.view):
                    prefix, _ = _key_ext(name)
                    if prefix is None or prefix == last:
                        continue
                    (split if prefix in seen else seen).add(prefix)
                    last = prefix
            except tarfile.ReadError:  # a cut shard: what came before the cut
                pass
            self._split = split
        return key in self._split


def _grouped(view: memoryview, url: str, filling: RemoteShard | None = None
             ) -> Iterator[dict[str, Any]]:
    """The tar's members grouped into samples by key; with ``filling`` still filling, each
    member once its bytes have arrived. Where two members of one sample have the same
    extension (case aside) the last is kept and the extension is listed under
    :data:`DUPLICATES`, so that a field reading it makes the sample a bad one. A key whose
    members came earlier in the tar, with other keys' between (a tar made from ``*.jpg *.txt``
    rather than sorted by name), starts a second sample marked :data:`SPLIT`; in a whole shard
    each sample also holds the shard's :class:`_KeyRuns` (:data:`KEY_RUNS`), which the field
    stage asks where a field is missing, so that the first part is named a split sample too. (A
    sample appended again, ``tar -r``, is such a second part.)"""
    streamed = filling is not None and filling.members is not view
    found = (streamed_members(cast(memoryview, filling.members)) if streamed and filling
             else members(view))  # the whole shard is there: its headers are read in bulk
    # A sample goes out once the next key starts or the tar ends, so when members() raises for a
    # cut shard the sample being gathered is dropped with the error, even when the cut is only in
    # the padding after its last member and that member is whole: the cut also lost whatever
    # followed, perhaps more fields of the same sample, so it could go out incomplete (a "missing
    # field" skip, or a SampleError in place of the shard's own error). The cut shard stays one
    # record, its unread samples uncounted.
    key: str | None = None
    current: dict[str, Any] = {}
    ended: set[str] = set()  # the keys whose members have ended (about 100 bytes each)
    runs = None if streamed else _KeyRuns(view, url)
    wait = filling.wait if streamed and filling else None
    for name, offset, size in found:
        prefix, dot, suffix = name.partition(".")  # _key_ext's fast case, inline
        if not (dot and prefix and "/" not in suffix):
            prefix, suffix = wds.tariterators.base_plus_ext(name)
            if prefix is None:
                continue
        if prefix != key:
            if key is not None:
                ended.add(key)
                yield current
            key, current = prefix, {"__key__": prefix, "__url__": url, KEY_RUNS: runs}
            if prefix in ended:
                current[SPLIT] = True
        if wait:
            wait(offset + size)
        ext = suffix.lower()
        if ext in current:  # which of the two is meant is unknown: a field that reads it is bad
            current.setdefault(DUPLICATES, set()).add(ext)
        current[ext] = view[offset:offset + size]
    if filling is not None:
        filling.wait(len(view))
    if key is not None:
        yield current
