"""Fields: what each output field of a dataset reads from a sample, and where it goes.
docs/internals.md, ``mmproxy.datasets.stages.fields``, has the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import numpy as np
from mmproxy.datasets.shards import DUPLICATES, KEY_RUNS, SPLIT
from mmproxy.datasets.stages._stage import Stage
from mmproxy.datasets.stages.mixer import SourceMixer
from mmproxy.datasets.stages.plan import Work
from mmproxy.datasets.stages.reader import Taken

from mmproxy.errors import SampleError
from mmproxy.media.checks import check_header
from mmproxy.protocols import Proxy
from mmproxy.skips import ErrorPolicy, SkipKind, SkippedSample
from mmproxy.worker import SampleId, naming

__all__ = ["Field", "FieldSpec", "FieldStage", "Processed", "SampleFields", "Skip", "parse_field"]


class Field(NamedTuple):
    """One output field of a :class:`MultiModalDataset`.

    Attributes:
        exts: The sample's extensions to read, like ``"jpg;jpeg;png"`` (the first one present).
        fn: What to do with the field's bytes.
        server: ``fn`` is a server's proxy: the bytes pass the header checks
            (:func:`~mmproxy.datasets.check_header`) and reach ``fn`` as a uint8 array that
            travels to the server without a copy. Otherwise ``fn`` gets ``bytes`` (``b""`` too)
            and runs in the worker (text, labels).
    """

    exts: str
    fn: Callable[[Any], Any]
    server: bool = False


FieldSpec = Field | Callable[[bytes], Any] | tuple[str, Callable[[bytes], Any]]


class Skip(Exception):
    """A sample that cannot be used: its record (shard, key, reason, kind)."""

    def __init__(self, url: str, key: str, reason: str, kind: SkipKind) -> None:
        super().__init__(reason)
        self.record = SkippedSample(url, key, reason, kind)


class Parsed(NamedTuple):
    exts: tuple[str, ...]
    fn: Callable[[Any], Any]
    server: bool


def parse_field(name: str, spec: FieldSpec) -> Parsed:
    """A field spec (a :class:`Field`, ``(extensions, callable)`` or a callable) made explicit."""
    if isinstance(spec, Field):
        exts, fn, server = spec
    elif isinstance(spec, tuple):
        exts, fn = spec
        server = isinstance(fn, Proxy)
    else:
        exts, fn, server = name, spec, isinstance(spec, Proxy)
    if not callable(fn):
        raise TypeError(f"field {name!r}: expected a callable, (extensions, callable) or a Field, "
                        f"got {spec!r}")
    return Parsed(tuple(e.strip().lower() for e in exts.split(";") if e.strip()), fn, bool(server))


class _Route(Enum):
    """How a field's bytes reach its function."""

    WORKER = "bytes, to a function run in the worker"
    SERVER = "a checked uint8 array, to a proxy call"
    BATCHED = "a checked uint8 array, to the proxy's sample_inputs (the batch route)"


class _Plan(NamedTuple):
    """One source's fields as the per-sample loop reads them: ``(name, extensions, function,
    route)`` each, and whether any function reads which sample is being processed (then the
    sample is named around the loop: :func:`mmproxy.sample_key`)."""

    fields: tuple[tuple[str, tuple[str, ...], Callable[[Any], Any], _Route], ...]
    named: bool


def _plan(fields: Mapping[str, Parsed], batched: Collection[str]) -> _Plan:
    rows = tuple((name, exts, fn, _Route.BATCHED if name in batched
                  else _Route.SERVER if server else _Route.WORKER)
                 for name, (exts, fn, server) in fields.items())
    # a function of the user's may call a proxy; a batch-route proxy says whether it reads it
    return _Plan(rows, any(route is not _Route.BATCHED or fn.reads_sample  # type: ignore[attr-defined]
                           for _, _, fn, route in rows))


_UNNAMED = contextlib.nullcontext()


def _split(url: str, key: str, sample: dict[str, Any]) -> Skip:
    here = ", ".join(repr(k) for k in sorted(k for k in sample if not k.startswith("__")))
    return Skip(url, key, f"split sample: its {here} file(s) lie apart from its other files in "
                          "the tar, other samples' files between them; a sample's files must "
                          "follow each other (write the tar sorted by name, e.g. GNU tar "
                          "--sort=name -cf SHARD.tar -C FOLDER ., or with mmproxy make-shards)",
                SkipKind.SPLIT_SAMPLE)


def _dotted(key: str, exts: tuple[str, ...], present: list[str]) -> str:
    """A hint when the missing field is the end of fields the sample has (``0.jpg`` for
    ``jpg``): files named with a dot inside their key (``clip.0.jpg``). Where several of them
    end so, several samples' files were read as one sample's: only renaming keeps them apart."""
    longer = [(f, e) for f in present for e in exts if f.endswith("." + e)]
    if not longer:
        return ""
    field, ext = longer[0]
    name = f"{key}.{field}"
    renamed = name[:-len(ext) - 1].replace(".", "_") + "." + ext
    hint = (f": a sample's key ends at the first dot of its file names (WebDataset's rule), so "
            f"files like '{name}' are field {field!r} of sample {key!r}; name them without a "
            f"dot in the key (like '{renamed}')")
    if len(longer) > 1:
        return (hint + f": {len(longer)} of its files end in '.{ext}', the files of "
                f"{len(longer)} samples read as one")
    return hint + ", or read the longer extension"


def _fields(sample: dict[str, Any], plan: _Plan, sample_id: SampleId, keep_keys: bool,
            max_pixels: int) -> dict[str, Any]:
    """The fields of one raw sample (``{ext: bytes}`` with ``__key__`` and ``__url__``), or
    :class:`Skip`; proxy calls inside are named after the sample (``sample_id``: its skip
    policy and its own seed) where the plan says a function may read it."""
    key, url = sample_id.key, str(sample_id.shard)
    out: dict[str, Any] = {"__key__": sample.get("__key__", "?"), "__url__": url} if keep_keys else {}
    duplicates = sample.get(DUPLICATES, ())
    if SPLIT in sample:
        raise _split(url, key, sample)
    with naming(sample_id) if plan.named else _UNNAMED:
        for name, exts, fn, route in plan.fields:
            for ext in exts:
                if ext in sample:
                    break
            else:
                runs = sample.get(KEY_RUNS)
                if runs is not None and runs.split(key):
                    raise _split(url, key, sample)
                present = sorted(k for k in sample if not k.startswith("__"))
                raise Skip(url, key, f"missing field {'/'.join(exts)!r} (the sample has {present})"
                           + _dotted(key, exts, present), SkipKind.MISSING_FIELD)
            if ext in duplicates:
                raise Skip(url, key, f"duplicate field {ext!r}: the shard holds more than one "
                                     f"{ext!r} member for this sample", SkipKind.DUPLICATE_FIELD)
            data = sample[ext]
            if route is not _Route.WORKER:  # a worker field's bytes, empty ones too, are its own
                try:
                    problem = check_header(ext, data, max_pixels)
                except Exception as err:  # a header no check foresaw: the sample is bad, not the run
                    problem = f"cannot be read ({type(err).__name__}: {err})"
                if problem:
                    raise Skip(url, key, f"bad header: field {ext!r} {problem}",
                               SkipKind.BAD_HEADER)
            try:
                if route is _Route.BATCHED:
                    out[name] = fn.sample_inputs(np.frombuffer(data, np.uint8))  # type: ignore[attr-defined]
                elif route is _Route.SERVER:
                    out[name] = fn(np.frombuffer(data, np.uint8))
                else:
                    out[name] = fn(bytes(data))
            except Exception as err:  # a user function failed on this sample
                raise Skip(url, key, f"field function failed: field {ext!r}: "
                                     f"{type(err).__name__}: {err}", SkipKind.FIELD_FUNCTION) from err
    return out


@dataclass(slots=True)
class Processed:
    """A sample's fields, with the source and the address it was read from, and the key its
    batch-route fields' runs name it by (None without such fields)."""

    source: int
    url: str
    index: int
    sample: dict[str, Any]
    key: SampleId | None = None


class SampleFields:
    """Every source's fields, applied to one raw sample at a time: what the field stage does to
    each sample, and what a batcher does to the samples of a loaded state's batch. A field in
    ``batched`` (whose function is a :class:`~mmproxy.DALIProxy`) gets the pipeline's inputs
    for the sample (:meth:`~mmproxy.DALIProxy.sample_inputs`) in place of a call's references:
    the batcher runs the batch's (:mod:`mmproxy.datasets.stages._batch_runs`).

    Args:
        sources: Per source, its name and its parsed fields.
        seed: The dataset's seed (each sample's own seed is drawn from it, the epoch, the source
            and the key).
        epoch: The epoch.
        mixed: Name the source of each sample in ``"__source__"``.
        keep_keys: Keep ``"__key__"`` and ``"__url__"``.
        max_pixels: Images whose header declares more pixels are bad samples.
        policy: The dataset's error policy: in skip mode a bad sample is a record, else it
            raises :class:`~mmproxy.errors.SampleError`.
        batched: The fields that take the batch route.
    """

    def __init__(self, sources: Sequence[tuple[str, Mapping[str, Parsed]]], *, seed: int,
                 epoch: int, mixed: bool, keep_keys: bool, max_pixels: int, policy: ErrorPolicy,
                 batched: frozenset[str] = frozenset()) -> None:
        self.names = [name for name, _ in sources]
        self.mixed, self.keep_keys, self.max_pixels = mixed, keep_keys, max_pixels
        self.policy, self.batched = policy, batched
        self.seeds = SampleSeeds(seed, epoch, self.names)
        self.plans = [_plan(fields, batched) for _, fields in sources]

    def __call__(self, source: int, taken: Taken) -> Processed | SkippedSample:
        """The fields of one raw sample of ``source``, or its record."""
        raw = taken.raw
        key = str(raw.get("__key__", "?"))
        skip = self.policy.skip
        sample_id = SampleId(key, raw.get("__url__", "?"), skip, self.seeds(source, key))
        try:
            out = _fields(raw, self.plans[source], sample_id, self.keep_keys, self.max_pixels)
        except Skip as bad:
            if not skip:
                url, key, reason, _ = bad.record
                raise SampleError(f"shard {url}, sample {key!r}: {reason}") from bad.__cause__
            return bad.record
        if self.mixed:
            out["__source__"] = self.names[source]
        return Processed(source, taken.url, taken.index, out, sample_id if self.batched else None)


class FieldStage(Stage[Processed | SkippedSample]):
    """Every sample's fields, from the source mixer's raw samples.

    :meth:`~Stage.next` gives a :class:`Processed`, or a :class:`~mmproxy.skips.SkippedSample`
    (a shard's, passed on, or a bad sample's in skip mode). It has no state of its own: its
    state is the mixer's.

    Args:
        mixer: The source mixer.
        fields: What each sample's fields are made by.
    """

    NAME = "fields"
    MIXER = "mixer"
    KEYS = (MIXER,)

    def __init__(self, mixer: SourceMixer, fields: SampleFields) -> None:
        self.mixer, self.fields = mixer, fields

    def next(self) -> Processed | SkippedSample:
        got = self.mixer.next()
        if isinstance(got, SkippedSample):
            return got
        return self.fields(*got)

    def state_dict(self) -> dict[str, Any]:
        return self._pack(**{self.MIXER: self.mixer.state_dict()})

    def _load(self, state: Mapping[str, Any]) -> None:
        self.mixer.reset(state[self.MIXER])

    def remaining(self, state: Mapping[str, Any]) -> list[list[Work]]:
        """What a state of this stage has left, per source: the mixer's."""
        return self.mixer.remaining(self._unpack(state)[self.MIXER])


def sample_seed(seed: int, epoch: int, source: str, key: str) -> int:
    """A sample's own seed: the same wherever and whenever the sample is read in an epoch."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{source}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class SampleSeeds:
    """:func:`sample_seed` of one epoch's samples, source by source: each source's hash of the
    dataset's seed, the epoch and its name made once, and only each key hashed on from there."""

    def __init__(self, seed: int, epoch: int, sources: Sequence[str]) -> None:
        self._heads = [hashlib.blake2b(f"{seed}:{epoch}:{source}:".encode(), digest_size=8)
                       for source in sources]

    def __call__(self, source: int, key: str) -> int:
        """The seed of sample ``key`` of source number ``source``."""
        h = self._heads[source].copy()
        h.update(key.encode())
        return int.from_bytes(h.digest(), "little")
