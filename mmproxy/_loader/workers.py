"""Workers: what an mmproxy DataLoader's worker processes start with, and how they go.

- :class:`WorkerInit` is the loader's ``worker_init_fn``: it tags each worker's runs with the
  loader's id and live epoch, hands the worker its starting position when the loader resumes,
  has small tensors handed over inline (:func:`inline_small_tensors`), then calls the user's
  own ``worker_init_fn``.
- :func:`shutdown` stops the workers of one of torch's iterators now.
- :func:`track`: a forked worker of a later loader inherits the iterators of earlier ones; if it
  garbage-collected them, torch's iterator would try to shut down workers that are not its
  children. The child keeps every tracked iterator alive (inert) instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from mmproxy import _context, _process
from mmproxy.state import ResumePoint

__all__ = ["WorkerInit", "inline_small_tensors", "shutdown", "track"]

# Tensors up to this size travel to the main process inside the pickled batch; larger ones in
# shared memory, as torch sends them.
INLINE_MAX = 128 << 10


class WorkerInit:
    """Runs in each worker: tags the worker's runs with this loader's id and live epoch, and
    hands it its starting position when the loader resumes.

    Args:
        loader_id: The loader's id.
        epoch: The loader's shared epoch counter (a ``multiprocessing.RawValue``).
        user: The user's ``worker_init_fn``, called last.
        persistent: Whether the workers are persistent (they then live over epochs).
    """

    def __init__(self, loader_id: str, epoch: Any, user: Callable[[int], None] | None,
                 persistent: bool) -> None:
        self.loader_id, self.epoch, self.user, self.persistent = loader_id, epoch, user, persistent
        self.resume: dict[int, ResumePoint] | None = None

    def __call__(self, worker_id: int) -> None:
        _context.set_loader_tag((self.loader_id, self.epoch), self.persistent)
        _context.set_resume(self.loader_id,
                            None if self.resume is None else self.resume.get(worker_id))
        inline_small_tensors()
        if self.user is not None:
            self.user(worker_id)


def inline_small_tensors() -> None:
    """Has this process hand small CPU tensors over inside the pickled batch. torch sends every
    tensor of a worker's batch through shared memory: the main process then fetches a file
    descriptor from the worker over a socket and maps it, about half a millisecond a tensor
    with the main process's interpreter held, where a batch's labels or tokens copied with the
    batch cost a tenth of that (the main process gets a copy either way). Tensors over
    :data:`INLINE_MAX`, that need gradients or are not plain strided CPU tensors go as torch
    sends them."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing.reductions import reduce_tensor

    def reduce(tensor: torch.Tensor) -> Any:
        if (tensor.device.type != "cpu" or tensor.layout is not torch.strided
                or tensor.requires_grad or tensor.is_quantized or tensor.is_nested
                or tensor.has_names() or tensor.nbytes > INLINE_MAX):
            return reduce_tensor(tensor)
        try:
            data = tensor.resolve_conj().resolve_neg().contiguous().reshape(-1).view(
                torch.uint8).numpy()
        except (RuntimeError, TypeError):  # a kind of tensor its bytes do not describe
            return reduce_tensor(tensor)
        return _inlined, (data, tensor.dtype, tuple(tensor.shape))

    ForkingPickler.register(torch.Tensor, reduce)


def _inlined(data: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor that :func:`inline_small_tensors` sent (``data``: its bytes, a numpy array)."""
    return torch.from_numpy(data).view(dtype).reshape(shape)


def shutdown(it: Any) -> None:
    """Shuts down the workers of torch's iterator ``it`` (nothing for one without workers)."""
    stop = getattr(it, "_shutdown_workers", None)
    if stop is None:
        return
    try:
        stop()
    except RuntimeError as err:
        # After a worker died, torch's SIGCHLD handler reports it again when the other workers
        # exit during the shutdown; the shutdown itself has finished (in torch's `finally`).
        if "DataLoader worker" not in str(err):
            raise


_live: weakref.WeakSet[Any] = weakref.WeakSet()  # torch's iterators of this process's loaders


def track(it: Any) -> None:
    """Keeps torch's iterator ``it`` alive in forked children while it lives here."""
    _live.add(it)


def _keep_inherited() -> None:
    for it in list(_live):
        _process.keep(it)


_process.on_fork_in_child(_keep_inherited)
