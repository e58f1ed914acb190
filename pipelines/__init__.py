"""mmproxy.pipelines: ready DALI pipelines for the heavy modalities (images, audio).

Each has named ``fn.external_source`` inputs, picks GPU operators when CUDA is available and CPU
operators (``device_id=None``) otherwise (``device="auto"|"gpu"|"cpu"``), and can be replaced by
any pipeline of your own wherever one is accepted.
"""

from mmproxy.pipelines.audio import audio_pipeline
from mmproxy.pipelines.image import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    image_eval_pipeline,
    image_train_pipeline,
)

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "audio_pipeline", "image_eval_pipeline",
           "image_train_pipeline"]
