"""Image headers: the size a PNG, JPEG or TIFF declares, and a JPEG's or PNG's damage or a
TIFF's variant, from a few bytes.

A JPEG's header is walked marker by marker up to its first scan: a file that ends inside it, a
malformed Huffman table, or data where a marker belongs is refused there (DALI's image decoders
can crash the whole process on the last two), and a JPEG without an end-of-image marker after
its scan, or a PNG without its ``IEND`` chunk, is cut short. The cost is one walk over the
JPEG's markers, which finds its declared size too, and, for a good file, a look at its last
bytes.
"""

from __future__ import annotations

import struct
from typing import Any
from zlib import adler32

from mmproxy.media import Unread

__all__ = ["image_size", "jpeg_header", "jpeg_orientation", "jpeg_truncated", "png_truncated", "tiff_info",
           "tiff_problem"]

_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def image_size(ext: str, data: bytes | memoryview) -> tuple[int, int] | None:
    """(width, height) a PNG or JPEG header declares, or None when it cannot be read cheaply."""
    if ext == "png" and len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        return width, height
    if ext in ("tif", "tiff"):
        info = tiff_info(data)
        if isinstance(info, dict) and "width" in info and "height" in info:
            return int(info["width"]), int(info["height"])
        return None
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


def jpeg_orientation(data: bytes | memoryview) -> int:
    """The EXIF Orientation a JPEG declares (1-8; 1, as stored, when it has none or the EXIF
    block cannot be read). 5-8 turn the image a quarter: DALI's decoders give it with its width
    and height swapped."""
    i, n = 2, min(len(data), 1 << 20)
    while i + 4 <= n and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker == 0xDA or marker in _SOF:  # the EXIF block comes before the frame
            return 1
        (length,) = struct.unpack_from(">H", data, i + 2)
        if marker == 0xE1 and bytes(data[i + 4:i + 10]) == b"Exif\0\0":
            return _exif_orientation(data[i + 10:min(n, i + 2 + length)])
        i += 2 + length
    return 1


def _exif_orientation(tiff: bytes | memoryview) -> int:
    """The Orientation tag (0x0112) of an EXIF block's first directory, or 1."""
    order = {b"II": "<", b"MM": ">"}.get(bytes(tiff[:2]))
    if order is None or len(tiff) < 8:
        return 1
    (ifd,) = struct.unpack_from(order + "I", tiff, 4)
    if ifd + 2 > len(tiff):
        return 1
    (count,) = struct.unpack_from(order + "H", tiff, ifd)
    for k in range(count):
        at = ifd + 2 + 12 * k
        if at + 12 > len(tiff):
            return 1
        tag, kind = struct.unpack_from(order + "HH", tiff, at)
        if tag == 0x0112 and kind == 3:  # a SHORT
            (value,) = struct.unpack_from(order + "H", tiff, at + 8)
            return value if 1 <= value <= 8 else 1
    return 1


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
            if marker in _STANDALONE:  # a stuffed zero, a restart or an image's start or end
                return -3, None if sizing else size
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


# Markers that have no segment and cannot stand before the first scan: a stuffed zero (FF00,
# which DALI 2.4's CPU decoder crashed on), TEM, the restarts, a second start of image, the end
_STANDALONE = frozenset({0x00, 0x01, *range(0xD0, 0xDA)})
_WATCHED = _SOF | _STANDALONE | {0xFF, 0xDA}  # those, fill bytes, the scan, the size's frames
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


# the integer field types a TIFF tag here may have (BYTE, SHORT, LONG, LONG8 and, as libtiff
# takes them too, their signed forms): their struct codes
_TIFF_TYPES = {1: "B", 3: "H", 4: "I", 16: "Q", 6: "b", 8: "h", 9: "i", 17: "q"}
_TIFF_TAGS = {256: "width", 257: "height", 258: "bits", 259: "compression", 277: "samples",
              284: "planar", 339: "sample_format"}
# The compression schemes DALI 2.4's CPU decoders read (on libtiff): none, CCITT (2-4), LZW,
# old-style and new JPEG, Deflate, PackBits. LZMA and WebP fail every batch that holds one.
_TIFF_COMPRESSIONS = frozenset({1, 2, 3, 4, 5, 6, 7, 8, 32773, 32946})


def tiff_info(data: bytes | memoryview) -> dict[str, Any] | str:
    """The first image's width, height, bits per sample, compression, samples per pixel, planar
    configuration and sample format that a TIFF's header (classic or BigTIFF) gives, or why it
    cannot be read."""
    n = len(data)
    if n < 16:
        return "is truncated (it ends inside its header)"
    order = "<" if bytes(data[:2]) == b"II" else ">"
    big = struct.unpack_from(order + "H", data, 2)[0] == 43
    if big and struct.unpack_from(order + "H", data, 4)[0] != 8:
        return "has a malformed BigTIFF header (offsets not of 8 bytes)"
    count_at, entry, offset = (("Q", 20, "Q") if big else ("H", 12, "I"))
    at = struct.unpack_from(order + offset, data, 8 if big else 4)[0]
    head = 8 if big else 2
    if at < 8 or at + head > n:
        return f"has its first image's header at byte {at}, outside the file (damaged?)"
    entries = struct.unpack_from(order + count_at, data, at)[0]
    if entries == 0 or entries > 4096 or at + head + entries * entry > n:  # libtiff's limit
        return f"has a malformed or truncated image header ({entries} entries at byte {at})"
    info: dict[str, Any] = {}
    for k in range(entries):
        e = at + head + k * entry
        tag, kind = struct.unpack_from(order + "HH", data, e)
        name = _TIFF_TAGS.get(tag)
        if name is None:
            continue
        code = _TIFF_TYPES.get(kind)
        count = struct.unpack_from(order + ("Q" if big else "I"), data, e + 4)[0]
        if code is None or count == 0 or count > 64:
            return f"has a malformed {name} field (type {kind}, {count} values)"
        size = struct.calcsize(code)
        field = e + (12 if big else 8)
        if size * count > (8 if big else 4):  # the values lie elsewhere
            field = struct.unpack_from(order + offset, data, field)[0]
            if field + size * count > n:
                return f"has its {name} field outside the file (damaged?)"
        values = struct.unpack_from(f"{order}{count}{code}", data, field)
        if min(values) < 0:  # a signed type's
            return f"has a malformed {name} field (the value {min(values)})"
        info[name] = values if name == "bits" else values[0]
    return info


def tiff_problem(data: bytes | memoryview) -> str | None:
    """Why DALI's decoders would not read a TIFF, or could crash on it, or None.

    DALI 2.4's CPU decoder crashed the whole process (a batch of 32 holding one such file, in
    its first run or after the pipeline was rebuilt) on samples of more than 16 bits (32-bit
    integers, 32- and 64-bit floats), on 65,535 samples a pixel (more than 16 are refused; 5
    decode), on a stuffed zero in a JPEG's header (:func:`jpeg_header`), and on an old-style
    JPEG TIFF whose header lists three bits-per-sample values and no samples a pixel; it raised
    on signed samples, 2- to 7-bit ones, LZMA and WebP compression and a header that points
    outside the file; its samples of more than 8 bits stored in planes apart (planar
    configuration 2) it decoded into noise, silently, different on every run. It read 1-, 8-,
    12- and 16-bit samples, palettes, CMYK, CIELab, 8-bit samples in planes apart, several pages
    (the first), CCITT, LZW, Deflate, PackBits and both JPEG schemes (Pillow's and
    scikit-image's test images)."""
    info = tiff_info(data)
    if isinstance(info, str):
        return info
    if "width" not in info or "height" not in info:
        return "has no image size in its header"
    samples = int(info.get("samples", 1))
    listed = info.get("bits", (1,))
    if "samples" not in info and len(listed) > 1:  # crashed DALI (old-style JPEG, Pillow's)
        return (f"has a malformed header ({len(listed)} bits-per-sample values and no samples "
                "a pixel)")
    bits = set(listed)
    compression = int(info.get("compression", 1))
    planar = int(info.get("planar", 1))
    variant = (
        f"{samples} samples a pixel" if not 1 <= samples <= 16 else
        f"{'/'.join(map(str, sorted(bits)))}-bit samples" if bits - {1, *range(8, 17)} else
        "signed or floating-point samples" if int(info.get("sample_format", 1)) != 1 else
        f"planar configuration {planar}" if planar not in (1, 2) else
        f"{'/'.join(map(str, sorted(bits)))}-bit samples in planes apart"
        if planar == 2 and samples > 1 and max(bits) > 8 else
        f"compression scheme {compression}" if compression not in _TIFF_COMPRESSIONS else None)
    return Unread(f"is a TIFF variant DALI does not read ({variant})") if variant else None
