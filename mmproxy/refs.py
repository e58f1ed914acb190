"""References: what a proxy call returns and what collation turns it into.

A :class:`DALIOutputSampleRef` stands for one output of one proxy call and carries the call's own
inputs. Collating a list of them (``default_collate`` finds the hook this module registers) decides
the batch a server runs: the calls actually present, in batch order. The hook ships those inputs
to the server and returns a :class:`DALIOutputBatchRef`, which names the server, the run and the
output, and which the loader (or ``server.produce_data``) swaps for the real data; :func:`run_refs`
makes the same references for a run sent without sample references.
docs/internals.md, ``mmproxy.refs``, has the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, Protocol

import numpy as np
import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map

from mmproxy.errors import CollateError

if TYPE_CHECKING:
    from mmproxy._context import SampleId


class Submitter(Protocol):
    """What a call's proxy offers its references (:class:`mmproxy.DALIProxy` is one): the
    server's identity, its number of outputs, and sending a batch of calls as one run."""

    server_uid: str
    server_name: str
    num_outputs: int

    def submit(self, calls: list[_Call]) -> str: ...

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

    def __init__(self, proxy: Submitter, call_id: str, inputs: tuple[np.ndarray, ...],
                 key: SampleId | None) -> None:
        self.proxy = proxy
        self.id = call_id
        self.inputs = inputs
        self.key = key


class DALIOutputSampleRef:
    """A future sample: output ``output_idx`` of one proxy call. Collate it; don't open it.

    It is never pickled, iterated or unpacked: each raises :class:`~mmproxy.errors.CollateError`
    naming the collation to use (in a DataLoader worker, pickling defers the error to the main
    process, where the batch is unpickled).
    """

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

    def __iter__(self) -> NoReturn:
        # Without this, webdataset's default collation_fn fails on bare references with "object
        # is not iterable", and unpacking a single-output call with "cannot unpack".
        raise CollateError(
            f"{self!r} is one output of one sample and cannot be iterated or unpacked (the "
            f"pipeline of server {self.server_name!r} has {self._call.proxy.num_outputs} "
            f"output(s)); to batch samples, {_HOW_TO_COLLATE}")

    def __reduce__(self) -> tuple[Any, ...]:
        error = uncollated_error(self)
        if get_worker_info() is None:
            raise error
        # In a DataLoader worker the batch is pickled by the result queue's feeder thread, where
        # an error is only printed and the batch is lost (the main loop would wait for it
        # forever); so the error travels instead and is raised where the batch is unpickled.
        return (_raise_collate_error, (str(error),))

    def __copy__(self) -> DALIOutputSampleRef:
        return self  # immutable; copying must not go through __reduce__

    def __deepcopy__(self, memo: dict[int, Any]) -> DALIOutputSampleRef:
        return self


_HOW_TO_COLLATE = ("collate them with torch's default_collate or mmproxy.Collate(); with "
                   "webdataset, use .batched(n, collation_fn=mmproxy.Collate()) (its default "
                   "collation_fn leaves the references in lists)")


def uncollated_error(ref: DALIOutputSampleRef) -> CollateError:
    """The error for a sample reference that reached the hand-over of a batch uncollated."""
    return CollateError(f"a batch holds an uncollated DALI sample reference, {ref!r}: proxy "
                        f"outputs must be collated where the batch is made; {_HOW_TO_COLLATE}")


def check_servers(refs: Iterable[DALIOutputBatchRef], known: Mapping[str, str], holder: str
                  ) -> None:
    """The rule for a batch's servers, wherever a batch is checked: every reference belongs to a
    server in ``known`` (uid -> name), the servers its ``holder`` (a collate, a loader) was given.

    Raises:
        CollateError: naming the first reference of another server.
    """
    for ref in refs:
        if ref.server_uid not in known:
            raise CollateError(f"the batch holds references of server {ref.server_name!r}, which "
                               f"{holder} was not given (it has {sorted(known.values())})")


def _raise_collate_error(message: str) -> NoReturn:
    raise CollateError(message)


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


def run_refs(proxy: Submitter, run_id: str) -> DALIOutputBatchRef | list[DALIOutputBatchRef]:
    """The references to run ``run_id``'s outputs, as ``default_collate`` makes them of one
    field of its samples' references: one batch reference, or a list of one per output when
    the pipeline has several (``default_collate`` makes a list of a field of tuples)."""
    refs = [DALIOutputBatchRef(proxy.server_uid, proxy.server_name, run_id, i)
            for i in range(proxy.num_outputs)]
    return refs[0] if proxy.num_outputs == 1 else refs


# DALI's proxy is used with torch's own DataLoader and default_collate (seed example 3), so the
# hook is registered where default_collate looks; this is the one import-time side effect.
default_collate_fn_map[DALIOutputSampleRef] = collate_sample_refs
