"""What the bench's systems run in DataLoader workers: raw samples of the shards, plain PyTorch's
transforms (torchvision, torchaudio, PyAV: the ``torch`` systems), and proxy calls (DALI's
proxy)."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from mmproxy.pipelines import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["ProxyCall", "TinySamples", "TorchImage", "TorchVideo", "WdsSamples", "call_named",
           "named_fields", "pad_collate", "torch_audio"]


class WdsSamples(torch.utils.data.IterableDataset):
    """``fn(bytes)`` of each sample's ``ext`` field (``jpg;png``: the first of them it has) in
    the shards, split by worker. Like a plain loader it skips nothing: a sample without the
    field, or one ``fn`` fails on, stops it with an error naming the sample and its shard."""

    def __init__(self, paths: list[str], ext: str, fn: Callable[[bytes], Any]) -> None:
        self.paths, self.ext, self.fn = paths, ext, fn

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        mine = self.paths[info.id::info.num_workers] if info else self.paths
        for where, data in named_fields(mine, self.ext):
            yield call_named(self.fn, where, data)


def named_fields(paths: list[str], ext: str) -> Iterator[tuple[str, bytes]]:
    """Each sample's ``ext`` field (``jpg;png``: the first of them it has) in the shards
    ``paths`` (webdataset's tar reader), with where it is in words ("sample KEY of SHARD"). A
    sample without the field is a ValueError naming it."""
    import webdataset as wds

    exts = ext.split(";")  # alternatives: the first a sample has
    for sample in wds.tariterators.tarfile_samples({"url": u} for u in paths):
        where = f"sample {sample.get('__key__')!r} of {sample.get('__url__')}"
        found = next((e for e in exts if e in sample), None)
        if found is None:
            fields = ", ".join(k for k in sample if not k.startswith("__"))
            raise ValueError(f"{where} has no {ext!r} field (it has {fields})")
        yield where, sample[found]


def call_named(fn: Callable[[bytes], Any], where: str, data: bytes) -> Any:
    """``fn(data)``; what it raises comes back as a RuntimeError that starts with ``where``."""
    try:
        return fn(data)
    except Exception as err:  # noqa: BLE001 - said with the sample, then raised
        raise RuntimeError(f"{where}: {type(err).__name__}: {err}") from err


class TinySamples(torch.utils.data.Dataset):
    """The proxy machinery alone: ``n`` proxy calls on 16-byte samples."""

    def __init__(self, proxy: Any, n: int) -> None:
        self.proxy, self.n = proxy, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.proxy(np.full(16, i % 251, np.uint8))


class ProxyCall:
    """A proxy called on a sample's bytes (DALI's proxy takes arrays)."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy

    def __call__(self, data: bytes) -> Any:
        return self.proxy(np.frombuffer(data, np.uint8))


class TorchImage:
    """The image pipeline's ops in torchvision: ``decoder`` "pil" (ImageFolder's default loader)
    or "tensor" (``torchvision.io.decode_image``: JPEG as ``decode_jpeg``, PNG, WebP...), then
    random-resized crop 224, flip, normalize."""

    def __init__(self, decoder: str) -> None:
        from torchvision.transforms import v2

        self.decoder = decoder
        first = [v2.PILToTensor()] if decoder == "pil" else []
        self.t = v2.Compose([*first, v2.RandomResizedCrop(224, antialias=True),
                             v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32),
                             v2.Normalize(list(IMAGENET_MEAN), list(IMAGENET_STD))])

    def __call__(self, data: bytes) -> torch.Tensor:
        if self.decoder == "pil":
            from PIL import Image

            return self.t(Image.open(io.BytesIO(data)).convert("RGB"))
        from torchvision.io import ImageReadMode, decode_image
        from torchvision.transforms.v2.functional import to_dtype

        image = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                             mode=ImageReadMode.RGB)  # a 16-bit PNG gives uint16, which flips
        return self.t(to_dtype(image, torch.uint8, scale=True))  # do not take: 8 bits, as DALI's


def torch_audio(data: bytes) -> torch.Tensor:
    """The audio pipeline's ops in PyTorch: decode (soundfile: WAV, FLAC and OGG, every format
    ``make-shards`` writes), downmix to mono, resample to 16 kHz (torchaudio)."""
    import soundfile as sf
    import torchaudio

    signal, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    x = torch.from_numpy(signal.mean(axis=1))
    return torchaudio.functional.resample(x, rate, 16000)


class TorchVideo:
    """The video pipeline's ops in PyTorch: PyAV decodes ``frames`` frames at ``stride`` from a
    random start (seeking to the key frame before it), torchvision resizes the shorter side to
    ``resize``, then a random ``size`` crop, a flip, normalized, as float32 CTHW."""

    def __init__(self, frames: int, stride: int, size: int, resize: int) -> None:
        self.frames, self.stride, self.size, self.resize = frames, stride, size, resize
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1, 1)

    def __call__(self, data: bytes) -> torch.Tensor:
        import random

        from torchvision.transforms.v2 import functional as F

        from mmproxy.datasets.checks import video_info
        from mmproxy.pipelines.video import clip_start, decode_clip

        rng = random.Random()
        info = video_info(data)
        start = clip_start(info.frames if info else None, self.frames, self.stride, True, rng)
        clip = torch.from_numpy(decode_clip(data, start, self.frames, self.stride))
        clip = F.resize(clip.permute(0, 3, 1, 2), self.resize, antialias=True)  # TCHW
        h, w = clip.shape[-2:]
        y, x = rng.randint(0, h - self.size), rng.randint(0, w - self.size)
        clip = clip[..., y:y + self.size, x:x + self.size]
        if rng.random() < 0.5:
            clip = clip.flip(-1)
        return (clip.permute(1, 0, 2, 3).float() - self.mean) / self.std


def pad_collate(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Clips of different lengths as one zero-padded batch and their lengths."""
    lengths = torch.tensor([len(x) for x in items])
    return torch.nn.utils.rnn.pad_sequence(items, batch_first=True), lengths
