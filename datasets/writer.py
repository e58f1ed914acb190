"""Writer: turn a folder of images (with captions) or audio files (with labels) into shards."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import webdataset as wds

__all__ = ["make_shards"]

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}
AUDIO_SUFFIXES = {".wav", ".flac", ".ogg"}


def make_shards(source: str | os.PathLike[str], output: str | os.PathLike[str], *,
                kind: Literal["image-text", "audio-label"] = "image-text", max_count: int = 1000,
                max_size: float = 1e9, prefix: str = "shard") -> list[str]:
    """Writes ``source`` as WebDataset shards into ``output``; returns the shard paths.

    ``image-text``: an ImageFolder tree (``class/xxx.jpg``) or a flat folder; each image's
    caption is the ``.txt`` file beside it, else its class name. ``audio-label``: audio files in
    class folders. Both write ``cls`` (the class index, classes sorted by name) when there are
    class folders, and ``classes.json`` beside the shards.
    """
    source, output = Path(source), Path(output)
    if not source.is_dir():
        raise FileNotFoundError(f"make-shards: {source} is not a folder")
    suffixes = IMAGE_SUFFIXES if kind == "image-text" else AUDIO_SUFFIXES
    files = sorted(p for p in source.rglob("*") if p.suffix.lower() in suffixes and p.is_file())
    if not files:
        raise FileNotFoundError(f"make-shards: no {kind.split('-')[0]} files under {source}")
    classes = sorted({p.parent.name for p in files if p.parent != source})
    index = {name: i for i, name in enumerate(classes)}
    output.mkdir(parents=True, exist_ok=True)
    pattern = str(output / f"{prefix}-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=max_count, maxsize=max_size, verbose=0) as sink:
        for n, path in enumerate(files):
            ext = path.suffix.lower().lstrip(".").replace("jpeg", "jpg")
            sample: dict[str, object] = {"__key__": f"{n:08d}", ext: path.read_bytes()}
            if path.parent != source:
                sample["cls"] = str(index[path.parent.name])
            caption = path.with_suffix(".txt")
            if kind == "image-text":
                sample["txt"] = (caption.read_text().strip() if caption.exists()
                                 else path.parent.name.replace("_", " "))
            sink.write(sample)
    (output / "classes.json").write_text(json.dumps(classes))
    return sorted(str(p) for p in output.glob(f"{prefix}-*.tar"))
