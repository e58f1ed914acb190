"""Worker context: what the code running in a DataLoader worker (or the main loop) is doing now.

Which loader and epoch the batch being collated belongs to (set by :class:`mmproxy.DataLoader`
in its workers; runs are tagged with it), whether this worker outlives the epoch, and which sample
the dataset is processing (so that proxy calls carry its key and skip policy). The dataset layer
reads it through :mod:`mmproxy.worker`.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from mmproxy.state import ResumePoint

# Set in DataLoader workers (and around each step in the main process when num_workers=0):
# (loader id, shared epoch value). Runs submitted under it are tagged (loader id, epoch).
_loader_tag: tuple[str, Any] | None = None
_persistent = False  # the worker outlives the epoch (persistent_workers=True)
_epoch_offset = 0  # added to the loader's epoch: 1 while a worker prepares the next epoch's first batch
_sample_key = threading.local()
_resume: dict[str, ResumePoint] = {}  # per loader id: where its epoch starts here (a resume)


def set_loader_tag(tag: tuple[str, Any] | None, persistent: bool = False) -> None:
    global _loader_tag, _persistent
    _loader_tag, _persistent = tag, persistent


def current_tag() -> tuple[str, int] | None:
    """(loader id, epoch) of the loader whose batch is being collated in this process, if any."""
    tag = _loader_tag
    if tag is None:
        return None
    return tag[0], int(tag[1].value) + _epoch_offset


def in_persistent_worker() -> bool:
    """Whether this is a persistent worker of an mmproxy DataLoader (it will see the next epoch)."""
    return _loader_tag is not None and _persistent


@contextlib.contextmanager
def next_epoch() -> Iterator[None]:
    """Runs submitted inside are tagged with the loader's next epoch."""
    global _epoch_offset
    _epoch_offset = 1
    try:
        yield
    finally:
        _epoch_offset = 0


class SampleId(NamedTuple):
    """Which sample a proxy call belongs to, and what to do when the pipeline cannot process it.

    ``skip``: the sample may be dropped from its batch and reported (a dataset in skip mode);
    otherwise a pipeline failure on it raises, naming it. ``seed``: the sample's own random seed
    (a dataset derives it from its seed, the epoch and the key), from which a server's
    sample-drawn inputs are drawn (:class:`mmproxy.proxy.SampleRandom`).
    """

    key: str
    shard: str | None = None
    skip: bool = False
    seed: int | None = None

    def __str__(self) -> str:
        return f"{self.shard}:{self.key}" if self.shard else self.key


def run_skips(keys: list[Any]) -> bool:
    """A run's error policy, given once with the run: its failing samples may be dropped when
    every sample is a :class:`SampleId` that may be (one dataset's run shares its policy)."""
    return bool(keys) and all(isinstance(k, SampleId) and k.skip for k in keys)


def current_key() -> SampleId | None:
    """The sample the dataset layer is processing in this thread, if it said so."""
    return getattr(_sample_key, "value", None)


def sample_key(key: str | None, *, shard: str | None = None, skip: bool = False,
               seed: int | None = None) -> contextlib.AbstractContextManager[None]:
    """Names the sample being processed, so that proxy calls inside carry its key (a context
    manager: ``with sample_key(key): ...``).

    Args:
        key: The sample's key (shown in every message about it).
        shard: Where it came from (a shard path or URL), if known.
        skip: Whether a pipeline failure on this sample drops it from its batch (reported in the
            loader's skip report and the batch's ``"__skipped__"``) instead of raising.
        seed: The sample's random seed: a pipeline's sample-drawn inputs (a random crop window,
            a flip) are drawn from it, so the sample gets the same augmentation whichever worker,
            batch or run it lands in (exact resume).
    """
    return _Naming(None if key is None else SampleId(str(key), shard, skip, seed))


def naming(sample: SampleId) -> contextlib.AbstractContextManager[None]:
    """:func:`sample_key` for a sample whose :class:`SampleId` is made already."""
    return _Naming(sample)


class _Naming:
    """:func:`sample_key`'s context manager (a class: entered once per sample, it must be
    cheap): the sample named inside, the one named before restored after."""

    __slots__ = ("previous", "value")

    def __init__(self, value: SampleId | None) -> None:
        self.value = value

    def __enter__(self) -> None:
        self.previous = getattr(_sample_key, "value", None), getattr(_sample_key, "draws", 0)
        _sample_key.value, _sample_key.draws = self.value, 0

    def __exit__(self, *_: object) -> None:
        _sample_key.value, _sample_key.draws = self.previous


def draw_number() -> int:
    """How many proxy calls of the current sample drew inputs before this one (0, 1, ...): two
    views of one sample (two fields, or a field function calling a proxy twice) draw apart."""
    number = getattr(_sample_key, "draws", 0)
    _sample_key.draws = number + 1
    return number


class Stamped:
    """A worker's item with the worker's position right after it: what a dataset yields (through
    :func:`mmproxy.worker.stamp`) so that the loader can save where every worker stands.

    Pickled (from a worker to the main process), the position travels as its pickled bytes
    (:class:`Packed`): the main process keeps the last one of each worker and reads it only when
    a state is asked for, not every batch (a shuffle buffer's position is hundreds of objects).
    """

    __slots__ = ("item", "worker", "state")

    def __init__(self, item: Any, worker: int, state: Any) -> None:
        self.item, self.worker, self.state = item, worker, state

    def __reduce__(self) -> tuple[Any, ...]:
        state = self.state if isinstance(self.state, Packed) else Packed(
            pickle.dumps(self.state, protocol=pickle.HIGHEST_PROTOCOL))
        return Stamped, (self.item, self.worker, state)

    def pin_memory(self) -> Stamped:  # torch's pin-memory thread calls this
        from torch.utils.data._utils.pin_memory import pin_memory

        return Stamped(pin_memory(self.item), self.worker, self.state)


class Packed(NamedTuple):
    """A worker's position as pickled bytes (see :class:`Stamped`)."""

    data: bytes


def unpacked(state: Any) -> Any:
    """A position as the dataset made it, whether it travelled :class:`Packed` or not."""
    return pickle.loads(state.data) if isinstance(state, Packed) else state


def set_resume(loader_id: str, state: ResumePoint | None) -> None:
    """Where this process starts the loader ``loader_id``'s next epoch (None: at its start).
    Kept per loader: two loaders without workers share one process (and a forked worker
    inherits its parent's entries, which name other loaders)."""
    if state is None:
        _resume.pop(loader_id, None)
    else:
        _resume[loader_id] = state


def take_resume(epoch: int) -> ResumePoint | None:
    """The position the loader whose batch is being made here handed this process for
    ``epoch``, once (later epochs start fresh)."""
    tag = _loader_tag
    if tag is None:
        return None
    state = _resume.get(tag[0])
    if state is None or state.epoch != epoch:
        return None
    del _resume[tag[0]]
    return state
