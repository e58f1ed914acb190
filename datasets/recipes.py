"""Recipes: ready datasets for image-text (CLIP-style) and audio-label training."""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Sequence
from typing import Any, Literal

import torch
from mmproxy.datasets.multimodal import MultiModalDataset

from mmproxy.server import DALIServer

__all__ = ["Tokenize", "audio_label_dataset", "image_text_dataset", "load_tokenizer",
           "video_label_dataset", "video_text_dataset"]

IMAGE_EXTS = "jpg;jpeg;png;webp;bmp;tif;tiff"  # every format make_shards writes
AUDIO_EXTS = "flac;wav;ogg"
VIDEO_EXTS = "mp4;mov;webm;mkv;avi"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
HUB_CHECK_SECONDS = 3.0  # how long to wait for the Hugging Face Hub to answer before giving up
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_TRUE = ("1", "on", "yes", "true")
_HOW = ("give the folder of a saved tokenizer (tokenizer.save_pretrained(folder) writes "
        "tokenizer.json there), or run once with network access to fill the Hugging Face cache")


def _first_line(err: BaseException) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


def _offline() -> bool:
    from huggingface_hub import constants

    env = (os.environ.get(k, "").strip().lower() for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(v in _TRUE for v in env) or bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _hub_unreachable(timeout: float | None = None) -> str | None:
    """Why the Hub (or the proxy to it) cannot be reached within ``timeout``, or None.

    Without this check a download attempt with no network retries for about 50 seconds.
    """
    timeout = HUB_CHECK_SECONDS if timeout is None else timeout
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    proxy = getproxies().get(url.scheme or "https")
    if proxy and not proxy_bypass(host):
        purl = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = purl.hostname or host, purl.port or 8080
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(f"{host}:{port} cannot be reached: {_first_line(err)}")

    probe = threading.Thread(target=connect, name="tokenizer-hub-check", daemon=True)
    probe.start()
    probe.join(timeout)  # name resolution has no timeout of its own: the daemon thread may stay
    return outcome[0] if outcome else f"{host}:{port} did not answer within {timeout:g} s"


def _load_folder(folder: str) -> Any:
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"tokenizer folder {folder!r} holds no tokenizer (none of "
                         f"{', '.join(TOKENIZER_FILES)}); save one there with "
                         "tokenizer.save_pretrained(folder)")
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ValueError(f"tokenizer folder {folder!r} cannot be loaded: {_first_line(err)}") from err


def load_tokenizer(tokenizer: Any) -> Any:
    """A ``transformers`` tokenizer: ``tokenizer`` itself, or one loaded with ``AutoTokenizer``.

    A string or path is a folder holding a saved tokenizer when such a folder exists, or a file
    of one (``tokenizer.json`` and the others of ``TOKENIZER_FILES``: its folder is loaded;
    another ``.json`` file: loaded as a ``tokenizers`` file), else a Hugging Face Hub name: taken
    from the local cache when it is there, downloaded otherwise. With
    ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``), or when the Hub cannot be reached
    within :data:`HUB_CHECK_SECONDS`, a name missing from the cache fails at once.

    Raises:
        ValueError: ``tokenizer`` is None or not a tokenizer, or the folder or file holds none.
        FileNotFoundError: No such folder, and no such name in the cache or on the Hub.
    """
    if tokenizer is None:
        raise ValueError("a tokenizer is needed to turn the text into input_ids: pass a "
                         "transformers tokenizer object, the folder of a saved one (holding "
                         "tokenizer.json), or a Hugging Face Hub name")
    if isinstance(tokenizer, os.PathLike):
        tokenizer = os.fspath(tokenizer)
        if not os.path.exists(tokenizer):
            raise FileNotFoundError(f"tokenizer folder {tokenizer!r} does not exist")
    if not isinstance(tokenizer, str):
        if not callable(tokenizer) or not hasattr(tokenizer, "pad_token_id"):
            raise ValueError(f"expected a transformers tokenizer, a folder or a Hub name, got "
                             f"{type(tokenizer).__name__}")
        return tokenizer
    if os.path.isdir(tokenizer):
        return _load_folder(tokenizer)
    if os.path.isfile(tokenizer):
        return _load_file(tokenizer)
    if not _REPO_ID.fullmatch(tokenizer) or tokenizer.endswith((".json", ".txt", ".model")):
        what = "file" if tokenizer.endswith((".json", ".txt", ".model")) else "folder"
        raise FileNotFoundError(f"tokenizer {what} {tokenizer!r} does not exist (and it is not a "
                                f"Hugging Face Hub name); {_HOW}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except (OSError, ValueError) as err:
        cached = err
    missing = f"tokenizer {tokenizer!r} is neither a local folder nor in the Hugging Face cache"
    if _offline():
        raise FileNotFoundError(f"{missing}, and HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE forbid "
                                f"downloading it; {_HOW}") from cached
    unreachable = _hub_unreachable()
    if unreachable is not None:
        raise FileNotFoundError(f"{missing}, nor downloadable ({unreachable}); {_HOW}") from cached
    try:
        return AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"{missing}, nor downloadable ({_first_line(err)}); "
                                f"{_HOW}") from err


def _load_file(path: str) -> Any:
    """A tokenizer from one of its files: the folder for a file of a saved one, else a
    ``tokenizers`` JSON file."""
    if os.path.basename(path) in TOKENIZER_FILES:
        return _load_folder(os.path.dirname(path) or ".")
    if not path.endswith(".json"):
        raise ValueError(f"tokenizer {path!r} is a file, but not a tokenizer's: give the folder of "
                         f"a saved tokenizer (holding one of {', '.join(TOKENIZER_FILES)}) or a "
                         "tokenizer.json file")
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast(tokenizer_file=path)
    except Exception as err:  # noqa: BLE001 - tokenizers raises its own kinds for a bad file
        raise ValueError(f"tokenizer file {path!r} cannot be loaded: {_first_line(err)}") from err


class Tokenize:
    """Batch transform: tokenizes the batch's ``text`` list in the worker, padded together.

    An empty caption is a row of the tokenizer's special tokens, or of padding alone (attention
    mask 0) for a tokenizer that adds none; ``input_ids`` has at least one column, also when
    every caption of a batch is empty.

    Args:
        tokenizer: A ``transformers`` tokenizer, or a folder / name for ``AutoTokenizer``.
        max_length: Longest sequence kept (longer captions are truncated).
        padding: "longest" (the batch's longest caption) or "max_length".
    """

    def __init__(self, tokenizer: Any, max_length: int, padding: str) -> None:
        self.tokenizer = load_tokenizer(tokenizer)
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"the tokenizer ({type(self.tokenizer).__name__}) has no pad token, "
                             "so captions cannot be padded into one batch; set "
                             "tokenizer.pad_token (for example to tokenizer.eos_token) first")
        self.max_length, self.padding = max_length, padding

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        enc = self.tokenizer(list(batch.pop("text")), padding=self.padding, truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        if ids.shape[-1] == 0:  # only empty captions, and no special tokens: one padding column
            ids = torch.full((len(ids), 1), self.tokenizer.pad_token_id, dtype=torch.int64)
            mask = torch.zeros_like(ids)
        batch["input_ids"], batch["attention_mask"] = ids, mask
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
    ``max_length``), ``__key__``, ``__url__`` and ``__skipped__``. An empty caption is kept (a row
    of padding, or of the tokenizer's special tokens: :class:`Tokenize`); an empty image is a bad
    sample. Other keyword arguments go to :class:`MultiModalDataset`.
    """
    if padding not in ("longest", "max_length"):
        raise ValueError(f"padding must be 'longest' or 'max_length', got {padding!r}")
    return MultiModalDataset(
        urls, {"image": (image_exts, image_server.proxy), "text": (text_exts, _caption)},
        batch_size=batch_size, batch_transform=Tokenize(tokenizer, max_length, padding), **kwargs)


class _SplitOutputs:
    """Batch transform: a server's two outputs (data, length) become ``name`` and
    ``name_length``; then, if given, ``then`` (e.g. tokenization)."""

    def __init__(self, name: str, then: Any = None) -> None:
        self.name, self.then = name, then

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        data = batch[self.name]
        if isinstance(data, (tuple, list)) and len(data) == 2:
            batch[self.name], batch[f"{self.name}_length"] = data
        return batch if self.then is None else self.then(batch)


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
        batch_size=batch_size, batch_transform=_SplitOutputs("audio"), **kwargs)


def video_label_dataset(urls: str | Sequence[str], video_server: DALIServer, *, batch_size: int,
                        video_exts: str = VIDEO_EXTS, label_exts: str = "cls",
                        **kwargs: Any) -> MultiModalDataset:
    """Videos with integer labels (Kinetics-style): clips through ``video_server`` (a
    :func:`~mmproxy.pipelines.video_pipeline`).

    Batches are dicts: ``video`` (NCTHW or NTHWC), ``video_length`` when the server decodes
    every frame, ``label`` (int64), ``__key__``, ``__url__``, ``__skipped__``.
    """
    return MultiModalDataset(
        urls, {"video": (video_exts, video_server.proxy), "label": (label_exts, _label)},
        batch_size=batch_size, batch_transform=_SplitOutputs("video"), **kwargs)


def video_text_dataset(urls: str | Sequence[str], video_server: DALIServer, tokenizer: Any, *,
                       batch_size: int, max_length: int = 77,
                       padding: Literal["longest", "max_length"] = "longest",
                       video_exts: str = VIDEO_EXTS, text_exts: str = "txt;caption",
                       **kwargs: Any) -> MultiModalDataset:
    """Video-text pairs (WebVid-style): clips through ``video_server``, captions tokenized in
    workers. Batches: ``video``, ``input_ids``, ``attention_mask``, ``__key__``, ``__url__``,
    ``__skipped__`` (and ``video_length`` when the server decodes every frame)."""
    if padding not in ("longest", "max_length"):
        raise ValueError(f"padding must be 'longest' or 'max_length', got {padding!r}")
    return MultiModalDataset(
        urls, {"video": (video_exts, video_server.proxy), "text": (text_exts, _caption)},
        batch_size=batch_size,
        batch_transform=_SplitOutputs("video", Tokenize(tokenizer, max_length, padding)), **kwargs)


