"""Batch runs: a batch's server fields sent as one run each by the batcher, not through collate.
docs/internals.md, ``mmproxy.datasets.stages._batch_runs``, has the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from mmproxy.datasets.stages.fields import Parsed, Processed

from mmproxy.proxy import DALIProxy
from mmproxy.refs import run_refs

__all__ = ["BatchRuns", "batch_fields"]


def batch_fields(sources: Sequence[Mapping[str, Parsed]]) -> frozenset[str]:
    """The fields that take the batch route: in every source a server field whose function is a
    :class:`~mmproxy.DALIProxy` (not a subclass, nor a function around one), the same server's
    in every source."""
    names = set(sources[0])
    for fields in sources:
        for name, parsed in fields.items():
            if not (parsed.server and type(parsed.fn) is DALIProxy):
                names.discard(name)
    return frozenset(n for n in names
                     if len({cast(DALIProxy, fields[n].fn).server_uid for fields in sources}) == 1)


class BatchRuns:
    """Turns a batch of processed samples into the batch dict, sending each batch-route field as
    one run (see the module docstring).

    Args:
        names: The batch-route fields (:func:`batch_fields`).
        sources: Per source, its parsed fields (each source's own proxies; a batch's run goes
            through its first sample's).
        collate: The collate of the other fields.
    """

    def __init__(self, names: frozenset[str], sources: Sequence[Mapping[str, Parsed]],
                 collate: Callable[[list[Any]], Any]) -> None:
        self.names, self.collate = names, collate
        self.proxies = [{n: cast(DALIProxy, fields[n].fn) for n in names} for fields in sources]

    def __call__(self, batch: list[Processed]) -> Any:
        """The batch dict of ``batch`` (whose samples lose their batch-route fields to it)."""
        first = batch[0]
        order = list(first.sample)
        keys = [p.key for p in batch]
        runs: dict[str, Any] = {}
        for name in order:  # in the order the collate would send them
            if name in self.names:
                proxy = self.proxies[first.source][name]
                runs[name] = run_refs(proxy, proxy.run(keys, [p.sample.pop(name) for p in batch]))
        rest = self.collate([p.sample for p in batch])
        return {k: runs[k] if k in runs else rest[k] for k in order}
