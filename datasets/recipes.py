"""Recipes: ready datasets for image-text (CLIP-style) and audio-label training."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from mmproxy.server import DALIServer

from .multimodal import MultiModalDataset

__all__ = ["Tokenize", "audio_label_dataset", "image_text_dataset", "load_tokenizer"]

IMAGE_EXTS = "jpg;jpeg;png;webp"
AUDIO_EXTS = "flac;wav;ogg"


def load_tokenizer(tokenizer: Any) -> Any:
    """A ``transformers`` tokenizer object, or one loaded with ``AutoTokenizer`` from a path."""
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    return tokenizer


class Tokenize:
    """Batch transform: tokenizes the batch's ``text`` list in the worker, padded together.

    Args:
        tokenizer: A ``transformers`` tokenizer, or a folder / name for ``AutoTokenizer``.
        max_length: Longest sequence kept (longer captions are truncated).
        padding: "longest" (the batch's longest caption) or "max_length".
    """

    def __init__(self, tokenizer: Any, max_length: int, padding: str) -> None:
        self.tokenizer = load_tokenizer(tokenizer)
        if self.tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token first")
        self.max_length, self.padding = max_length, padding

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        enc = self.tokenizer(list(batch.pop("text")), padding=self.padding, truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        batch["input_ids"] = enc["input_ids"]
        batch["attention_mask"] = enc["attention_mask"]
        return batch


def _caption(data: bytes) -> str:
    return data.decode("utf-8").strip()


def image_text_dataset(urls: str | Sequence[str], image_server: DALIServer, tokenizer: Any, *,
                       batch_size: int, max_length: int = 77,
                       padding: Literal["longest", "max_length"] = "longest",
                       image_exts: str = IMAGE_EXTS, text_exts: str = "txt;caption",
                       **kwargs: Any) -> MultiModalDataset:
    """Image-text pairs: the image through ``image_server``, the caption tokenized in workers.

    Batches are dicts: ``image`` (the server's output), ``input_ids`` and ``attention_mask``
    (int64, padded with the tokenizer's pad id to the batch's longest caption or to
    ``max_length``), ``__key__``, ``__url__`` and ``__skipped__``. Other keyword arguments go to
    :class:`MultiModalDataset`.
    """
    if padding not in ("longest", "max_length"):
        raise ValueError(f"padding must be 'longest' or 'max_length', got {padding!r}")
    return MultiModalDataset(
        urls, {"image": (image_exts, image_server.proxy), "text": (text_exts, _caption)},
        batch_size=batch_size, batch_transform=Tokenize(tokenizer, max_length, padding), **kwargs)


class _SplitAudio:
    """Batch transform: the audio server's two outputs become ``audio`` and ``audio_length``."""

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        audio = batch["audio"]
        if isinstance(audio, (tuple, list)) and len(audio) == 2:
            batch["audio"], batch["audio_length"] = audio
        return batch


def _label(data: bytes) -> int:
    return int(data.decode("utf-8").strip())


def audio_label_dataset(urls: str | Sequence[str], audio_server: DALIServer, *, batch_size: int,
                        audio_exts: str = AUDIO_EXTS, label_exts: str = "cls",
                        **kwargs: Any) -> MultiModalDataset:
    """Audio clips with integer labels: the audio through ``audio_server``.

    Batches are dicts: ``audio`` (padded when the server pads), ``audio_length`` (the pipeline's
    length output, for masking), ``label`` (int64), ``__key__``, ``__url__``, ``__skipped__``.
    """
    return MultiModalDataset(
        urls, {"audio": (audio_exts, audio_server.proxy), "label": (label_exts, _label)},
        batch_size=batch_size, batch_transform=_SplitAudio(), **kwargs)


