"""Folder: what :func:`~mmproxy.datasets.make_shards` finds in a source folder, and what each
file holds.

:func:`plan` walks the folder in name order, following symbolic links as torchvision's
``ImageFolder`` does, and pairs each media file of the kind with its caption (the ``.txt`` beside
it, in any case, else its class folder's name) and its class; :func:`sniff` tells
the format a file holds from its first bytes (a PNG named ``.jpg`` is a PNG) and checks its
header. Files that cannot be written are returned as :class:`~mmproxy.datasets.writer.LeftOut`
with their reason.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, NamedTuple

from mmproxy.datasets.writer._written import LeftOut, Reason

from mmproxy.media import Unread
from mmproxy.media.checks import SIGNATURES, check_header, video_info

__all__ = ["AUDIO_SUFFIXES", "IMAGE_SUFFIXES", "KINDS", "Kind", "Planned", "VIDEO_SUFFIXES",
           "other_kind", "plan", "sniff"]

# suffix read -> extension written (one name per format); the recipes read every one of them
IMAGE_SUFFIXES = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp", ".bmp": "bmp",
                  ".tif": "tiff", ".tiff": "tiff"}
AUDIO_SUFFIXES = {".flac": "flac", ".wav": "wav", ".ogg": "ogg"}
VIDEO_SUFFIXES = {".mp4": "mp4", ".m4v": "mp4", ".mov": "mov", ".webm": "webm", ".mkv": "mkv",
                  ".avi": "avi"}
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


class Planned(NamedTuple):
    """A media file to write, with its caption and class."""

    path: Path
    rel: str  # relative to the source, with "/"
    named: str  # the extension its name gives
    class_name: str | None
    caption: str | None
    origin: str | None  # "txt" | "folder" | None (audio)


_Entry = tuple[Path, LeftOut | None]  # an entry of the source, and why it is left out, if it is


def _walk(source: Path) -> Iterator[_Entry]:
    """Every entry under ``source``, in name order, with symbolic links followed as torchvision's
    ``ImageFolder`` follows them: ``(path, None)`` for a file, ``(path, why it is left out)`` for
    a link to nothing, a folder that leads back to one holding it (a loop: not entered), and
    anything that is neither a file nor a folder (a FIFO, a socket, a device)."""

    def entries(folder: Path, holders: dict[tuple[int, int], str]) -> Iterator[_Entry]:
        """The entries under ``folder``; ``holders``: the folders on its way from ``source``
        (itself included), ``(st_dev, st_ino) -> path relative to source``."""
        with os.scandir(folder) as listing:
            names = sorted(entry.name for entry in listing)
        for name in names:
            path = folder / name
            rel = path.relative_to(source).as_posix()
            try:
                info = path.stat()  # through the link, if it is one
            except OSError as err:
                if not path.is_symlink():
                    raise
                target = os.readlink(path)
                why = (f"a symbolic link to {target}, which does not exist"
                       if isinstance(err, FileNotFoundError) else
                       f"a symbolic link to {target}, which cannot be followed ({err.strerror})")
                yield path, LeftOut(rel, why, Reason.DANGLING_LINK)
                continue
            if stat.S_ISDIR(info.st_mode):
                folder_id = (info.st_dev, info.st_ino)
                held_by = holders.get(folder_id)
                if held_by is None:
                    yield from entries(path, {**holders, folder_id: rel})
                else:
                    where = "the source folder" if held_by == "." else f"the folder {held_by}"
                    yield path, LeftOut(rel, f"leads back to {where}, which holds it: not "
                                        "entered (a loop)", Reason.LINK_LOOP)
            elif stat.S_ISREG(info.st_mode):
                yield path, None
            else:
                yield path, LeftOut(rel, Reason.NOT_A_FILE.value, Reason.NOT_A_FILE)

    top = source.stat()
    yield from entries(source, {(top.st_dev, top.st_ino): "."})


def _is_caption(path: Path) -> bool:
    """Whether ``path`` is named as a caption: ``.txt``, in any case."""
    return path.suffix.lower() == ".txt"


def _caption(captions: list[_Entry], class_name: str | None) -> tuple[str | None, str, Reason | None]:
    """(caption, origin "txt" | "folder", None), or (None, why there is none, the reason), from
    the ``captions`` beside a file (each with why it cannot be read, if it cannot). A class
    folder's name is a caption when it has a letter (not img2dataset's ``00000``)."""
    if len(captions) > 1:
        names = ", ".join(path.name for path, _ in captions)
        return None, f"it has {len(captions)} captions beside it ({names}): keep one", Reason.CAPTION
    if captions:
        txt, broken = captions[0]
        if broken is not None:
            return None, f"its caption {txt.name} is {broken.why}", Reason.CAPTION
        try:
            text = txt.read_text(encoding="utf-8-sig").strip()  # a BOM is no part of a caption
        except UnicodeDecodeError:
            return None, f"its caption {txt.name} is not UTF-8 text", Reason.CAPTION
        return text, "txt", None  # an empty caption too: web corpora hold them
    if class_name is not None and any(c.isalpha() for c in class_name):
        return class_name.replace("_", " "), "folder", None
    if class_name is not None:
        return None, (f"no caption: no .txt beside it, and its folder's name {class_name!r} is "
                      "no caption (an img2dataset folder?)"), Reason.NO_CAPTION
    return None, Reason.NO_CAPTION.value, Reason.NO_CAPTION


def plan(source: Path, output: Path, kind: str, left_out: list[LeftOut]) -> list[Planned]:
    """The files to write, in name order; the others go to ``left_out`` with the reason.

    Symbolic links are followed (to files and folders, as torchvision's ``ImageFolder`` does: a
    linked class folder is a class); links to nothing and loops are left out. A caption is the
    file of the same name with ``.txt`` in any case (``.txt``, ``.TXT``), as media suffixes are
    read in any case.
    """
    suffixes, media, captioned = KINDS[kind]
    what = {"image": "an image", "audio": "an audio", "video": "a video"}[media]
    out_dir = output.resolve()
    found: list[tuple[Path, str]] = []  # media files of the kind
    captions: dict[Path, list[_Entry]] = {}  # by the path less its suffix
    inside: list[str] = []  # source files in the output folder (it lies inside the source)
    for path, broken in _walk(source):
        rel = path.relative_to(source)
        suffix = path.suffix.lower()
        lies = path.resolve() if broken is None else path.parent.resolve() / path.name
        if out_dir in lies.parents:
            if suffix in suffixes:
                inside.append(rel.as_posix())
            continue
        if any(part.startswith(".") for part in rel.parts):
            left_out.append(LeftOut(rel.as_posix(), Reason.HIDDEN.value, Reason.HIDDEN))
        elif broken is not None:
            left_out.append(broken)
            if captioned and _is_caption(path) and broken.reason is not Reason.LINK_LOOP:
                captions.setdefault(path.with_suffix(""), []).append((path, broken))
        elif suffix in suffixes:
            found.append((path, suffix))
        elif captioned and _is_caption(path):
            captions.setdefault(path.with_suffix(""), []).append((path, None))
        else:
            left_out.append(LeftOut(rel.as_posix(), f"not {what} file this writer reads "
                                    f"({suffix or 'no suffix'})", Reason.FORMAT))
    planned: list[Planned] = []
    for path, suffix in found:
        rel = path.relative_to(source)
        class_name = rel.parts[0] if len(rel.parts) > 1 else None  # ImageFolder: top folder
        caption, origin, reason = (_caption(captions.get(path.with_suffix(""), []), class_name)
                                   if captioned else (None, None, None))
        if reason is not None:
            left_out.append(LeftOut(rel.as_posix(), str(origin), reason))
        elif not captioned and class_name is None:
            left_out.append(LeftOut(rel.as_posix(), Reason.NO_LABEL.value, Reason.NO_LABEL))
        else:
            planned.append(Planned(path, rel.as_posix(), suffixes[suffix], class_name, caption,
                                   origin))
    stems = {path.with_suffix("") for path, _ in found}  # of every media file found
    for stem, beside in captions.items():
        if stem not in stems:
            left_out.extend(LeftOut(path.relative_to(source).as_posix(),
                                    f"a caption with no {media} beside it", Reason.LONE_CAPTION)
                            for path, broken in beside if broken is None)
    left_out.sort(key=lambda item: item.path)
    if inside:
        raise ValueError(
            f"the output folder {output} is inside the source folder and holds {len(inside)} "
            f"{media} file(s) of it (e.g. {inside[0]}), which would be left out: write the shards "
            "to a folder outside the source, or to an empty one")
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


def sniff(item: Planned, media: str, data: bytes) -> tuple[str, LeftOut | None]:
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
                           else f"{ext.upper()} data that {problem}",
                           Reason.UNREAD if isinstance(problem, Unread) else Reason.DAMAGED)
    return ext, None


def class_folders(source: Path) -> list[str]:
    """The class folders of ``source`` as torchvision's ``ImageFolder`` finds them: every folder
    at its top (links to folders followed), hidden ones and loops back to it aside, sorted; a
    class folder with no file of the kind keeps its label."""
    top = source.resolve()
    names = []
    for entry in os.scandir(source):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        real = Path(entry.path).resolve()
        if real != top and real not in top.parents:
            names.append(entry.name)
    return sorted(names)


def other_kind(source: Path, media: str) -> str | None:
    """A kind whose files ``source`` holds instead of ``media`` ones: for files in class folders
    with no caption beside them, the label kind."""
    files = [path.relative_to(source) for path, broken in _walk(source) if broken is None]
    captioned_stems = {f.with_suffix("") for f in files if _is_caption(f)}
    for kind, (suffixes, other, captioned) in KINDS.items():
        found = [f for f in files if f.suffix.lower() in suffixes]
        if other == media or not found:
            continue
        labelled = all(len(f.parts) > 1 and f.with_suffix("") not in captioned_stems
                       for f in found)
        if not (captioned and labelled and f"{other}-label" in KINDS):
            return kind
    return None
