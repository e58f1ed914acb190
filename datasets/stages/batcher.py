"""Batcher: a worker's samples into batches, each carrying the skip records that came before it.

Its state: the batches made, the quota, the addresses of the samples of the batch being filled,
and the records made but not yet given (those that follow a batch that is not a dict); a resumed
batcher reads those samples again and processes them (their proxies run again, and nothing of
them had reached a server before, as their batch was not collated).
docs/internals.md, ``mmproxy.datasets.stages.batcher``, has the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mmproxy.datasets.stages._stage import Stage, pack_addresses, unpack_addresses
from mmproxy.datasets.stages.fields import FieldStage, Processed, SampleFields
from mmproxy.datasets.stages.plan import Work
from mmproxy.datasets.stages.reader import Fetch, Taken

from mmproxy.skips import SHARDS_TRIED, SKIPPED, SkipKind, SkippedSample

__all__ = ["Batcher", "Batching"]


@dataclass(frozen=True)
class Batching:
    """How a worker's samples become batches: made once by the dataset, which reads its batch
    size from it, and given to every batcher of its workers.

    Attributes:
        size: Samples per batch.
        partial: Make the last, smaller batch.
        collate: Turns a list of samples into a batch.
        transform: Applied to each collated batch (e.g. tokenization), or None.
        runs: Makes the batch of the processed samples in place of ``collate`` when the
            fields have batch-route fields (:mod:`mmproxy.datasets.stages._batch_runs`), or None.
    """

    size: int
    partial: bool
    collate: Callable[[list[Any]], Any]
    transform: Callable[[Any], Any] | None = None
    runs: Callable[[list[Processed]], Any] | None = None


class Batcher(Stage[Any]):
    """Batches of one worker's samples (see the module docstring).

    Args:
        fields: The field stage, which gives processed samples and records.
        batching: The batch size and how a batch is made.
        quota: Batches to make at most (None: until the samples run out).
        fetch: Reads the samples at given addresses again (those of a loaded state's batch).
        process: Makes their fields (what the field stage applies to every sample).
        tried: The shards begun since it was last called (carried with each batch's records).
    """

    NAME = "batcher"
    VERSION = 2
    MADE, QUOTA, URLS, BATCH, UNSENT, FIELDS = "made", "quota", "urls", "batch", "unsent", "fields"
    KEYS = (MADE, QUOTA, URLS, BATCH, UNSENT, FIELDS)

    def __init__(self, fields: FieldStage, batching: Batching, *, quota: int | None,
                 fetch: Fetch, process: SampleFields, tried: Callable[[], int]) -> None:
        self.fields, self.batching, self.quota = fields, batching, quota
        self.fetch, self.process, self.tried = fetch, process, tried
        self._start()

    def _start(self) -> None:
        self.made = 0
        self.batch: list[Processed] = []
        self.pending: list[SkippedSample] = []  # records not yet sent
        self._out: list[Any] = []  # items made, not yet given (past the first, only records)
        self._over = False

    def next(self) -> Any:
        while not self._out:
            if self._over:
                raise StopIteration
            self._step()
        return self._out.pop(0)

    def _step(self) -> None:
        """Takes samples until a batch, or records alone, can go out, or the samples end."""
        if self.quota is not None and self.made >= self.quota:
            return self._finish()
        batch, pending, size = self.batch, self.pending, self.batching.size
        for got in self.fields:
            if isinstance(got, SkippedSample):
                pending.append(got)
                if len(pending) >= size:
                    return self._out.append(self._records())  # nothing to batch yet: records alone
            else:
                batch.append(got)
                if len(batch) == size:
                    return self._emit()
        self._finish()

    def _finish(self) -> None:
        self._over = True
        if (self.batch and self.batching.partial
                and (self.quota is None or self.made < self.quota)):
            self._emit()
        sent = self._records()
        if sent[SKIPPED] or sent[SHARDS_TRIED]:
            self._out.append(sent)

    def _emit(self) -> None:
        processed, self.batch = self.batch, []
        self.made += 1
        how = self.batching
        batch = (how.runs(processed) if how.runs is not None
                 else how.collate([p.sample for p in processed]))
        if how.transform is not None:
            batch = how.transform(batch)
        if isinstance(batch, dict):
            batch.update(self._records())
            self._out.append(batch)
        else:
            self._out.append(batch)
            sent = self._records()
            if sent[SKIPPED] or sent[SHARDS_TRIED]:
                self._out.append(sent)

    def _records(self) -> dict[str, Any]:
        """The records so far and the shards begun since the last ones went (emptying both),
        as a batch carries them (:mod:`mmproxy.skips`)."""
        records, self.pending = self.pending, []
        return {SKIPPED: records, SHARDS_TRIED: self.tried()}

    def state_dict(self) -> dict[str, Any]:
        urls, batch = pack_addresses([(p.source, p.url, p.index) for p in self.batch])
        unsent = [([(r.shard, r.key, r.reason, r.kind.value) for r in item[SKIPPED]],
                   item[SHARDS_TRIED]) for item in self._out]  # plain values: weights_only
        return self._pack(**{self.MADE: self.made, self.QUOTA: self.quota, self.URLS: urls,
                             self.BATCH: batch, self.UNSENT: unsent,
                             self.FIELDS: self.fields.state_dict()})

    def _load(self, state: Mapping[str, Any]) -> None:
        """Back to a saved position: the batch being filled is read and processed again."""
        self.fields.reset(state[self.FIELDS])
        self._start()
        self.made, self.quota = int(state[self.MADE]), state[self.QUOTA]
        self._out = [{SKIPPED: [SkippedSample(shard, key, reason, SkipKind(kind))
                                for shard, key, reason, kind in records],
                      SHARDS_TRIED: int(tried)} for records, tried in state[self.UNSENT]]
        addresses = unpack_addresses(state[self.URLS], state[self.BATCH])
        found, self.pending = self.fetch([(url, i) for _, url, i in addresses])
        for source, url, i in addresses:
            if (url, i) in found:
                got = self.process(source, Taken(url, i, found[url, i]))
                if isinstance(got, SkippedSample):
                    self.pending.append(got)
                else:
                    self.batch.append(got)

    def remaining(self, state: Mapping[str, Any]) -> list[list[Work]]:
        """What a state of this batcher has left, per source: the samples of its batch, and
        what the field stage has left."""
        state = self._unpack(state)
        out = self.fields.remaining(state[self.FIELDS])
        for source, url, i in unpack_addresses(state[self.URLS], state[self.BATCH]):
            out[source].insert(0, Work(url, only=(i,)))
        return out
