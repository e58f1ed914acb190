"""Image headers: the size a PNG or JPEG declares, and a JPEG's or PNG's damage, from a few bytes.

A JPEG's header is walked marker by marker up to its first scan: a file that ends inside it, a
malformed Huffman table, or data where a marker belongs is refused there (DALI's image decoders
can crash the whole process on the last two), and a JPEG without an end-of-image marker after
its scan, or a PNG without its ``IEND`` chunk, is cut short. The cost is one walk over the
JPEG's markers, which finds its declared size too, and, for a good file, a look at its last
bytes.
"""

from __future__ import annotations

import struct
from zlib import adler32

__all__ = ["image_size", "jpeg_header", "jpeg_truncated", "png_truncated"]

_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def image_size(ext: str, data: bytes | memoryview) -> tuple[int, int] | None:
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


def jpeg_header(data: bytes | memoryview) -> tuple[int | None, tuple[int, int] | None]:
    """(scan, size) of a JPEG from one walk over its markers: ``scan`` is the offset of its
    first start-of-scan marker, -1 when the file ends before it, -2 when a Huffman table is
    malformed, -3 when a byte other than a marker stands where the next marker belongs, None
    when the headers are too long to walk cheaply; ``size`` is what :func:`image_size` says."""
    n = len(data)
    size = None
    sizing = True  # the walk is where image_size's would be, and it has found no size yet
    marker_at, watched = _MARKER.unpack_from, _WATCHED
    i = 2
    while i < 1 << 22:
        try:
            mark, marker, length = marker_at(data, i)
        except struct.error:  # fewer than 4 bytes left
            return -1, None if sizing else size
        if sizing and (i + 9 >= n or i >= 1 << 20):
            sizing = False  # image_size stops here, with no size
        if mark != 0xFF:
            return -3, None if sizing else size
        if marker in watched:
            if marker == 0xFF:
                i += 1
                continue
            if marker == 0xDA:  # a scan before any size: image_size walks on past it
                return i, image_size("jpg", data) if sizing else size
            if sizing and marker in _SOF:
                height, width = _SIZE.unpack_from(data, i + 5)
                size, sizing = (width, height), False
        end = i + 2 + length
        if end > n:
            return -1, None if sizing else size
        if marker == 0xC4 and not (  # one table that fills the segment, or each table in turn
                19 <= length <= 275 and data[i + 4] in _TABLE_KINDS
                and adler32(data[i + 5:i + 21]) & 0xFFFF == length - 18
                or _huffman_tables_ok(data, i + 4, max(i + 4, end))):
            return -2, image_size("jpg", data) if sizing else size
        i = end
    return None, size


_WATCHED = _SOF | {0xFF, 0xDA}  # fill bytes, the scan, the frames that hold the size
_TABLE_KINDS = frozenset(range(4)) | frozenset(range(0x10, 0x14))  # a Huffman table's class, id
_MARKER = struct.Struct(">BBH")
_SIZE = struct.Struct(">HH")


def _huffman_tables_ok(data: bytes | memoryview, at: int, end: int) -> bool:
    """Whether the DHT segment ``data[at:end]`` holds well-formed tables: class 0/1, id 0-3, at
    most 256 codes each. The 16 code counts of a table are summed by zlib's Adler-32, whose low
    half is one plus the bytes' sum (at most 4,080, far below its modulus); :func:`jpeg_header`
    does the same inline for a segment of one table."""
    while at < end:
        if at + 17 > end:
            return False
        kind = data[at]
        counts = (adler32(data[at + 1:at + 17]) & 0xFFFF) - 1
        if kind >> 4 > 1 or kind & 0x0F > 3 or counts > 256:
            return False
        at += 17 + counts
    return at == end


def jpeg_truncated(data: bytes | memoryview, scan: int | None) -> str | None:
    """Why a JPEG whose :func:`jpeg_header` found ``scan`` looks cut short or has a malformed
    header; None when neither."""
    if scan == -1:
        return "is truncated (it ends inside its header)"
    if scan == -2:
        return "has a malformed Huffman table"
    if scan == -3:
        return "has a malformed header (data where a marker belongs, before the image data)"
    if data[-2:] == b"\xff\xd9":
        return None
    if scan is not None and bytes(data[scan:]).rfind(b"\xff\xd9") < 0:
        return "is truncated (no end-of-image marker after its image data)"
    return None


def png_truncated(data: bytes | memoryview) -> str | None:
    """Why a PNG looks cut short (no ``IEND`` chunk), or None."""
    if data[-8:-4] == b"IEND" or bytes(data).rfind(b"IEND") >= 0:
        return None
    return "is truncated (no IEND chunk)"
