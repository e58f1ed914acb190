"""Written shards: what :func:`~mmproxy.datasets.make_shards` wrote and left out, its summary,
and the source file of a sample its manifest lists."""

from __future__ import annotations

import enum
import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

__all__ = ["LeftOut", "MANIFEST", "Reason", "WrittenShards", "manifest_sources"]

MANIFEST = "manifest.jsonl"  # one line per sample (key, shard, source)


class Reason(enum.Enum):
    """Why a file of the source was left out: the groups of :meth:`WrittenShards.summary`."""

    FORMAT = "not a format this writer reads"
    CONTENT = "holds none of the formats this writer reads"
    EMPTY = "empty"
    DAMAGED = "damaged (the header check refused it)"
    UNREAD = "a variant of its format that DALI's decoders do not read"
    NO_CAPTION = "no caption: no .txt beside it and no class folder to take one from"
    CAPTION = "its caption cannot be used"
    NO_LABEL = "no label: not in a class folder"
    LONE_CAPTION = "a caption with no file beside it"
    HIDDEN = "hidden file or folder"
    DANGLING_LINK = "a symbolic link to nothing"
    LINK_LOOP = "a link back to a folder that holds it (a loop: not entered)"
    NOT_A_FILE = "neither a file nor a folder (a FIFO, a socket or a device)"


class LeftOut(NamedTuple):
    """A file not written: its ``path`` relative to the source, ``why`` in words, its ``reason``."""

    path: str
    why: str
    reason: Reason


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _listed(items: list[str], limit: int) -> list[str]:
    """``items``, or the first ``limit`` and how many more (never "and 1 more")."""
    if len(items) <= limit + 1:
        return items
    return [*items[:limit], f"... and {len(items) - limit} more"]


class WrittenShards(list[str]):
    """What :func:`make_shards` wrote: the list of the shard paths, in order, and a summary.

    Attributes:
        kind: What was written (see :func:`make_shards`).
        reads: The suffixes of the files of that kind the writer reads.
        samples: Samples written.
        captions_from_txt: Images whose caption is the ``.txt`` file beside them.
        captions_from_folder: Images whose caption was guessed from their class folder's name.
        renamed: ``(path relative to the source, extension stored)`` for every file whose content
            is another format than its name says, stored as what it holds.
        files_left_out: A :class:`LeftOut` for every file not written, in name order.
        manifest: Path of ``manifest.jsonl`` (key, shard, source file, where the caption came from).
        left_out_file: Path of ``left_out.jsonl`` (every file left out: source, why, reason), or
            "" when none was.
        empty_classes: ``(class name, label)`` of every class folder whose files of the kind
            were all refused by the header check: its label stays in ``classes.json``, and no
            sample has it.
    """

    def __init__(self, kind: str, reads: list[str]) -> None:
        super().__init__()
        self.kind, self.reads = kind, reads
        self.samples = self.captions_from_txt = self.captions_from_folder = 0
        self.renamed: list[tuple[str, str]] = []
        self.files_left_out: list[LeftOut] = []
        self.manifest = self.left_out_file = ""
        self.empty_classes: list[tuple[str, int]] = []

    @property
    def left_out(self) -> list[tuple[str, str]]:
        """``(path relative to the source, why)`` for every file not written."""
        return [(f.path, f.why) for f in self.files_left_out]

    @property
    def pattern(self) -> str:
        """The brace pattern of the shards written, for the datasets and ``--data``."""
        if len(self) < 2:
            return self[0] if self else ""
        first, last = (re.fullmatch(r"(.*-)(\d+)\.tar", path) for path in (self[0], self[-1]))
        assert first is not None and last is not None  # the writer names them so
        return f"{first[1]}{{{first[2]}..{last[2]}}}.tar"

    def summary(self, examples: int = 3) -> str:
        """A few lines for people: counts, the pattern to read the shards with, then the files
        left out, grouped by reason, with up to ``examples`` of each."""
        folder = os.path.dirname(self[0]) if self else "nowhere"
        lines = [f"wrote {_plural(self.samples, 'sample')} in {_plural(len(self), 'shard')} to "
                 f"{folder}"]
        if self:
            lines.append(f"  read them as: {self.pattern}")
        if self.captions_from_txt or self.captions_from_folder:
            lines.append(f"  captions: {self.captions_from_txt} from .txt files, "
                         f"{self.captions_from_folder} guessed from the class folder's name")
        if self.renamed:
            lines.append(f"  stored under the extension of their content: "
                         f"{_plural(len(self.renamed), 'file')}")
            lines += [f"    {item}" for item in _listed(
                [f"{path}: {ext.upper()} data, stored as .{ext}" for path, ext in self.renamed],
                examples)]
        lines.append(f"  left out: {_plural(len(self.files_left_out), 'file')}"
                     + (", by reason:" if self.files_left_out else ""))
        groups: dict[Reason, list[LeftOut]] = {}
        for item in self.files_left_out:
            groups.setdefault(item.reason, []).append(item)
        for reason, items in sorted(groups.items(), key=lambda group: -len(group[1])):
            same = len({item.why for item in items}) == 1  # then said once, in the heading
            head = items[0].why if same else reason.value
            if reason is Reason.FORMAT:  # how many of each suffix
                suffixes = Counter(Path(item.path).suffix.lower() or "no suffix" for item in items)
                head = (f"{reason.value} ({', '.join(f'{s} {n}' for s, n in suffixes.most_common())}"
                        f"; it reads {' '.join(self.reads)})")
            lines.append(f"    {len(items)} x {head}")
            shown = [item.path if same or reason is Reason.FORMAT else f"{item.path}: {item.why}"
                     for item in items]
            lines += [f"      {line}" for line in _listed(shown, examples)]
        if self.left_out_file:
            lines.append(f"  every file left out, and why: {self.left_out_file}")
        if self.empty_classes:
            lines.append("  classes with no sample (all their files left out; no sample has their "
                         "label): " + ", ".join(f"{name} ({label})" for name, label in self.empty_classes))
        if self.manifest:
            lines.append(f"  manifest (key -> shard, source file): {self.manifest}")
        return "\n".join(lines)


_KEY = re.compile(r'"key": "([^"]*)"')  # a line's key, found before the line is parsed


def manifest_sources(samples: Sequence[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The source file of each ``(shard, key)`` whose shard is a local file with make-shards'
    manifest beside it: {(shard, key): source} (the skip summary's
    :func:`~mmproxy.skips.add_file_lookup`). One pass over each manifest, ended once every
    key wanted from it is found (only the lines of a wanted key are parsed); a manifest that
    cannot be read, or is not make-shards' own, names nothing."""
    wanted: dict[str, dict[tuple[str, str], str]] = {}  # manifest -> {(shard name, key): shard}
    for url, name in samples:
        if "://" not in url and not url.startswith("pipe:"):
            manifest = os.path.join(os.path.dirname(url), MANIFEST)
            wanted.setdefault(manifest, {})[os.path.basename(url), name] = url
    found: dict[tuple[str, str], str] = {}
    for manifest, keys in wanted.items():
        names = {key for _, key in keys}
        try:
            with open(manifest, encoding="utf-8") as f:
                for line in f:
                    key = _KEY.search(line)
                    if key is None or key[1] not in names:
                        continue
                    row = json.loads(line)
                    source = row.get("source") if isinstance(row, dict) else None
                    if not isinstance(source, str) or not isinstance(row.get("shard"), str):
                        continue
                    shard = keys.pop((row["shard"], key[1]), None)
                    if shard is not None:
                        found[shard, key[1]] = source
                        if not keys:
                            break
        except (OSError, ValueError, TypeError):  # none there, or not make-shards' own
            continue
    return found
