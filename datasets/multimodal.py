"""MultiModalDataset: WebDataset shards into batches whose heavy fields go through servers.

Stages, each a small generator over the previous one, all running in DataLoader workers::

    shard urls -> (shuffle per epoch) -> split by node -> split by worker -> tar members
      -> samples (grouped by key) -> shuffle buffer (raw bytes) -> fields: header check, then
         proxy or function -> batches (composite collate) -> batch transform

Bad samples: a sample with a missing, empty or corrupt field (header checks), or a field function
that raises, never reaches a server; a sample that passes the checks but that a server's pipeline
cannot process (damage inside the compressed data) is found by the server (see
:class:`~mmproxy.DALIServer`). With ``on_error="raise"`` either raises, naming the shard and the
key (:class:`~mmproxy.errors.SampleError`, :class:`~mmproxy.errors.PipelineError`); a shard that
cannot be opened raises :class:`~mmproxy.errors.ShardError`. With ``on_error="skip"`` the sample
(or shard) is left out and reported as a :class:`~mmproxy.skips.SkippedSample` ``(shard, key,
reason)`` in the next batch's ``"__skipped__"`` list, and in the loader's
:attr:`~mmproxy.DataLoader.skipped` report. A batch that lost samples in a server is smaller:
the loader removes those samples' rows from every field (every server's outputs, tokens, labels,
keys), so the fields stay aligned. Records that no batch can carry (after a worker's last batch,
or while nothing can be batched) travel on their own, so none is lost. An epoch that reads
nothing, or skips more than ``max_skipped``, raises in the main loop (:mod:`mmproxy.skips`).
"""

from __future__ import annotations

import random
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch.utils.data
import webdataset as wds

from mmproxy import worker
from mmproxy.collate import Collate
from mmproxy.errors import SampleError, ShardError
from mmproxy.skips import SKIPPED, SkippedSample

from .checks import MAX_PIXELS
from .fields import Field, FieldSpec, Skip, parse_field, process
from .remote import RemoteOptions, redact
from .remote import prepare as prepare_remote
from .shards import (
    current_epoch,
    expand,
    is_local,
    is_remote,
    rank_shards,
    read_local_tar,
    read_remote_tar,
    resampled,
    worker_info,
    worker_shards,
)

__all__ = ["Field", "MultiModalDataset", "OnError"]

OnError = Literal["raise", "skip"]


class MultiModalDataset(torch.utils.data.IterableDataset):
    """Batches from WebDataset shards; chosen fields go through servers' proxies.

    Args:
        urls: Shards: a brace pattern (``"data-{000..099}.tar"``), a list, local paths,
            ``http(s)://`` or ``s3://`` URLs (streamed, retried, optionally cached: ``remote``),
            or ``pipe:`` commands, as webdataset reads them.
        fields: Output name -> what to do: a :class:`Field` (explicit), or ``(extensions,
            callable)``, or a callable applied to the extension of the same name. In the two
            short forms a field goes through a server when its callable is a server's proxy
            (it has ``server_uid``); wrap a proxy in your own function and say
            ``Field(exts, fn, server=True)``.
        batch_size: Samples per batch (batching happens in the workers).
        shuffle_shards: Shuffle the shard list every epoch (same order on every rank).
        shuffle_buffer: Size of the sample shuffle buffer on raw bytes; 0 disables it.
        seed: Base seed for shard and sample shuffling; every epoch reseeds from it.
        resampled: Draw shards with replacement (needs ``epoch_length``).
        epoch_length: Batches per rank per epoch. With it every rank yields the same number of
            batches (ranks that run out of their own shards start them again).
        on_error: "raise" or "skip" (see the module docstring).
        max_skipped: In skip mode, the largest fraction of samples an epoch may skip before the
            loader raises :class:`~mmproxy.errors.SkipLimitError` (default 0.1: web corpora lose
            0.01-1% to damage; more means a wrong path, extension or field function). ``None``
            never raises for the fraction; an epoch that delivers nothing always raises.
        partial: Yield the last, smaller batch of each worker.
        collate: The collate for a list of sample dicts; :class:`~mmproxy.Collate` by default.
        batch_transform: Applied to each collated batch in the worker (e.g. tokenization).
        keep_keys: Keep ``"__key__"`` (and ``"__url__"``) in the batches.
        max_pixels: Images whose header declares more pixels are bad samples.
        prefetch_next_epoch: In a persistent worker of an :class:`mmproxy.DataLoader`, prepare
            the next epoch's first batch as soon as this epoch's samples are done, so the
            servers start it while the main loop finishes this epoch (as a DALI reader keeps
            prefetching across epochs). The next epoch is the loader's next (this one plus one);
            an explicit :meth:`set_epoch` turns it off. The cost: after the last epoch, one
            batch per worker is prepared and run for nothing.
        remote: How ``http(s)://`` and ``s3://`` shards are read: retries, timeouts and the
            node-local cache (:class:`~mmproxy.datasets.remote.RemoteOptions`; by default no
            cache unless ``MMPROXY_CACHE_DIR`` is set). A shard still failing after the retries,
            or missing, is an unreadable shard: a ``__skipped__`` record or a ``ShardError``.
    """

    def __init__(self, urls: str | Sequence[str], fields: Mapping[str, FieldSpec], *,
                 batch_size: int, shuffle_shards: bool = True, shuffle_buffer: int = 0,
                 seed: int = 0, resampled: bool = False, epoch_length: int | None = None,
                 on_error: OnError = "raise", max_skipped: float | None = 0.1, partial: bool = True,
                 collate: Callable[[list[Any]], Any] | None = None,
                 batch_transform: Callable[[Any], Any] | None = None,
                 keep_keys: bool = True, max_pixels: int = MAX_PIXELS,
                 prefetch_next_epoch: bool = True, remote: RemoteOptions | None = None) -> None:
        super().__init__()
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if max_skipped is not None and not 0 <= max_skipped <= 1:
            raise ValueError(f"max_skipped is a fraction of the samples (0-1), got {max_skipped}")
        if resampled and epoch_length is None:
            raise ValueError("resampled=True needs epoch_length (batches per rank per epoch)")
        self.urls = expand(urls)
        self.fields = {name: parse_field(name, spec) for name, spec in fields.items()}
        if not self.fields:
            raise ValueError("fields is empty: say which fields to read")
        self.batch_size = batch_size
        self.shuffle_shards = shuffle_shards
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.resampled = resampled
        self.epoch_length = epoch_length
        self.on_error = on_error
        self.max_skipped = max_skipped
        self.partial = partial
        proxies = [f.fn for f in self.fields.values() if f.server]
        known = all(hasattr(p, "server_uid") for p in proxies)
        self.collate = collate or Collate(proxies if known else None)
        self.batch_transform = batch_transform
        self.keep_keys = keep_keys
        self.max_pixels = max_pixels
        self.prefetch_next_epoch = prefetch_next_epoch
        self.remote = remote or RemoteOptions()
        prepare_remote(self.urls)
        self._epoch: int | None = None
        self._ahead: tuple[int, Any, Iterator[Any]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Fixes the epoch used for seeding (otherwise mmproxy's DataLoader supplies it)."""
        self._epoch = epoch

    def __len__(self) -> int:
        if self.epoch_length is None:
            raise TypeError("the number of batches is known only with epoch_length set")
        return self.epoch_length

    def loader(self, servers: Any, *, num_workers: int = 2, **kwargs: Any) -> Any:
        """An :class:`mmproxy.DataLoader` over this dataset (batching stays in the workers)."""
        from mmproxy.loader import DataLoader

        return DataLoader(servers, self, batch_size=None, num_workers=num_workers, **kwargs)

    def check_loader(self, loader: Any) -> None:
        """Called by :class:`mmproxy.DataLoader` when it is made: mistakes that would otherwise
        show up only later (a torch batch size on batches, ranks or workers left without shards
        when every rank must yield ``epoch_length`` batches) raise now, before any batch."""
        if loader.batch_size is not None:
            raise ValueError(
                f"MultiModalDataset makes its own batches (batch_size={self.batch_size}); give the "
                f"loader batch_size=None (it got batch_size={loader.batch_size}), or use "
                "dataset.loader(servers, ...)")
        if self.resampled:
            return
        rank, world, _, _ = worker_info()
        mine = rank_shards(self.urls, shuffle=False, seed=self.seed, epoch=0)  # raises if none
        workers = max(1, loader.num_workers)
        if self.epoch_length is not None and len(mine) < workers:
            raise ShardError(
                f"rank {rank} of {world} has {len(mine)} shards for {workers} workers, and with "
                f"epoch_length every worker needs shards of its own; use at most {len(mine)} "
                "workers, more (smaller) shards, or resampled=True")

    # -- stages ---------------------------------------------------------------------------------

    def _quota(self) -> int | None:
        if self.epoch_length is None:
            return None
        _, _, worker, workers = worker_info()
        return self.epoch_length // workers + (1 if worker < self.epoch_length % workers else 0)

    def _shard_stream(self, epoch: int, again: int) -> Iterator[str]:
        rank, _, worker, _ = worker_info()
        if self.resampled:
            yield from resampled(self.urls, random.Random(f"{self.seed}:{epoch}:{rank}:{worker}"))
            return
        shards = worker_shards(rank_shards(self.urls, shuffle=self.shuffle_shards,
                                           seed=self.seed, epoch=epoch))
        if again:  # a later pass over this worker's shards (to fill epoch_length): reshuffled
            random.Random(f"{self.seed}:{epoch}:{rank}:{worker}:{again}").shuffle(shards)
        yield from shards

    def _passes(self, epoch: int, skipped: list[SkippedSample]) -> Iterator[dict[str, Any] | None]:
        """Samples of this worker's shards, shuffled; passes repeat only to fill epoch_length.

        Each pass is shuffled on its own, so the shuffle buffer's read-ahead never mixes a
        sample's repeat into the pass that holds the sample. ``None`` marks a shard that added a
        record to ``skipped`` (so that records flow even when no sample does).
        """
        rank, _, worker, _ = worker_info()
        again = 0
        while True:
            samples = self._samples(self._shard_stream(epoch, again), skipped)
            if self.shuffle_buffer > 0:
                rng = random.Random(f"{self.seed}:{epoch}:{rank}:{worker}:{again}:samples")
                samples = wds.filters.shuffle(self.shuffle_buffer, min(100, self.shuffle_buffer),
                                              rng=rng)(samples)
            count = 0
            for sample in samples:
                count += sample is not None
                yield sample
            if self.epoch_length is None or self.resampled:
                return
            if count == 0:
                reasons = Counter(r.reason for r in skipped).most_common(3)
                raise ShardError(f"worker {worker} on rank {rank}: its shards hold no samples, so "
                                 f"it cannot make its share of epoch_length (reasons: {reasons})")
            again += 1

    def _samples(self, shards: Iterator[str], skipped: list[SkippedSample]
                 ) -> Iterator[dict[str, Any] | None]:
        """Samples of the shards: local and remote ones mapped (zero copy), others through
        webdataset."""

        def failed(url: str, exn: BaseException) -> None:
            reason = _describe(exn)
            if self.on_error == "skip":
                skipped.append(SkippedSample(redact(url), "", f"unreadable shard: {reason}"))
            else:
                raise ShardError(f"shard {redact(url)}: cannot be read: {reason}") from exn

        def handler(exn: Exception) -> bool:
            failed(str(exn.args[-1]) if exn.args else "?", exn)
            return True

        for url in shards:
            count, records = 0, len(skipped)
            if is_local(url) or is_remote(url):
                try:
                    for sample in (read_local_tar(url) if is_local(url)
                                   else read_remote_tar(url, self.remote)):
                        count += 1
                        yield sample
                except (OSError, tarfile.TarError, ValueError) as exn:
                    failed(url, exn)
                    yield None
                    continue
            else:
                for sample in wds.tariterators.tarfile_samples([{"url": url}], handler=handler):
                    count += 1
                    yield sample
            if count == 0 and self.on_error == "skip":
                if len(skipped) == records:
                    skipped.append(SkippedSample(redact(url), "", "empty shard: it holds no files"))
                yield None

    def _process(self, sample: dict[str, Any]) -> dict[str, Any]:
        return process(sample, self.fields, keep_keys=self.keep_keys, max_pixels=self.max_pixels,
                       skip=self.on_error == "skip")

    def __iter__(self) -> Iterator[Any]:
        epoch = current_epoch(self._epoch)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == epoch:
            yield ahead[1]
            batches = ahead[2]
        else:
            batches = self._batches(epoch)
        yield from batches
        # The loader has asked past this worker's last batch. A persistent worker of an mmproxy
        # DataLoader will be asked for the next epoch (numbered one more), so it prepares that
        # epoch's first batch now: its inputs reach the server, which runs them once this epoch's
        # runs are done, and the next epoch starts with outputs ready instead of a cold pipeline.
        if self.prefetch_next_epoch and self._epoch is None and worker.in_persistent_worker():
            upcoming = self._batches(epoch + 1)
            try:
                with worker.next_epoch():
                    first = next(upcoming)
            except Exception:  # noqa: BLE001 - raised again, in its own epoch
                return
            self._ahead = (epoch + 1, first, upcoming)

    def _batches(self, epoch: int) -> Iterator[Any]:
        pending: list[SkippedSample] = []  # skip records not yet sent with a batch
        samples = self._passes(epoch, pending)
        quota = self._quota()
        made = 0
        batch: list[dict[str, Any]] = []
        for raw in samples:
            if quota is not None and made >= quota:
                break
            if raw is None:  # a shard was skipped
                if len(pending) >= self.batch_size:
                    yield {SKIPPED: _take(pending)}
                continue
            try:
                batch.append(self._process(raw))
            except Skip as skip:
                if self.on_error == "raise":
                    url, key, reason = skip.record
                    raise SampleError(f"shard {url}, sample {key!r}: {reason}") from skip.__cause__
                pending.append(skip.record)
            if len(batch) == self.batch_size:
                yield from self._collate(batch, pending)
                made += 1
                batch = []
            elif len(pending) >= self.batch_size:
                yield {SKIPPED: _take(pending)}  # nothing to batch yet: the records go alone
        if batch and self.partial and (quota is None or made < quota):
            yield from self._collate(batch, pending)
        if pending:
            yield {SKIPPED: _take(pending)}

    def _collate(self, samples: list[dict[str, Any]], skipped: list[SkippedSample]) -> Iterator[Any]:
        batch = self.collate(samples)
        if self.batch_transform is not None:
            batch = self.batch_transform(batch)
        if isinstance(batch, dict):
            batch[SKIPPED] = _take(skipped)
            yield batch
        else:
            yield batch
            if skipped:
                yield {SKIPPED: _take(skipped)}


def _take(records: list[SkippedSample]) -> list[SkippedSample]:
    """The records so far (a copy), emptying the list that collects them."""
    taken = list(records)
    records.clear()
    return taken


def _describe(exn: BaseException) -> str:
    """An error in words: an OSError's message (not its errno), else the error's own text."""
    if isinstance(exn, OSError) and exn.strerror:
        return exn.strerror + (f" ({exn.filename})" if exn.filename else "")
    return f"{type(exn).__name__}: {exn}" if str(exn) else type(exn).__name__


