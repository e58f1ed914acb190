"""DALI adapter: the only code that touches DALI's internals.

Private DALI attributes used, all on ``nvidia.dali.Pipeline`` (DALI 2.x): ``_py_graph_built``,
``_build_graph``, ``_ops`` / ``op._op`` (to find the inputs), ``_deserialized``, ``_run_once``,
``_shutdown`` / ``_built`` / ``_backend_prepared`` (to rebuild from the same graph, and to
build copies of it with their own seed and threads: :meth:`Pipe.copy`), and
``Pipeline._pipes`` / ``_pipe`` (every live pipeline and its native part: a forked child keeps
the parent's from shutting down, :func:`_keep_inherited_pipelines`).
docs/internals.md, ``mmproxy._server.dali``, has the rest.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mmproxy import _process
from mmproxy._server import convert as _convert
from mmproxy._server.encoded import Encoded
from mmproxy.errors import ServerStateError

__all__ = ["Pipe", "named_sample", "summary"]


def _input_names(pipeline: Any) -> tuple[str, ...]:
    from nvidia.dali.external_source import ExternalSource

    if getattr(pipeline, "_deserialized", False):
        raise TypeError("cannot find the inputs of a deserialized pipeline; build it in Python")
    if not pipeline._py_graph_built:
        pipeline._build_graph()
    return tuple(op.name for op in pipeline._ops
                 if isinstance(op._op, ExternalSource) and getattr(op._op, "_callback", None) is None)


# DALI's decoder operators (schema names: ``fn.decoders.image`` is ``decoders__Image``; the
# ``experimental`` and legacy ``ops`` spellings too) and what they read from their first input.
_DECODERS = {
    **{f"{prefix}decoders__{name}": Encoded.IMAGE for prefix in ("", "experimental__")
       for name in ("Image", "ImageCrop", "ImageRandomCrop", "ImageSlice")},
    **{f"ImageDecoder{name}": Encoded.IMAGE for name in ("", "Crop", "RandomCrop", "Slice")},
    "PeekImageShape": Encoded.IMAGE, "experimental__PeekImageShape": Encoded.IMAGE,
    "decoders__Audio": Encoded.AUDIO, "AudioDecoder": Encoded.AUDIO,
    "decoders__Video": Encoded.VIDEO, "experimental__decoders__Video": Encoded.VIDEO,
}


def _encoded_inputs(pipeline: Any, names: tuple[str, ...]) -> dict[str, Encoded]:
    """The inputs among ``names`` that feed a decoder directly, and what it decodes."""
    kinds: dict[str, Encoded] = {}
    for op in pipeline._ops:
        kind = _DECODERS.get(getattr(op._op, "schema_name", None) or "")
        if kind is None or not op.inputs:
            continue
        source = op.inputs[0].source
        if source is not None and source.name in names:
            kinds[source.name] = kind
    return kinds


class Pipe:
    """A built DALI pipeline as the server uses it.

    Args:
        pipeline: A ``nvidia.dali.Pipeline``, or a function that builds one (called now, and
            again by :meth:`rebuild`).
        name: The server's name, for messages.
    """

    def __init__(self, pipeline: Any, name: str, *, seed: int | None = None) -> None:
        from nvidia.dali.pipeline import Pipeline

        self.name = name
        self._factory: Callable[[], Any] | None = None
        if not isinstance(pipeline, Pipeline) and callable(pipeline):
            self._factory, pipeline = pipeline, pipeline()
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"expected an NVIDIA DALI pipeline or a function that builds one, got "
                            f"{type(pipeline).__name__}")
        self.input_names = _input_names(pipeline)
        if not self.input_names:
            raise ValueError(f"server {name!r}: the pipeline has no fn.external_source input "
                             "without a source; the proxy would have nothing to send")
        self.encoded_inputs = _encoded_inputs(pipeline, self.input_names)
        self._seed = seed
        _seeded(pipeline, seed, name)
        pipeline.build()
        self.pipeline = pipeline
        self.num_outputs: int = pipeline.num_outputs
        self.max_batch_size: int = pipeline.max_batch_size
        self.num_threads: int = pipeline.num_threads
        self.device_id: int | None = (pipeline.device_id if pipeline.device_id is not None
                                      and pipeline.device_id >= 0 else None)
        depth = pipeline.prefetch_queue_depth
        self.queue_depth: int = depth if isinstance(depth, int) else min(depth.values())
        if not (pipeline.exec_pipelined and pipeline.exec_async):
            # The classic synchronous executor accepts one outstanding run after its first
            # outputs(); a second _run_once would block forever.
            self.queue_depth = 1

    @property
    def seed(self) -> int | None:
        """The seed DALI's random operators draw from (None: a random one of DALI's)."""
        return self.pipeline.seed

    def copy(self, index: int) -> Pipe:
        """Another instance of this pipeline, with its own DALI threads and seed (this one's
        seed + ``index``, or a random one when this one's is): built by the function that built
        this one, else from the same Python graph (Python operators included; DALI's
        serialization cannot hold them)."""
        seed = None if self.seed is None else (self.seed + index) % 2**31
        if self._factory is not None:
            other = Pipe(self._factory, self.name, seed=seed)
            if other.input_names != self.input_names:
                raise ServerStateError(f"server {self.name!r}: the pipeline function built a "
                                       f"pipeline with inputs {other.input_names}, not "
                                       f"{self.input_names}")
            return other
        return Pipe(_clone(self.pipeline, seed, self.name), self.name)

    @property
    def survives_errors(self) -> bool:
        """Whether the pipeline stays usable after a run fails (the dynamic executor)."""
        return bool(self.pipeline.exec_dynamic)

    def feed(self, inputs: Sequence[Sequence[Any]], rows: Sequence[int] | None = None) -> None:
        """Feeds one run (``rows`` of it, when given) and schedules it (``_run_once``)."""
        for name, arrays in zip(self.input_names, inputs):
            chosen = arrays if rows is None else [arrays[i] for i in rows]
            self.pipeline.feed_input(name, _tensor_list(chosen))
        self.pipeline._run_once()

    @property
    def keeps_outputs(self) -> bool:
        """Whether a run's outputs stay valid once later runs are scheduled (the dynamic
        executor's are the caller's; the classic executors reuse their buffers)."""
        return bool(self.pipeline.exec_dynamic)

    def take(self, stream: Any = None) -> Any:
        """The oldest scheduled run's outputs as DALI gives them, ready on ``stream`` (None for
        a CPU pipeline). Raises DALI's error when the run failed."""
        return self.pipeline.outputs() if stream is None else self.pipeline.outputs(cuda_stream=stream)

    def convert(self, taken: Any, pad: set[int], stream: Any = None) -> tuple[tuple[Any, ...], Any]:
        """:meth:`take`'s outputs as torch, and the CUDA event that marks them ready on
        ``stream`` (None for a CPU pipeline)."""
        if stream is None:
            copy = not self.keeps_outputs  # the classic executors reuse their output buffers
            return tuple(_convert.to_torch(o, copy=copy, want_pad=i in pad)
                         for i, o in enumerate(taken)), None
        import torch

        with torch.cuda.stream(stream):
            data = tuple(_convert.to_torch(o, copy=False, want_pad=i in pad, stream=stream)
                         for i, o in enumerate(taken))
            event = torch.cuda.Event()
            event.record(stream)
        return data, event

    def outputs(self, pad: set[int], stream: Any = None) -> tuple[tuple[Any, ...], Any]:
        """The oldest scheduled run's outputs as torch (:meth:`take`, then :meth:`convert`)."""
        return self.convert(self.take(stream), pad, stream)

    def close(self) -> None:
        """Releases the pipeline's native part now. A DALI pipeline is part of reference cycles
        of its own (pipeline, operators, graph nodes), so without this it would wait for the
        cyclic collector, and a forked child that inherited it would shut it down: that hangs
        (CPU) or aborts (CUDA) the child. The Python object left behind is inert."""
        self.pipeline._shutdown()

    def rebuild(self) -> None:
        """A fresh pipeline after an error the executor does not survive: from the function
        that built it, else from the same Python graph (DALI keeps its operators' specs)."""
        if self._factory is not None:
            fresh = self._factory()
            _seeded(fresh, self._seed, self.name)
            if _input_names(fresh) != self.input_names:
                raise ServerStateError(f"server {self.name!r}: the pipeline function built a pipeline "
                                       f"with inputs {_input_names(fresh)}, not {self.input_names}")
            fresh.build()
            self.pipeline._shutdown()
            self.pipeline = fresh
            return
        pipe = self.pipeline
        pipe._shutdown()
        pipe._built = False
        pipe._backend_prepared = False
        pipe.build()


def _seeded(pipeline: Any, seed: int | None, name: str) -> None:
    """Gives an unbuilt pipeline ``seed`` (a copy's); a built one cannot take it."""
    if seed is None:
        return
    if pipeline._built:
        raise ValueError(f"server {name!r}: the pipeline function returned a built pipeline, "
                         "which cannot take a copy's seed; return it unbuilt (do not call "
                         "build()) to run several pipelines")
    pipeline._seed = seed


def _clone(pipeline: Any, seed: int | None, name: str) -> Any:
    """An unbuilt copy of a built pipeline that shares its Python graph (operators and their
    specs, read-only once built) and has its own backend, seed and state; registered as DALI
    registers every pipeline, so that it is shut down at exit and kept inert in forked children.
    A graph with an ``external_source`` that has a ``source`` is refused: the copies would call
    one source object from several threads."""
    import copy
    import weakref

    from nvidia.dali.pipeline import Pipeline

    if pipeline._input_callbacks:
        raise ValueError(f"server {name!r}: the pipeline has an external_source with a source, "
                         "which copies of it would share; give the server a function that "
                         "builds the pipeline to run several")

    other = copy.copy(pipeline)
    for key, value in vars(pipeline).items():
        if isinstance(value, (dict, list, set)):  # the graph's tables the backend's build pops
            setattr(other, key, copy.copy(value))
    other._pipe = None
    other._built = other._backend_prepared = other._py_pool_started = False
    other._first_iter, other._batches_to_consume, other._consumer_iter = True, 0, 0
    other._seed = seed
    Pipeline._pipes.add(weakref.ref(other))
    return other


def _tensor_list(arrays: Sequence[Any]) -> Any:
    """One input's samples as one ``TensorListCPU`` that shares their memory (no copy).

    Fed as a Python list, DALI converts and checks every sample while holding the GIL, in which
    no other thread of the main process (the training loop included) runs; one tensor list is
    built and fed in a fraction of that time, so the training loop waits less for each feed.
    Samples DALI cannot put in one list (different dimensionality, types) are fed as the list,
    so that DALI's own error names the problem; so are samples that are not numpy arrays (a
    prepare stage's frames on the GPU): offered to ``TensorCPU``, which refuses them, they would
    be formatted into its error message, the whole tensor copied and printed with the GIL held.
    """
    import numpy as np
    from nvidia.dali.backend import TensorCPU, TensorListCPU

    if not all(isinstance(a, np.ndarray) for a in arrays):
        return list(arrays)
    try:
        # DALI's type stubs lack ``contiguous`` (DALI 2.x has it: False shares the samples)
        return TensorListCPU([TensorCPU(a) for a in arrays], contiguous=False)  # type: ignore[call-overload]
    except (TypeError, RuntimeError, ValueError):
        return list(arrays)


_NAMED = re.compile(r"sample #(\d+)")
_OPERATOR = re.compile(r"operator `(?:nvidia\.dali\.)?([^`]+)`")


def named_sample(err: BaseException, n: int) -> int | None:
    """The batch index a DALI error names (``Failed to decode sample #6``), if any."""
    match = _NAMED.search(str(err))
    if match is None:
        return None
    i = int(match.group(1))
    return i if i < n else None


# nvImageCodec's status codes (nvimgcodecStatus_t, in DALI's "nvImageCodec failure: '#3'") in words.
_DAMAGED = "the image data is damaged: it is not a valid stream of the format it starts as"
_UNREAD = "the data is not an image of a format the decoder reads"
_FAILED = ("the image decoder failed on the data (damaged, cut short, or a variant of its "
           "format DALI does not read)")
_MEMORY = "the decoder ran out of memory"
_CODEC_WORDS = {
    3: _DAMAGED, 13: _DAMAGED, 19: "the image data ends early (a file cut short)",
    4: _UNREAD, 14: _UNREAD, 9: "no decoder supports this kind of image",
    18: "no decoder supports this kind of image", 5: _MEMORY, 15: _MEMORY,
    6: _FAILED, 8: _FAILED, 17: _FAILED, 20: _FAILED,
}
_CODEC = re.compile(r"nvImageCodec failure: '#(\d+)'")
_UNDECODED = re.compile(r"Failed to decode sample #\d+\s*:?\s*(.*)")
# the audio decoder's: it names a file it has none of (its input is bytes in memory)
_AUDIO_UNDECODED = re.compile(r"Error decoding file \S*\s*\.?\s*Error:\s*(.*)")


def _in_words(line: str) -> str:
    """A DALI error line made a sentence where DALI's own is a code or stops short."""
    codec = _CODEC.search(line)
    if codec is not None:
        status = int(codec.group(1))
        words = _CODEC_WORDS.get(status, "the image codec failed")
        return f"{words} (nvImageCodec status {status})"
    undecoded = _UNDECODED.match(line) or _AUDIO_UNDECODED.match(line)
    if undecoded is not None:
        detail = undecoded.group(1).strip()
        return ("the decoder could not decode the data" + (f": {detail}" if detail else
                " (damaged, cut short, or a variant of its format DALI does not read; DALI "
                "gives no detail)"))
    if "std::bad_alloc" in line:
        return f"{_MEMORY} (does the data declare a huge size?)"
    return line


def summary(err: BaseException) -> str:
    """What failed, in words: the informative line of a DALI error (the one after
    'encountered:', else the first one) with the operator that raised it when DALI names one,
    and DALI's codes and cut-off lines said in words: ``fn.decoders.image: the image data is
    damaged: ... (nvImageCodec status 3)``."""
    text = str(err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else type(err).__name__
    if "encountered:" in lines:
        rest = lines[lines.index("encountered:") + 1:]
        if rest:
            line = rest[0]
    operator = _OPERATOR.search(text)
    line = _in_words(line)
    return f"{operator.group(1)}: {line}" if operator else line


def _keep_inherited_pipelines() -> None:
    """In a forked child: every DALI pipeline of the parent's (any, the user's too) loses its
    native part to :func:`mmproxy._process.keep`, so that freeing it here never shuts it down.
    Its threads were the parent's: the shutdown would wait for them forever (a DataLoader worker
    that collects a pipeline the parent dropped without shutting it down would hang)."""
    module = sys.modules.get("nvidia.dali.pipeline")
    if module is None:
        return
    for ref in list(getattr(module.Pipeline, "_pipes", ())):
        pipeline = ref()
        if pipeline is not None and pipeline._pipe is not None:
            _process.keep(pipeline._pipe)
            pipeline._pipe = None


_process.on_fork_in_child(_keep_inherited_pipelines)
