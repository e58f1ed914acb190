"""Writer: turn a folder of images or videos (with captions or labels) or audio files (with
labels) into shards.

Each sample of a shard holds the media (``jpg``, ``png``, ``webp``, ``bmp``, ``tiff``; ``flac``,
``wav``, ``ogg``; or ``mp4``, ``mov``, ``webm``, ``mkv``, ``avi``), its caption (``txt``,
image-text and video-text) and class index (``cls``, when the file is in a class folder), and
``src``: the file's path relative to the source folder, so that an error naming
``shard-000001.tar:00000010`` can be traced back to the file. Beside the shards go
``classes.json`` (class names, sorted; ``cls`` indexes it) and ``manifest.jsonl`` (one line per
sample: ``key``, ``shard``, ``source``, ``caption`` = "txt" | "folder" | null).

A file is stored under the extension of what it holds, whatever its name says (a PNG named
``.jpg`` as ``png``, a WAV named ``.flac`` as ``wav``); every extension written is one the
recipes read by default (``IMAGE_EXTS``, ``AUDIO_EXTS``, ``VIDEO_EXTS`` of
:mod:`mmproxy.datasets.recipes`). Other files are left out and reported by reason, never silently.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal, NamedTuple

import webdataset as wds

from mmproxy._parts import final_path, part_path, remove_stale_parts
from mmproxy.errors import MmproxyError

from ._written import LeftOut, Reason, WrittenShards
from .checks import SIGNATURES, check_header, video_info

__all__ = ["LeftOut", "NoMediaError", "OutputExistsError", "Reason", "WrittenShards",
           "make_shards"]

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
_FORMATS = {"image": ("jpg", "png", "webp", "bmp", "tiff"), "audio": ("flac", "wav", "ogg")}
_CONTAINERS = {"mp4": ("mp4", "mov"), "matroska": ("mkv", "webm"), "avi": ("avi",)}


def _option(name: str, value: object, cli: bool) -> str:
    """An option as the caller gives it: ``kind='x'`` to the function, ``--kind x`` to the CLI."""
    if cli:
        flag = "--" + name.replace("_", "-")
        return flag if value is True else f"{flag} {value}"
    return f"{name}={value!r}"


class OutputExistsError(MmproxyError, FileExistsError):
    """:func:`make_shards` was refused: ``output`` already holds a shard set.

    Attributes:
        output: The folder.
        files: Names of that set's files in it (shards, classes.json, manifest.jsonl).
    """

    def __init__(self, output: str, files: list[str], cli: bool = False) -> None:
        self.output, self.files = output, files
        names = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        super().__init__(f"{output} already holds a shard set ({len(files)} files: {names}); "
                         f"{'add' if cli else 'pass'} {_option('overwrite', True, cli)} to "
                         "replace it, or write to an empty folder")

    def for_cli(self) -> OutputExistsError:
        """The same error worded with the command line's options."""
        return OutputExistsError(self.output, self.files, cli=True)


class NoMediaError(MmproxyError, FileNotFoundError):
    """:func:`make_shards` found nothing to write.

    Attributes:
        message: What was looked for and where, and why files were left out.
        kind: The kind whose files the source holds instead, or None.
    """

    def __init__(self, message: str, kind: str | None, cli: bool = False) -> None:
        self.message, self.kind = message, kind
        hint = f"; it holds {KINDS[kind][1]} files: use {_option('kind', kind, cli)}" if kind else ""
        super().__init__(message + hint)

    def for_cli(self) -> NoMediaError:
        """The same error worded with the command line's options."""
        return NoMediaError(self.message, self.kind, cli=True)


class _Planned(NamedTuple):
    path: Path
    rel: str  # relative to the source, with "/"
    named: str  # the extension its name gives
    class_name: str | None
    caption: str | None
    origin: str | None  # "txt" | "folder" | None (audio)


def _old_set(output: Path, prefix: str) -> tuple[list[Path], list[Path]]:
    """(the shard set already in ``output``: shards of ``prefix`` and those its manifest.jsonl
    names, classes.json, manifest.jsonl; the other ``.tar`` files there)."""
    if not output.is_dir():
        return [], []
    named: set[str] = set()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # unreadable: names none
        rows = (output / MANIFEST).read_text(encoding="utf-8").splitlines()
        named = {json.loads(row)["shard"] for row in rows if row.strip()}
    shard = re.compile(re.escape(prefix) + r"-\d+\.tar")
    ours, foreign = [], []
    for path in sorted(output.iterdir()):
        if path.name in (CLASSES, MANIFEST) or shard.fullmatch(path.name) or path.name in named:
            ours.append(path)
        elif path.name.endswith(".tar"):
            foreign.append(path)
    return ours, foreign


def _caption(path: Path, class_name: str | None) -> tuple[str | None, str, Reason | None]:
    """(caption, origin "txt" | "folder", None), or (None, why there is none, the reason)."""
    txt = path.with_suffix(".txt")
    if txt.is_file():
        try:
            text = txt.read_text(encoding="utf-8-sig").strip()  # a BOM is no part of a caption
        except UnicodeDecodeError:
            return None, f"its caption {txt.name} is not UTF-8 text", Reason.CAPTION
        if text:
            return text, "txt", None
        return None, f"its caption {txt.name} is empty", Reason.CAPTION
    if class_name is not None:
        return class_name.replace("_", " "), "folder", None
    return None, Reason.NO_CAPTION.value, Reason.NO_CAPTION


def _plan(source: Path, output: Path, kind: str, left_out: list[LeftOut]) -> list[_Planned]:
    """The files to write, in name order; the others go to ``left_out`` with the reason."""
    suffixes, media, captioned = KINDS[kind]
    what = {"image": "an image", "audio": "an audio", "video": "a video"}[media]
    out_dir = output.resolve()
    planned: list[_Planned] = []
    captions: list[Path] = []
    stems: set[Path] = set()  # of every media file found, written or not
    for path in sorted(source.rglob("*")):
        if not path.is_file() or out_dir in path.resolve().parents:
            continue
        rel = path.relative_to(source)
        suffix = path.suffix.lower()
        class_name = rel.parts[0] if len(rel.parts) > 1 else None  # ImageFolder: top folder
        if any(part.startswith(".") for part in rel.parts):
            left_out.append(LeftOut(rel.as_posix(), Reason.HIDDEN.value, Reason.HIDDEN))
        elif suffix in suffixes:
            stems.add(path.with_suffix(""))
            caption, origin, reason = (_caption(path, class_name) if captioned
                                       else (None, None, None))
            if reason is not None:
                left_out.append(LeftOut(rel.as_posix(), str(origin), reason))
            elif not captioned and class_name is None:
                left_out.append(LeftOut(rel.as_posix(), Reason.NO_LABEL.value, Reason.NO_LABEL))
            else:
                planned.append(_Planned(path, rel.as_posix(), suffixes[suffix], class_name,
                                        caption, origin))
        elif captioned and suffix == ".txt":
            captions.append(path)
        else:
            left_out.append(LeftOut(rel.as_posix(), f"not {what} file this writer reads "
                                    f"({suffix or 'no suffix'})", Reason.FORMAT))
    for path in captions:
        if path.with_suffix("") not in stems:
            left_out.append(LeftOut(path.relative_to(source).as_posix(),
                                    f"a caption with no {media} beside it", Reason.LONE_CAPTION))
    left_out.sort(key=lambda item: item.path)
    return planned


def _stored_ext(media: str, named: str, data: bytes) -> str | None:
    """The extension of the format ``data`` holds, among ``media``'s formats: ``named`` (the
    one its name gives) when it holds that one; None when it holds none of them."""
    if media == "video":
        info = video_info(data)
        family = _CONTAINERS.get(info.container, ()) if info else ()
        return named if named in family else next(iter(family), None)
    if SIGNATURES[named](data[:16]):
        return named
    return next((ext for ext in _FORMATS[media] if SIGNATURES[ext](data[:16])), None)


def _left_out(item: _Planned, media: str, data: bytes) -> tuple[str, LeftOut | None]:
    """(the extension to store ``item`` under, or why it is left out)."""
    if not data:
        return "", LeftOut(item.rel, "is empty", Reason.EMPTY)
    ext = _stored_ext(media, item.named, data)
    if ext is None:
        return "", LeftOut(item.rel, f"holds none of the {media} formats this writer reads (it "
                           f"starts with {data[:8]!r})", Reason.CONTENT)
    problem = check_header(ext, data)
    if problem is not None:
        return "", LeftOut(item.rel, f"{problem}" if ext == item.named
                           else f"{ext.upper()} data that {problem}", Reason.DAMAGED)
    return ext, None


def _other_kind(source: Path, media: str) -> str | None:
    """A kind whose files ``source`` holds instead of ``media`` ones: for files in class folders
    with no caption beside them, the label kind."""
    files = {p.relative_to(source) for p in source.rglob("*") if p.is_file()}
    for kind, (suffixes, other, captioned) in KINDS.items():
        found = [f for f in files if f.suffix.lower() in suffixes]
        if other == media or not found:
            continue
        labelled = all(len(f.parts) > 1 and f.with_suffix(".txt") not in files for f in found)
        if not (captioned and labelled and f"{other}-label" in KINDS):
            return kind
    return None


def make_shards(source: str | os.PathLike[str], output: str | os.PathLike[str], *,
                kind: Kind = "image-text", max_count: int = 1000, max_size: float = 1e9,
                prefix: str = "shard", overwrite: bool = False) -> WrittenShards:
    """Writes ``source`` as WebDataset shards ``{prefix}-NNNNNN.tar`` into ``output``.

    ``image-text``: an ImageFolder tree (``class/xxx.jpg``) or a flat folder; each image's
    caption is the ``.txt`` file beside it (``xxx.txt``, UTF-8), else its class folder's name
    (counted in ``captions_from_folder``); an image at the top of ``source`` with neither is left
    out. ``audio-label``: audio files in class folders; files at the top are left out.
    ``video-text`` and ``video-label``: the same for videos (mp4, mov, webm, mkv, avi). All write
    ``cls`` (the class index, classes sorted by name) for files in class folders, ``src`` (the
    path relative to ``source``), and ``classes.json`` and ``manifest.jsonl`` beside the shards.
    A file is stored under the extension of its content (a PNG named ``.jpg`` as ``png``).
    Files of other formats or content, empty files, empty or unreadable captions, and files whose
    header :func:`~mmproxy.datasets.check_header` rejects are left out and listed with the reason.

    The shards are written under temporary names and take their own only when the whole set is
    written: an error or an interrupt leaves ``output`` as it was.

    Args:
        source: The folder to read.
        output: The folder to write to; created if missing.
        kind: "image-text", "audio-label", "video-text" or "video-label".
        max_count: Samples per shard at most.
        max_size: Bytes per shard (roughly) at most.
        prefix: Shard file names start with it.
        overwrite: Replace the shard set already in ``output`` (the shards of ``prefix``, those
            its ``manifest.jsonl`` names, ``classes.json`` and ``manifest.jsonl``) once the new
            one is written. Without it such a folder is refused (:class:`OutputExistsError`).

    Returns:
        The paths of exactly the shards written, with a summary (:class:`WrittenShards`).

    Raises:
        OutputExistsError: ``output`` holds a shard set and ``overwrite`` is off.
        FileExistsError: ``output`` holds other ``.tar`` files (a folder of shards is read whole:
            they would be read with the new set's labels), with or without ``overwrite``.
        NoMediaError: Nothing to write (it says why, and which kind fits when another does).

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
    remove_stale_parts(output)
    old, foreign = _old_set(output, prefix)
    if foreign:
        names = ", ".join(p.name for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise FileExistsError(
            f"{output} holds {len(foreign)} .tar file(s) of no shard set written there ({names}: "
            f"not of prefix {prefix!r}, not named in its {MANIFEST}); a folder of shards is read "
            "whole, so they would be read beside the new set, with its labels: move them away or "
            "write to another folder")
    if old and not overwrite:
        raise OutputExistsError(str(output), [p.name for p in old])
    media = KINDS[kind][1]
    written = WrittenShards(kind, sorted(KINDS[kind][0]))
    planned = _plan(source, output, kind, written.files_left_out)
    classes = sorted({p.class_name for p in planned if p.class_name is not None})
    index = {name: i for i, name in enumerate(classes)}
    manifest: list[dict[str, Any]] = []
    parts: list[str] = []
    pattern = (str(output / prefix).replace("%", "%%") + "-%06d.tar"
               + part_path("").replace("%", "%%"))  # ShardWriter fills in the number
    sink: Any = None
    try:
        for item in planned:
            data = item.path.read_bytes()
            ext, left = _left_out(item, media, data)
            if left is not None:
                written.files_left_out.append(left)
                continue
            if ext != item.named:
                written.renamed.append((item.rel, ext))
            if sink is None:
                output.mkdir(parents=True, exist_ok=True)
                sink = wds.ShardWriter(pattern, maxcount=max_count, maxsize=max_size,
                                       verbose=0, post=parts.append)
            key = f"{len(manifest):08d}"
            sample: dict[str, Any] = {"__key__": key, ext: data, "src": item.rel}
            if item.caption is not None:
                sample["txt"] = item.caption
            if item.class_name is not None:
                sample["cls"] = str(index[item.class_name])
            sink.write(sample)
            manifest.append({"key": key, "shard": os.path.basename(final_path(sink.fname)),
                             "source": item.rel, "caption": item.origin})
        if sink is not None:
            sink.close()
    except BaseException:  # an error or an interrupt: none of the new set stays
        if sink is not None:
            with contextlib.suppress(Exception):
                sink.close()
            parts.append(sink.fname)
        for part in parts:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
        raise
    written.files_left_out.sort(key=lambda item: item.path)
    if not manifest:
        reasons = "; ".join(f"{p}: {w}" for p, w in written.left_out[:3])
        raise NoMediaError(f"no {media} files to write under {source}"
                           + (f" ({len(written.files_left_out)} left out: {reasons})"
                              if reasons else ""), _other_kind(source, media))
    for path in old:  # the new set is whole: only now the old one goes
        path.unlink()
    for part in parts:
        os.replace(part, final_path(part))
        written.append(final_path(part))
    _write(output / CLASSES, json.dumps(classes))
    _write(output / MANIFEST, "".join(json.dumps(row) + "\n" for row in manifest))
    written.samples = len(manifest)
    written.captions_from_txt = sum(row["caption"] == "txt" for row in manifest)
    written.captions_from_folder = sum(row["caption"] == "folder" for row in manifest)
    written.manifest = str(output / MANIFEST)
    return written


def _write(path: Path, text: str) -> None:
    part = part_path(path)
    Path(part).write_text(text)
    os.replace(part, path)
