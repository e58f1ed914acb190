"""Process hygiene: ids unique across processes, the servers of this process, and what a fork does.
docs/internals.md, ``mmproxy._process``, has the rest.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import os
import secrets
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["keep", "local", "new_id", "on_fork_in_child", "process_token", "register_local"]

_lock = threading.Lock()
_pid: int | None = None
_token = ""
_counter: Iterator[int] = itertools.count()


def process_token() -> str:
    """A short token unique to this process (renewed after a fork)."""
    global _pid, _token, _counter
    pid = os.getpid()
    if _pid != pid:
        with _lock:
            if _pid != pid:
                _token = f"{pid:x}.{secrets.token_hex(3)}"
                _counter = itertools.count()
                _pid = pid
    return _token


def new_id() -> str:
    """An id unique across processes and time: ``<process token>:<counter>``."""
    token = process_token()
    return f"{token}:{next(_counter)}"


_servers: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_servers_pid = os.getpid()


def register_local(uid: str, server: Any) -> None:
    """Records a server of this process (held weakly)."""
    global _servers_pid
    _servers_pid = os.getpid()
    _servers[uid] = server


def local(uid: str) -> Any:
    """The server ``uid`` if it lives in this very process, else None."""
    return _servers.get(uid) if os.getpid() == _servers_pid else None


def local_servers() -> list[Any]:
    """Every registered server (in a forked child: the parent's, inherited)."""
    return list(_servers.values())


_hooks: list[Callable[[], None]] = []


def on_fork_in_child(hook: Callable[[], None]) -> None:
    """Runs ``hook`` in every forked child, right after the fork."""
    _hooks.append(hook)


def keep(obj: Any) -> None:
    """Keeps ``obj`` alive for the rest of this (forked child) process: never freed here, not
    even when the interpreter shuts down (a child that leaves by ``sys.exit`` rather than
    ``os._exit`` would free it then)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # a reference nothing ever drops


# The collector is off from the fork until the hooks below have run in the child: Python's own
# after-fork work (threading's) runs first and allocates, and a collection there would free
# garbage the hooks must make inert first (a DALI pipeline that shuts down in a forked child
# hangs it). Forks from several threads at once are counted, so that the first one in saves
# whether the collector ran and the last one out restores it.
_forks_lock = threading.Lock()
_forks = 0  # forks under way in this process
_collecting = True  # whether the collector ran when the first of them began


def _before_fork() -> None:
    global _forks, _collecting
    with _forks_lock:
        if _forks == 0:
            _collecting = gc.isenabled()
            gc.disable()
        _forks += 1


def _after_fork_in_parent() -> None:
    global _forks
    with _forks_lock:
        _forks -= 1
        if _forks == 0 and _collecting:
            gc.enable()


def _after_fork_in_child() -> None:
    global _forks, _forks_lock
    _forks, _forks_lock = 0, threading.Lock()  # only this thread came along
    try:
        for hook in _hooks:
            try:
                hook()
            except Exception as err:  # one hook's failure must not stop the others
                warnings.warn(f"mmproxy: an after-fork hook failed in a forked child "
                              f"({type(err).__name__}: {err})", RuntimeWarning, stacklevel=1)
    finally:
        if _collecting:
            gc.enable()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
