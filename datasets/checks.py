"""Checks: cheap header checks that keep corrupt or dangerous bytes away from the servers.

They look at a few bytes: the format's signature, a PNG's or JPEG's declared size (an image that
claims to be 100,000 x 100,000 pixels would make the decoder allocate tens of gigabytes), and
whether a WAV file holds any audio frames. They cannot see corruption inside compressed data;
the decoder reports that (see docs/reliability.md).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

__all__ = ["MAX_PIXELS", "SIGNATURES", "check_header", "image_size"]

MAX_PIXELS = 64 * 2**20  # 64 megapixels
Data = bytes | memoryview  # a field: bytes, or a view of a mapped shard


def _wav(b: Data) -> bool:
    return len(b) >= 12 and b[:4] in (b"RIFF", b"RIFX") and b[8:12] == b"WAVE"


SIGNATURES: dict[str, Callable[[Data], bool]] = {
    "jpg": lambda b: b[:3] == b"\xff\xd8\xff",
    "jpeg": lambda b: b[:3] == b"\xff\xd8\xff",
    "png": lambda b: b[:8] == b"\x89PNG\r\n\x1a\n",
    "wav": _wav,
    "flac": lambda b: b[:4] == b"fLaC",
    "ogg": lambda b: b[:4] == b"OggS",
    "webp": lambda b: b[:4] == b"RIFF" and b[8:12] == b"WEBP",
}
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def image_size(ext: str, data: Data) -> tuple[int, int] | None:
    """(width, height) a PNG or JPEG header declares, or None when it cannot be read cheaply."""
    if ext == "png" and len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        return width, height
    if ext in ("jpg", "jpeg"):
        i = 2
        while i + 9 < len(data) and i < 1 << 20:
            if data[i] != 0xFF:
                return None
            marker = data[i + 1]
            if marker == 0xFF:
                i += 1
                continue
            (length,) = struct.unpack(">H", data[i + 2:i + 4])
            if marker in _SOF:
                height, width = struct.unpack(">HH", data[i + 5:i + 9])
                return width, height
            i += 2 + length
    return None


def _wav_frames(data: Data) -> int | None:
    """Bytes in a WAV file's data chunk, or None if the chunk is not found in the header."""
    i = 12
    while i + 8 <= len(data) and i < 1 << 16:
        chunk, size = data[i:i + 4], struct.unpack("<I", data[i + 4:i + 8])[0]
        if chunk == b"data":
            return min(size, len(data) - i - 8)
        i += 8 + size + (size & 1)
    return None


def check_header(ext: str, data: Data, max_pixels: int = MAX_PIXELS) -> str | None:
    """Returns why ``data`` is not a usable ``ext`` file, or None if it looks right."""
    if not data:
        return "is empty"
    ext = ext.lower()
    check = SIGNATURES.get(ext)
    if check is not None and not check(data[:16]):
        return f"does not start with a {ext.upper()} signature (first bytes {bytes(data[:8])!r})"
    size = image_size(ext, data)
    if size is not None:
        width, height = size
        if width == 0 or height == 0:
            return f"declares an empty image ({width}x{height})"
        if width * height > max_pixels:
            return f"declares {width}x{height} pixels, more than max_pixels={max_pixels}"
    if ext == "wav" and _wav_frames(data) == 0:
        return "holds no audio frames"
    return None
