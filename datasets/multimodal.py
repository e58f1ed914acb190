"""MultiModalDataset: WebDataset shards into batches whose heavy fields go through servers.
docs/internals.md, ``mmproxy.datasets.multimodal``, has the rest.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import torch.utils.data
from mmproxy.datasets.remote import RemoteOptions
from mmproxy.datasets.remote import prepare as prepare_remote
from mmproxy.datasets.shards import current_epoch, expand, require_files, worker_info
from mmproxy.datasets.stages import elastic
from mmproxy.datasets.stages._batch_runs import BatchRuns, batch_fields
from mmproxy.datasets.stages.batcher import Batcher, Batching
from mmproxy.datasets.stages.buffer import ShuffleBuffer
from mmproxy.datasets.stages.fields import Field, FieldSpec, FieldStage, SampleFields, parse_field
from mmproxy.datasets.stages.mixer import OnExhausted, Source, SourceMixer, check_weights
from mmproxy.datasets.stages.plan import Layout, ShardPlan, Work, check_shares, split_quota
from mmproxy.datasets.stages.position import PositionStamp
from mmproxy.datasets.stages.reader import ShardReader, TarReader

from mmproxy import worker
from mmproxy.collate import Collate
from mmproxy.errors import BatchSizeError
from mmproxy.media.checks import MAX_PIXELS
from mmproxy.protocols import Proxy
from mmproxy.skips import ErrorPolicy, OnError
from mmproxy.state import LoaderState

__all__ = ["Field", "MultiModalDataset", "NextEpoch", "OnError", "Source"]


class NextEpoch:
    """The next epoch's first item and the rest of its items, made ahead (or nothing)."""

    def __init__(self) -> None:
        self._held: tuple[int, Any, Iterator[Any]] | None = None

    def take(self, epoch: int) -> Iterator[Any] | None:
        """The items of ``epoch`` when they were prepared (its first one included), else None;
        whatever was held is let go either way."""
        held, self._held = self._held, None
        if held is None or held[0] != epoch:
            return None
        return itertools.chain([held[1]], held[2])

    def prepare(self, epoch: int, items: Iterator[Any]) -> None:
        """Takes the first of ``items`` (epoch ``epoch``'s) now, under
        :func:`mmproxy.worker.next_epoch`. An error leaves nothing held: the epoch raises it
        again in its own time, when it is read."""
        try:
            with worker.next_epoch():
                first = next(items)
        except Exception:  # noqa: BLE001 - raised again, in its own epoch
            return
        self._held = (epoch, first, items)


class _Source:
    """A source as the dataset uses it: name, expanded shards, parsed fields, weight."""

    def __init__(self, index: int, source: Source, mixed: bool, timeout: float) -> None:
        self.name = source.name or f"source{index}"
        self.urls = expand(source.urls, timeout)
        require_files(self.urls, f"the urls of source {self.name!r}" if mixed else "urls")
        self.fields = {name: parse_field(name, spec) for name, spec in source.fields.items()}
        if not self.fields:
            raise ValueError(f"source {self.name!r}: fields is empty: say which fields to read")
        self.weight = float(source.weight)


class MultiModalDataset(torch.utils.data.IterableDataset):
    """Batches from WebDataset shards; chosen fields go through servers' proxies.

    Args:
        urls: Shards: a brace pattern (``"data-{000..099}.tar"``), a list, local paths or
            globs of them (``"/data/*.tar"``, sorted), ``http(s)://``, ``s3://``, ``gs://`` or
            ``az://`` URLs (streamed, retried, optionally cached: ``remote``; an object-store
            prefix ending in ``/`` or a glob is listed), or ``pipe:`` commands, as webdataset
            reads them. Local shards that do not exist are refused here
            (``FileNotFoundError``, naming the first few and how many). None when ``sources``
            are given.
        fields: Output name -> what to do: a :class:`Field` (explicit), or ``(extensions,
            callable)``, or a callable applied to the extension of the same name. In the two
            short forms a field goes through a server when its callable is a server's proxy
            (a :class:`mmproxy.protocols.Proxy`); wrap a proxy in your own function and say
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
        max_skipped: In skip mode, the largest fraction of the samples read that an epoch may
            skip, and separately the largest fraction of the shards it tried (on each rank) that
            may be unreadable or empty, before the loader raises
            :class:`~mmproxy.errors.SkipLimitError` (default 0.1: far more than web corpora lose
            to damage, so more means a wrong path, extension or field function, or missing
            shards). A shard counts as a shard, never as one sample (its samples were never read;
            ``loader.skipped.shards`` says how many, ``.empty_shards`` how many of them were
            empty, ``.shards_tried`` of how many). ``None`` never raises for a fraction; an epoch
            that delivers nothing always raises.
        partial: Yield the last, smaller batch of each worker.
        collate: The collate for a list of sample dicts; :class:`~mmproxy.Collate` by default,
            and then a field whose function is a server's proxy goes to its server as one run
            per batch without a reference per sample (the same batch, at less cost in the
            workers). A collate given gets the samples with their proxies' references.
        batch_transform: Applied to each collated batch in the worker (e.g. tokenization).
        keep_keys: Keep ``"__key__"`` (and ``"__url__"``) in the batches.
        max_pixels: Images whose header declares more pixels are bad samples.
        prefetch_next_epoch: In a persistent worker of an :class:`mmproxy.DataLoader`, prepare
            the next epoch's first batch as soon as this epoch's samples are done, so the
            servers start it while the main loop finishes this epoch (as a DALI reader keeps
            prefetching across epochs). The next epoch is the loader's next (this one plus one);
            an explicit :meth:`set_epoch` turns it off. The cost: after the last epoch, one
            batch per worker is prepared and run for nothing.
        remote: How remote shards (``http(s)://``, ``s3://``, ``gs://``, ``az://``) are read:
            retries, timeouts and the node-local cache
            (:class:`~mmproxy.datasets.remote.RemoteOptions`; by default no cache unless
            ``MMPROXY_CACHE_DIR`` is set). A shard still failing after the retries, or
            missing, is an unreadable shard: a ``__skipped__`` record or a ``ShardError``.

    Resuming: every stage of the chain owns its state (:mod:`mmproxy.datasets.stages._stage`). Under an
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
        self.policy = ErrorPolicy(on_error, max_skipped)  # the one owner of both
        if on_exhausted not in ("stop", "restart"):
            raise ValueError(f"on_exhausted must be 'stop' or 'restart', got {on_exhausted!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
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
        self.remote = remote or RemoteOptions()
        self.sources = [_Source(i, source, self.mixed, self.remote.connect_timeout)
                        for i, source in enumerate(sources)]
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
        self.shuffle_shards, self.shuffle_buffer, self.seed = shuffle_shards, shuffle_buffer, seed
        self.resampled, self.epoch_length = resampled, epoch_length
        proxies = [f.fn for s in self.sources for f in s.fields.values() if f.server]
        known = all(isinstance(p, Proxy) for p in proxies)
        self._own_collate = collate is None
        collate = collate or Collate(proxies if known else None)
        # with its own collate, the proxies' fields go as one run each (_batch_runs)
        self._batched = batch_fields([s.fields for s in self.sources]) if self._own_collate else frozenset()
        self.batching = Batching(batch_size, partial, collate, batch_transform, BatchRuns(
            self._batched, [s.fields for s in self.sources], collate) if self._batched else None)
        self.keep_keys = keep_keys
        self.max_pixels, self.prefetch_next_epoch = max_pixels, prefetch_next_epoch
        prepare_remote(self.urls)
        self._read = TarReader(self.policy, self.remote)
        self._epoch: int | None = None
        self._next_epoch = NextEpoch()  # prefetch_next_epoch's

    @property
    def batch_size(self) -> int:
        """Samples per batch (its owner: :attr:`batching`)."""
        return self.batching.size

    @property
    def partial(self) -> bool:
        """Whether each worker yields its last, smaller batch."""
        return self.batching.partial

    @property
    def collate(self) -> Callable[[list[Any]], Any]:
        """The collate of a list of sample dicts."""
        return self.batching.collate

    @property
    def batch_transform(self) -> Callable[[Any], Any] | None:
        """Applied to each collated batch in the worker, or None."""
        return self.batching.transform

    @property
    def on_error(self) -> OnError:
        """``"raise"`` or ``"skip"`` (its owner: :attr:`policy`)."""
        return self.policy.on_error

    @property
    def max_skipped(self) -> float | None:
        """The skip limit the loader judges each epoch by (its owner: :attr:`policy`)."""
        return self.policy.max_skipped

    def set_epoch(self, epoch: int) -> None:
        """Fixes the epoch used for seeding (otherwise mmproxy's DataLoader supplies it)."""
        self._epoch = epoch

    @property
    def follows_loader_epoch(self) -> bool:
        """Whether the loader's epoch seeds the order and the draws: no :meth:`set_epoch`, and
        something shuffled (an evaluation set read in order repeats by design)."""
        return self._epoch is None and bool(self.shuffle_shards or self.shuffle_buffer
                                            or self.resampled)

    def __len__(self) -> int:
        if self.epoch_length is None:
            raise TypeError("the number of batches is known only with epoch_length set")
        return self.epoch_length

    def loader(self, servers: Any = (), *, num_workers: int = 2, **kwargs: Any) -> Any:
        """An :class:`mmproxy.DataLoader` over this dataset (batching stays in the workers), with
        the servers its fields send to (none for a dataset of plain functions only)."""
        from mmproxy.loader import DataLoader

        return DataLoader(servers, self, batch_size=None, num_workers=num_workers, **kwargs)

    def check_loader(self, loader: Any) -> None:
        """Called by :class:`mmproxy.DataLoader` when it is made: mistakes that would otherwise
        show up only later (a torch batch size on batches, a server field whose server the
        loader was not given, batches larger than a server's pipeline takes, ranks or workers
        left without shards when every rank must yield ``epoch_length`` batches) raise now,
        before any batch."""
        if loader.batch_size is not None:
            raise ValueError(
                f"MultiModalDataset makes its own batches (batch_size={self.batch_size}); give the "
                f"loader batch_size=None (it got batch_size={loader.batch_size}), or use "
                "dataset.loader(servers, ...)")
        given = {server.uid for server in loader.servers}
        for name, field in ((n, f) for s in self.sources for n, f in s.fields.items()):
            if field.server and isinstance(field.fn, Proxy) and field.fn.server_uid not in given:
                raise ValueError(
                    f"field {name!r} goes through server {field.fn.server_name!r}, which the "
                    f"loader was not given (it has {sorted(s.name for s in loader.servers)}): "
                    "give it every server the fields use, dataset.loader([server, ...])")
        # with its own collate a run holds one batch's calls; a collate of the user's may split it
        mine = {f.fn.server_uid for s in self.sources for f in s.fields.values()
                if f.server and isinstance(f.fn, Proxy)} if self._own_collate else set()
        for server in loader.servers:
            if server.uid in mine and self.batch_size > server.max_batch_size:
                raise BatchSizeError(
                    f"server {server.name!r}: the dataset makes batches of {self.batch_size} "
                    f"samples, more than the pipeline's batch_size={server.max_batch_size}; raise "
                    "the pipeline's batch_size or lower the dataset's")
        if self.resampled:
            return
        rank, world, _, _ = worker_info()
        for source in self.sources:
            check_shares(source.urls, rank=rank, world=world, workers=max(1, loader.num_workers),
                         source=source.name if self.mixed else None,
                         own_shards=self.epoch_length is not None)

    # -- the chain of stages -------------------------------------------------------------------

    def _chain(self, epoch: int, worker_id: int, workers: int, *, rank: int | None = None,
               world: int | None = None, dealt: Sequence[Sequence[Work]] | None = None,
               quota: int | None = None) -> PositionStamp:
        """The stages of worker ``worker_id`` (of ``workers``) for ``epoch``, on this rank unless
        told; ``dealt``: each source's first pass (an elastic resume); ``quota``: its batches
        (by default its share of ``epoch_length``)."""
        if rank is None or world is None:
            rank, world, _, _ = worker_info()
        layout = Layout(self.seed, epoch, rank, world, worker_id, workers)
        read, buffers, required = self._read, {}, []
        for i, s in enumerate(self.sources):
            plan = ShardPlan(s.urls, layout, source=i, shuffle=self.shuffle_shards,
                             resampled=self.resampled, dealt=None if dealt is None else dealt[i])
            required.append(dealt is None and bool(plan.items()))
            reader = ShardReader(plan, read, layout,
                                 drawn_from=len(s.urls) if self.resampled else None)
            buffers[s.name] = ShuffleBuffer(reader, self.shuffle_buffer, fetch=read.fetch,
                                            layout=layout, source=i)
        mixer = SourceMixer(buffers, [s.weight for s in self.sources], self.on_exhausted,
                            self.epoch_length is not None, layout, required)
        process = SampleFields([(s.name, s.fields) for s in self.sources], seed=self.seed,
                               epoch=epoch, mixed=self.mixed, keep_keys=self.keep_keys,
                               max_pixels=self.max_pixels, policy=self.policy,
                               batched=self._batched)
        if quota is None and self.epoch_length is not None:
            quota = split_quota(self.epoch_length, workers)[worker_id]
        batcher = Batcher(FieldStage(mixer, process), self.batching, quota=quota,
                          fetch=read.fetch, process=process, tried=read.take_tried)
        return PositionStamp(batcher, layout)

    def _resumed(self, epoch: int, point: worker.ResumePoint | None) -> PositionStamp:
        """This worker's chain for ``epoch``: at its start, or where ``point`` says."""
        _, _, worker_id, workers = worker_info()
        if point is None or point.state is None:
            return self._chain(epoch, worker_id if point is None else point.worker, workers)
        chain = self._chain(*PositionStamp.where(point.state))
        chain.reset(point.state)
        return chain

    def reshard(self, saved: Sequence[LoaderState], *, rank: int, world: int,
                workers: int) -> list[dict[str, Any]]:
        """Elastic resume: the positions of every worker of every rank (the loader states of
        all ranks) turned into what each of ``workers`` workers of rank ``rank`` (of ``world``)
        reads to finish the epoch: every sample not yet delivered, once. The order is new."""
        return elastic.reshard(self._chain, saved, sources=len(self.sources), rank=rank,
                               world=world, workers=workers, epoch_length=self.epoch_length)

    def __iter__(self) -> Iterator[Any]:
        _refuse_plain_loader(sys._getframe(1))  # the frame that asked for the first batch
        epoch = current_epoch(self._epoch)
        point = worker.resume_state(epoch)
        prefetched = self._next_epoch.take(epoch)
        yield from (prefetched if point is None and prefetched is not None
                    else self._resumed(epoch, point))
        # the loader has asked past this worker's last batch: a persistent worker will be asked
        # for the next epoch, numbered one more (see _next_epoch)
        if self.prefetch_next_epoch and self._epoch is None and worker.in_persistent_worker():
            self._next_epoch.prepare(epoch + 1, self._resumed(epoch + 1, None))


_TORCH_DATA = "torch.utils.data."  # torch's DataLoader asks for items from a module under it


def _refuse_plain_loader(caller: FrameType | None) -> None:
    """Raises when a DataLoader other than :class:`mmproxy.DataLoader` iterates the dataset (its
    items asked for from torch's own data code, outside an mmproxy loader's workers or main
    loop): the batches would reach the training loop unresolved, the records the workers send
    apart from the batches would arrive as batches holding only ``"__skipped__"`` and
    ``"__shards_tried__"``, and no epoch would be judged against ``max_skipped``. Iterating the
    dataset directly gives those items as they are (a worker's view)."""
    if worker.wants_state() or caller is None:
        return
    if str(caller.f_globals.get("__name__", "")).startswith(_TORCH_DATA):
        raise TypeError(
            "a MultiModalDataset is read by mmproxy.DataLoader, not torch.utils.data.DataLoader "
            "(which would hand over the server fields' references unresolved, the skip records "
            "sent apart from the batches as batches of their own, and judge no max_skipped): "
            "use dataset.loader(servers, num_workers=...), dataset.loader(num_workers=...) for "
            "fields that are all plain functions, or mmproxy.DataLoader(servers, dataset, "
            "batch_size=None)")
