"""External input: a graph function behind one named ``fn.external_source``, the pipeline shape a
:class:`~mmproxy.DALIServer` takes (the input's name is the proxy's argument); and
:func:`resolve_device`, the one place that decides where a ready pipeline runs (GPU when there is
one, CPU operators otherwise)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

__all__ = ["Device", "external_pipeline", "resolve_device"]


Device = Literal["auto", "gpu", "cpu"]


def resolve_device(device: Device = "auto", device_id: int | None = None) -> tuple[bool, int | None]:
    """Returns (use_gpu, device_id) for ``device``: 'auto' picks the GPU when CUDA is there,
    'gpu' insists on it (ValueError without CUDA), 'cpu' never uses it; ``device_id`` None means
    the current CUDA device. The id is None whenever use_gpu is False (DALI's CPU-only mode)."""
    if device not in ("auto", "gpu", "cpu"):
        raise ValueError(f"device must be 'auto', 'gpu' or 'cpu', got {device!r}")
    if device == "cpu":
        return False, None
    import torch

    available = torch.cuda.is_available()
    if device == "gpu" and not available:
        raise ValueError("device='gpu' was asked for, but CUDA is not available here")
    if not available:
        return False, None
    return True, torch.cuda.current_device() if device_id is None else device_id


def external_pipeline(graph: Callable[[Any], Any], *, input_name: str, batch_size: int,
                      num_threads: int = 4, device_id: int | None = None,
                      prefetch_queue_depth: int = 2, seed: int | None = None,
                      more_inputs: Sequence[str] = ()) -> Any:
    """Builds a pipeline whose outputs are ``graph(data)``, ``data`` being the bytes the proxy is
    given (``fn.external_source(name=input_name)``, uint8, one 1-D array per sample).

    Args:
        graph: DALI nodes in, DALI nodes out, e.g. ``partial(image_train_graph, gpu=False)``.
        input_name: Name of the ``external_source`` (the proxy's argument).
        batch_size: The largest batch the server will be asked to run.
        num_threads: DALI CPU threads.
        device_id: The GPU (from :func:`~mmproxy.pipelines.resolve_device`); None for CPU only.
        prefetch_queue_depth: Runs the server keeps in flight.
        seed: DALI's random seed (None: random).
        more_inputs: Names of further ``external_source`` inputs, given to ``graph`` as keyword
            arguments (e.g. the sample-drawn inputs of :class:`mmproxy.proxy.SampleRandom`).
    """
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def
    def pipe() -> Any:
        more = {name: fn.external_source(name=name, no_copy=True) for name in more_inputs}
        return graph(fn.external_source(name=input_name, no_copy=True, dtype=types.UINT8), **more)

    return pipe(batch_size=batch_size, num_threads=num_threads, device_id=device_id, seed=seed,
                prefetch_queue_depth=prefetch_queue_depth)
