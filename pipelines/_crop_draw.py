"""Crop draw: the image training pipeline's per-sample crop window and flip, from the sample's seed.

A :class:`RandomResizedCrop` (the :class:`~mmproxy.proxy.SampleRandom` of
``image_train_pipeline(sample_seeded=True)``) reads the image's size from its header and draws
the crop window and the flip, so the server's decoder decodes only that window.
"""

from __future__ import annotations

import math
import random

import numpy as np

__all__ = ["RandomResizedCrop"]

_FLIP = (np.array(0, np.int32), np.array(1, np.int32))  # shared, never written to


class RandomResizedCrop:
    """The training pipeline's random draws, made per sample from the sample's seed (a
    :class:`~mmproxy.proxy.SampleRandom`): a crop window like torchvision's RandomResizedCrop
    (``scale`` of the area, aspect ``ratio`` drawn log-uniformly, 10 attempts, then the centre
    crop of the nearest allowed ratio) and a flip.

    The window needs the image's size, read from its header (JPEG, PNG), as DALI decodes it: a
    JPEG's EXIF orientation 5-8 swaps its width and height; for other formats the window is drawn
    as if the image were square (its relative area is still within ``scale``).
    """

    names = ("crop_anchor", "crop_shape", "flip")

    def __init__(self, input_name: str, scale: tuple[float, float], ratio: tuple[float, float],
                 flip_probability: float) -> None:
        self.input_name, self.scale, self.ratio = input_name, scale, ratio
        self.flip_probability = flip_probability

    def __call__(self, given: dict[str, np.ndarray], rng: random.Random
                 ) -> dict[str, np.ndarray]:
        from mmproxy.media.checks import image_size, jpeg_orientation

        data = given[self.input_name].data.cast("B")  # the header reader takes bytes
        png = data[:4] == b"\x89PNG"
        size = image_size("png" if png else "jpg", data)
        width, height = size if size and min(size) > 0 else (1024, 1024)
        if not png and jpeg_orientation(data) >= 5:  # decoded turned a quarter: the window is
            width, height = height, width  # drawn, and cut, in the turned image
        x, y, w, h = self.window(width, height, rng)
        flip = rng.random() < self.flip_probability
        return {"crop_anchor": np.array((x / width, y / height), np.float32),
                "crop_shape": np.array((w / width, h / height), np.float32),
                "flip": _FLIP[flip]}

    def window(self, width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
        """(x, y, w, h) of the crop in pixels."""
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                return rng.randint(0, width - w), rng.randint(0, height - h), w, h
        aspect = width / height
        if aspect < min(self.ratio):
            w, h = width, round(width / min(self.ratio))
        elif aspect > max(self.ratio):
            w, h = round(height * max(self.ratio)), height
        else:
            w, h = width, height
        return (width - w) // 2, (height - h) // 2, w, h
