"""Part files: a file written under a temporary name beside its own, renamed when it is whole.

A reader never sees half a file, an interrupted writer leaves no file that looks whole, and the
part files of processes that have ended are found by name (``NAME.part-HOST-PID``) and removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil

__all__ = ["final_path", "part_path", "remove_stale_parts"]


def part_path(path: str | os.PathLike[str]) -> str:
    """Where a file is written before it is renamed to ``path``: ``PATH.part-HOST-PID``, so that
    a reader never sees half of it and :func:`remove_stale_parts` knows whose it is."""
    return f"{os.fspath(path)}.part-{os.uname().nodename}-{os.getpid()}"


_PART = re.compile(r".+\.part-(?P<host>.+)-(?P<pid>\d+)")


def remove_stale_parts(folder: str | os.PathLike[str]) -> None:
    """Removes the files (and folders) of :func:`part_path` in ``folder`` left by processes of
    this host that have ended (killed while writing); those of running processes and of other
    hosts (a shared folder) stay. Nothing reads them: they only take space."""
    if not os.path.isdir(folder):
        return
    host = os.uname().nodename
    for entry in os.scandir(folder):
        match = _PART.fullmatch(entry.name)
        if match is None or match["host"] != host or _running(int(match["pid"])):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):  # another process removed it first
                os.unlink(entry.path)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def final_path(part: str) -> str:
    """The name a file of :func:`part_path` is renamed to."""
    return part.rsplit(".part-", 1)[0]
