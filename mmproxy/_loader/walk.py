"""Walking nested structures: find or replace references inside any nesting, cycles included.

The walk is an object, not a recursive closure: a nested function that calls itself holds itself
through its closure cell, a reference cycle that would keep everything the walk touched (a batch's
CUDA tensors among them) alive until the cyclic garbage collector runs, possibly in a forked child
where freeing CUDA memory aborts the process. See docs/reliability.md, "Forks".
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Tensor,
           np.ndarray, np.generic, types.ModuleType, type, types.FunctionType,
           types.BuiltinFunctionType, types.MethodType)
_LEAF_TYPES = frozenset(_LEAVES)  # exactly these: a list of them (a batch's keys) is one check


class _Replace:
    def __init__(self, kind: type | tuple[type, ...], fn: Callable[[Any], Any]) -> None:
        self.kind, self.fn = kind, fn
        self.memo: dict[int, Any] = {}
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # a list of leaves holds nothing to replace, unless a leaf is itself of ``kind``
        self._leaf_lists = not any(issubclass(leaf, k) for leaf in _LEAVES for k in kinds)

    def visit(self, x: Any) -> Any:
        if isinstance(x, self.kind):
            return self.fn(x)
        if isinstance(x, _LEAVES):
            return x
        key = id(x)
        if key in self.memo:
            return self.memo[key]
        if self._leaf_lists and type(x) in (list, tuple) and _LEAF_TYPES.issuperset(map(type, x)):
            return x
        if isinstance(x, tuple):
            self.memo[key] = x  # a cycle through a tuple passes through a mutable container first
            items = [self.visit(v) for v in x]
            if all(a is b for a, b in zip(items, x)):
                return x
            new = type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
            self.memo[key] = new
            return new
        if isinstance(x, list):
            return self._rebuild(x, key, enumerate(x), new_list := copy.copy(x), new_list.__setitem__)
        if isinstance(x, dict):
            return self._rebuild(x, key, list(x.items()), new_dict := copy.copy(x), new_dict.__setitem__)
        attrs = getattr(x, "__dict__", None)
        if attrs is None:
            return x
        new_obj = copy.copy(x)
        return self._rebuild(x, key, list(attrs.items()), new_obj,
                             lambda k, v: setattr(new_obj, k, v))

    def _rebuild(self, x: Any, key: int, items: Any, new: Any, put: Callable[[Any, Any], None]) -> Any:
        """Visits ``items`` of ``x`` into its copy ``new``; returns ``x`` itself if none changed."""
        self.memo[key] = new
        changed = False
        for k, v in items:
            nv = self.visit(v)
            if nv is not v:
                put(k, nv)
                changed = True
        if not changed:
            self.memo[key] = x
            return x
        return new


def replace(obj: Any, kind: type | tuple[type, ...], fn: Callable[[Any], Any]) -> Any:
    """Returns ``obj`` with every instance of ``kind`` replaced by ``fn(instance)``.

    Lists, tuples, named tuples, dicts (and subclasses), and objects with a ``__dict__`` are
    visited; containers are rebuilt only where something inside changed; shared and cyclic
    structure is kept (each object is visited once).
    """
    return _Replace(kind, fn).visit(obj)


def collect(obj: Any, kind: type | tuple[type, ...]) -> list[Any]:
    """Every instance of ``kind`` inside ``obj``, in traversal order."""
    found: list[Any] = []

    def note(x: Any) -> Any:
        found.append(x)
        return x

    replace(obj, kind, note)
    return found
