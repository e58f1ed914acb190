"""The bench's DALI pipelines: one graph per workload (:mod:`mmproxy.pipelines`), behind an
``external_source`` (mmproxy, DALI's proxy) or behind ``fn.readers.webdataset`` (the pure reader),
so every DALI system runs the same operators."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmproxy.apps.bench.systems import Setup

__all__ = ["proxied_pipeline", "reader_pipeline"]


def _graph(setup: Setup) -> Any:
    """The workload's graph: encoded bytes in, one output (images, or padded audio) out."""
    from mmproxy.pipelines import audio_graph, image_train_graph

    if setup.workload == "machinery":
        return lambda data: data  # the proxy machinery alone: the bytes come back
    if setup.modality == "audio":
        return lambda data: audio_graph(data, gpu=setup.gpu, sample_rate=16000,
                                        pad_to_longest=True)[0]
    return partial(image_train_graph, gpu=setup.gpu, size=224, cpu_resize=setup.args.cpu_resize)


def proxied_pipeline(setup: Setup, prefetch: int | None = None) -> Any:
    """The workload's pipeline fed by proxies (input ``data``), ``prefetch`` runs deep (default:
    ``--prefetch``)."""
    from mmproxy.pipelines import external_pipeline

    return external_pipeline(_graph(setup), input_name="data", batch_size=setup.batch,
                             num_threads=setup.args.threads, device_id=setup.device_id,
                             prefetch_queue_depth=prefetch or setup.args.prefetch)


def reader_pipeline(setup: Setup, prefetch: int = 2) -> Any:
    """The workload's pipeline fed by DALI's own shard reader (named ``reader``), shuffling,
    ``prefetch`` runs deep (DALI's default, 2)."""
    from nvidia.dali import fn, pipeline_def

    graph = _graph(setup)

    @pipeline_def
    def pipe() -> Any:
        data = fn.readers.webdataset(paths=setup.paths, ext=[setup.ext], random_shuffle=True,
                                     initial_fill=256, name="reader",
                                     missing_component_behavior="error")  # as the others
        return graph(data)

    return pipe(batch_size=setup.batch, num_threads=setup.args.threads, device_id=setup.device_id,
                prefetch_queue_depth=prefetch)
