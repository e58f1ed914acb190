"""Resolving: swap every server's batch references inside a batch for the servers' outputs.

One walk finds the references; deterministic servers are told the order of their runs first;
a second walk replaces each reference, waiting for its run. GPU outputs are made safe for the
consumer's stream before they are handed over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mmproxy import _convert, _walk
from mmproxy.errors import ServerStateError
from mmproxy.refs import DALIOutputBatchRef

if TYPE_CHECKING:
    from mmproxy.server import DALIServer, _Run


def claim(refs: list[DALIOutputBatchRef], servers: dict[str, DALIServer]) -> None:
    """Tells each deterministic server among ``servers`` which of its runs go next, in order."""
    claims: dict[str, list[str]] = {}
    for ref in refs:
        server = servers.get(ref.server_uid)
        if server is not None and server.deterministic:
            claims.setdefault(ref.server_uid, []).append(ref.run_id)
    for uid, run_ids in claims.items():
        servers[uid]._claim(run_ids)


def resolve(obj: Any, servers: dict[str, DALIServer], *, strict: bool = False) -> Any:
    """Replaces the batch references of ``servers`` (uid -> server) inside ``obj`` with data.

    With ``strict``, a reference to a server not in ``servers`` raises; otherwise it is kept.
    """
    refs = _walk.collect(obj, DALIOutputBatchRef)
    if not refs:
        return obj
    if strict:
        for ref in refs:
            if ref.server_uid not in servers:
                known = ", ".join(repr(s.name) for s in servers.values())
                raise ServerStateError(f"the batch holds references of server {ref.server_name!r}, "
                                       f"which this loader was not given (it has {known})")
    claim(refs, servers)
    runs: dict[tuple[str, str], _Run] = {}
    current = None

    def produce(ref: DALIOutputBatchRef) -> Any:
        nonlocal current
        server = servers.get(ref.server_uid)
        if server is None:
            return ref
        key = (ref.server_uid, ref.run_id)
        run = runs.get(key)
        if run is None:
            run = runs[key] = server._wait(ref)
            if run.event is not None:
                current = current or torch.cuda.current_stream(server._device)
                current.wait_event(run.event)
                for out in run.outputs:
                    for t in _convert.tensors_of(out):
                        if t.is_cuda:  # a GPU pipeline may also have CPU outputs
                            t.record_stream(current)
        return _convert.select(run.outputs[ref.output_idx], ref.rows)

    out = _walk.replace(obj, DALIOutputBatchRef, produce)
    for (uid, _), run in runs.items():
        servers[uid]._release(run)
    return out
