"""mmproxy.pipelines: ready DALI pipelines for the heavy modalities (images, audio, video).

Each pipeline is a graph function (``image_train_graph``, ``image_eval_graph``, ``audio_graph``,
``video_graph``: DALI nodes in, DALI nodes out) behind a named ``fn.external_source``
(``external_pipeline``), so a pipeline fed by a proxy and one fed by a DALI reader share one
definition. Each picks GPU operators when CUDA is available and CPU operators (``device_id=None``)
otherwise (``device="auto"|"gpu"|"cpu"``, decided by ``resolve_device``), and can be replaced by
any pipeline of your own wherever one is accepted.
"""

from mmproxy.pipelines.audio import audio_graph, audio_pipeline
from mmproxy.pipelines.external import Device, external_pipeline, resolve_device
from mmproxy.pipelines.image import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    RandomResizedCrop,
    image_eval_graph,
    image_eval_pipeline,
    image_train_graph,
    image_train_pipeline,
    resize,
)
from mmproxy.pipelines.video import ClipDraw, decode_clip, video_graph, video_pipeline

__all__ = ["ClipDraw", "Device", "IMAGENET_MEAN", "IMAGENET_STD", "RandomResizedCrop",
           "audio_graph", "audio_pipeline", "decode_clip", "external_pipeline", "image_eval_graph",
           "image_eval_pipeline", "image_train_graph", "image_train_pipeline", "resize",
           "resolve_device", "video_graph", "video_pipeline"]
