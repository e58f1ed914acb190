"""Fields: what each output field of a dataset reads from a sample, and where it goes.

A field names the sample's extensions to read (the first one present is used) and a function.
A *server* field's function is a server's proxy: its bytes first pass the header checks
(:func:`~mmproxy.datasets.check_header`) and reach the proxy as a uint8 array that travels to the
server without a copy. Any other field's function gets ``bytes`` and runs in the worker (text,
labels). :func:`process` turns one raw sample into the dict of its fields, or raises :class:`Skip`
with the reason, which the dataset reports or raises according to its ``on_error``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from mmproxy import worker
from mmproxy.skips import SkipKind, SkippedSample

from .checks import check_header

__all__ = ["Field", "FieldSpec", "Skip", "parse_field", "process"]


class Field(NamedTuple):
    """One output field of a :class:`MultiModalDataset`.

    Attributes:
        exts: The sample's extensions to read, like ``"jpg;jpeg;png"`` (the first one present).
        fn: What to do with the field's bytes.
        server: ``fn`` is a server's proxy: the bytes pass the header checks
            (:func:`~mmproxy.datasets.check_header`) and reach ``fn`` as a uint8 array that
            travels to the server without a copy. Otherwise ``fn`` gets ``bytes`` and runs in the
            worker (text, labels).
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
        server = hasattr(fn, "server_uid")
    else:
        exts, fn, server = name, spec, hasattr(spec, "server_uid")
    if not callable(fn):
        raise TypeError(f"field {name!r}: expected a callable, (extensions, callable) or a Field, "
                        f"got {spec!r}")
    return Parsed(tuple(e.strip().lower() for e in exts.split(";") if e.strip()), fn, bool(server))


def process(sample: dict[str, Any], fields: Mapping[str, Parsed], *, keep_keys: bool,
            max_pixels: int, skip: bool, seed: int | None = None) -> dict[str, Any]:
    """The fields of one raw sample (``{ext: bytes}`` with ``__key__`` and ``__url__``); proxy
    calls inside are named after the sample, with its skip policy and its own ``seed``."""
    key = sample.get("__key__", "?")
    url = sample.get("__url__", "?")
    out: dict[str, Any] = {"__key__": key, "__url__": url} if keep_keys else {}
    with worker.sample_key(key, shard=url, skip=skip, seed=seed):
        for name, (exts, fn, server) in fields.items():
            ext = next((e for e in exts if e in sample), None)
            if ext is None:
                present = sorted(k for k in sample if not k.startswith("__"))
                raise Skip(url, key, f"missing field {'/'.join(exts)!r} (the sample has {present})",
                           SkipKind.MISSING_FIELD)
            data = sample[ext]
            try:
                problem = check_header(ext, data, max_pixels) if server else (
                    None if data else "is empty")
            except Exception as err:  # a header no check foresaw: the sample is bad, not the run
                problem = f"cannot be read ({type(err).__name__}: {err})"
            if problem:
                raise Skip(url, key, f"bad header: field {ext!r} {problem}", SkipKind.BAD_HEADER)
            try:
                out[name] = fn(np.frombuffer(data, np.uint8)) if server else fn(bytes(data))
            except Exception as err:  # a user function failed on this sample
                raise Skip(url, key, f"field function failed: field {ext!r}: "
                                     f"{type(err).__name__}: {err}", SkipKind.FIELD_FUNCTION) from err
    return out
