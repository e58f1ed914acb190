"""The bench's DALI pipelines: one graph per workload (:mod:`mmproxy.pipelines`), behind an
``external_source`` (mmproxy, DALI's proxy) or behind ``fn.readers.webdataset`` (the pure reader),
so every DALI system runs the same operators.

Video clips (the ``video`` workload) are :data:`FRAMES` frames at :data:`STRIDE` from a random
start, the shorter side resized to :data:`RESIZE`, a random :data:`SIZE` crop, a flip,
normalized to float32 NCTHW: small enough for a CPU of two cores. mmproxy runs
:func:`~mmproxy.pipelines.video_pipeline` (on CPU the workers decode with PyAV); the reader
decodes with DALI's ``fn.decoders.video`` (on a GPU: DALI's CPU decoder has no H.264)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmproxy.apps.bench.systems import Setup

__all__ = ["FRAMES", "RESIZE", "SIZE", "STRIDE", "proxied_pipeline", "reader_pipeline",
           "recipe_pipeline"]

FRAMES, STRIDE, SIZE, RESIZE = 8, 4, 112, 128  # the video workload's clips


def _graph(setup: Setup) -> Any:
    """The workload's graph: encoded bytes in, one output (images, or padded audio) out."""
    from mmproxy.pipelines import audio_graph, image_train_graph

    if setup.workload == "machinery":
        return lambda data: data  # the proxy machinery alone: the bytes come back
    if setup.modality == "audio":
        return lambda data: audio_graph(data, gpu=setup.gpu, sample_rate=16000,
                                        pad_to_longest=True)[0]
    return partial(image_train_graph, gpu=setup.gpu, size=224, cpu_resize=setup.args.cpu_resize,
                   hw_decoder_load=getattr(setup.args, "hw_decoder_load", None))


def proxied_pipeline(setup: Setup, prefetch: int | None = None) -> Any:
    """The workload's pipeline fed by proxies (input ``data``; ``videos`` for video, whose
    pipeline draws each clip's start, crop and flip in the worker), ``prefetch`` runs deep
    (default: ``--prefetch``)."""
    from mmproxy.pipelines import external_pipeline, video_pipeline

    depth = prefetch or setup.args.prefetch
    if setup.modality == "video":
        return video_pipeline(batch_size=setup.batch, frames=FRAMES, stride=STRIDE, size=SIZE,
                              resize_size=RESIZE, device="gpu" if setup.gpu else "cpu",
                              device_id=setup.device_id, num_threads=setup.args.threads,
                              prefetch_queue_depth=depth, cpu_resize=setup.args.cpu_resize)
    return external_pipeline(_graph(setup), input_name="data", batch_size=setup.batch,
                             num_threads=setup.args.threads, device_id=setup.device_id,
                             prefetch_queue_depth=depth)


def recipe_pipeline(setup: Setup) -> tuple[Any, list[int]]:
    """mmproxy's pipeline as the README's recipes build it, and the outputs the server pads:
    for audio, ``audio_pipeline`` with clips of their own lengths padded by the server
    (``pad=[0]``); for the other workloads, :func:`proxied_pipeline`."""
    if setup.modality != "audio" or setup.workload == "machinery":
        return proxied_pipeline(setup), []
    from mmproxy.pipelines import audio_pipeline

    pipe = audio_pipeline(batch_size=setup.batch, sample_rate=16000,
                          device="gpu" if setup.gpu else "cpu", device_id=setup.device_id,
                          num_threads=setup.args.threads, prefetch_queue_depth=setup.args.prefetch,
                          input_name="data")
    return pipe, [0]


def reader_pipeline(setup: Setup, prefetch: int = 2) -> Any:
    """The workload's pipeline fed by DALI's own shard reader (named ``reader``), shuffling,
    ``prefetch`` runs deep (DALI's default, 2)."""
    from nvidia.dali import fn, pipeline_def

    graph = _video_graph if setup.modality == "video" else _graph(setup)

    @pipeline_def
    def pipe() -> Any:
        data = fn.readers.webdataset(paths=setup.paths, ext=[setup.ext], random_shuffle=True,
                                     initial_fill=256, name="reader",
                                     missing_component_behavior="error")  # as the others
        return graph(data)

    return pipe(batch_size=setup.batch, num_threads=setup.args.threads, device_id=setup.device_id,
                prefetch_queue_depth=prefetch)


def _video_graph(encoded: Any) -> Any:
    """Encoded clips to the video workload's clips, all in DALI (GPU): NVDEC decodes the clip
    from a random start among those the bench's clips (50 frames) have room for."""
    from nvidia.dali import fn, types

    from mmproxy.pipelines import video_graph

    room = 50 - (FRAMES - 1) * STRIDE - 1
    start = fn.cast(fn.random.uniform(range=(0.0, room + 1.0)), dtype=types.INT32)
    video = fn.decoders.video(encoded, device="mixed", start_frame=start, sequence_length=FRAMES,
                              stride=STRIDE, pad_mode="edge")
    return video_graph(video, gpu=True, size=SIZE, resize_size=RESIZE,
                       crop_x=fn.random.uniform(range=(0.0, 1.0)),
                       crop_y=fn.random.uniform(range=(0.0, 1.0)), flip=fn.random.coin_flip())
