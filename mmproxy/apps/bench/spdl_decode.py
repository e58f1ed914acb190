"""SPDL decoding: one sample of the bench's image and audio workloads through SPDL's media
library (``spdl.io``), and the batch as one tensor; what the ``spdl`` systems' decoding tasks
run (:mod:`~mmproxy.apps.bench.spdl_loader`). The decoders load SPDL's FFmpeg when they are made
(:func:`~mmproxy.apps.bench.spdl_ffmpeg.load_ffmpeg`: the system's, else PyAV's)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Normalize", "NvjpegImage", "SIZE", "SpdlAudio", "SpdlImage"]

SIZE = 224  # the image workload's crops, as every system's
_SAMPLE_RATE = 16000  # the audio workload's rate


class SpdlImage:
    """One JPEG (or any image FFmpeg decodes) to a ``SIZE`` x ``SIZE`` RGB frame: a random crop
    window and flip drawn in Python from the image's size, applied by FFmpeg's filter graph
    while it decodes. Returns SPDL's ``ImageFrames`` (batched by :meth:`collate`)."""

    def __init__(self, seed: int | None = None) -> None:
        import spdl.io

        from mmproxy.apps.bench.spdl_ffmpeg import load_ffmpeg
        from mmproxy.pipelines import RandomResizedCrop

        load_ffmpeg()
        self.rng = random.Random(seed)
        self.crop = RandomResizedCrop("data", (0.08, 1.0), (3 / 4, 4 / 3), 0.5)
        self.tail = spdl.io.get_video_filter_desc(scale_width=SIZE, scale_height=SIZE,
                                                  scale_mode=None, scale_algo="bilinear",
                                                  pix_fmt="rgb24")

    def __call__(self, data: bytes) -> Any:
        import spdl.io

        packets = spdl.io.demux_image(data)
        codec = packets.codec
        if codec is None:
            raise ValueError("FFmpeg finds no image in it")
        x, y, w, h = self.crop.window(codec.width, codec.height, self.rng)
        flip = "hflip," if self.rng.random() < 0.5 else ""
        return spdl.io.decode_packets(packets, filter_desc=f"crop={w}:{h}:{x}:{y},{flip}{self.tail}")

    @staticmethod
    def collate(frames: list[Any]) -> torch.Tensor:
        """The batch's frames as one uint8 NHWC tensor (SPDL copies them into one buffer)."""
        import spdl.io

        return spdl.io.to_torch(spdl.io.convert_frames(frames))


class SpdlAudio:
    """One clip to a float32 mono waveform at 16 kHz. WAV through SPDL's own WAV reader
    (``spdl.io.load_wav``: a view of the samples, no FFmpeg), downmixed and resampled by
    torchaudio as the ``torch`` system does; any other format (FLAC, OGG, ...) decoded,
    downmixed and resampled by FFmpeg (``aformat``, ``aresample``). Batched by
    :func:`~mmproxy.apps.bench.workers.pad_collate`."""

    _SCALE = {"int16": 2.0 ** 15, "int32": 2.0 ** 31, "uint8": 2.0 ** 7}  # to [-1, 1)

    def __init__(self) -> None:
        import spdl.io

        from mmproxy.apps.bench.spdl_ffmpeg import load_ffmpeg

        load_ffmpeg()
        self.filter = spdl.io.get_audio_filter_desc(sample_rate=_SAMPLE_RATE, num_channels=1,
                                                    sample_fmt="fltp")

    def __call__(self, data: bytes) -> torch.Tensor:
        import numpy as np
        import spdl.io
        import torch
        import torchaudio

        if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
            frames = spdl.io.decode_packets(spdl.io.demux_audio(data), filter_desc=self.filter)
            return spdl.io.to_torch(spdl.io.convert_frames(frames))[0]  # planar: (channel, time)
        rate = spdl.io.parse_wav(data).sample_rate
        samples = np.asarray(spdl.io.load_wav(data))  # (time, channel)
        clip = torch.from_numpy(samples.astype(np.float32)).mean(dim=1)  # a view of bytes: copied
        if samples.dtype == np.uint8:
            clip -= 128
        if samples.dtype.name in self._SCALE:
            clip /= self._SCALE[samples.dtype.name]
        return torchaudio.functional.resample(clip, rate, _SAMPLE_RATE)


class Normalize:
    """uint8 NHWC images to float32 NCHW, ImageNet's mean and std (0-255 units)."""

    def __init__(self) -> None:
        import torch

        from mmproxy.pipelines import IMAGENET_MEAN, IMAGENET_STD

        std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        self.scale, self.shift = 1 / std, -torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) / std

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        import torch

        if self.scale.device != batch.device:
            self.scale, self.shift = self.scale.to(batch.device), self.shift.to(batch.device)
        out = batch.permute(0, 3, 1, 2).contiguous().to(torch.float32)  # each pass contiguous
        return out.mul_(self.scale).add_(self.shift)


class NvjpegImage:
    """``spdl-gpu``: one JPEG decoded by nvJPEG on the GPU, then the crop window and flip drawn
    as :class:`SpdlImage` draws them, cut, resized (bilinear, antialiased) and flipped there with
    torchvision v2: a uint8 CHW tensor on the GPU."""

    def __init__(self, device_id: int, seed: int | None = None) -> None:
        import spdl.io
        import torch

        from mmproxy.pipelines import RandomResizedCrop

        self.rng = random.Random(seed)
        self.crop = RandomResizedCrop("data", (0.08, 1.0), (3 / 4, 4 / 3), 0.5)
        self.config = spdl.io.cuda_config(
            device_index=device_id,
            allocator=(torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete))

    def __call__(self, data: bytes) -> torch.Tensor:
        import spdl.io
        from torchvision.transforms.v2 import functional as F

        image = spdl.io.to_torch(spdl.io.decode_image_nvjpeg(data, device_config=self.config))
        height, width = image.shape[-2:]
        x, y, w, h = self.crop.window(width, height, self.rng)
        image = F.resized_crop(image, y, x, h, w, [SIZE, SIZE], antialias=True)
        return image.flip(-1) if self.rng.random() < 0.5 else image

    @staticmethod
    def collate(images: list[torch.Tensor]) -> torch.Tensor:
        """The batch as one uint8 NHWC tensor on the GPU (as :meth:`SpdlImage.collate` gives)."""
        import torch

        return torch.stack(images).permute(0, 2, 3, 1)
