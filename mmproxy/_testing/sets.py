"""Synthetic sets: the demo's shards, an ImageFolder tree, a tokenizer trained on the captions,
and the cache folder they are kept in. Public through :mod:`mmproxy.testing`."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mmproxy._testing.media import (
    audio_bytes,
    image_bytes,
    synth_image,
    synth_speech,
    synth_video,
    video_bytes,
)

__all__ = ["WORDS", "cache_dir", "caption", "demo_shards", "demo_tokenizer", "image_folder",
           "make_tokenizer", "write_tar", "writing_cache"]

WORDS = ("a red circle on a blue field", "green stripes over a yellow sky",
         "a small square in the corner", "waves of orange and purple light",
         "two dots beside a long line", "a bright ring around a dark center")


def cache_dir() -> Path:
    """mmproxy's cache folder: ``$XDG_CACHE_HOME/mmproxy``, else ``~/.cache/mmproxy``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmproxy"


@contextlib.contextmanager
def writing_cache(where: str | os.PathLike[str]) -> Iterator[None]:
    """Writing under ``where``: an ``OSError`` there (a read-only or full disk, no permission)
    says, when ``where`` is in :func:`cache_dir`, where that folder comes from and how to move it
    (``XDG_CACHE_HOME``); elsewhere it goes on as it is."""
    try:
        yield
    except OSError as err:
        cache = cache_dir()
        if not Path(where).is_relative_to(cache):
            raise
        base = os.environ.get("XDG_CACHE_HOME")
        origin = f"$XDG_CACHE_HOME/mmproxy (XDG_CACHE_HOME={base})" if base else (
            "~/.cache/mmproxy, as XDG_CACHE_HOME is not set")
        what = f"{err.filename}: " if err.filename else ""
        raise type(err)(f"cannot write to mmproxy's cache folder {cache}: {what}"
                        f"{err.strerror or err}; that folder is {origin}: set XDG_CACHE_HOME to a "
                        "writable folder") from err


def caption(i: int) -> str:
    """The caption of synthetic sample ``i``: one of :data:`WORDS` (label ``i % len(WORDS)``)."""
    return f"{WORDS[i % len(WORDS)]}, take {i}"



def write_tar(path: str | os.PathLike[str], samples: Iterable[dict[str, Any]]) -> int:
    """Writes WebDataset samples (``{"__key__": ..., "jpg": bytes, "cls": 3, ...}``) to a tar,
    atomically: a reader (or another process writing the same shard) never sees half of it, and
    an error or an interrupt leaves nothing behind."""
    from mmproxy.parts import part_path

    count = 0
    part = part_path(path)
    try:
        with tarfile.open(part, "w") as tar:
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
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)
        raise
    return count


def demo_shards(samples: int = 128, per_shard: int = 16,
                folder: str | os.PathLike[str] | None = None, video: bool = False,
                on_write: Callable[[Path], None] | None = None) -> str:
    """Writes (once) the demo's multi-modal shards: per sample a JPEG, its :func:`caption`, FLAC
    speech and a label (``cls``), and with ``video`` an H.264 clip (``mp4``, 2 s, needs PyAV);
    keys ``demo000000`` on. Returns their brace pattern. Shards half-written by a process that
    ended are removed; those already whole are kept.

    Args:
        samples: How many samples.
        per_shard: Samples per shard.
        folder: Where; default ``cache_dir()/demo/shards-SAMPLES-PER_SHARD[-video]``.
        video: Add a video field.
        on_write: Called with the folder once, before the first shard is written (not when every
            shard is there already).
    """
    from mmproxy.parts import remove_stale_parts

    name = f"shards-{samples}-{per_shard}" + ("-video" if video else "")
    where = Path(folder or cache_dir() / "demo" / name)
    shards = (samples + per_shard - 1) // per_shard
    missing = [s for s in range(shards) if not (where / f"demo-{s:04d}.tar").exists()]
    if missing:
        with writing_cache(where):
            where.mkdir(parents=True, exist_ok=True)
            remove_stale_parts(where)
            if on_write is not None:
                on_write(where)
            for s in missing:
                write_tar(where / f"demo-{s:04d}.tar", (
                    _demo_sample(i, video)
                    for i in range(s * per_shard, min(samples, (s + 1) * per_shard))))
    return str(where / f"demo-{{0000..{shards - 1:04d}}}.tar")


def _demo_sample(i: int, video: bool = False) -> dict[str, Any]:
    speech = synth_speech(i, 1.0 + (i % 5) * 0.4, 22050)
    sample = {"__key__": f"demo{i:06d}", "jpg": image_bytes(synth_image(i, 240, 320)),
              "txt": caption(i), "flac": audio_bytes(speech, 22050, "FLAC"),
              "cls": str(i % len(WORDS))}
    if video:
        sample["mp4"] = video_bytes(synth_video(i, 50, 120, 160))
    return sample


def image_folder(root: str | os.PathLike[str], per_class: int = 8) -> str:
    """Writes an ImageFolder tree of synthetic JPEGs, two classes (``circles``, ``stripes``)."""
    for c, name in enumerate(("circles", "stripes")):
        (Path(root) / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (Path(root) / name / f"{i}.jpg").write_bytes(image_bytes(synth_image(100 * c + i)))
    return str(root)


def make_tokenizer(folder: str | os.PathLike[str], texts: Sequence[str] = WORDS,
                   vocab_size: int = 200) -> str:
    """Trains a tiny word-piece tokenizer with ``tokenizers`` and saves it for AutoTokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size,
                                        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
                                        show_progress=False)  # blank lines in a log
    tok.train_from_iterator(list(texts) * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]")
    Path(folder).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return str(folder)


def demo_tokenizer(folder: str | os.PathLike[str] | None = None) -> str:
    """A tiny tokenizer trained on the synthetic captions, made once in ``folder`` (default
    ``cache_dir()/demo/tokenizer``); processes making it at the same time (ranks) all get one
    whole copy. Returns the folder, for :func:`mmproxy.datasets.load_tokenizer`."""
    from mmproxy.parts import part_path, remove_stale_parts

    where = Path(folder or cache_dir() / "demo" / "tokenizer")
    if not (where / "tokenizer.json").exists():
        part = Path(part_path(where))
        with writing_cache(where):
            remove_stale_parts(where.parent)
            try:
                make_tokenizer(part, [caption(i) for i in range(10 * len(WORDS))])
                part.rename(where)  # atomic; refused if another process's copy is already there
            except OSError:
                if not (where / "tokenizer.json").exists():
                    raise
            finally:
                shutil.rmtree(part, ignore_errors=True)
    return str(where)
