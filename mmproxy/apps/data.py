"""Data: the shards a ``--data`` option names, and the fields of their first sample (``mmproxy
demo`` and ``mmproxy bench`` on your own shards)."""

from __future__ import annotations

import os
import tarfile
from collections.abc import Generator
from typing import Any

__all__ = ["expand_data", "first_sample_fields", "sample_fields"]


def expand_data(data: str) -> list[str]:
    """The shards ``--data`` names: a folder of shards (its ``.tar``, ``.tar.gz`` and ``.tgz``
    files, what the datasets read: :func:`~mmproxy.datasets.shards.folder_shards`), or anything
    the datasets take (:func:`~mmproxy.datasets.shards.expand`: a path, a brace pattern, a glob
    of local paths, URLs), or ``::``-separated lists of them."""
    from mmproxy.datasets.shards import expand, folder_shards

    shards = []
    for item in data.split("::"):  # a folder may be one of several
        if os.path.isdir(item):
            found = folder_shards(item)
            if not found:
                raise FileNotFoundError(f"no shard (.tar, .tar.gz or .tgz file) in the folder "
                                        f"{item}")
            shards += found
        else:
            shards += expand(item)
    return shards


_PROBED = 8  # local shards tried for a first sample before --data is refused


def _samples(shard: str) -> Generator[dict[str, Any], None, None]:
    """The samples of ``shard``, read as the datasets read them."""
    from mmproxy.datasets.shards import is_local, is_remote, read_local_tar

    if is_local(shard):
        samples = read_local_tar(shard, register=False)  # the probe sends nothing to a server
        try:
            yield from samples
        finally:
            samples.close()
        return
    if is_remote(shard):
        from mmproxy.datasets.remote import RemoteError, RemoteOptions
        from mmproxy.datasets.shards import read_remote_tar

        try:
            yield from read_remote_tar(shard, RemoteOptions())
        except RemoteError as err:
            raise ValueError(str(err)) from err
        return
    import webdataset as wds

    yield from wds.WebDataset(shard, shardshuffle=False)


def _first_sample(shard: str) -> dict[str, Any]:
    """The first sample of ``shard`` (empty when it holds none), read as the datasets read it."""
    samples = _samples(shard)
    try:
        return next(samples, {})
    finally:
        samples.close()


def sample_fields(shard: str, count: int) -> list[tuple[str, list[str]]]:
    """The key and the fields of each of the first ``count`` samples of ``shard``."""
    samples = _samples(shard)
    try:
        return [(str(sample.get("__key__", "?")), [k.lower() for k in sample if not k.startswith("__")])
                for _, sample in zip(range(count), samples)]
    finally:
        samples.close()


def first_sample_fields(shards: list[str]) -> tuple[str, list[str]]:
    """The shard the fields were read from and the extensions (fields) of its first sample: the
    first shard that has a sample. A damaged or empty local shard is passed over (the run reports
    it), up to 8 of them; a remote or ``pipe:`` shard that cannot be read stops the search (its
    retries would only be repeated). A first sample whose files lie apart in its shard (a tar
    not sorted by name) is refused with the datasets' reason: its fields are not the sample's."""
    from mmproxy.datasets.shards import is_local, require_files, split_reason

    require_files(shards, "--data")  # all of them, so no run (or comparison) goes on with part
    problems = []
    for shard in shards[:_PROBED]:
        try:
            sample = _first_sample(shard)
        except tarfile.TarError as err:  # damaged content: the next shard may do
            problems.append(f"{shard} cannot be read: {err}")
        except (OSError, ValueError) as err:  # not there, not reachable: say so now
            raise ValueError(f"cannot read the first sample of {shard}: {err}") from err
        else:
            exts = [k.lower() for k in sample if not k.startswith("__")]
            split = split_reason(sample) if exts else None
            if split:
                raise ValueError(f"the first sample of {shard}, {sample['__key__']!r}, cannot be "
                                 f"read: {split}")
            if exts:
                return shard, exts
            problems.append(f"{shard} holds no samples (no tar members named KEY.EXT)")
        if not is_local(shard):
            break
    tried = f"the first {len(problems)} shards" if len(problems) > 1 else "the shard"
    more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    raise ValueError(f"no sample to read the fields from in {tried}: "
                     f"{'; '.join(problems[:3])}{more}")
