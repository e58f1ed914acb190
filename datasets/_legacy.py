"""Worker states of the first version (before the dataset was a chain of stages), read again.

A loader state of version 1 carries, per worker, an entry ``{"worker", "workers", "quota",
"state"}``, where ``"state"`` was the worker's position (``"made"``, ``"batch"`` and ``"urls"``,
and ``"order"`` with the mixing generator and per source its pass, item, next index, buffer,
buffer generator and dealt plan), or None with ``"plans"`` for a worker that an elastic resume
had dealt work to. :func:`upgrade` writes the same position into the state of a freshly built
chain, key by key, so the resumed run is the one the old code would have made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mmproxy.errors import StateError

from ._stage import VERSION_KEY, pack_addresses
from .batcher import Batcher
from .buffer import ShuffleBuffer
from .fields import FieldStage
from .mixer import SourceMixer
from .plan import ShardPlan, Work
from .position import PositionStamp
from .reader import ShardReader

__all__ = ["is_first_version", "upgrade"]

Build = Callable[..., PositionStamp]


def is_first_version(state: Any) -> bool:
    return isinstance(state, Mapping) and VERSION_KEY not in state and "state" in state


def upgrade(entry: Mapping[str, Any], build: Build) -> dict[str, Any]:
    """The state of this version that a first-version worker entry stands for."""
    try:
        return _upgrade(entry, build)
    except (KeyError, IndexError, TypeError, ValueError) as err:
        raise StateError(f"a dataset state of the first version that cannot be read "
                         f"({type(err).__name__}: {err}); its keys: {sorted(entry)}") from err


def _upgrade(entry: Mapping[str, Any], build: Build) -> dict[str, Any]:
    old = entry["state"]
    if old is None:  # dealt work by an elastic resume, nothing delivered since
        plans = entry.get("plans")
        dealt = None if plans is None else [[Work(*w) for w in plan] for plan in plans]
        return build(int(entry["epoch"]), int(entry["worker"]), int(entry["workers"]),
                     dealt=dealt, quota=entry["quota"]).state_dict()
    state = build(int(old["epoch"]), int(old["worker"]), int(old["workers"]),
                  quota=old["quota"]).state_dict()
    urls = old["urls"]
    batcher = state[PositionStamp.BATCHER]
    batcher[Batcher.MADE] = int(old["made"])
    batcher[Batcher.URLS], batcher[Batcher.BATCH] = pack_addresses(
        [(s, urls[u], i) for s, u, i in old["batch"]])
    mixer = batcher[Batcher.FIELDS][FieldStage.MIXER]
    order = old["order"]
    names = list(mixer[SourceMixer.SOURCES])
    if len(order["sources"]) != len(names):
        raise ValueError(f"it has {len(order['sources'])} sources, this dataset {len(names)}")
    mixer[SourceMixer.RNG] = order["mix"]
    mixer[SourceMixer.ACTIVE] = [names[s] for s in order["active"]]
    for name, saved in zip(names, order["sources"]):
        buffer = mixer[SourceMixer.SOURCES][name]
        buffer[ShuffleBuffer.TAKEN] = int(saved["taken"])
        buffer[ShuffleBuffer.ENDED] = bool(saved["ended"])
        buffer[ShuffleBuffer.RNG] = saved["rng"]
        buffer[ShuffleBuffer.URLS], buffer[ShuffleBuffer.HELD] = pack_addresses(
            [(0, urls[u], i) for u, i in saved["buffer"]])
        reader = buffer[ShuffleBuffer.READER]
        reader[ShardReader.NEXT] = int(saved["next"])
        plan = reader[ShardReader.PLAN]
        plan[ShardPlan.PASS], plan[ShardPlan.ITEM] = int(saved["pass"]), int(saved["item"])
        plan[ShardPlan.SHARDS] = None  # the first version did not say which shards
        plan[ShardPlan.DEALT] = None if saved["plan"] is None else [tuple(w)
                                                                    for w in saved["plan"]]
    return state
