"""Testing: small synthetic media and shards, for tests, the demo and benchmarks.

Images have structure (gradients, shapes), audio has speech-like harmonics; nothing is downloaded.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["audio_bytes", "image_bytes", "make_tokenizer", "synth_image", "synth_speech",
           "write_tar"]

WORDS = ("a red circle on a blue field", "green stripes over a yellow sky",
         "a small square in the corner", "waves of orange and purple light",
         "two dots beside a long line", "a bright ring around a dark center")


def synth_image(seed: int, height: int = 96, width: int = 128) -> np.ndarray:
    """An RGB uint8 image with gradients and a filled shape, different for every seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(0, 255, 3)
    angle = rng.uniform(0, np.pi)
    grad = (np.cos(angle) * x / width + np.sin(angle) * y / height)
    img = base[None, None, :] * 0.5 + 120 * grad[..., None] * rng.uniform(0.3, 1.0, 3)
    cy, cx, r = rng.uniform(0.2, 0.8) * height, rng.uniform(0.2, 0.8) * width, rng.uniform(8, 30)
    mask = (y - cy) ** 2 + (x - cx) ** 2 < r * r
    img[mask] = rng.uniform(0, 255, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


def image_bytes(array: np.ndarray, fmt: str = "JPEG", mode: str | None = None,
                quality: int = 90) -> bytes:
    """Encodes an array with Pillow (``fmt``: JPEG, PNG, ...; ``mode``: L, RGBA, ...)."""
    from PIL import Image

    img = Image.fromarray(array)
    if mode:
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def synth_speech(seed: int, seconds: float, rate: int = 16000, channels: int = 1) -> np.ndarray:
    """A float32 signal with a gliding fundamental, harmonics and syllable-like bursts."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = rng.uniform(90, 220) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * rng.uniform(2, 5) * t)) ** 2
    signal = (0.2 * voice * envelope).astype(np.float32)
    if channels > 1:
        signal = np.stack([signal * (1 - 0.2 * c) for c in range(channels)], axis=1)
    return signal


def audio_bytes(signal: np.ndarray, rate: int, fmt: str = "WAV") -> bytes:
    """Encodes a float signal as 16-bit WAV (standard library), FLAC or OGG/Vorbis (soundfile)."""
    buf = io.BytesIO()
    if fmt == "WAV":
        import wave

        pcm = np.round(np.clip(signal, -1, 1) * 32767).astype("<i2")
        with wave.open(buf, "wb") as w:
            w.setnchannels(1 if pcm.ndim == 1 else pcm.shape[1])
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(pcm.tobytes())
        return buf.getvalue()
    import soundfile as sf

    sf.write(buf, signal, rate, format=fmt, subtype={"FLAC": "PCM_16", "OGG": "VORBIS"}[fmt])
    return buf.getvalue()


def write_tar(path: str | os.PathLike[str], samples: Iterable[dict[str, Any]]) -> int:
    """Writes WebDataset samples (``{"__key__": ..., "jpg": bytes, "cls": 3, ...}``) to a tar."""
    count = 0
    with tarfile.open(path, "w") as tar:
        for sample in samples:
            key = sample["__key__"]
            for ext, value in sample.items():
                if ext.startswith("__"):
                    continue
                data = value if isinstance(value, bytes) else str(value).encode()
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(data))
            count += 1
    return count


def make_tokenizer(folder: str | os.PathLike[str], texts: Sequence[str] = WORDS,
                   vocab_size: int = 200) -> str:
    """Trains a tiny word-piece tokenizer with ``tokenizers`` and saves it for AutoTokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size,
                                        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    tok.train_from_iterator(list(texts) * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]")
    Path(folder).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return str(folder)
