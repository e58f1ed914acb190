"""Shards app: ``mmproxy make-shards SOURCE OUTPUT``, a folder of media into WebDataset shards."""

from __future__ import annotations

import argparse

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Writes the shards (see :func:`mmproxy.datasets.make_shards`) and prints what was written."""
    from mmproxy.datasets import make_shards
    from mmproxy.datasets.writer import NoMediaError, OutputExistsError

    try:
        written = make_shards(args.source, args.output, kind=args.kind, max_count=args.max_count,
                              max_size=args.max_size, prefix=args.prefix, overwrite=args.overwrite)
    except (NoMediaError, OutputExistsError) as err:  # said with the command's options
        raise err.for_cli() from None
    print(written.summary())
    return 0
