"""Checks: cheap header checks that keep corrupt or dangerous bytes away from the servers.
docs/internals.md, ``mmproxy.media.checks``, has the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from mmproxy.media.audio import ogg_cut, wav_problem
from mmproxy.media.image import (
    image_size,
    jpeg_header,
    jpeg_orientation,
    jpeg_truncated,
    png_truncated,
    tiff_problem,
)
from mmproxy.media.video import VIDEO_EXTS, VideoInfo, video_cut, video_info, video_problem

__all__ = ["MAX_PIXELS", "SIGNATURES", "VIDEO_EXTS", "VideoInfo", "check_header", "image_size",
           "jpeg_orientation", "video_cut", "video_info"]

MAX_PIXELS = 64 * 2**20  # 64 megapixels
Data = bytes | memoryview  # a field: bytes, or a view of a mapped shard


def _wav(b: Data) -> bool:  # RIFF, big-endian RIFX, and RF64 (64-bit sizes in a ds64 chunk)
    return len(b) >= 12 and b[:4] in (b"RIFF", b"RIFX", b"RF64") and b[8:12] == b"WAVE"


_TIFF = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # little / big endian, classic / BigTIFF
_JPEG = b"\xff\xd8\xff"
SIGNATURES: dict[str, Callable[[Data], bool]] = {
    "jpg": lambda b: b[:3] == _JPEG,
    "jpeg": lambda b: b[:3] == _JPEG,
    "png": lambda b: b[:8] == b"\x89PNG\r\n\x1a\n",
    "wav": _wav,
    "flac": lambda b: b[:4] == b"fLaC",
    "ogg": lambda b: b[:4] == b"OggS",
    "webp": lambda b: b[:4] == b"RIFF" and b[8:12] == b"WEBP",
    "bmp": lambda b: b[:2] == b"BM",
    "tif": lambda b: b[:4] in _TIFF,
    "tiff": lambda b: b[:4] in _TIFF,
}
_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")


def _image_format(data: Data) -> str | None:
    """The image format ``data`` starts with (decoders go by the bytes, not the name)."""
    head = data[:16]
    return next((ext for ext in ("jpg", "png", "webp", "bmp", "tiff") if SIGNATURES[ext](head)),
                None)


def _size_problem(size: tuple[int, int] | None, max_pixels: int) -> str | None:
    if size is None:
        return None
    width, height = size
    if width == 0 or height == 0:
        return f"declares an empty image ({width}x{height})"
    if width * height > max_pixels:
        return f"declares {width}x{height} pixels, more than max_pixels={max_pixels}"
    return None


def check_header(ext: str, data: Data, max_pixels: int = MAX_PIXELS) -> str | None:
    """Returns why ``data`` is not a usable ``ext`` file, or None if it looks right."""
    if not data:
        return "is empty"
    ext = ext.lower()
    if ext in VIDEO_EXTS:
        return video_problem(data)
    if ext in _IMAGE_EXTS:  # a PNG named .jpg decodes: check it as what it is
        if data[:3] == _JPEG:  # one walk for its size and damage
            scan, size = jpeg_header(data)
            return _size_problem(size, max_pixels) or jpeg_truncated(data, scan)
        ext = _image_format(data) or ext
    check = SIGNATURES.get(ext)
    if check is not None and not check(data[:16]):
        return f"does not start with a {ext.upper()} signature (first bytes {bytes(data[:8])!r})"
    problem = _size_problem(image_size(ext, data), max_pixels)
    if problem:
        return problem
    if ext == "wav":
        return wav_problem(data)
    if ext == "ogg":
        return ogg_cut(data)
    if ext == "png":
        return png_truncated(data)
    if ext in ("tif", "tiff"):
        return tiff_problem(data)
    return None
