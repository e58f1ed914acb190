"""Shard reader: the raw samples of the work items a shard plan gives, each with its address.

:class:`TarReader` reads one work item: local and remote shards mapped (zero copy; a gzip one
decompressed into memory first), others through webdataset; a shard that cannot be read, or
holds nothing, becomes one :class:`~mmproxy.skips.SkippedSample` record (``on_error="skip"``)
or a :class:`~mmproxy.errors.ShardError`. This is where a shard's skip record is made.
:class:`ShardReader` is the stage: one source's samples for one worker, item after item of its
plan, with the item being read and the next sample index in it as its state; a resumed reader
opens that item again from that index, passing over the samples before it unprocessed.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import webdataset as wds
from mmproxy.datasets.remote import RemoteOptions, redact
from mmproxy.datasets.shards import is_local, is_remote, read_local_tar, read_remote_tar
from mmproxy.datasets.stages._stage import Stage
from mmproxy.datasets.stages.plan import Layout, ShardPlan, Work

from mmproxy.errors import ShardError
from mmproxy.skips import ErrorPolicy, SkipKind, SkippedSample

__all__ = ["Fetch", "ShardReader", "Taken", "TarReader"]


@dataclass(slots=True)  # not frozen: a frozen dataclass is slower to make, once per sample
class Taken:
    """A raw sample (``{ext: bytes}`` with ``__key__`` and ``__url__``) and its address."""

    url: str
    index: int
    raw: dict[str, Any]


Read = Iterator[tuple[int, dict[str, Any]] | SkippedSample]
# addresses (shard, index) -> the raw samples found there, and the records of shards that failed
Fetch = Callable[[Sequence[tuple[str, int]]],
                 tuple[dict[tuple[str, int], dict[str, Any]], list[SkippedSample]]]


class TarReader:
    """Reads work items of shards; picklable (it travels to the workers with the dataset).

    Args:
        policy: The dataset's error policy; in skip mode a shard that cannot be read or is
            empty is a record, else a :class:`~mmproxy.errors.ShardError`.
        remote: How remote shards (``http(s)://``, ``s3://``, ``gs://``, ``az://``) are read.
    """

    def __init__(self, policy: ErrorPolicy, remote: RemoteOptions) -> None:
        self.policy, self.remote = policy, remote
        self._tried = 0  # shards begun since take_tried() last said

    def take_tried(self) -> int:
        """The shards begun since the last call: each work item read from its start, not one
        opened again where a resumed position stands nor one read for a shuffle buffer's or a
        batch's addresses (the loader judges the unreadable ones' share against it)."""
        tried, self._tried = self._tried, 0
        return tried

    def __call__(self, work: Work) -> Read:
        """``(index, sample)`` of the samples ``work`` asks for (those before ``work.start``
        are passed over unprocessed), and the shard's record if it failed or was empty."""
        url = work.url
        wanted = None if work.only is None else set(work.only)
        last = max(work.only) if work.only else -1
        if wanted is not None and not wanted:
            return
        if work.start == 0 and work.only is None:
            self._tried += 1
        failures: list[SkippedSample] = []

        def handler(exn: Exception) -> bool:  # webdataset's: record it, and the shard is over
            failures.append(self._failed(url, exn))
            return False  # (what follows a broken stream fails again: one record a shard)

        count = 0
        if is_local(url) or is_remote(url):
            samples: Iterator[dict[str, Any]] = (read_local_tar(url) if is_local(url)
                                                 else read_remote_tar(url, self.remote))
        else:
            samples = wds.tariterators.tarfile_samples([{"url": url}], handler=handler)
        try:
            for index, sample in enumerate(samples):
                count += 1
                if wanted is not None and index > last:
                    break
                if index >= work.start and (wanted is None or index in wanted):
                    yield index, sample
        except ShardError:  # raised by the handler (on_error="raise"): as it is
            raise
        except (OSError, tarfile.TarError, ValueError) as exn:
            yield self._failed(url, exn)
            return
        yield from failures
        if count == 0 and self.policy.skip and not failures:
            yield SkippedSample(redact(url), "", "empty shard: it holds no files",
                                SkipKind.EMPTY_SHARD)

    def _failed(self, url: str, exn: BaseException) -> SkippedSample:
        reason = _describe(exn)
        if not self.policy.skip:
            raise ShardError(f"shard {redact(url)}: cannot be read: {reason}") from exn
        return SkippedSample(redact(url), "", f"unreadable shard: {reason}",
                             SkipKind.UNREADABLE_SHARD)

    def fetch(self, addresses: Sequence[tuple[str, int]]
              ) -> tuple[dict[tuple[str, int], dict[str, Any]], list[SkippedSample]]:
        """The raw samples at ``addresses``, each shard read once up to the last index wanted;
        and the records of shards that failed on the way."""
        by_url: dict[str, set[int]] = {}
        for url, index in addresses:
            by_url.setdefault(url, set()).add(index)
        found: dict[tuple[str, int], dict[str, Any]] = {}
        records: list[SkippedSample] = []
        for url, indices in by_url.items():
            for got in self(Work(url, only=tuple(sorted(indices)))):
                if isinstance(got, SkippedSample):
                    records.append(got)
                else:
                    found[url, got[0]] = got[1]
        return found, records


class ShardReader(Stage[Taken | SkippedSample]):
    """One source's raw samples for one worker, read item after item of its :class:`ShardPlan`.

    :meth:`~Stage.next` gives a :class:`Taken` or a shard's record; the pass ends with the
    plan's.

    Args:
        plan: The source's shard plan.
        read: Reads a work item (:class:`TarReader`).
        layout: Where the worker sits (for messages).
        drawn_from: When the plan draws shards without end (``resampled``), how many it draws
            from: a reader that meets more than twice as many empty ones in a row (and 100)
            raises rather than drawing forever.
    """

    NAME = "shard reader"
    VERSION = 2
    WORK, NEXT, PLAN = "work", "next", "plan"
    KEYS = (WORK, NEXT, PLAN)

    def __init__(self, plan: ShardPlan, read: Callable[[Work], Read], layout: Layout, *,
                 drawn_from: int | None = None) -> None:
        self.plan, self.read, self.layout, self.drawn_from = plan, read, layout, drawn_from
        self.work: Work | None = None  # the item being read
        self.next_index = 0  # the next sample index to read in it
        self._open: Read | None = None
        self._records: list[SkippedSample] = []  # more records of a shard that failed

    def next(self) -> Taken | SkippedSample:
        if self._records:
            return self._records.pop(0)
        empty = 0  # shards in a row that held nothing
        while True:
            work = self.work
            if work is None:
                work = self.work = self.plan.next()  # StopIteration: the pass is over
            if self._open is None:
                self._open = self.read(work.starting_at(self.next_index))
            got = next(self._open, None)
            if got is None:
                self._close()
                empty += 1
                if self.drawn_from is not None and empty > 2 * self.drawn_from + 100:
                    raise ShardError(f"{self.layout}: {empty} shards drawn in a row held "
                                     "no samples (resampled=True draws forever)")
                continue
            if isinstance(got, SkippedSample):  # the shard failed or was empty: it is over
                self._records = [r for r in self._open if isinstance(r, SkippedSample)]
                self._close()
                return got
            index, raw = got
            self.next_index = index + 1
            return Taken(work.url, index, raw)

    def _close(self) -> None:
        self._open, self.work, self.next_index = None, None, 0

    def _next_pass(self) -> None:
        self._close()
        self._records = []
        self.plan.reset()

    def state_dict(self) -> dict[str, Any]:
        work = None if self.work is None else tuple(self.work)  # a tuple: torch's weights_only
        return self._pack(**{self.WORK: work, self.NEXT: self.next_index,
                             self.PLAN: self.plan.state_dict()})

    def _load(self, state: Mapping[str, Any]) -> None:
        self.plan.reset(state[self.PLAN])
        work = state[self.WORK]
        self._open, self._records = None, []
        self.work, self.next_index = None if work is None else Work(*work), int(state[self.NEXT])

    def remaining(self, state: Mapping[str, Any]) -> list[Work]:
        """What a state of this reader has left: the rest of its item, and the items after
        (nothing of a plan that draws without end)."""
        state = self._unpack(state)
        work = state[self.WORK]
        rest = self.plan.remaining(state[self.PLAN])
        if work is None or self.drawn_from is not None:
            return rest
        return [Work(*work).starting_at(int(state[self.NEXT])), *rest]


# webdataset's errors: a failed pipe's "(args, kwargs): exit N (read) ...", a tar error's
# text with " @ <stream>" added, each with the stream and the url added to its arguments
_PIPE_EXIT = re.compile(r"\(.*\): exit (-?\d+) \(read\).*", re.S)
_AT_STREAM = re.compile(r" @ <.*>\Z", re.S)


def _describe(exn: BaseException) -> str:
    """An error in words: an OSError's message (not its errno); one of webdataset's by its first
    argument (no reprs of its stream or command: the url names the shard), a failed pipe by its
    exit status; else the error's own text."""
    if isinstance(exn, OSError) and exn.strerror:
        return exn.strerror + (f" ({exn.filename})" if exn.filename else "")
    text = _AT_STREAM.sub("", str(exn.args[0]) if len(exn.args) > 1 else str(exn))
    if isinstance(exn, OSError) and (exit := _PIPE_EXIT.fullmatch(text)):
        return f"the command exited with status {exit[1]}"
    return f"{type(exn).__name__}: {text}" if text else type(exn).__name__
