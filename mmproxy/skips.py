"""Skip report: the samples a loader dropped in one epoch, why, and when that is too many.

A sample is skipped where it fails: in a worker (an unreadable shard, a missing or corrupt field,
a field function that raises) or in a server (the pipeline cannot process it; the server finds
the sample and runs the rest of its batch). Each skip is a :class:`SkippedSample` record; every
batch of a :class:`~mmproxy.datasets.MultiModalDataset` carries its records in ``"__skipped__"``,
and the loader adds them all up in :attr:`mmproxy.DataLoader.skipped`.

The loader turns a run that reads (almost) nothing into an error instead of an empty success:

- nothing delivered yet and ``EMPTY_AFTER`` (1,000) samples or shards skipped:
  :class:`EmptyEpochError` at once (so a resampled or ``epoch_length`` run that can read nothing
  fails within seconds instead of spinning);
- an epoch that ends without delivering a sample: :class:`EmptyEpochError`;
- more than ``max_skipped`` (a fraction of the samples seen) skipped at the end of an epoch, or
  at any multiple of ``CHECK_EVERY`` (10,000) samples seen: :class:`SkipLimitError`. Damage is
  often clustered (one bad shard early in an epoch), so the fraction is not judged on fewer
  samples than that.

Each error gives the counts and the first record of each kind of failure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

from mmproxy.errors import EmptyEpochError, SkipLimitError

__all__ = ["CHECK_EVERY", "EMPTY_AFTER", "SKIPPED", "SkipReport", "SkippedSample", "kind_of"]

SKIPPED = "__skipped__"  # the batch key that carries skip records
EMPTY_AFTER = 1000  # skipped samples with none delivered before an epoch is called empty
CHECK_EVERY = 10_000  # samples seen between two checks of the skipped fraction
_KEEP = 10_000  # records kept per epoch (the counts stay exact)
_KINDS = ("unreadable shard", "empty shard", "missing field", "bad header", "field function failed",
          "pipeline failed")


class SkippedSample(NamedTuple):
    """One skipped sample (or unreadable or empty shard, then ``key`` is empty)."""

    shard: str
    key: str
    reason: str


def kind_of(reason: str) -> str:
    """The kind of failure a reason describes (its leading words), e.g. ``"missing field"``."""
    return next((k for k in _KINDS if reason.startswith(k)), "other")


class SkipReport:
    """What one epoch delivered and skipped.

    Attributes:
        delivered: Samples handed to the training loop.
        skipped: Samples and shards skipped, unreadable or empty (a shard counts once, however
            many samples it held or had left: they were never read, so nobody counted them).
        shards: Of those, the shards (records without a sample key): unreadable ones, and empty
            ones (:attr:`empty_shards`).
        records: The first 10,000 :class:`SkippedSample` records, in arrival order.
        by_kind: Skips per kind of failure (see :func:`kind_of`).
    """

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self.delivered = 0
        self.skipped = 0
        self.shards = 0
        self.records: list[SkippedSample] = []
        self.by_kind: Counter[str] = Counter()
        self._first: dict[str, SkippedSample] = {}
        self._checked_at = 0

    def add(self, delivered: int, records: list[SkippedSample] | list[tuple[str, str, str]]) -> None:
        self.delivered += delivered
        for record in records:
            record = SkippedSample(*record)
            self.skipped += 1
            self.shards += not record.key
            kind = kind_of(record.reason)
            self.by_kind[kind] += 1
            self._first.setdefault(kind, record)
            if len(self.records) < _KEEP:
                self.records.append(record)

    def state_dict(self) -> dict[str, Any]:
        """The counts and the first records (at most 100), for a resumed epoch to go on from."""
        return {"epoch": self.epoch, "delivered": self.delivered, "skipped": self.skipped,
                "shards": self.shards, "by_kind": dict(self.by_kind),
                "first": [tuple(r) for r in self._first.values()],
                "records": [tuple(r) for r in self.records[:100]]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SkipReport:
        report = cls(state["epoch"])
        report.delivered, report.skipped = state["delivered"], state["skipped"]
        report.shards = state.get("shards", 0)  # absent from states saved before it was counted
        report.by_kind.update(state["by_kind"])
        report._first = {kind_of(r[2]): SkippedSample(*r) for r in state["first"]}
        report.records = [SkippedSample(*r) for r in state["records"]]
        return report

    @classmethod
    def merged(cls, states: Sequence[dict[str, Any]], epoch: int) -> SkipReport:
        """Several reports' states (every rank's, for an elastic resume) as one report: the
        counts added up (exact), the records and first records kept as far as the states hold
        them."""
        report = cls(epoch)
        for state in states:
            part = cls.from_state(state)
            report.delivered += part.delivered
            report.skipped += part.skipped
            report.shards += part.shards
            report.by_kind.update(part.by_kind)
            for kind, first in part._first.items():
                report._first.setdefault(kind, first)
            report.records.extend(part.records[:_KEEP - len(report.records)])
        return report

    @property
    def seen(self) -> int:
        return self.delivered + self.skipped

    @property
    def samples_skipped(self) -> int:
        """Of :attr:`skipped`, the samples (the rest are whole shards)."""
        return self.skipped - self.shards

    @property
    def empty_shards(self) -> int:
        """Of :attr:`shards`, those that hold no files (the others could not be read)."""
        return self.by_kind["empty shard"]

    def shards_text(self) -> str:
        """The skipped shards in words: ``"2 unreadable shard(s)"``, ``"1 empty shard(s)"`` or
        ``"2 unreadable and 1 empty shard(s)"``; empty when none was skipped."""
        counts = {"unreadable": self.shards - self.empty_shards, "empty": self.empty_shards}
        words = " and ".join(f"{n} {what}" for what, n in counts.items() if n)
        return f"{words} shard(s)" if words else ""

    def summary(self) -> str:
        """Counts and the first record of each kind, one kind per line."""
        shards = (f" and {self.shards_text()}, their unread samples not counted"
                  if self.shards else "")
        lines = [f"epoch {self.epoch}: {self.delivered} samples delivered, "
                 f"{self.samples_skipped} samples skipped{shards}"]
        for kind, count in self.by_kind.most_common():
            first = self._first[kind]
            where = f"{first.shard}, sample {first.key!r}" if first.key else first.shard
            lines.append(f"  {count} x {kind}; first: {where}: {first.reason}")
        return "\n".join(lines)

    def check(self, max_skipped: float | None, *, final: bool = False) -> None:
        """Raises when the epoch so far (or, with ``final``, the whole epoch) read too little."""
        if self.delivered == 0 and (final or self.skipped >= EMPTY_AFTER):
            hint = ("check the shard paths, the field extensions and the field functions"
                    if self.skipped else "check that the shard pattern matches files with samples")
            raise EmptyEpochError(f"no sample could be used ({hint}):\n{self.summary()}")
        if max_skipped is None or not self.skipped:
            return
        if not final and self.seen - self._checked_at < CHECK_EVERY:
            return
        self._checked_at = self.seen
        if self.skipped > max_skipped * self.seen:
            share = f"{self.skipped / self.seen:.1%}"
            what = (f"{self.samples_skipped} samples and {self.shards_text()} "
                    f"skipped of {self.seen} ({share}, a shard counted as one sample)"
                    if self.shards else f"{self.skipped} of {self.seen} samples skipped ({share})")
            raise SkipLimitError(what, max_skipped, self.summary())

    def __repr__(self) -> str:
        return f"SkipReport(epoch={self.epoch}, delivered={self.delivered}, skipped={self.skipped})"
