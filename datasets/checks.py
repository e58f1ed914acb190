"""Checks: cheap header checks that keep corrupt bytes away from the servers."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["SIGNATURES", "check_header"]


def _wav(b: bytes) -> bool:
    return len(b) >= 12 and b[:4] in (b"RIFF", b"RIFX") and b[8:12] == b"WAVE"


SIGNATURES: dict[str, Callable[[bytes], bool]] = {
    "jpg": lambda b: b[:3] == b"\xff\xd8\xff",
    "jpeg": lambda b: b[:3] == b"\xff\xd8\xff",
    "png": lambda b: b[:8] == b"\x89PNG\r\n\x1a\n",
    "wav": _wav,
    "flac": lambda b: b[:4] == b"fLaC",
    "ogg": lambda b: b[:4] == b"OggS",
    "webp": lambda b: b[:4] == b"RIFF" and b[8:12] == b"WEBP",
}


def check_header(ext: str, data: bytes) -> str | None:
    """Returns why ``data`` is not a valid ``ext`` file, or None if it looks right."""
    if not data:
        return "is empty"
    check = SIGNATURES.get(ext.lower())
    if check is not None and not check(data[:16]):
        return f"does not start with a {ext.upper()} signature (first bytes {data[:8]!r})"
    return None
