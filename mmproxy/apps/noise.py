"""Decoder noise: the warnings C decoders print on stderr, counted for a summary instead.
docs/internals.md, ``mmproxy.apps.noise``, has the rest.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from collections import Counter
from typing import IO, Any

__all__ = ["DecoderWarnings", "REFUSED", "WARNING"]

# libjpeg's warnings (jerror.h, JWRN_*: the image is decoded) and libpng's
WARNING = re.compile(
    r"Corrupt JPEG data: .+|Premature end of JPEG file|Warning: unknown JFIF revision number .+|"
    r"Invalid SOS parameters for sequential JPEG|Application transferred too many scanlines|"
    r"Inconsistent progression sequence for component \d+ coefficient \d+|"
    r"Warning: thumbnail image size does not match data length \d+|libpng warning: .+|"
    # libtiff's (its codecs' modules by name), OpenCV's image format readers'
    r"(?:TIFF|JPEG|OJPEG|LZW|ZIP|Fax[34]|PackBits|LogLuv|Predictor)\w*: Warning, .+|"
    r"\[ WARN:\d+@[\d.]+\] global grfmt_\w+\.cpp:\d+ .+")
# A CPU decoder of DALI's refusing a file (the next one is tried), and libtiff's and OpenCV's
# errors from its attempt (libtiff's modules by name, not a Python exception's "TIFF...Error:")
REFUSED = re.compile(
    r"\[ERROR\] \[(?:libtiff|opencv\w*)_decoder\] .+|"
    r"(?:TIFF[A-Z]\w*(?<!Error)(?<!Exception)|(?:LZW|ZIP|Fax[34]|OJPEG|PackBits)Decode): .+|"
    r"\[ERROR:\d+@[\d.]+\] global (?:loadsave\.cpp:\d+ imdecode_|grfmt_\w+\.cpp:\d+) .+")
_COLOURS = re.compile(r"\x1b\[[0-9;]*m")

_NUMBER = re.compile(r"\b0x[0-9a-fA-F]+\b|(?<![A-Za-z_])\d+")  # not a name's digits (nvjpeg2k)
_KINDS = 100  # the kinds counted apart; the lines of any further kind are counted together
_OTHER = {"warnings": "other decoder warnings", "refusals": "other decoder errors"}


def _kind(line: str) -> str:
    """A warning's kind: its line with every number read as N (hexadecimal ones as 0xN)."""
    return _NUMBER.sub(lambda number: "0xN" if number[0].startswith("0x") else "N", line)


def _filter(result_fd: int) -> None:
    """The filter process: stdin to stderr, warnings counted; the counts to ``result_fd``."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is for the command
    counts: dict[str, Counter[str]] = {"warnings": Counter(), "refusals": Counter()}
    for raw in sys.stdin.buffer:
        line = _COLOURS.sub("", raw.decode(errors="replace").rstrip("\r\n"))
        group = ("warnings" if WARNING.fullmatch(line) else
                 "refusals" if REFUSED.fullmatch(line) else None)
        if group is not None:
            kinds, kind = counts[group], _kind(line)
            kinds[kind if kind in kinds or len(kinds) < _KINDS else _OTHER[group]] += 1
        else:
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
    left = memoryview(json.dumps(counts).encode())
    try:
        while left:
            left = left[os.write(result_fd, left):]
    except BrokenPipeError:
        pass  # the command stopped waiting for the counts (a worker held stderr too long)
    finally:
        os.close(result_fd)


def _read_all(fd: int, deadline: float) -> bytes | None:
    """Everything ``fd`` gives until its end, or None where the end has not come by ``deadline``."""
    chunks: list[bytes] = []
    while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
    return None


class DecoderWarnings:
    """A context manager: while it is open, decoder warnings on stderr are counted, not shown.

    Attributes:
        terminal: A text stream on the real stderr (for a progress bar: ``isatty()`` tells).
        counts: After the exit, each kind of warning (its line, numbers read as N) and how many
            times it came; the kinds after the first hundred are counted together.
        refusals: The same for the errors of a decoder refusing a file.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.terminal: IO[str] = sys.stderr
        self._saved = -1
        self._result = -1
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> DecoderWarnings:
        sys.stderr.flush()
        self._saved = os.dup(2)
        self.terminal = os.fdopen(os.dup(self._saved), "w", buffering=1)
        read_end, write_end = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from mmproxy.apps.noise import _filter; _filter({write_end})"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self._saved,
            pass_fds=(write_end,), close_fds=True)
        os.close(write_end)
        self._result = read_end
        assert self._proc.stdin is not None
        os.dup2(self._proc.stdin.fileno(), 2)
        self._proc.stdin.close()  # fd 2 (and the workers' copies) hold the pipe now
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # this process's end of the pipe is closed
        os.close(self._saved)
        self.terminal.close()
        assert self._proc is not None
        # every writer gone (workers included), the filter reports and ends; after an error the
        # workers may not have ended yet: no waiting for them. The counts are read before the
        # wait: the filter ends only once they are all written.
        try:
            found = _read_all(self._result, time.monotonic() + (10 if kind is None else 0.5))
        finally:
            os.close(self._result)
        if found is None:
            return  # a process still holds the pipe: its lines still pass; no counts
        try:
            counts = json.loads(found or b"{}")
            self.counts = Counter(counts.get("warnings", {}))
            self.refusals = Counter(counts.get("refusals", {}))
        except ValueError:
            pass  # the filter died before it reported (its traceback went to the terminal)
        try:
            self._proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass  # it has reported and is ending

    def summary(self, limit: int = 3) -> list[str]:
        """Lines for people: how many warnings and decoders' refusals, and the most common."""
        lines: list[str] = []
        refused = ("decoder errors kept off stderr (a decoder refused a file and the next was "
                   "tried; a file none reads fails its sample, by name)")
        for counts, what in ((self.counts, "decoder warnings kept off stderr (the files decoded)"),
                             (self.refusals, refused)):
            if counts:
                lines.append(f"{what}: {sum(counts.values())}")
                lines += [f"  {n} x {line}" for line, n in counts.most_common(limit)]
                if len(counts) > limit:
                    lines.append(f"  and {len(counts) - limit} other kinds")
        return lines
