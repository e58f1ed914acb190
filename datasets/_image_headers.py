"""Image headers: the size a PNG or JPEG declares, and a JPEG's or PNG's damage, from a few bytes.

A JPEG's header is walked marker by marker up to its first scan: a file that ends inside it, a
malformed Huffman table, or data where a marker belongs is refused there (DALI's image decoders
can crash the whole process on the last two), and a JPEG without an end-of-image marker after
its scan, or a PNG without its ``IEND`` chunk, is cut short. The cost is the header walk and,
for a good file, a look at its last bytes.
"""

from __future__ import annotations

import struct

__all__ = ["image_size", "image_truncated"]

_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


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


def _jpeg_scan(data: bytes | memoryview) -> int | None:
    """Offset of a JPEG's first start-of-scan marker; -1 when the file ends before it; -2 when a
    Huffman table is malformed; -3 when a byte other than a marker stands where the next marker
    belongs; None when the headers are too long to walk cheaply."""
    i = 2
    while i < 1 << 22:
        if i + 4 > len(data):
            return -1
        if data[i] != 0xFF:
            return -3
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker == 0xDA:
            return i
        (length,) = struct.unpack(">H", data[i + 2:i + 4])
        if i + 2 + length > len(data):
            return -1
        if marker == 0xC4 and not _huffman_tables_ok(data[i + 4:i + 2 + length]):
            return -2
        i += 2 + length
    return None


def _huffman_tables_ok(segment: bytes | memoryview) -> bool:
    """Whether a DHT segment holds well-formed tables: class 0/1, id 0-3, at most 256 codes each."""
    at = 0
    while at < len(segment):
        if at + 17 > len(segment):
            return False
        kind = segment[at]
        counts = sum(segment[at + 1:at + 17])
        if kind >> 4 > 1 or kind & 0x0F > 3 or counts > 256:
            return False
        at += 17 + counts
    return at == len(segment)


def image_truncated(ext: str, data: bytes | memoryview) -> str | None:
    """Why a JPEG or PNG looks cut short (its end marker is missing) or, for a JPEG, why its
    header is malformed; None when neither (or for other formats)."""
    if ext in ("jpg", "jpeg"):
        scan = _jpeg_scan(data)
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
    elif ext == "png":
        if data[-8:-4] == b"IEND" or bytes(data).rfind(b"IEND") >= 0:
            return None
        return "is truncated (no IEND chunk)"
    return None
