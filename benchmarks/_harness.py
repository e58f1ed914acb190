"""What the benchmark scripts share: their common options, the device and batch size they run
with, the summary of repeated measurements, and the JSON they write (with the command, the commit,
the date, the machine and the code measured, as ``mmproxy bench`` writes them)."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def parser(doc: str, *, workers: int = 2, threads: int = 2,
           batch_size: int | None = None) -> argparse.ArgumentParser:
    """A parser named by the first line of ``doc`` with the options every script takes:
    ``--workers``, ``--threads``, ``--batch-size``, ``--device``, ``--data-dir`` and ``--json``."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--workers", type=int, default=workers, help="DataLoader workers")
    p.add_argument("--threads", type=int, default=threads, help="DALI threads per pipeline")
    p.add_argument("--batch-size", type=int, default=batch_size,
                   help="samples per batch (default: " + (str(batch_size) if batch_size else
                                                          "256 on a GPU, 64 on CPU") + ")")
    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                   help="where the pipelines run (default: the GPU when there is one)")
    p.add_argument("--data-dir", default=None,
                   help="where the data is written once and read again (default: the cache folder)")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def setup(args: argparse.Namespace) -> tuple[bool, int | None, int, Path]:
    """``(gpu, device_id, batch_size, data_dir)`` for the parsed options."""
    from mmproxy.pipelines import resolve_device

    from mmproxy.testing import cache_dir

    gpu, device_id = resolve_device(args.device)
    batch = args.batch_size or (256 if gpu else 64)
    return gpu, device_id, batch, Path(args.data_dir or cache_dir() / "bench")


def spread(values: Sequence[float]) -> dict[str, Any]:
    """The median and the range of repeated measurements (rates or ratios), rounded."""
    if not values:
        raise ValueError("no measurements to summarize")
    return {"median": round(statistics.median(values), 3),
            "range": [round(min(values), 3), round(max(values), 3)]}


def ratios(these: Sequence[float], those: Sequence[float]) -> list[float]:
    """Round by round, ``these[i] / those[i]``: ratios taken within one round only."""
    if len(these) != len(those):
        raise ValueError(f"{len(these)} measurements against {len(those)}: rounds must pair up")
    return [a / b for a, b in zip(these, those)]


def stamped(results: Any) -> dict[str, Any]:
    """``results`` (a dict, or anything else under ``"rows"``) after what every results file
    opens with: the command that ran, the commit measured and the date
    (``mmproxy.apps.bench.report.provenance``)."""
    from mmproxy.apps.bench.report import provenance

    return {**provenance(), **(results if isinstance(results, dict) else {"rows": results})}


def write_json(path: str | None, args: argparse.Namespace, gpu: bool, results: dict[str, Any]) -> None:
    """Writes ``results`` to ``path`` (nothing when None) after the command, the commit, the date
    (:func:`stamped`), the settings and the machine (``mmproxy.apps.bench.report.machine``)."""
    if path is None:
        return
    from mmproxy.apps.bench.report import machine

    out = stamped({"settings": vars(args), "machine": machine(gpu), **results})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")


def mapped_samples(paths: Sequence[str], ext: str) -> list[Any]:
    """The ``ext`` members of the shards ``paths``, as views of read-only mappings of the shards
    (as a server's inputs are), every shard registered with the transport past a worker's usual
    bound, so that the views are sent by reference."""
    import mmap

    import numpy as np
    from mmproxy.datasets._tar import members

    from mmproxy import worker
    from mmproxy._wire import mappings as _mappings

    _mappings.MAX_FILES = max(_mappings.MAX_FILES, len(paths))
    out = []
    for path in paths:
        with open(path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            worker.register_file_mapping(mapping, f.fileno())
        data = np.frombuffer(mapping, np.uint8)
        out += [data[o:o + n] for name, o, n in members(memoryview(mapping))
                if name.endswith("." + ext)]
    return out
