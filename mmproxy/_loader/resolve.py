"""Resolving: swap every server's batch references inside a batch for the servers' outputs.

One walk finds the references; deterministic servers are told the order of their runs first;
every run is waited for; then, when a server dropped samples it could not process (skip mode),
their rows are removed from every field of the batch (see :func:`drop_rows`) so that the fields
stay aligned; a last walk replaces each reference. GPU outputs are made safe for the consumer's
stream before they are handed over.
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch

from mmproxy._loader import walk as _walk
from mmproxy._server import convert as _convert
from mmproxy._server.runs import Run, RunTable
from mmproxy.errors import PipelineError
from mmproxy.refs import DALIOutputBatchRef, DALIOutputSampleRef, check_servers, uncollated_error
from mmproxy.skips import SKIPPED, SkipKind, SkippedSample


class Resolved(NamedTuple):
    """A resolved batch, how many samples it holds (None: no references to count by), and the
    samples that servers dropped from it."""

    batch: Any
    size: int | None
    dropped: list[SkippedSample]


def claim(refs: list[DALIOutputBatchRef], servers: dict[str, RunTable],
          tag: tuple[str, int] | None = None) -> None:
    """Tells each deterministic server among ``servers`` which of its runs go next, in order
    (``tag``: the loader and epoch they belong to)."""
    claims: dict[str, list[str]] = {}
    for ref in refs:
        server = servers.get(ref.server_uid)
        if server is not None and server.deterministic:
            claims.setdefault(ref.server_uid, []).append(ref.run_id)
    for uid, run_ids in claims.items():
        servers[uid].claim(run_ids, tag)


def resolve(obj: Any, servers: dict[str, RunTable], *, strict: bool = False) -> Any:
    """Replaces the batch references of ``servers`` (uid -> run table) inside ``obj`` with data.

    With ``strict``, a reference to a server not in ``servers`` raises
    :class:`~mmproxy.errors.CollateError` (:func:`~mmproxy.refs.check_servers`); otherwise it is
    kept.
    A sample reference (a proxy output that was never collated) raises
    :class:`~mmproxy.errors.CollateError` either way: no server can ever produce it.
    """
    return resolve_batch(obj, servers, strict=strict).batch


def resolve_batch(obj: Any, servers: dict[str, RunTable], *, strict: bool = False) -> Resolved:
    """:func:`resolve`, also saying how many samples the batch holds and which were dropped."""
    found = _walk.collect(obj, (DALIOutputBatchRef, DALIOutputSampleRef))
    refs = [r for r in found if isinstance(r, DALIOutputBatchRef)]
    if len(refs) < len(found):  # e.g. webdataset's .batched() with its default collation
        raise uncollated_error(next(r for r in found if isinstance(r, DALIOutputSampleRef)))
    if not refs:
        return Resolved(obj, None, [])
    if strict:
        check_servers(refs, {uid: table.name for uid, table in servers.items()}, "this loader")
    claim(refs, servers)
    runs: dict[tuple[str, str], Run] = {}
    try:
        _wait_all(refs, servers, runs)
        size, drop, dropped = _dropped_rows(refs, runs)
        if drop and len(runs) < len({(r.server_uid, r.run_id) for r in refs}):
            left = sorted({r.server_name for r in refs if (r.server_uid, r.run_id) not in runs})
            raise PipelineError(
                f"samples were dropped from this batch ({_shown(dropped)}), but it also holds "
                f"references of server(s) {left} that are not resolved with it, whose rows could "
                "not be dropped too: resolve every server's references in one call (one "
                "mmproxy.DataLoader given all the servers)")
        if drop:
            obj = drop_rows(obj, size, drop, dropped)
        keep = None if not drop else [p for p in range(size) if p not in drop]
        out = _walk.replace(obj, DALIOutputBatchRef, partial(_produce, runs=runs, keep=keep))
    finally:
        for (uid, _), run in runs.items():
            servers[uid].release(run)
    return Resolved(out, size - len(drop), dropped)


def _wait_all(refs: list[DALIOutputBatchRef], servers: dict[str, RunTable],
              runs: dict[tuple[str, str], Run]) -> None:
    """Waits for every run of the batch (into ``runs``) and makes GPU outputs safe to use on the
    consumer's current stream."""
    current = None
    for ref in refs:
        server = servers.get(ref.server_uid)
        key = (ref.server_uid, ref.run_id)
        if server is None or key in runs:
            continue
        run = runs[key] = server.wait(ref.run_id)
        if run.event is not None:
            current = current or torch.cuda.current_stream(server.device)
            current.wait_event(run.event)
            for out in run.outputs:
                for t in _convert.tensors_of(out):
                    if t.is_cuda:  # a GPU pipeline may also have CPU outputs
                        t.record_stream(current)


def _produce(ref: DALIOutputBatchRef, *, runs: dict[tuple[str, str], Run], keep: list[int] | None) -> Any:
    """The data of one reference: its run's output, at the batch's rows that are kept."""
    run = runs.get((ref.server_uid, ref.run_id))
    if run is None:
        return ref
    output = run.outputs[ref.output_idx]
    if keep is None and run.kept is None:
        return _convert.select(output, ref.rows)
    rows = ref.rows if ref.rows is not None else range(len(run.keys))
    at = {sample: row for row, sample in enumerate(run.kept)} if run.kept is not None else None
    wanted = [rows[p] for p in (keep if keep is not None else range(len(rows)))]
    if not wanted:
        return []  # every sample of the batch was dropped; the loader skips the batch
    return _convert.select(output, tuple(at[s] if at is not None else s for s in wanted))


def _dropped_rows(refs: list[DALIOutputBatchRef], runs: dict[tuple[str, str], Run]
                  ) -> tuple[int, set[int], list[SkippedSample]]:
    """(batch size, positions dropped by any server, a record per dropped sample)."""
    sizes = set()
    drop: set[int] = set()
    dropped: list[SkippedSample] = []
    noted: set[int] = set()  # batch positions already recorded (one record per sample)
    for ref in refs:
        run = runs.get((ref.server_uid, ref.run_id))
        if run is None:
            continue
        rows = ref.rows if ref.rows is not None else range(len(run.keys))
        sizes.add(len(rows))
        for position, sample in enumerate(rows):
            reason = run.dropped.get(sample)
            if reason is None:
                continue
            drop.add(position)
            if position not in noted:
                noted.add(position)
                key = run.keys[sample]
                shard, name = (key.shard or "", key.key) if key is not None else ("", f"#{sample}")
                dropped.append(SkippedSample(shard, name, reason, SkipKind.PIPELINE))
    size = max(sizes)
    if drop and len(sizes) > 1:
        raise PipelineError(f"a server dropped samples it could not process, but the batch's fields "
                            f"hold different numbers of samples ({sorted(sizes)}), so the rows of "
                            f"the dropped samples cannot be found in every field: {_shown(dropped)}")
    return size, drop, dropped


def _shown(records: list[SkippedSample]) -> str:
    more = f" and {len(records) - 3} more" if len(records) > 3 else ""
    return "; ".join(f"{r.shard + ':' if r.shard else ''}{r.key}: {r.reason}" for r in records[:3]) + more


def drop_rows(batch: Any, size: int, drop: set[int], dropped: list[SkippedSample]) -> Any:
    """Removes batch positions ``drop`` from every field that holds one row per sample.

    Such fields are tensors and arrays with ``size`` rows, and lists of ``size`` items (keys,
    captions, variable-length tensors) that hold no server reference (a list that does is the
    batch's own structure, e.g. a collated tuple, and is walked into); references are left to the
    resolver. A dict's ``"__skipped__"`` list gets the ``dropped`` records instead. So every field
    a collate or ``batch_transform`` adds must hold one row per sample: a batch-level tensor whose
    first dimension happens to be the batch size (a ``[B, B]`` similarity target) would be cut too.
    """
    keep = [p for p in range(size) if p not in drop]
    return _drop(batch, size, keep, torch.tensor(keep, dtype=torch.int64), dropped)


def _drop(x: Any, size: int, keep: list[int], index: torch.Tensor, dropped: list[SkippedSample]) -> Any:
    # A module-level function, not a recursive closure (a closure cycle would keep the batch's
    # tensors alive until the cyclic collector runs; see mmproxy._loader.walk).
    if isinstance(x, DALIOutputBatchRef):
        return x
    if isinstance(x, torch.Tensor):
        return x[index.to(x.device)] if x.dim() and x.shape[0] == size else x
    if isinstance(x, np.ndarray):
        return x[keep] if x.ndim and x.shape[0] == size else x
    if isinstance(x, list):
        if len(x) == size and not _walk.collect(x, DALIOutputBatchRef):
            return [x[p] for p in keep]  # one item per sample (keys, captions, variable tensors)
        return [_drop(v, size, keep, index, dropped) for v in x]
    if isinstance(x, tuple):
        items = [_drop(v, size, keep, index, dropped) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if isinstance(x, dict):
        out = copy.copy(x)
        for k, v in x.items():
            out[k] = list(v) + dropped if k == SKIPPED else _drop(v, size, keep, index, dropped)
        return out
    return x
