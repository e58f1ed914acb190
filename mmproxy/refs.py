"""References: what a proxy call returns and what collation turns it into.

A :class:`DALIOutputSampleRef` stands for one output of one proxy call and carries the call's own
inputs. Collating a list of them (``default_collate`` finds the hook this module registers) decides
the batch a server runs: the calls actually present, in batch order. The hook ships those inputs
to the server and returns a :class:`DALIOutputBatchRef`, which names the server, the run and the
output, and which the loader (or ``server.produce_data``) swaps for the real data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate_fn_map

from mmproxy.errors import CollateError

if TYPE_CHECKING:
    from mmproxy.proxy import DALIProxy

__all__ = ["DALIOutputBatchRef", "DALIOutputSampleRef", "PaddedBatch"]


class PaddedBatch(NamedTuple):
    """A batch of variable-shape samples padded with zeros to the largest one.

    Attributes:
        data: ``[batch, *max_shape]`` tensor.
        lengths: int64 ``[batch]`` with each sample's length for 1-D samples, otherwise
            ``[batch, ndim]`` with each sample's full shape.
    """

    data: torch.Tensor
    lengths: torch.Tensor


class _Call:
    """One proxy call: its inputs (one array per pipeline input), shared by its outputs."""

    __slots__ = ("id", "inputs", "key", "proxy")

    def __init__(self, proxy: DALIProxy, call_id: str, inputs: tuple[np.ndarray, ...],
                 key: str | None) -> None:
        self.proxy = proxy
        self.id = call_id
        self.inputs = inputs
        self.key = key


class DALIOutputSampleRef:
    """A future sample: output ``output_idx`` of one proxy call. Collate it; don't open it."""

    __slots__ = ("_call", "output_idx")

    def __init__(self, call: _Call, output_idx: int) -> None:
        self._call = call
        self.output_idx = output_idx

    @property
    def server_name(self) -> str:
        return self._call.proxy.server_name

    def __repr__(self) -> str:
        return (f"DALIOutputSampleRef(server={self.server_name!r}, call={self._call.id!r}, "
                f"output={self.output_idx})")


class DALIOutputBatchRef:
    """A future batch: output ``output_idx`` of run ``run_id`` on one server.

    ``rows`` maps each batch position to a sample of the run (``None`` means one to one); it
    differs from the identity when one call appears more than once in a field.
    """

    __slots__ = ("output_idx", "rows", "run_id", "server_name", "server_uid")

    def __init__(self, server_uid: str, server_name: str, run_id: str, output_idx: int,
                 rows: tuple[int, ...] | None = None) -> None:
        self.server_uid = server_uid
        self.server_name = server_name
        self.run_id = run_id
        self.output_idx = output_idx
        self.rows = rows

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.server_uid, self.server_name, self.run_id, self.output_idx, self.rows)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (self.server_uid, self.server_name, self.run_id, self.output_idx, self.rows) = state

    def __repr__(self) -> str:
        return (f"DALIOutputBatchRef(server={self.server_name!r}, run={self.run_id!r}, "
                f"output={self.output_idx})")


def collate_sample_refs(batch: list[DALIOutputSampleRef], *,
                        collate_fn_map: dict[Any, Any] | None = None) -> DALIOutputBatchRef:
    """Turns one field's sample references into a batch reference, shipping the run's inputs."""
    first = batch[0]
    proxy = first._call.proxy
    for ref in batch:
        if not isinstance(ref, DALIOutputSampleRef):
            raise CollateError(f"a field mixes DALI references with {type(ref).__name__} values")
        if ref._call.proxy.server_uid != proxy.server_uid or ref.output_idx != first.output_idx:
            raise CollateError(
                "one field of the batch holds references to different servers or outputs: "
                f"{first!r} and {ref!r}; give each server output its own field")
    calls: list[_Call] = []
    index: dict[str, int] = {}
    for ref in batch:
        if ref._call.id not in index:
            index[ref._call.id] = len(calls)
            calls.append(ref._call)
    rows = tuple(index[ref._call.id] for ref in batch)
    run_id = proxy.submit(calls)
    return DALIOutputBatchRef(proxy.server_uid, proxy.server_name, run_id, first.output_idx,
                              None if rows == tuple(range(len(calls))) else rows)


# DALI's proxy is used with torch's own DataLoader and default_collate (seed example 3), so the
# hook is registered where default_collate looks; this is the one import-time side effect.
default_collate_fn_map[DALIOutputSampleRef] = collate_sample_refs
