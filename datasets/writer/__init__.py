"""Writer: turn a folder of images or videos (with captions or labels) or audio files (with
labels) into shards.

A file is stored under the extension of what it holds, whatever its name says (a PNG named
``.jpg`` as ``png``, a WAV named ``.flac`` as ``wav``); every extension written is one the
recipes read by default (``IMAGE_EXTS``, ``AUDIO_EXTS``, ``VIDEO_EXTS`` of
:mod:`mmproxy.datasets.recipes`). Other files are left out and reported by reason, never silently.
docs/internals.md, ``mmproxy.datasets.writer``, has the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

import webdataset as wds
from mmproxy.datasets.writer._folder import (
    AUDIO_SUFFIXES as AUDIO_SUFFIXES,  # the suffixes read, importable here too
)
from mmproxy.datasets.writer._folder import IMAGE_SUFFIXES as IMAGE_SUFFIXES
from mmproxy.datasets.writer._folder import KINDS, Kind, class_folders, other_kind, plan, sniff
from mmproxy.datasets.writer._folder import VIDEO_SUFFIXES as VIDEO_SUFFIXES
from mmproxy.datasets.writer._written import MANIFEST, LeftOut, Reason, WrittenShards

from mmproxy.errors import MmproxyError
from mmproxy.parts import final_path, part_path, remove_stale_parts

__all__ = ["LeftOut", "NoMediaError", "OutputExistsError", "Reason", "WrittenShards",
           "make_shards"]

CLASSES, LEFT_OUT = "classes.json", "left_out.jsonl"


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
        files: Names of that set's files in it (shards, classes.json, manifest.jsonl,
            left_out.jsonl).
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



def _old_set(output: Path, prefix: str) -> tuple[list[Path], list[Path]]:
    """(the shard set already in ``output``: shards of ``prefix`` and those its manifest.jsonl
    names, classes.json, manifest.jsonl, left_out.jsonl; the other ``.tar`` files there)."""
    if not output.is_dir():
        return [], []
    named: set[str] = set()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # unreadable: names none
        rows = (output / MANIFEST).read_text(encoding="utf-8").splitlines()
        named = {json.loads(row)["shard"] for row in rows if row.strip()}
    shard = re.compile(re.escape(prefix) + r"-\d+\.tar")
    ours, foreign = [], []
    for path in sorted(output.iterdir()):
        if (path.name in (CLASSES, MANIFEST, LEFT_OUT) or shard.fullmatch(path.name)
                or path.name in named):
            ours.append(path)
        elif path.name.endswith(".tar"):
            foreign.append(path)
    return ours, foreign



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
    Symbolic links are followed as torchvision's ``ImageFolder`` follows them (a linked class
    folder is a class, with the label ``ImageFolder`` gives it); a link to nothing, and a folder
    that leads back to one that holds it (a loop, not entered), are left out. Suffixes are read
    in any case (``x.JPEG`` with its caption ``x.TXT``).
    A file is stored under the extension of its content (a PNG named ``.jpg`` as ``png``).
    Files of other formats or content, empty files, unreadable captions, and files whose header
    :func:`~mmproxy.datasets.check_header` rejects are left out: the summary gives them by
    reason, ``left_out.jsonl`` beside the shards lists every one. An empty caption is written as
    it is (an empty ``txt``). Every folder at the top of ``source`` is a class with the label
    torchvision's ``ImageFolder`` gives it, also one with no file of the kind (it keeps its
    label in ``classes.json``, no sample has it, and the summary names it: ``empty_classes``).
    A folder's name with no letter (img2dataset's ``00000``) is no caption: its images without
    a ``.txt`` are left out.

    The shards, ``classes.json``, ``manifest.jsonl`` and ``left_out.jsonl`` are written under
    temporary names and take their own only when the whole set is written, the old set's files
    (with ``overwrite``) kept aside until then: an error or an interrupt leaves ``output`` as it
    was.

    Args:
        source: The folder to read.
        output: The folder to write to; created if missing.
        kind: "image-text", "audio-label", "video-text" or "video-label".
        max_count: Samples per shard at most.
        max_size: Bytes per shard (roughly) at most.
        prefix: Shard file names start with it.
        overwrite: Replace the shard set already in ``output`` (the shards of ``prefix``, those
            its ``manifest.jsonl`` names, ``classes.json``, ``manifest.jsonl``,
            ``left_out.jsonl``) once the new one is written. Without it such a folder is refused
            (:class:`OutputExistsError`).

    Returns:
        The paths of exactly the shards written, with a summary (:class:`WrittenShards`).

    Raises:
        OutputExistsError: ``output`` holds a shard set and ``overwrite`` is off.
        FileExistsError: ``output`` holds other ``.tar`` files (a folder of shards is read whole:
            they would be read with the new set's labels), with or without ``overwrite``.
        NoMediaError: Nothing to write (it says why, and which kind fits when another does).
        FileNotFoundError: ``source`` does not exist.
        NotADirectoryError: ``source`` is a file.

    Example:
        >>> written = make_shards("photos/", "shards/")       # doctest: +SKIP
        >>> print(written.summary())                          # doctest: +SKIP
    """
    source, output = Path(source), Path(output)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if max_count < 1 or max_size <= 0:
        raise ValueError(f"max_count and max_size must be positive, got {max_count}, {max_size}")
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist")
    if not source.is_dir():
        raise NotADirectoryError(f"{source} is a file, not a folder of images, sounds or videos")
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
    planned = plan(source, output, kind, written.files_left_out)
    top, out = source.resolve(), output.resolve()
    inside = {out.relative_to(top).parts[0]} if top in out.parents else set()  # not a class
    classes = sorted({p.class_name for p in planned if p.class_name is not None}
                     | (set(class_folders(source)) - inside if planned else set()))
    index = {name: i for i, name in enumerate(classes)}
    manifest: list[dict[str, Any]] = []
    filled: set[str] = set()  # the classes a sample was written for
    parts: list[str] = []  # the shards' part files (ShardWriter's post), then classes.json's,
    # manifest.jsonl's and left_out.jsonl's
    pattern = (str(output / prefix).replace("%", "%%") + "-%06d.tar"
               + part_path("").replace("%", "%%"))  # ShardWriter fills in the number
    sink: Any = None
    try:
        for item in planned:
            data = item.path.read_bytes()
            ext, left = sniff(item, media, data)
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
                filled.add(item.class_name)
            sink.write(sample)
            manifest.append({"key": key, "shard": os.path.basename(final_path(sink.fname)),
                             "source": item.rel, "caption_from": item.origin})
        written.files_left_out.sort(key=lambda item: item.path)
        if not manifest:
            reasons = "; ".join(f"{p}: {w}" for p, w in written.left_out[:3])
            raise NoMediaError(f"no {media} files to write under {source}"
                               + (f" ({len(written.files_left_out)} left out: {reasons})"
                                  if reasons else ""), other_kind(source, media))
        sink.close()
        written.extend(final_path(part) for part in parts)
        _write_part(output / CLASSES, json.dumps(classes), parts)
        _write_part(output / MANIFEST, "".join(json.dumps(row) + "\n" for row in manifest), parts)
        if written.files_left_out:
            _write_part(output / LEFT_OUT, "".join(
                json.dumps({"source": f.path, "why": f.why, "reason": f.reason.name.lower()}) + "\n"
                for f in written.files_left_out), parts)
        _put_in_place(parts, [str(path) for path in old])  # the new set is whole: now it goes in
    except BaseException:  # an error or an interrupt: none of the new set stays
        if sink is not None:
            with contextlib.suppress(Exception):
                sink.close()
            parts.append(sink.fname)
        for part in parts:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
        raise
    written.samples = len(manifest)
    written.captions_from_txt = sum(row["caption_from"] == "txt" for row in manifest)
    written.captions_from_folder = sum(row["caption_from"] == "folder" for row in manifest)
    written.manifest = str(output / MANIFEST)
    written.left_out_file = str(output / LEFT_OUT) if written.files_left_out else ""
    written.empty_classes = [(name, index[name]) for name in classes if name not in filled]
    return written


def _write_part(path: Path, text: str, parts: list[str]) -> None:
    """Writes ``text`` to the part file of ``path``, listed in ``parts`` first (removed with
    them if the writing fails)."""
    parts.append(part_path(path))
    Path(parts[-1]).write_text(text, encoding="utf-8")


def _put_in_place(parts: list[str], old: list[str]) -> None:
    """Renames every part file to its own name and removes the ``old`` files: all or nothing.

    Each old file is first renamed aside (to a part file of its own), the one of a new file's
    name just before the new file takes it; an error or an interrupt until every new file is in
    place puts them back and removes the new files that took a name (their part files are the
    caller's), so that the folder holds the whole old set or the whole new one. The old files go
    last.
    """
    aside: list[tuple[str, str]] = []  # (an old file's name, where it waits)
    placed: list[str] = []
    try:
        for part in parts:
            final = final_path(part)
            if os.path.lexists(final):
                aside.append((final, part_path(final + ".old")))
                os.replace(*aside[-1])
            os.replace(part, final)
            placed.append(final)
        for path in old:
            if path not in placed:
                aside.append((path, part_path(path + ".old")))
                os.replace(*aside[-1])
    except BaseException:  # raised as it came, once the folder is as it was
        for path in placed:
            with contextlib.suppress(OSError):
                os.unlink(path)
        for path, waits in reversed(aside):
            with contextlib.suppress(OSError):  # the rename aside itself failed
                os.replace(waits, path)
        raise
    for _, waits in aside:
        with contextlib.suppress(OSError):  # a part file: the next run removes it
            os.unlink(waits)
