"""Decoder noise: the warnings C decoders print on stderr, counted for a summary instead.

libjpeg prints "Corrupt JPEG data: 2 extraneous bytes before marker 0xd9" (and libpng its
"libpng warning: ...") straight to the process's stderr, from DALI's threads, for files that
still decode. :class:`DecoderWarnings` sends the process's stderr (file descriptor 2, which
DataLoader workers inherit) through a filter process: lines that are exactly such warnings are
counted, every other line goes on to the real stderr as it came. The filter is a process of its
own, so whatever the decoders or a crash write last still reaches the terminal if this process
dies; it ignores Ctrl-C, and ends when every writer has closed its end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from typing import IO, Any

__all__ = ["DecoderWarnings", "WARNING"]

# libjpeg's warnings (jerror.h, JWRN_*: the image is decoded) and libpng's
WARNING = re.compile(
    r"Corrupt JPEG data: .+|Premature end of JPEG file|Warning: unknown JFIF revision number .+|"
    r"Invalid SOS parameters for sequential JPEG|Application transferred too many scanlines|"
    r"Inconsistent progression sequence for component \d+ coefficient \d+|"
    r"Warning: thumbnail image size does not match data length \d+|libpng warning: .+")


def _filter(result_fd: int) -> None:
    """The filter process: stdin to stderr, warnings counted; the counts to ``result_fd``."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is for the command
    counts: Counter[str] = Counter()
    for raw in sys.stdin.buffer:
        line = raw.decode(errors="replace").rstrip("\r\n")
        if WARNING.fullmatch(line):
            counts[line] += 1
        else:
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
    with os.fdopen(result_fd, "w") as result:
        json.dump(counts, result)


class DecoderWarnings:
    """A context manager: while it is open, decoder warnings on stderr are counted, not shown.

    Attributes:
        terminal: A text stream on the real stderr (for a progress bar: ``isatty()`` tells).
        counts: After the exit, each warning line and how many times it came.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.terminal: IO[str] = sys.stderr
        self._saved = -1
        self._result: IO[str] | None = None
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
        self._result = os.fdopen(read_end)
        assert self._proc.stdin is not None
        os.dup2(self._proc.stdin.fileno(), 2)
        self._proc.stdin.close()  # fd 2 (and the workers' copies) hold the pipe now
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # this process's end of the pipe is closed
        os.close(self._saved)
        self.terminal.close()
        assert self._proc is not None and self._result is not None
        try:  # every writer gone (workers included), the filter reports and ends; after an
            # error the workers may not have ended yet: no waiting for them
            self._proc.wait(timeout=10 if kind is None else 0.5)
            self.counts = Counter(json.loads(self._result.read() or "{}"))
        except (subprocess.TimeoutExpired, ValueError):
            pass  # a process still holds the pipe: its lines still pass; no counts
        finally:
            self._result.close()

    def summary(self, limit: int = 3) -> list[str]:
        """Lines for people: how many warnings, and the most common ones."""
        if not self.counts:
            return []
        lines = [f"decoder warnings kept off stderr (the files decoded): "
                 f"{sum(self.counts.values())}"]
        lines += [f"  {n} x {line}" for line, n in self.counts.most_common(limit)]
        if len(self.counts) > limit:
            lines.append(f"  and {len(self.counts) - limit} other kinds")
        return lines
