"""Walking nested structures: find or replace references inside any nesting, cycles included."""

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


def replace(obj: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """Returns ``obj`` with every instance of ``kind`` replaced by ``fn(instance)``.

    Lists, tuples, named tuples, dicts (and subclasses), and objects with a ``__dict__`` are
    visited; containers are rebuilt only where something inside changed; shared and cyclic
    structure is kept (each object is visited once).
    """
    memo: dict[int, Any] = {}

    def visit(x: Any) -> Any:
        if isinstance(x, kind):
            return fn(x)
        if isinstance(x, _LEAVES):
            return x
        key = id(x)
        if key in memo:
            return memo[key]
        if isinstance(x, tuple):
            memo[key] = x  # a cycle through a tuple passes through a mutable container first
            items = [visit(v) for v in x]
            if all(a is b for a, b in zip(items, x)):
                return x
            new = type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
            memo[key] = new
            return new
        if isinstance(x, list):
            new_list = copy.copy(x)
            memo[key] = new_list
            changed = False
            for i, v in enumerate(x):
                nv = visit(v)
                if nv is not v:
                    new_list[i] = nv
                    changed = True
            if not changed:
                memo[key] = x
                return x
            return new_list
        if isinstance(x, dict):
            new_dict = copy.copy(x)
            memo[key] = new_dict
            changed = False
            for k, v in x.items():
                nv = visit(v)
                if nv is not v:
                    new_dict[k] = nv
                    changed = True
            if not changed:
                memo[key] = x
                return x
            return new_dict
        attrs = getattr(x, "__dict__", None)
        if attrs is None:
            return x
        new_obj = copy.copy(x)
        memo[key] = new_obj
        changed = False
        for k, v in list(attrs.items()):
            nv = visit(v)
            if nv is not v:
                setattr(new_obj, k, nv)
                changed = True
        if not changed:
            memo[key] = x
            return x
        return new_obj

    return visit(obj)


def collect(obj: Any, kind: type) -> list[Any]:
    """Every instance of ``kind`` inside ``obj``, in traversal order."""
    found: list[Any] = []

    def note(x: Any) -> Any:
        found.append(x)
        return x

    replace(obj, kind, note)
    return found
