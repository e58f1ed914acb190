"""Writer: turn a folder of images or videos (with captions or labels) or audio files (with
labels) into shards.

Each sample of a shard holds the media (``jpg``, ``png``, ``webp``, ``bmp``, ``tiff``; ``flac``,
``wav``, ``ogg``; or ``mp4``, ``mov``, ``webm``, ``mkv``, ``avi``), its caption (``txt``,
image-text and video-text) and class index (``cls``, when the file is in a class folder), and
``src``: the file's path relative to the source folder, so that an error naming
``shard-000001.tar:00000010`` can be traced back to the file. Beside the shards go
``classes.json`` (class names, sorted; ``cls`` indexes it) and ``manifest.jsonl`` (one line per
sample: ``key``, ``shard``, ``source``, ``caption`` = "txt" | "folder" | null).

Every suffix written is one the recipes read by default (``IMAGE_EXTS``, ``AUDIO_EXTS``,
``VIDEO_EXTS`` of :mod:`mmproxy.datasets.recipes`); other files are left out and reported, never
silently.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal, NamedTuple

import webdataset as wds

from .checks import check_header

__all__ = ["WrittenShards", "make_shards"]

# suffix read -> extension written (one name per format); the recipes read every one of them
IMAGE_SUFFIXES = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp", ".bmp": "bmp",
                  ".tif": "tiff", ".tiff": "tiff"}
AUDIO_SUFFIXES = {".flac": "flac", ".wav": "wav", ".ogg": "ogg"}
VIDEO_SUFFIXES = {".mp4": "mp4", ".m4v": "mp4", ".mov": "mov", ".webm": "webm", ".mkv": "mkv",
                  ".avi": "avi"}
CLASSES, MANIFEST = "classes.json", "manifest.jsonl"
Kind = Literal["image-text", "audio-label", "video-text", "video-label"]
# kind -> (the media it reads, what they are called, whether each needs a caption)
KINDS: dict[str, tuple[dict[str, str], str, bool]] = {
    "image-text": (IMAGE_SUFFIXES, "image", True),
    "audio-label": (AUDIO_SUFFIXES, "audio", False),
    "video-text": (VIDEO_SUFFIXES, "video", True),
    "video-label": (VIDEO_SUFFIXES, "video", False),
}


class WrittenShards(list[str]):
    """What :func:`make_shards` wrote: the list of the shard paths, in order, and a summary.

    Attributes:
        samples: Samples written.
        captions_from_txt: Images whose caption is the ``.txt`` file beside them.
        captions_from_folder: Images whose caption was guessed from their class folder's name.
        left_out: ``(path relative to the source, why)`` for every file not written.
        manifest: Path of ``manifest.jsonl`` (key, shard, source file, caption origin).
    """

    def __init__(self) -> None:
        super().__init__()
        self.samples = self.captions_from_txt = self.captions_from_folder = 0
        self.left_out: list[tuple[str, str]] = []
        self.manifest = ""

    def summary(self, max_listed: int = 10) -> str:
        """A few lines for people: counts, then the files left out and why."""
        folder = os.path.dirname(self[0]) if self else "nowhere"
        shards = f"{len(self)} shard" + ("" if len(self) == 1 else "s")
        lines = [f"wrote {self.samples} samples in {shards} to {folder}"]
        if self.captions_from_txt or self.captions_from_folder:
            lines.append(f"  captions: {self.captions_from_txt} from .txt files, "
                         f"{self.captions_from_folder} guessed from the class folder's name")
        lines.append(f"  left out: {len(self.left_out)} files")
        for path, why in self.left_out[:max_listed]:
            lines.append(f"    {path}: {why}")
        if len(self.left_out) > max_listed:
            lines.append(f"    ... and {len(self.left_out) - max_listed} more (all in the "
                         "WrittenShards.left_out of make_shards())")
        if self.manifest:
            lines.append(f"  manifest (key -> shard, source file): {self.manifest}")
        return "\n".join(lines)


class _Planned(NamedTuple):
    path: Path
    rel: str  # relative to the source, with "/"
    ext: str  # extension written
    class_name: str | None
    caption: str | None
    origin: str | None  # "txt" | "folder" | None (audio)


def _old_files(output: Path, prefix: str) -> list[Path]:
    """Shards of ``prefix``, classes.json and manifest.jsonl already in ``output``."""
    if not output.is_dir():
        return []
    shard = re.compile(re.escape(prefix) + r"-\d+\.tar")
    return sorted(p for p in output.iterdir()
                  if shard.fullmatch(p.name) or p.name in (CLASSES, MANIFEST))


def _caption(path: Path, class_name: str | None) -> tuple[str | None, str]:
    """(caption, origin "txt" | "folder"), or (None, why there is none)."""
    txt = path.with_suffix(".txt")
    if txt.is_file():
        try:
            text = txt.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            return None, f"its caption {txt.name} is not UTF-8 text"
        return (text, "txt") if text else (None, f"its caption {txt.name} is empty")
    if class_name is not None:
        return class_name.replace("_", " "), "folder"
    return None, "no caption: no .txt beside it and no class folder to take one from"


def _plan(source: Path, output: Path, kind: str,
          left_out: list[tuple[str, str]]) -> list[_Planned]:
    """The files to write, in name order; the others go to ``left_out`` with the reason."""
    suffixes, media, image = KINDS[kind]  # `image`: captioned media (images, videos)
    what = {"image": "an image", "audio": "an audio", "video": "a video"}[media]
    readable = " ".join(sorted(suffixes))
    out_dir = output.resolve()
    planned: list[_Planned] = []
    captions: list[Path] = []
    stems: set[Path] = set()  # of every image found, written or not
    for path in sorted(source.rglob("*")):
        if not path.is_file() or out_dir in path.resolve().parents:
            continue
        rel = path.relative_to(source)
        suffix = path.suffix.lower()
        class_name = rel.parts[0] if len(rel.parts) > 1 else None  # ImageFolder: top folder
        if any(part.startswith(".") for part in rel.parts):
            left_out.append((rel.as_posix(), "hidden file or folder"))
        elif suffix in suffixes:
            stems.add(path.with_suffix(""))
            caption, origin = _caption(path, class_name) if image else (None, None)
            if image and caption is None:
                left_out.append((rel.as_posix(), str(origin)))
            elif not image and class_name is None:
                left_out.append((rel.as_posix(), "no label: not in a class folder"))
            else:
                planned.append(_Planned(path, rel.as_posix(), suffixes[suffix], class_name,
                                        caption, origin))
        elif image and suffix == ".txt":
            captions.append(path)
        else:
            left_out.append((rel.as_posix(), f"not {what} file this writer reads "
                             f"({suffix or 'no suffix'}; it reads {readable})"))
    for path in captions:
        if path.with_suffix("") not in stems:
            left_out.append((path.relative_to(source).as_posix(),
                             f"a caption with no {media} beside it"))
    return planned


def make_shards(source: str | os.PathLike[str], output: str | os.PathLike[str], *,
                kind: Kind = "image-text", max_count: int = 1000, max_size: float = 1e9,
                prefix: str = "shard", overwrite: bool = False) -> WrittenShards:
    """Writes ``source`` as WebDataset shards ``{prefix}-NNNNNN.tar`` into ``output``.

    ``image-text``: an ImageFolder tree (``class/xxx.jpg``) or a flat folder; each image's
    caption is the ``.txt`` file beside it (``xxx.txt``), else its class folder's name (counted
    in ``captions_from_folder``); an image at the top of ``source`` with neither is left out.
    ``audio-label``: audio files in class folders; files at the top are left out.
    ``video-text`` and ``video-label``: the same for videos (mp4, mov, webm, mkv, avi). All write
    ``cls`` (the class index, classes sorted by name) for files in class folders, ``src`` (the
    path relative to ``source``), and ``classes.json`` and ``manifest.jsonl`` beside the shards.
    Files of other formats, empty or unreadable captions and files whose header
    :func:`~mmproxy.datasets.check_header` rejects are left out and listed with the reason.

    Args:
        source: The folder to read.
        output: The folder to write to; created if missing.
        kind: "image-text", "audio-label", "video-text" or "video-label".
        max_count: Samples per shard at most.
        max_size: Bytes per shard (roughly) at most.
        prefix: Shard file names start with it.
        overwrite: Remove the shards of ``prefix``, ``classes.json`` and ``manifest.jsonl``
            already in ``output`` first. Without it such a folder is refused (FileExistsError).

    Returns:
        The paths of exactly the shards written, with a summary (:class:`WrittenShards`).

    Example:
        >>> written = make_shards("photos/", "shards/")       # doctest: +SKIP
        >>> print(written.summary())                          # doctest: +SKIP
    """
    source, output = Path(source), Path(output)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if max_count < 1 or max_size <= 0:
        raise ValueError(f"max_count and max_size must be positive, got {max_count}, {max_size}")
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is not a folder")
    old = _old_files(output, prefix)
    if old and not overwrite:
        names = ", ".join(p.name for p in old[:3]) + (", ..." if len(old) > 3 else "")
        raise FileExistsError(f"{output} already holds {len(old)} files of a shard set ({names}); "
                              "pass overwrite=True (--overwrite) to replace them, or write to "
                              "an empty folder")
    written = WrittenShards()
    planned = _plan(source, output, kind, written.left_out)
    classes = sorted({p.class_name for p in planned if p.class_name is not None})
    index = {name: i for i, name in enumerate(classes)}
    manifest: list[dict[str, Any]] = []
    sink: Any = None
    try:
        for item in planned:
            data = item.path.read_bytes()
            problem = check_header(item.ext, data)
            if problem is not None:
                written.left_out.append((item.rel, f"not a usable {item.ext} file: {problem}"))
                continue
            if sink is None:  # the first good file: only now replace the old set
                output.mkdir(parents=True, exist_ok=True)
                for path in old:
                    path.unlink()
                sink = wds.ShardWriter(str(output / f"{prefix}-%06d.tar"), maxcount=max_count,
                                       maxsize=max_size, verbose=0, post=written.append)
            key = f"{len(manifest):08d}"
            sample: dict[str, Any] = {"__key__": key, item.ext: data, "src": item.rel}
            if item.caption is not None:
                sample["txt"] = item.caption
            if item.class_name is not None:
                sample["cls"] = str(index[item.class_name])
            sink.write(sample)
            manifest.append({"key": key, "shard": os.path.basename(sink.fname),
                             "source": item.rel, "caption": item.origin})
    finally:
        if sink is not None:
            sink.close()
    if not manifest:
        what = KINDS[kind][1]
        reasons = "; ".join(f"{p}: {w}" for p, w in written.left_out[:3])
        present = {p.suffix.lower() for p in source.rglob("*")}
        hint = next((f"; it holds {media} files: use kind={other!r} (--kind {other})"
                     for other, (suffixes, media, _) in KINDS.items()
                     if media != what and present & set(suffixes)), "")
        raise FileNotFoundError(f"no {what} files to write under {source}"
                                + (f" ({len(written.left_out)} left out: {reasons})"
                                   if reasons else "") + hint)
    (output / CLASSES).write_text(json.dumps(classes))
    (output / MANIFEST).write_text("".join(json.dumps(row) + "\n" for row in manifest))
    written.samples = len(manifest)
    written.captions_from_txt = sum(row["caption"] == "txt" for row in manifest)
    written.captions_from_folder = sum(row["caption"] == "folder" for row in manifest)
    written.manifest = str(output / MANIFEST)
    return written
