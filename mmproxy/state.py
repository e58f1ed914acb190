"""Loader state: where a loader stands in its epoch, as one versioned, typed value.

:class:`LoaderState` is what :meth:`mmproxy.DataLoader.state_dict` returns (as a plain dict, by
:meth:`LoaderState.to_dict`, so that ``torch.load(weights_only=True)`` reads it) and what
``load_state_dict`` takes back (:meth:`LoaderState.from_dict`). The dataset's part is one value
per worker, kept as the dataset stamped it (:func:`mmproxy.worker.stamp`): the loader carries it
and never reads inside it. :class:`ResumePoint` is what one worker is handed on a resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mmproxy.errors import StateError

__all__ = ["LoaderState", "ResumePoint", "VERSION"]

VERSION = 2


@dataclass(frozen=True)
class ResumePoint:
    """Where one worker starts an epoch on a resume.

    Attributes:
        epoch: The epoch it resumes.
        worker: The worker whose samples it reads (the loader may hand one worker's position to
            another, to keep the order of batches).
        state: That worker's last stamped dataset state, or None for its start.
    """

    epoch: int
    worker: int
    state: Any = None


@dataclass
class LoaderState:
    """Where one rank's loader stands.

    Attributes:
        epoch: The epoch (1, 2, ...; 0 before the first).
        done: The epoch was read to its end (a resume starts the next one).
        rank: The rank that saved it.
        world: The number of ranks then.
        workers: The loader's workers (at least 1).
        batches: Batches delivered in this epoch.
        next: The worker whose item torch's round-robin takes next.
        positions: Per worker, the dataset's state after the last item taken from it (opaque).
        report: The epoch's skip report so far (:meth:`mmproxy.SkipReport.state_dict`).
    """

    epoch: int
    done: bool
    rank: int = 0
    world: int = 1
    workers: int = 1
    batches: int = 0
    next: int = 0
    positions: dict[int, Any] = field(default_factory=dict)
    report: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"version": VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, state: Any) -> LoaderState:
        """The state a :meth:`to_dict` of this version gave; anything else raises
        :class:`~mmproxy.errors.StateError`, saying what it is not."""
        if not isinstance(state, Mapping):
            raise StateError(f"not a state of an mmproxy.DataLoader: a {type(state).__name__}")
        version = state.get("version")
        if version != VERSION:
            raise StateError(f"not a state of this mmproxy.DataLoader (version {VERSION}): its "
                             f"version is {version!r}")
        known = {"version", *cls.__dataclass_fields__}
        unknown = sorted(set(state) - known)
        missing = sorted({"epoch", "done"} - set(state))
        if unknown or missing:
            raise StateError(f"not a state of this mmproxy.DataLoader (version {VERSION}): "
                             f"unknown keys {unknown}, missing keys {missing}")
        values = {k: v for k, v in state.items() if k != "version"}
        values["positions"] = {int(w): p for w, p in (values.get("positions") or {}).items()}
        return cls(**values)
