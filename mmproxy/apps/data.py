"""Data: the shards a ``--data`` option names, and the fields of their first sample (``mmproxy
demo`` and ``mmproxy bench`` on your own shards)."""

from __future__ import annotations

import os
import re
import tarfile
from typing import Any

__all__ = ["expand_data", "first_sample_fields"]


def expand_data(data: str) -> list[str]:
    """The shards ``--data`` names: a folder of ``.tar`` files, or anything the datasets take
    (:func:`~mmproxy.datasets.shards.expand`: a path, a brace pattern, a glob of local paths,
    ``::``-separated lists of them, URLs)."""
    from mmproxy.datasets.shards import expand, local_glob

    if os.path.isdir(data):
        shards = local_glob(os.path.join(data, "*.tar"))
        if not shards:
            raise FileNotFoundError(f"no .tar shard in the folder {data}")
        return shards
    return expand(data)


def first_sample_fields(shards: list[str]) -> tuple[list[str], list[str]]:
    """The shards and the extensions (fields) of the first shard's first sample."""
    first = shards[0]
    local = "://" not in first and not first.startswith("pipe:")
    missing = [s for s in shards if "://" not in s and not s.startswith("pipe:")
               and not os.path.isfile(s)]
    if missing:  # all of them, so no run (or comparison) goes on with part of the data
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise FileNotFoundError(f"no shard at {', '.join(missing[:3])}{more} ({len(missing)} of "
                                f"the {len(shards)} that --data names)")
    exts: list[str] = []
    try:
        if local:
            with tarfile.open(first) as tar:
                key = None
                for member in tar:  # KEY.EXT as webdataset splits it: at the name's first dot
                    match = re.match(r"^((?:.*/|)[^./][^.]*)[.]([^/]*)$", member.name)
                    if not member.isfile() or match is None:
                        continue
                    if key is not None and match[1] != key:
                        break
                    key = match[1]
                    exts.append(match[2].lower())
        elif first.startswith(("http://", "https://", "s3://")):
            from mmproxy.datasets.remote import RemoteError, RemoteOptions
            from mmproxy.datasets.shards import read_remote_tar

            try:
                sample: dict[str, Any] = next(iter(read_remote_tar(first, RemoteOptions())), {})
            except RemoteError as err:
                raise ValueError(str(err)) from err
            exts = [k for k in sample if not k.startswith("__")]
        else:
            import webdataset as wds

            sample = next(iter(wds.WebDataset(first, shardshuffle=False)), {})
            exts = [k for k in sample if not k.startswith("__")]
    except (tarfile.TarError, OSError, ValueError) as err:
        raise ValueError(f"cannot read the first sample of {first}: {err}") from err
    if not exts:
        raise ValueError(f"{first} holds no samples (no tar members named KEY.EXT)")
    return shards, exts
