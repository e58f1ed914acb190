"""Proxy: the picklable callable that DataLoader workers use in place of a DALI pipeline.
docs/internals.md, ``mmproxy.proxy``, has the rest.
"""

from __future__ import annotations

import inspect
import os
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from mmproxy import _context, _process
from mmproxy._server import encoded as _encoded
from mmproxy._server.encoded import Encoded
from mmproxy._wire import transport as _transport
from mmproxy.errors import ProxyArgumentError
from mmproxy.refs import DALIOutputSampleRef, _Call

if TYPE_CHECKING:
    from mmproxy.protocols import Prepare

__all__ = ["DALIProxy", "SampleRandom", "SampleSeeded"]


class SampleRandom(Protocol):
    """Inputs of a pipeline that the proxy draws itself, per sample, from the sample's seed.

    A pipeline whose randomness comes in through such inputs (a crop window, a flip; see
    :func:`mmproxy.pipelines.image_train_pipeline`) gives every sample the same augmentation in
    whichever worker, batch or run it lands: what exact resume needs, and what DALI's own
    random operators (one generator per batch slot, advanced run after run) cannot give. Give
    one to a server with its pipeline, as :class:`SampleSeeded`; the server's proxy then takes
    only the other inputs.
    """

    @property
    def names(self) -> tuple[str, ...]:
        """The inputs it fills."""
        ...

    def __call__(self, given: dict[str, np.ndarray], rng: random.Random
                 ) -> dict[str, np.ndarray]:
        """The drawn inputs of one sample, from the inputs given to the proxy (``rng`` is
        seeded by the sample's seed: Python's generator, cheaper to seed than numpy's)."""
        ...


@dataclass(frozen=True)
class SampleSeeded:
    """A pipeline whose sample-seeded inputs the proxy draws: what :class:`~mmproxy.DALIServer`
    takes in place of a bare pipeline (and what ``image_train_pipeline(sample_seeded=True)`` and
    ``video_pipeline`` return).

    Args:
        pipeline: A DALI pipeline, or a function that builds one (see the server).
        sample_random: The inputs the proxy draws from each sample's seed (None: none).
        arguments: The proxy's arguments, when they are not simply the pipeline's other inputs
            (e.g. encoded video that ``sample_random`` decodes in the worker into the
            pipeline's ``frames`` input).
        prepare: A stage the server runs on a run's samples before it feeds them (e.g. the
            video pipeline's NVDEC decoding: clip bytes in, frames on the GPU out); the proxy
            then takes the stage's inputs (:class:`mmproxy.Prepare`).
    """

    pipeline: Any
    sample_random: SampleRandom | None
    arguments: tuple[str, ...] | None = None
    prepare: Prepare | None = None


_unseeded = random.Random()  # samples named without a seed: drawn, not reproducible


# The element types DALI's feed_input can take; anything else is refused by the proxy call, which
# can name the server and the input, instead of failing the pipeline or being misread by it.
_DALI_DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64))


def _to_numpy(value: Any) -> np.ndarray:
    """The array a proxy argument stands for, before any conversion.

    ``bytes``, ``bytearray`` and ``str`` (as UTF-8) are 1-D uint8; a memoryview keeps its own shape
    and format (raw bytes, format ``'c'``, as uint8); a tensor is its CPU array.
    """
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (bytes, bytearray)):
        return np.frombuffer(value, dtype=np.uint8)
    if isinstance(value, str):
        return np.frombuffer(value.encode(), dtype=np.uint8)
    if isinstance(value, memoryview):
        array = np.asarray(value)
        return array.view(np.uint8) if array.dtype == np.dtype("S1") else array
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _as_array(value: Any, name: str, server_name: str) -> np.ndarray:
    """Turns one proxy argument into the array its pipeline input receives.

    The pipeline gets the value exactly as given (shape, 0-d and empty dimensions included,
    element type and values), whether its server lives in this process or the call is made in a
    DataLoader worker, because both paths start from this array. Two conversions make it one that
    DALI reads correctly: an array that is not C-contiguous (a strided slice, a transpose, Fortran
    order, negative strides) is copied into C order, since ``feed_input`` refuses strided data;
    and an array in non-native byte order (``'>f4'`` on x86 and ARM) is converted to native order
    with the same values, since ``feed_input`` ignores the byte order and reads the bytes as native
    ones (wrong values, no error). Anything else is passed on as it is, without a copy.

    Raises:
        ProxyArgumentError: ``value`` is another proxy call's output, cannot be made an array, or
            has an element type DALI lacks (complex, strings, objects, dates, float128).
    """
    if type(value) is np.ndarray and value.dtype in _DALI_DTYPES and value.flags.c_contiguous:
        return value  # already what the pipeline gets (native order: others are not in the set)
    if isinstance(value, DALIOutputSampleRef):
        raise ProxyArgumentError(
            f"server {server_name!r}, input {name!r}: got the output of another proxy call; "
            "DALI outputs can only be used after the loader resolves them")
    try:
        array = _to_numpy(value)
    except Exception as err:
        raise ProxyArgumentError(f"server {server_name!r}, input {name!r}: cannot turn "
                                 f"{type(value).__name__} into an array: {err}") from err
    native = array.dtype.newbyteorder("=")
    if native not in _DALI_DTYPES:
        raise ProxyArgumentError(
            f"server {server_name!r}, input {name!r}: DALI has no element type for {array.dtype} "
            f"(from {type(value).__name__}); pass bool, int8-64, uint8-64 or float16/32/64 "
            "values, or bytes")
    if array.dtype.isnative and array.flags.c_contiguous:
        return array
    return np.asarray(array, dtype=native, order="C")


class DALIProxy:
    """Stands in for a server's pipeline in workers: ``proxy(*inputs)`` or ``proxy(**inputs)``.

    Args:
        server_name: The server's name, used in every message.
        server_uid: The server's unique id.
        input_names: The pipeline's ``external_source`` names, in declaration order.
        num_outputs: How many outputs the pipeline has.
        address: The server's socket address.
        sample_random: Inputs the proxy draws itself from each sample's seed (not arguments).
        arguments: The proxy's arguments (see :class:`SampleSeeded`); by default the inputs
            that are not drawn.
        encoded: Inputs that a decoder of the pipeline reads: each call refuses an array that
            cannot be what it decodes (:func:`mmproxy._server.encoded.problem`), naming the sample.
    """

    def __init__(self, server_name: str, server_uid: str, input_names: tuple[str, ...],
                 num_outputs: int, address: str,
                 sample_random: SampleRandom | None = None,
                 arguments: tuple[str, ...] | None = None,
                 encoded: dict[str, Encoded] | None = None) -> None:
        self.server_name = server_name
        self.server_uid = server_uid
        self.input_names = input_names
        self.num_outputs = num_outputs
        self.address = address
        self.sample_random = sample_random
        self.encoded = dict(encoded or {})
        drawn = set(sample_random.names) if sample_random is not None else set()
        if not drawn <= set(input_names):
            raise ValueError(f"server {server_name!r}: the pipeline's sample-drawn inputs "
                             f"{sorted(drawn - set(input_names))} are not among its inputs "
                             f"{list(input_names)}")
        if arguments is not None and sample_random is None:
            raise ValueError(f"server {server_name!r}: proxy arguments {list(arguments)} need a "
                             "sample_random that makes the pipeline's inputs of them")
        rest = tuple(n for n in input_names if n not in drawn)
        self.argument_names: tuple[str, ...] = arguments or rest
        if not set(rest) <= set(self.argument_names):
            raise ValueError(f"server {server_name!r}: inputs {sorted(set(rest) - set(self.argument_names))} "
                             "are neither drawn nor arguments")
        self._recent: OrderedDict[tuple[str, ...], str] = OrderedDict()

    @property
    def __signature__(self) -> inspect.Signature:
        params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                  for n in self.argument_names]
        return inspect.Signature(params)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_recent"] = OrderedDict()
        return state

    def __repr__(self) -> str:
        return f"DALIProxy(server={self.server_name!r}, signature={self.__signature__})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = _Call(self, _process.new_id(), self.sample_inputs(*args, **kwargs),
                     _context.current_key())
        if self.num_outputs == 1:
            return DALIOutputSampleRef(call, 0)
        return tuple(DALIOutputSampleRef(call, i) for i in range(self.num_outputs))

    @property
    def reads_sample(self) -> bool:
        """Whether :meth:`sample_inputs` reads which sample is being processed
        (:func:`mmproxy.sample_key`): to draw inputs from its seed, or to name it when it
        refuses an input."""
        return self.sample_random is not None or bool(self.encoded)

    def sample_inputs(self, *args: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        """What a call sends for one sample: one array per pipeline input, in their order
        (converted, drawn from the sample's seed, checked), without a reference. What
        :meth:`run` takes per sample; a call is this and a reference.

        Raises:
            ProxyArgumentError: The arguments do not fit the signature, or one of them (or a
                drawn input) cannot be a pipeline input, naming the server, input and sample.
        """
        names = self.argument_names
        if kwargs or len(args) != len(names):  # named, or not one value per argument
            try:
                bound = self.__signature__.bind(*args, **kwargs)
            except TypeError as err:
                got = ", ".join([type(a).__name__ for a in args]
                                + [f"{k}={type(v).__name__}" for k, v in kwargs.items()])
                raise ProxyArgumentError(
                    f"server {self.server_name!r}: expected proxy{self.__signature__}, "
                    f"got proxy({got}): {err}") from None
            args = tuple(bound.arguments[n] for n in names)
        if len(names) == 1:
            inputs: tuple[np.ndarray, ...] = (_as_array(args[0], names[0], self.server_name),)
        else:
            inputs = tuple(_as_array(v, n, self.server_name) for v, n in zip(args, names))
        if self.sample_random is None and not self.encoded:
            return inputs
        key = _context.current_key()
        if self.sample_random is not None:
            inputs = self._draw(dict(zip(names, inputs)), key)
        for name, kind in self.encoded.items():
            problem = _encoded.problem(kind, inputs[self.input_names.index(name)])
            if problem is not None:
                sample = f", sample {key}" if key is not None else ""
                raise ProxyArgumentError(
                    f"server {self.server_name!r}, input {name!r}{sample}: the pipeline decodes "
                    f"this input and expects {_encoded.expected(kind)}; {problem}")
        return inputs

    def _draw(self, given: dict[str, np.ndarray], key: _context.SampleId | None
              ) -> tuple[np.ndarray, ...]:
        """All the pipeline's inputs: ``given`` and the ones drawn from the sample's seed."""
        assert self.sample_random is not None
        seed = key.seed if key is not None else None
        if seed is None:
            rng = _unseeded
        else:  # each call of the sample draws from its own stream: two views, two crops
            rng = random.Random((seed + _context.draw_number() * 0x9E3779B97F4A7C15) % 2**64)
        drawn = self.sample_random(given, rng)
        return tuple(_as_array(drawn[n], n, self.server_name) if n in drawn else given[n]
                     for n in self.input_names)

    def submit(self, calls: list[_Call]) -> str:
        """Sends the inputs of ``calls`` (in order) to the server as one run; returns its id.

        The same calls collated again (the other outputs of a multi-output pipeline) reuse the
        run instead of running the pipeline twice.
        """
        key = tuple(c.id for c in calls)
        run_id = self._recent.get(key)
        if run_id is not None:
            return run_id
        run_id = self.run([c.key for c in calls], [c.inputs for c in calls])
        self._recent[key] = run_id
        if len(self._recent) > 8:
            self._recent.popitem(last=False)
        return run_id

    def run(self, keys: list[_context.SampleId | None], samples: list[tuple[np.ndarray, ...]]
            ) -> str:
        """Sends one run to the server: each sample's inputs (what :meth:`sample_inputs` gave),
        named by its key; returns the run's id. The run belongs to the loader and epoch whose
        batch is being made here (:mod:`mmproxy._context`).

        Raises:
            ProxyArgumentError: ``keys`` and ``samples`` differ in length, or a sample does not
                hold one array per pipeline input (checked here: the server would take such a
                run for a damaged one and fail).
        """
        width = len(self.input_names)
        if len(keys) != len(samples) or set(map(len, samples)) - {width}:
            counts = sorted(set(map(len, samples)))
            raise ProxyArgumentError(
                f"server {self.server_name!r}: a run of {len(keys)} keys and {len(samples)} "
                f"samples of {counts} inputs; give one key per sample and, per sample, one "
                f"array per pipeline input {list(self.input_names)} (what sample_inputs gives)")
        run_id = _process.new_id()
        tag = _context.current_tag()
        inputs = [list(column) for column in zip(*samples)] if samples else [
            [] for _ in self.input_names]
        server = _process.local(self.server_uid)
        if server is not None:  # the server lives in this process: no transport
            server.table.accept(_transport.Request(run_id, tag, list(keys), inputs,
                                                   _context.run_skips(list(keys))))
        else:
            fd, files = _transport.pack(run_id, tag, keys, inputs)
            try:
                _transport.send(self.address, [fd, *files], self.server_name)
            finally:
                os.close(fd)
        return run_id
