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

import hashlib
import tarfile
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
from .order import (
    Layout,
    OnExhausted,
    Order,
    Source,
    SourceStream,
    UrlTable,
    Work,
    check_weights,
    fetch,
    remaining,
    reshard,
    shard_plan,
    split_quota,
)
from .remote import RemoteOptions, redact
from .remote import prepare as prepare_remote
from .shards import (
    current_epoch,
    expand,
    is_local,
    is_remote,
    read_local_tar,
    read_remote_tar,
    worker_info,
)

__all__ = ["Field", "MultiModalDataset", "OnError", "Source"]

OnError = Literal["raise", "skip"]


class _Source:
    """A source as the dataset uses it: name, expanded shards, parsed fields, weight."""

    def __init__(self, index: int, source: Source) -> None:
        self.name = source.name or f"source{index}"
        self.urls = expand(source.urls)
        self.fields = {name: parse_field(name, spec) for name, spec in source.fields.items()}
        if not self.fields:
            raise ValueError(f"source {self.name!r}: fields is empty: say which fields to read")
        self.weight = float(source.weight)


class MultiModalDataset(torch.utils.data.IterableDataset):
    """Batches from WebDataset shards; chosen fields go through servers' proxies.

    Args:
        urls: Shards: a brace pattern (``"data-{000..099}.tar"``), a list, local paths or
            globs of them (``"/data/*.tar"``, sorted), ``http(s)://`` or ``s3://`` URLs
            (streamed, retried, optionally cached: ``remote``), or ``pipe:`` commands, as
            webdataset reads them. None when ``sources`` are given.
        fields: Output name -> what to do: a :class:`Field` (explicit), or ``(extensions,
            callable)``, or a callable applied to the extension of the same name. In the two
            short forms a field goes through a server when its callable is a server's proxy
            (it has ``server_uid``); wrap a proxy in your own function and say
            ``Field(exts, fn, server=True)``.
        sources: Instead of ``urls`` and ``fields``: several :class:`Source` s, each with its own
            shards, field mapping and weight, mixed sample by sample (each sample's source is
            drawn by weight, from the dataset's seed); every sample says which in
            ``"__source__"``. Each source is split by rank and worker on its own.
        on_exhausted: When a source's shards run out: ``"stop"`` ends the epoch (of this
            worker), ``"restart"`` reads that source again (reshuffled) until every source has
            been read once. With ``epoch_length`` sources always restart.
        batch_size: Samples per batch (batching happens in the workers).
        shuffle_shards: Shuffle the shard list every epoch (same order on every rank).
        shuffle_buffer: Size of the sample shuffle buffer on raw bytes; 0 disables it.
        seed: Base seed for shard and sample shuffling, source mixing and each sample's own seed
            (from which sample-seeded pipelines draw its augmentation); every epoch reseeds.
        resampled: Draw shards with replacement (needs ``epoch_length``).
        epoch_length: Batches per rank per epoch. With it every rank yields the same number of
            batches (ranks that run out of their own shards start them again).
        on_error: "raise" or "skip" (see the module docstring).
        max_skipped: In skip mode, the largest fraction of samples an epoch may skip before the
            loader raises :class:`~mmproxy.errors.SkipLimitError` (default 0.1: web corpora lose
            0.01-1% to damage; more means a wrong path, extension or field function). An
            unreadable or empty shard counts as one sample (its samples were never read, so
            nobody counted them; ``loader.skipped.shards`` says how many, ``.empty_shards`` how
            many of them were empty). ``None`` never raises for the fraction; an epoch that
            delivers nothing always raises.
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

    Resuming: the sample order is state (:mod:`mmproxy.datasets.order`). Under an
    :class:`mmproxy.DataLoader` every batch carries its worker's position, so
    ``loader.state_dict()`` after k batches lets a new loader continue with batch k+1
    (``load_state_dict``): the same batches, in the same order, with the same augmentation when
    the pipeline draws it from the sample's seed; with other numbers of workers or ranks, every
    remaining sample of the epoch once (:meth:`reshard`). See ``docs/resume.md``.
    """

    def __init__(self, urls: str | Sequence[str] | None = None,
                 fields: Mapping[str, FieldSpec] | None = None, *, batch_size: int,
                 sources: Sequence[Source] | None = None, on_exhausted: OnExhausted = "stop",
                 shuffle_shards: bool = True, shuffle_buffer: int = 0,
                 seed: int = 0, resampled: bool = False, epoch_length: int | None = None,
                 on_error: OnError = "raise", max_skipped: float | None = 0.1, partial: bool = True,
                 collate: Callable[[list[Any]], Any] | None = None,
                 batch_transform: Callable[[Any], Any] | None = None,
                 keep_keys: bool = True, max_pixels: int = MAX_PIXELS,
                 prefetch_next_epoch: bool = True, remote: RemoteOptions | None = None) -> None:
        super().__init__()
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if on_exhausted not in ("stop", "restart"):
            raise ValueError(f"on_exhausted must be 'stop' or 'restart', got {on_exhausted!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if max_skipped is not None and not 0 <= max_skipped <= 1:
            raise ValueError(f"max_skipped is a fraction of the samples (0-1), got {max_skipped}")
        if resampled and epoch_length is None:
            raise ValueError("resampled=True needs epoch_length (batches per rank per epoch)")
        if sources is None:
            if urls is None or fields is None:
                raise TypeError("give urls and fields, or sources=[Source(urls, fields), ...]")
            sources, self.mixed = [Source(urls, fields)], False
        elif urls is not None or fields is not None:
            raise TypeError("give either urls and fields, or sources (each with its own urls and "
                            "fields), not both")
        else:
            self.mixed = True
        self.sources = [_Source(i, source) for i, source in enumerate(sources)]
        if not self.sources:
            raise ValueError("sources is empty")
        check_weights([s.weight for s in self.sources])
        names = [sorted(s.fields) for s in self.sources]
        if any(n != names[0] for n in names):
            raise ValueError("every source must give the same fields (they are batched together): "
                             + "; ".join(f"{s.name}: {sorted(s.fields)}" for s in self.sources))
        if len({s.name for s in self.sources}) < len(self.sources):
            raise ValueError(f"source names repeat: {[s.name for s in self.sources]}")
        self.urls = [url for s in self.sources for url in s.urls]
        self.fields = self.sources[0].fields
        self.on_exhausted = on_exhausted
        self.batch_size = batch_size
        self.shuffle_shards = shuffle_shards
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.resampled = resampled
        self.epoch_length = epoch_length
        self.on_error = on_error
        self.max_skipped = max_skipped
        self.partial = partial
        proxies = [f.fn for s in self.sources for f in s.fields.values() if f.server]
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
        workers = max(1, loader.num_workers)
        for source in self.sources:
            mine = source.urls[rank::world]
            where = f" of source {source.name!r}" if self.mixed else ""
            if not mine:
                raise ShardError(f"rank {rank} of {world} gets no shards{where}: there are only "
                                 f"{len(source.urls)} shards for {world} ranks; write more, "
                                 "smaller shards or use resampled=True")
            if self.mixed and len(mine) < workers:
                raise ShardError(
                    f"rank {rank} of {world} has {len(mine)} shards{where} for {workers} workers; "
                    "with several sources every worker needs shards of each source (or its share "
                    f"of the weights would go to the others): use at most {_workers(len(mine))}, or "
                    "more (smaller) shards")
            if self.epoch_length is not None and len(mine) < workers:
                raise ShardError(
                    f"rank {rank} of {world} has {len(mine)} shards{where} for {workers} workers, "
                    "and with epoch_length every worker needs shards of its own; use at most "
                    f"{_workers(len(mine))}, more (smaller) shards, or resampled=True")

    # -- the sample order -----------------------------------------------------------------------

    def _layout(self, epoch: int, worker_id: int, workers: int) -> Layout:
        rank, world, _, _ = worker_info()
        return Layout(self.seed, epoch, rank, world, worker_id, workers, self.shuffle_shards,
                      self.shuffle_buffer, self.resampled)

    def _order(self, layout: Layout, skipped: list[SkippedSample],
               plans: list[list[Work]] | None = None) -> Order:
        streams = [SourceStream(i, s.urls, layout, self._read, skipped,
                                None if plans is None else [Work(*w) for w in plans[i]])
                   for i, s in enumerate(self.sources)]
        return Order(streams, [s.weight for s in self.sources], self.on_exhausted,
                     self.epoch_length is not None, layout)

    def reshard(self, saved: Sequence[Mapping[str, Any]], *, rank: int, world: int,
                workers: int) -> list[dict[str, Any]]:
        """Elastic resume: the positions of every worker of every rank (the loader states of
        all ranks) turned into what each of ``workers`` workers of rank ``rank`` (of ``world``)
        reads to finish the epoch: every sample not yet delivered, once. The order is new."""
        old = {int(s["rank"]): s for s in saved}
        first = saved[0]
        old_world, old_workers, epoch = first["world"], first["workers"], first["epoch"]
        if set(old) != set(range(old_world)):
            raise ValueError(f"an elastic resume needs the states of all {old_world} ranks that "
                             f"saved them; got ranks {sorted(old)}")
        work: list[list[Work]] = [[] for _ in self.sources]
        for r in range(old_world):
            for w in range(old_workers):
                entry = old[r]["states"].get(w) or {}
                state, plans = entry.get("state"), entry.get("plans")
                for i, source in enumerate(self.sources):
                    if state is None and plans is not None:  # itself resharded, nothing delivered
                        work[i].extend(Work(*item) for item in plans[i])
                        continue
                    def plan_of(pass_: int, i: int = i, urls: list[str] = source.urls,
                                r: int = r, w: int = w) -> list[Work]:
                        return shard_plan(urls, shuffle=self.shuffle_shards, seed=self.seed,
                                          epoch=epoch, source=i, rank=r, world=old_world,
                                          worker=w, workers=old_workers, pass_=pass_)
                    work[i].extend([] if self.resampled else remaining(state, i, plan_of))
        dealt = reshard(work, world=world, workers=workers)
        quota: list[int | None] = [None] * workers
        if self.epoch_length is not None:
            delivered = max(int(s["batches"]) for s in saved)
            quota = list(split_quota(max(0, self.epoch_length - delivered), workers))
        return [{"epoch": epoch, "worker": w, "state": None, "quota": quota[w], "workers": workers,
                 "plans": [[tuple(item) for item in plan] for plan in dealt[rank * workers + w]]}
                for w in range(workers)]  # plain tuples: torch.load(weights_only=True) reads them

    def _read(self, work: Work, skipped: list[SkippedSample]
              ) -> Iterator[tuple[int, dict[str, Any]] | None]:
        """``(index, sample)`` of one shard's samples that ``work`` asks for: local and remote
        shards mapped (zero copy), others through webdataset; ``None`` after a shard that added
        a record to ``skipped``. Samples before ``work.start`` are passed over unprocessed."""
        url = work.url
        wanted = None if work.only is None else set(work.only)
        last = max(work.only) if work.only else -1
        if wanted is not None and not wanted:
            return

        def failed(exn: BaseException) -> None:
            reason = _describe(exn)
            if self.on_error == "skip":
                skipped.append(SkippedSample(redact(url), "", f"unreadable shard: {reason}"))
            else:
                raise ShardError(f"shard {redact(url)}: cannot be read: {reason}") from exn

        def handler(exn: Exception) -> bool:
            failed(exn)
            return True

        count, records = 0, len(skipped)
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
        except (OSError, tarfile.TarError, ValueError) as exn:
            failed(exn)
            yield None
            return
        if count == 0 and self.on_error == "skip":
            if len(skipped) == records:
                skipped.append(SkippedSample(redact(url), "", "empty shard: it holds no files"))
            yield None

    def _process(self, source: int, raw: dict[str, Any], epoch: int) -> dict[str, Any]:
        src = self.sources[source]
        key = str(raw.get("__key__", "?"))
        out = process(raw, src.fields, keep_keys=self.keep_keys, max_pixels=self.max_pixels,
                      skip=self.on_error == "skip",
                      seed=_sample_seed(self.seed, epoch, src.name, key))
        if self.mixed:
            out["__source__"] = src.name
        return out

    # -- batches --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        epoch = current_epoch(self._epoch)
        resume = worker.resume_state(epoch)
        ahead, self._ahead = self._ahead, None
        if resume is None and ahead is not None and ahead[0] == epoch:
            yield ahead[1]
            batches = ahead[2]
        else:
            batches = self._batches(epoch, resume)
        yield from batches
        # The loader has asked past this worker's last batch. A persistent worker of an mmproxy
        # DataLoader will be asked for the next epoch (numbered one more), so it prepares that
        # epoch's first batch now: its inputs reach the server, which runs them once this epoch's
        # runs are done, and the next epoch starts with outputs ready instead of a cold pipeline.
        if self.prefetch_next_epoch and self._epoch is None and worker.in_persistent_worker():
            upcoming = self._batches(epoch + 1, None)
            try:
                with worker.next_epoch():
                    first = next(upcoming)
            except Exception:  # noqa: BLE001 - raised again, in its own epoch
                return
            self._ahead = (epoch + 1, first, upcoming)

    def _batches(self, epoch: int, resume: Mapping[str, Any] | None) -> Iterator[Any]:
        _, _, worker_id, workers = worker_info()
        if resume is not None:
            worker_id, workers = resume["worker"], resume.get("workers", workers)
        layout = self._layout(epoch, worker_id, workers)
        pending: list[SkippedSample] = []  # skip records not yet sent with a batch
        order = self._order(layout, pending, None if resume is None else resume.get("plans"))
        quota = None if self.epoch_length is None else split_quota(self.epoch_length,
                                                                   workers)[worker_id]
        if resume is not None and resume.get("quota") is not None:
            quota = resume["quota"]
        made = 0
        batch: list[dict[str, Any]] = []
        taken: list[tuple[int, str, int]] = []  # the addresses of the samples in `batch`
        saved = None if resume is None else resume.get("state")
        if saved is not None:
            order.restore(saved["order"], saved["urls"])
            made = saved["made"]
            found = fetch([(saved["urls"][u], i) for _, u, i in saved["batch"]], self._read,
                          pending)
            for s, u, i in saved["batch"]:
                url = saved["urls"][u]
                if (url, i) in found:
                    batch.append(self._process(s, found[url, i], epoch))
                    taken.append((s, url, i))

        def stamped(item: Any) -> Any:
            def state() -> dict[str, Any]:
                table = UrlTable()
                return {"epoch": epoch, "worker": worker_id, "workers": workers, "quota": quota,
                        "made": made, "order": order.state(table),
                        "batch": [(s, table.id(url), i) for s, url, i in taken],
                        "urls": table.urls}
            return worker.stamp(item, worker_id, state)

        for got in order:
            if quota is not None and made >= quota:
                break
            if got is None:  # a shard was skipped
                if len(pending) >= self.batch_size:
                    yield stamped({SKIPPED: _take(pending)})
                continue
            source, (url, index, raw) = got
            try:
                batch.append(self._process(source, raw, epoch))
                taken.append((source, url, index))
            except Skip as skip:
                if self.on_error == "raise":
                    url, key, reason = skip.record
                    raise SampleError(f"shard {url}, sample {key!r}: {reason}") from skip.__cause__
                pending.append(skip.record)
            if len(batch) == self.batch_size:
                full, batch, taken = batch, [], []
                made += 1
                for item in self._collate(full, pending):
                    yield stamped(item)
            elif len(pending) >= self.batch_size:
                yield stamped({SKIPPED: _take(pending)})  # nothing to batch yet: records go alone
        if batch and self.partial and (quota is None or made < quota):
            full, batch, taken = batch, [], []
            made += 1
            for item in self._collate(full, pending):
                yield stamped(item)
        if pending:
            yield stamped({SKIPPED: _take(pending)})

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


def _sample_seed(seed: int, epoch: int, source: str, key: str) -> int:
    """A sample's own seed: the same wherever and whenever the sample is read in an epoch."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{source}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


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




def _workers(n: int) -> str:
    return f"{n} worker" + ("" if n == 1 else "s")
