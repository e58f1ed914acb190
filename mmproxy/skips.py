"""Skip report: what a loader dropped in one epoch (samples and whole shards), why, and when
that is too much.

Each error gives the counts and the first record of each kind of failure, each sample named by
the file it was made from where a lookup given to :func:`add_file_lookup` knows it.
docs/internals.md, ``mmproxy.skips``, has the rest.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from mmproxy.errors import EmptyEpochError, SkipLimitError, StateError

__all__ = ["CHECK_EVERY", "EMPTY_AFTER", "ErrorPolicy", "FileLookup", "OnError", "SHARDS_TRIED",
           "SHARD_CHECK_EVERY", "SKIPPED", "SkipKind", "SkipReport", "SkippedSample",
           "add_file_lookup"]

SKIPPED = "__skipped__"  # the batch key that carries skip records
SHARDS_TRIED = "__shards_tried__"  # the batch key that carries the shards a worker began since
EMPTY_AFTER = 1000  # skipped samples with none delivered before an epoch is called empty
CHECK_EVERY = 10_000  # samples read between two checks of the skipped fraction
SHARD_CHECK_EVERY = 100  # shards tried between two checks of the unreadable share
_KEEP = 10_000  # records kept per epoch (the counts stay exact)
_MORE_OF_A_KIND = 4  # records of a kind a summary lists after the first
_LISTED = 3  # shards named in a shard limit's message
# (shard, key) pairs -> {(shard, key): the file the sample was made from}, for those it knows
FileLookup = Callable[[Sequence[tuple[str, str]]], dict[tuple[str, str], str]]


OnError = Literal["raise", "skip"]


@dataclass(frozen=True)
class ErrorPolicy:
    """What a dataset does with a bad sample or shard, given once: the dataset holds it, and
    hands it to the stages that meet bad data when they are made.

    Attributes:
        on_error: ``"raise"``: a bad sample or shard raises, naming it; ``"skip"``: it is left
            out and reported as a :class:`SkippedSample`.
        max_skipped: In skip mode, the largest fraction of the samples read, and separately of
            the shards tried, that an epoch may skip (:meth:`SkipReport.check`); None: no limit.
    """

    on_error: OnError = "raise"
    max_skipped: float | None = 0.1

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.max_skipped is not None and not 0 <= self.max_skipped <= 1:
            raise ValueError(
                f"max_skipped is a fraction of the samples (0-1), got {self.max_skipped}")

    @property
    def skip(self) -> bool:
        """Whether bad samples and shards are records, not errors."""
        return self.on_error == "skip"


class SkipKind(str, enum.Enum):
    """What kind of failure a skip was; its value is how reports name it (the first words of the
    record's reason)."""

    UNREADABLE_SHARD = "unreadable shard"
    EMPTY_SHARD = "empty shard"
    MISSING_FIELD = "missing field"
    DUPLICATE_FIELD = "duplicate field"
    SPLIT_SAMPLE = "split sample"
    BAD_HEADER = "bad header"
    FIELD_FUNCTION = "field function failed"
    PIPELINE = "pipeline failed"
    OTHER = "other"

    @property
    def whole_shard(self) -> bool:
        """Whether the record stands for a whole shard (its samples were never read)."""
        return self in (SkipKind.UNREADABLE_SHARD, SkipKind.EMPTY_SHARD)

    def __str__(self) -> str:
        return self.value


class SkippedSample(NamedTuple):
    """One skipped sample, or a whole shard (then ``key`` is empty): where, why in words, and
    the kind of failure (mmproxy's records always say; a dataset of your own may leave it
    :attr:`SkipKind.OTHER`)."""

    shard: str
    key: str
    reason: str
    kind: SkipKind = SkipKind.OTHER


def _where(record: SkippedSample, sources: dict[tuple[str, str], str]) -> str:
    if not record.key:
        return record.shard
    source = sources.get((record.shard, record.key))
    return f"{record.shard}, sample {record.key!r}" + (f" (file {source})" if source else "")


_FILE_LOOKUPS: list[FileLookup] = []


def add_file_lookup(lookup: FileLookup) -> None:
    """Has :meth:`SkipReport.summary` name each sample by the file it was made from, where
    ``lookup`` knows it: given ``(shard, key)`` pairs, it returns ``{(shard, key): file}`` for those
    it knows (e.g. :mod:`mmproxy.datasets` reads the manifest ``make-shards`` writes beside its
    shards). A lookup added twice counts once."""
    if lookup not in _FILE_LOOKUPS:
        _FILE_LOOKUPS.append(lookup)


def _sources(records: Iterable[SkippedSample]) -> dict[tuple[str, str], str]:
    """The file of each sample record that a lookup of :func:`add_file_lookup` knows."""
    samples = [(r.shard, r.key) for r in records if r.key]
    found: dict[tuple[str, str], str] = {}
    for lookup in _FILE_LOOKUPS:
        if samples:
            found.update(lookup([s for s in samples if s not in found]))
    return found


def _record(saved: Sequence[Any]) -> SkippedSample:
    """A record from a state: ``(shard, key, reason, kind)``."""
    shard, key, reason, kind = saved
    return SkippedSample(shard, key, reason, SkipKind(kind))


def _saved(record: SkippedSample) -> tuple[str, str, str, str]:
    """A record as plain values (``torch.load(weights_only=True)`` reads them)."""
    return (record.shard, record.key, record.reason, record.kind.value)


class SkipReport:
    """What one epoch delivered and skipped.

    Attributes:
        delivered: Samples handed to the training loop.
        skipped: Records: samples skipped plus whole shards skipped (unreadable or empty).
        shards: Of those, the whole shards: unreadable ones, and empty ones
            (:attr:`empty_shards`).
        shards_tried: Shards the workers began reading this epoch (on this rank), as their
            batches report it; the share of :attr:`shards` is judged against it.
        records: The first 10,000 :class:`SkippedSample` records, in arrival order.
        by_kind: Skips per :class:`SkipKind`.
    """

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self.delivered = 0
        self.skipped = 0
        self.shards = 0
        self.shards_tried = 0
        self.records: list[SkippedSample] = []
        self.by_kind: Counter[SkipKind] = Counter()
        self._first: dict[SkipKind, SkippedSample] = {}
        self._checked_at = 0
        self._shards_checked_at = 0

    def add(self, delivered: int, records: Iterable[SkippedSample], shards_tried: int = 0) -> None:
        """Counts a batch: its samples delivered, its skip records, and the shards its worker
        began since its previous batch."""
        self.delivered += delivered
        self.shards_tried += shards_tried
        for record in records:
            self.skipped += 1
            self.shards += record.kind.whole_shard
            self.by_kind[record.kind] += 1
            self._first.setdefault(record.kind, record)
            if len(self.records) < _KEEP:
                self.records.append(record)

    def state_dict(self) -> dict[str, Any]:
        """The counts and the first records (at most 100), for a resumed epoch to go on from."""
        return {"epoch": self.epoch, "delivered": self.delivered, "skipped": self.skipped,
                "shards": self.shards, "tried": self.shards_tried,
                "by_kind": {kind.value: n for kind, n in self.by_kind.items()},
                "first": [_saved(r) for r in self._first.values()],
                "records": [_saved(r) for r in self.records[:100]]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SkipReport:
        """The report a :meth:`state_dict` gave; one that lacks a part raises
        :class:`~mmproxy.errors.StateError` naming it."""
        missing = sorted({"epoch", "delivered", "skipped", "shards", "tried", "by_kind", "first",
                          "records"} - set(state))
        if missing:
            raise StateError(f"not a skip report state of this version: missing keys {missing}")
        report = cls(state["epoch"])
        report.delivered, report.skipped = state["delivered"], state["skipped"]
        report.shards, report.shards_tried = state["shards"], state["tried"]
        report.by_kind.update({SkipKind(kind): n for kind, n in state["by_kind"].items()})
        report._first = {r.kind: r for r in map(_record, state["first"])}
        report.records = [_record(r) for r in state["records"]]
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
            report.shards_tried += part.shards_tried
            report.by_kind.update(part.by_kind)
            for kind, first in part._first.items():
                report._first.setdefault(kind, first)
            report.records.extend(part.records[:_KEEP - len(report.records)])
        return report

    @property
    def seen(self) -> int:
        """Samples delivered plus records skipped."""
        return self.delivered + self.skipped

    @property
    def samples_skipped(self) -> int:
        """Of :attr:`skipped`, the samples (the rest are whole shards)."""
        return self.skipped - self.shards

    @property
    def samples_read(self) -> int:
        """Samples delivered or skipped (not those of shards that could not be read)."""
        return self.delivered + self.samples_skipped

    @property
    def empty_shards(self) -> int:
        """Of :attr:`shards`, those that hold no files (the others could not be read)."""
        return self.by_kind[SkipKind.EMPTY_SHARD]

    def shards_text(self) -> str:
        """The skipped shards in words: ``"2 unreadable shard(s)"``, ``"1 empty shard(s)"`` or
        ``"2 unreadable and 1 empty shard(s)"``; empty when none was skipped."""
        counts = {"unreadable": self.shards - self.empty_shards, "empty": self.empty_shards}
        words = " and ".join(f"{n} {what}" for what, n in counts.items() if n)
        return f"{words} shard(s)" if words else ""

    def summary(self) -> str:
        """Counts and the first records of each kind (the first on the kind's line, up to
        :data:`_MORE_OF_A_KIND` more under it)."""
        shards = (f" and {self.shards_text()}, their unread samples not counted"
                  if self.shards else "")
        lines = [f"epoch {self.epoch}: {self.delivered} samples delivered, "
                 f"{self.samples_skipped} samples skipped{shards}"]
        listed = [(kind, count, self._first[kind],
                   [r for r in self.records if r.kind == kind and r != self._first[kind]
                    ][:_MORE_OF_A_KIND]) for kind, count in self.by_kind.most_common()]
        sources = _sources(r for _, _, first, more in listed for r in (first, *more))
        for kind, count, first, more in listed:
            lines.append(f"  {count} x {kind.value}; first: {_where(first, sources)}: "
                         f"{first.reason}")
            lines += [f"    then {_where(r, sources)}: {r.reason}" for r in more]
            if count > 1 + len(more):
                lines.append(f"    and {count - 1 - len(more)} more")
        return "\n".join(lines)

    def check(self, max_skipped: float | None, *, final: bool = False) -> None:
        """Raises when the epoch so far (or, with ``final``, the whole epoch) read too little:
        nothing, too many samples skipped, or too many shards unreadable (module docstring)."""
        if self.delivered == 0 and (final or self.skipped >= EMPTY_AFTER):
            self._empty()
        if max_skipped is None:
            return
        read = self.samples_read
        if self.samples_skipped and (final or read - self._checked_at >= CHECK_EVERY):
            self._checked_at = read
            if self.samples_skipped > max_skipped * read:
                raise SkipLimitError(f"{self.samples_skipped} of {read} samples skipped "
                                     f"({self.samples_skipped / read:.1%})", max_skipped,
                                     self.summary())
        tried = max(self.shards_tried, self.shards)  # a dataset may not say what it tried
        if self.shards and (final or tried - self._shards_checked_at >= SHARD_CHECK_EVERY):
            self._shards_checked_at = tried
            if self.shards > max_skipped * tried:
                if self.delivered == 0:
                    self._empty()
                raise SkipLimitError(f"{self.shards_text()} of the {tried} tried this epoch "
                                     f"({self.shards / tried:.1%})", max_skipped,
                                     self.summary() + "\n" + self._first_shards())

    def _empty(self) -> None:
        if self.shards and not self.samples_skipped:
            hint = f"{self.shards_text()} tried, and none could be read"
            raise EmptyEpochError(f"no sample could be used ({hint}):\n{self.summary()}\n"
                                  f"{self._first_shards()}")
        kinds = set(self.by_kind) - {SkipKind.UNREADABLE_SHARD, SkipKind.EMPTY_SHARD}
        hint = ("check that the shard pattern matches files with samples" if not self.skipped else
                "every sample read was skipped, for the reasons below"
                if kinds and kinds <= {SkipKind.BAD_HEADER, SkipKind.PIPELINE} else
                "check the shard paths, the field extensions and the field functions")
        raise EmptyEpochError(f"no sample could be used ({hint}):\n{self.summary()}")

    def _first_shards(self) -> str:
        """The first shards skipped (each once), one per line with its reason."""
        first: dict[str, SkippedSample] = {}
        for record in self.records:
            if record.kind.whole_shard:
                first.setdefault(record.shard, record)
        shards = list(first.values())
        head = (f"  the first {_LISTED} of {len(shards)} shards:" if len(shards) > _LISTED
                else "  the shards:")
        return "\n".join([head, *(f"    {r.shard}: {r.reason}" for r in shards[:_LISTED])])

    def __repr__(self) -> str:
        return (f"SkipReport(epoch={self.epoch}, delivered={self.delivered}, "
                f"skipped={self.skipped}, shards={self.shards})")

