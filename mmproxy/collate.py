"""Collate: the composite collate that turns samples into one batch for several servers.

It is ``default_collate`` (whose map knows :class:`~mmproxy.refs.DALIOutputSampleRef`) made
explicit: each field of DALI references becomes one run on its server and one batch reference;
text tensors and labels are collated as PyTorch does. It then checks the batch's integrity: every
reference belongs to a known server, and no sample reference was left uncollated by a custom inner
collate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import default_collate

from mmproxy._loader import walk as _walk
from mmproxy.errors import CollateError
from mmproxy.protocols import Proxy
from mmproxy.refs import DALIOutputBatchRef, DALIOutputSampleRef, check_servers

__all__ = ["Collate"]


def _identity(server: Any) -> tuple[str, str]:
    """(uid, name) of a DALIServer or of a DALIProxy."""
    if isinstance(server, Proxy):
        return server.server_uid, server.server_name
    return server.uid, server.name


class Collate:
    """Collates samples holding proxy outputs of one or more servers into one batch.

    Args:
        servers: The servers (or their proxies) whose references may appear; a reference of
            another server raises :class:`~mmproxy.errors.CollateError` in the worker, naming it.
            ``None`` accepts any. :class:`~mmproxy.datasets.MultiModalDataset` passes the
            proxies of its server fields.
        inner: The collate applied to the samples; ``default_collate`` when ``None``.
    """

    def __init__(self, servers: Iterable[Any] | None = None,
                 inner: Callable[[list[Any]], Any] | None = None) -> None:
        self._names = None if servers is None else dict(_identity(s) for s in servers)
        self._inner = inner or default_collate

    def __call__(self, samples: list[Any]) -> Any:
        batch = self._inner(samples)
        found = _references(batch)
        left = [r for r in found if isinstance(r, DALIOutputSampleRef)]
        if left:
            raise CollateError(f"the collate left {len(left)} DALI sample references uncollated "
                               f"(first: {left[0]!r}); collate them with default_collate")
        if self._names is not None:
            check_servers([r for r in found if isinstance(r, DALIOutputBatchRef)], self._names,
                          "this collate")
        return batch


_PLAIN = frozenset({str, bytes, int, float, bool, type(None)})


def _references(batch: Any) -> list[Any]:
    """The sample and batch references inside ``batch``, in one walk; a dict's tensors and its
    lists of plain values (keys, captions, numbers) are passed over without a look at each item."""
    kinds = (DALIOutputSampleRef, DALIOutputBatchRef)
    if not isinstance(batch, dict):
        return _walk.collect(batch, kinds)
    found: list[Any] = []
    for value in batch.values():
        if isinstance(value, torch.Tensor) or (
                type(value) is list and set(map(type, value)) <= _PLAIN):
            continue
        found += _walk.collect(value, kinds)
    return found
