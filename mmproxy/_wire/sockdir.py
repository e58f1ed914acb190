"""Socket folders: the private folder a server's socket lives in, for as long as the server runs.

A server listens on ``$TMPDIR/mmproxy-<pid>-<server uid>/inputs.sock`` (in ``/tmp`` when
``TMPDIR`` is too long for a socket's path). The folder is ``0700``,
so no other user can connect to the socket or take its name (a Linux abstract address would leave
nothing on disk, but anyone may bind a freed abstract name and receive what workers send next).
docs/internals.md, ``mmproxy._wire.sockdir``, has the rest.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import stat
import tempfile
import threading

from mmproxy import _process

__all__ = ["make", "path", "remove", "remove_stale"]

_NAME = re.compile(r"mmproxy-(\d+)-[0-9a-f]{16}")
_made: set[str] = set()  # folders this process made and has not removed yet
_lock = threading.Lock()


_MAX_PATH = 107  # a Unix socket's path, in bytes (sun_path holds 108 with the final NUL)


def _roots() -> list[str]:
    """Where socket folders go: ``TMPDIR``, and ``/tmp`` for a ``TMPDIR`` too long for one."""
    return list(dict.fromkeys([tempfile.gettempdir(), "/tmp"]))


def path(server_uid: str) -> str:
    """The socket of server ``server_uid`` (made in this process): in ``TMPDIR``, or in ``/tmp``
    when that path would be longer than a Unix socket's path may be."""
    for root in _roots():
        socket_path = os.path.join(root, f"mmproxy-{os.getpid()}-{server_uid}", "inputs.sock")
        if len(os.fsencode(socket_path)) <= _MAX_PATH:
            return socket_path
    raise OSError(f"no folder for server sockets: {tempfile.gettempdir()!r} and /tmp are too "
                  f"long for a Unix socket's path ({_MAX_PATH} bytes)")


def make(socket_path: str) -> None:
    """Makes the private folder of ``socket_path``, after removing stale ones.

    Raises:
        FileExistsError: The folder exists (mmproxy did not make it for this server).
    """
    remove_stale()
    folder = os.path.dirname(socket_path)
    os.mkdir(folder, mode=0o700)
    with _lock:
        _made.add(folder)


def remove(socket_path: str) -> None:
    """Removes the folder of ``socket_path`` and what is in it (nothing when already gone)."""
    folder = os.path.dirname(socket_path)
    with _lock:
        _made.discard(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user has that id now
        return True
    return True


def remove_stale() -> list[str]:
    """Removes this user's socket folders whose process is gone; returns them."""
    removed: list[str] = []
    for root in _roots():
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            found = _NAME.fullmatch(name)
            if found is None or _alive(int(found.group(1))):
                continue
            folder = os.path.join(root, name)
            try:
                st = os.lstat(folder)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


def _at_exit() -> None:
    with _lock:
        left = list(_made)
        _made.clear()
    for folder in left:
        shutil.rmtree(folder, ignore_errors=True)


def _after_fork() -> None:
    # a forked child removes nothing of its parent's; not a lock another thread may have held
    global _lock
    _lock = threading.Lock()
    _made.clear()


atexit.register(_at_exit)
_process.on_fork_in_child(_after_fork)
