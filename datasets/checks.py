"""Checks: cheap header checks that keep corrupt or dangerous bytes away from the servers.

They look at a few bytes: the format's signature, a PNG's or JPEG's declared size (an image that
claims to be 100,000 x 100,000 pixels would make the decoder allocate tens of gigabytes), whether a
WAV file has a sound ``fmt `` chunk and any audio frames, and whether a JPEG, PNG, OGG, WAV or
video was cut short (the most common damage in web-scale corpora: an interrupted download). A
JPEG without an end-of-image marker after its first scan, or a PNG without its ``IEND`` chunk,
fails DALI's decoders every time, an OGG whose last page does not end the stream decodes to
nothing, and a video whose container declares more bytes than follow decodes to fewer frames
than its header promises, so catching them here saves the server a failed run (or a clip of
made-up frames); a good file pays for a look at its last bytes or its top-level boxes.
Trailing bytes after the end marker are allowed (decoders ignore them).

The JPEG header walk also refuses a malformed Huffman table and data where a marker belongs:
DALI 2.4's image decoders (CPU and GPU) can crash the whole process on such files when a batch
of 64 or more holds one (``benchmarks/dali_decoder_crash.py`` shows it without mmproxy), so
they must never reach a pipeline. No check sees other corruption inside compressed data; the
server finds those samples when the pipeline fails on them (see docs/reliability.md).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import NamedTuple, cast

__all__ = ["MAX_PIXELS", "SIGNATURES", "VIDEO_EXTS", "VideoInfo", "check_header", "image_size",
           "video_cut", "video_info"]

MAX_PIXELS = 64 * 2**20  # 64 megapixels
Data = bytes | memoryview  # a field: bytes, or a view of a mapped shard


def _wav(b: Data) -> bool:
    return len(b) >= 12 and b[:4] in (b"RIFF", b"RIFX") and b[8:12] == b"WAVE"


_TIFF = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # little / big endian, classic / BigTIFF
SIGNATURES: dict[str, Callable[[Data], bool]] = {
    "jpg": lambda b: b[:3] == b"\xff\xd8\xff",
    "jpeg": lambda b: b[:3] == b"\xff\xd8\xff",
    "png": lambda b: b[:8] == b"\x89PNG\r\n\x1a\n",
    "wav": _wav,
    "flac": lambda b: b[:4] == b"fLaC",
    "ogg": lambda b: b[:4] == b"OggS",
    "webp": lambda b: b[:4] == b"RIFF" and b[8:12] == b"WEBP",
    "bmp": lambda b: b[:2] == b"BM",
    "tif": lambda b: b[:4] in _TIFF,
    "tiff": lambda b: b[:4] in _TIFF,
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


def _jpeg_scan(data: Data) -> int | None:
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


def _huffman_tables_ok(segment: Data) -> bool:
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


def _truncated(ext: str, data: Data) -> str | None:
    """Why a JPEG, PNG or OGG looks cut short (its end marker is missing) or, for a JPEG, why its
    header is malformed; None when neither."""
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
    elif ext == "ogg":  # the last page of a stream carries the end-of-stream flag
        tail = bytes(data[-65536:])
        last = tail.rfind(b"OggS")
        if last < 0 or last + 6 > len(tail) or not tail[last + 5] & 0x04:
            return "is truncated (its last page does not end the stream)"
    elif ext == "png":
        if data[-8:-4] == b"IEND" or bytes(data).rfind(b"IEND") >= 0:
            return None
        return "is truncated (no IEND chunk)"
    return None


def _wav_chunks(data: Data) -> Iterator[tuple[bytes, int, int]]:
    """(chunk id, size, offset of its body) of a WAV file's chunks, up to the ``data`` chunk, in
    the file's byte order (RIFX is big-endian); stops quietly after the first 1 MiB."""
    order = ">I" if bytes(data[:4]) == b"RIFX" else "<I"
    i = 12
    while i + 8 <= len(data) and i < 1 << 20:
        chunk, size = bytes(data[i:i + 4]), struct.unpack(order, data[i + 4:i + 8])[0]
        yield chunk, size, i + 8
        if chunk == b"data":
            return
        i += 8 + size + (size & 1)


_PCM_TAGS = (1, 3, 0xFFFE)  # integer PCM, IEEE float, extensible: bits per sample must be set


def _wav_format(data: Data) -> str | None:
    """What is wrong with a WAV file's ``fmt `` chunk, or None when it is sound (or not found
    within the part of the header that is read)."""
    big = bytes(data[:4]) == b"RIFX"
    end = 12
    for chunk, size, body in _wav_chunks(data):
        end = body + size + (size & 1)
        if chunk == b"fmt ":
            if size < 16 or body + 16 > len(data):
                return f"has a malformed 'fmt ' chunk ({size} bytes)"
            tag, channels, rate = struct.unpack(">HHI" if big else "<HHI", data[body:body + 8])
            bits = struct.unpack(">H" if big else "<H", data[body + 14:body + 16])[0]
            bits_ok = 0 < bits <= 64 or (tag not in _PCM_TAGS and bits == 0)  # e.g. GSM 6.10
            if not (0 < channels <= 256 and 0 < rate <= 10_000_000 and bits_ok):
                return (f"has a malformed 'fmt ' chunk ({channels} channels, {rate} Hz, "
                        f"{bits} bits per sample)")
            return None
        if chunk == b"data":
            return "has no 'fmt ' chunk before its audio data"
    if end < len(data) and end >= 1 << 20:
        return None  # the header goes on past what is read: not known
    return "has no 'fmt ' chunk (its chunks run past the end of the file)"


_OPEN_ENDED = (0xFFFFFFFF, 0x7FFFFFFF)  # a streaming writer's data size: "to the end of the file"


def _wav_cut(data: Data) -> str | None:
    """Why a WAV file looks cut short (its data chunk declares more bytes than follow), or None."""
    for chunk, size, body in _wav_chunks(data):
        if chunk == b"data":
            there = len(data) - body
            if size > there and size not in _OPEN_ENDED:
                return f"is truncated (its data chunk declares {size} bytes, {there} follow)"
            return None
    return None


def _wav_frames(data: Data) -> int | None:
    """Bytes in a WAV file's data chunk, or None if the chunk is not found in the header."""
    for chunk, size, body in _wav_chunks(data):
        if chunk == b"data":
            return min(size, len(data) - body)
    return None


_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")


def _image_format(data: Data) -> str | None:
    """The image format ``data`` starts with (decoders go by the bytes, not the name)."""
    head = data[:16]
    return next((ext for ext in ("jpg", "png", "webp", "bmp", "tiff") if SIGNATURES[ext](head)),
                None)


VIDEO_EXTS = ("mp4", "m4v", "mov", "webm", "mkv", "avi")


class VideoInfo(NamedTuple):
    """What a video's container says: ``container`` ("mp4", "matroska" or "avi"), the video
    ``codec`` ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg"; None when not found) and the
    number of ``frames`` (None when the container does not say it cheaply: Matroska / WebM)."""

    container: str
    codec: str | None
    frames: int | None


_MP4_CODECS = {b"avc1": "h264", b"avc3": "h264", b"hvc1": "hevc", b"hev1": "hevc",
               b"vp09": "vp9", b"vp08": "vp8", b"av01": "av1", b"mp4v": "mpeg4",
               b"jpeg": "mjpeg", b"mjpa": "mjpeg", b"mjpb": "mjpeg"}
_MKV_CODECS = {b"V_MPEG4/ISO/AVC": "h264", b"V_MPEGH/ISO/HEVC": "hevc", b"V_VP9": "vp9",
               b"V_VP8": "vp8", b"V_AV1": "av1", b"V_MJPEG": "mjpeg", b"V_MPEG4/ISO/": "mpeg4"}
_AVI_CODECS = {b"mjpg": "mjpeg", b"h264": "h264", b"avc1": "h264", b"xvid": "mpeg4",
               b"divx": "mpeg4", b"fmp4": "mpeg4", b"vp80": "vp8", b"vp90": "vp9"}
_MP4_PARENTS = {b"moov", b"trak", b"mdia", b"minf", b"stbl"}
_MP4_TOP = {b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot", b"uuid"}


def _mp4_boxes(data: Data, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
    """(type, payload start, payload end) of the boxes in ``data[start:end]``."""
    at = start
    while at + 8 <= end:
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        head = 8
        if size == 1 and at + 16 <= end:
            (size,) = struct.unpack(">Q", data[at + 8:at + 16])
            head = 16
        elif size == 0:
            size = end - at
        if size < head:
            return
        yield bytes(kind), at + head, min(at + size, end)
        at += size


def _mp4_video(data: Data, start: int, end: int, found: dict[str, object], depth: int = 0) -> None:
    """Fills ``found`` with the first video track's codec and sample count."""
    if depth > 8:  # moov/trak/mdia/minf/stbl is 5 deep; deeper is not a real file
        return
    for kind, begin, stop in _mp4_boxes(data, start, end):
        if kind == b"trak":
            track: dict[str, object] = {}
            _mp4_video(data, begin, stop, track, depth + 1)
            if track.get("handler") == b"vide" and "codec" not in found:
                found.update(track)
        elif kind in _MP4_PARENTS:
            _mp4_video(data, begin, stop, found, depth + 1)
        elif kind == b"hdlr" and stop - begin >= 12:  # the media's (mdia) handler comes first;
            found.setdefault("handler", bytes(data[begin + 8:begin + 12]))  # QuickTime adds more
        elif kind == b"stsd" and stop - begin >= 16:
            fourcc = bytes(data[begin + 12:begin + 16])
            found["codec"] = _MP4_CODECS.get(fourcc.lower(), fourcc.decode("latin-1").strip())
        elif kind == b"stsz" and stop - begin >= 12:
            (found["frames"],) = struct.unpack(">I", data[begin + 8:begin + 12])
        if kind in (b"stsz", b"stsc", b"stco", b"co64"):  # the index: where each frame lies
            found[kind.decode()] = (begin, stop)
        if kind == b"moov":
            found["moov"] = True


def video_info(data: Data) -> VideoInfo | None:
    """The container, codec and frame count of an MP4/MOV, Matroska/WebM or AVI file, from its
    header (no decoding); None when ``data`` is none of these."""
    head = bytes(data[:12])
    if head[4:8] in _MP4_TOP:
        found: dict[str, object] = {}
        _mp4_video(data, 0, len(data), found)
        frames = found.get("frames")
        return VideoInfo("mp4", found.get("codec"),  # type: ignore[arg-type]
                         frames if isinstance(frames, int) and frames > 0 else None)
    if head[:4] == b"\x1aE\xdf\xa3":
        start = bytes(data[:1 << 16])
        codec = next((name for key, name in _MKV_CODECS.items() if key in start), None)
        return VideoInfo("matroska", codec, None)
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        start = bytes(data[:1 << 16])
        codec, frames = None, None
        at = start.find(b"vids")
        if at >= 0:
            codec = _AVI_CODECS.get(start[at + 4:at + 8].lower())
        at = start.find(b"avih")
        if at >= 0 and at + 28 <= len(start):
            (frames,) = struct.unpack("<I", start[at + 24:at + 28])
        return VideoInfo("avi", codec, frames or None)
    return None


_CUT = "is truncated: the file ends before the frames its header promises"


def _mp4_data_end(data: Data, index: dict[str, object]) -> int | None:
    """Where a video track's last frame ends, by its index: the last chunk's offset (``stco`` or
    ``co64``) plus the sizes (``stsz``) of the frames it holds (``stsc``); None when the index is
    incomplete."""
    def box(name: str) -> tuple[int, int, int]:  # (payload start, end, entry count)
        begin, stop = cast("tuple[int, int]", index.get(name, (0, 0)))
        count = struct.unpack(">I", data[begin + 4:begin + 8])[0] if stop - begin >= 8 else 0
        return begin + 8, stop, count

    wide = "co64" in index
    at, stop, chunks = box("co64" if wide else "stco")
    width = 8 if wide else 4
    last = at + (chunks - 1) * width
    if not chunks or last + width > stop:
        return None
    (offset,) = struct.unpack(">Q" if wide else ">I", data[last:last + width])
    at, stop, runs = box("stsc")
    if not runs or at + 12 * runs > stop:
        return None
    per_chunk = struct.unpack(">I", data[at + 12 * runs - 8:at + 12 * runs - 4])[0]
    at, stop, uniform = box("stsz")  # a size all frames share (0: each has its own), then
    if at + 4 > stop:  # the number of frames and their sizes
        return None
    (frames,) = struct.unpack(">I", data[at:at + 4])
    if uniform:
        return int(offset) + uniform * min(per_chunk, frames)
    if not 0 < per_chunk <= frames or at + 4 + 4 * frames > stop:
        return None
    first = at + 4 + 4 * (frames - per_chunk)
    return int(offset) + sum(struct.unpack(f">{per_chunk}I", data[first:first + 4 * per_chunk]))


def _mp4_cut(data: Data) -> str | None:
    """Why an MP4 looks cut short: a top-level box holding the index or frames that declares more
    bytes than follow, or a video track whose index places frames past the end of the file."""
    at = 0
    while at + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        if size == 1 and at + 16 <= len(data):
            (size,) = struct.unpack(">Q", data[at + 8:at + 16])
        elif size < 8:  # 0: the box runs to the end of the file; others are not sizes
            break
        if at + size > len(data):
            if kind not in (b"moov", b"moof", b"mdat"):  # not the index or frames: junk, maybe
                break
            name = kind.decode("latin-1")
            return f"{_CUT} (its {name!r} box declares {size:,} bytes, {len(data) - at:,} follow)"
        at += size
    track: dict[str, object] = {}
    _mp4_video(data, 0, len(data), track)
    end = _mp4_data_end(data, track)
    if end is not None and end > len(data):
        return (f"{_CUT} (its index places the video's frames up to byte {end:,}, the file has "
                f"{len(data):,} bytes)")
    return None


def _ebml_number(data: Data, at: int) -> tuple[int | None, int]:
    """The EBML variable-length number at ``at`` (an element's id or size) and its length in
    bytes; the value is None where all its bits are set (a size that is not known)."""
    length = 9 - data[at].bit_length() if at < len(data) else 9
    if length > 8 or at + length > len(data):
        return None, 9
    value = data[at] & (0xFF >> length)
    for byte in data[at + 1:at + length]:
        value = value << 8 | byte
    return (None if value == (1 << 7 * length) - 1 else value), length


_EBML_TOP = {b"\x1aE\xdf\xa3": "EBML header", b"\x18S\x80g": "Segment"}


def _matroska_cut(data: Data) -> str | None:
    """Why a Matroska/WebM file looks cut short: its EBML header or Segment (which holds every
    frame) declares more bytes than follow."""
    at = 0
    while at < len(data):
        name = _EBML_TOP.get(bytes(data[at:at + 4]))
        size, size_length = _ebml_number(data, at + 4)
        if name is None or size is None:  # something else (junk?), or a size left open
            return None
        body = at + 4 + size_length
        if body + size > len(data):
            return f"{_CUT} (its {name} declares {size:,} bytes, {len(data) - body:,} follow)"
        at = body + size
    return None


def _avi_cut(data: Data) -> str | None:
    """Why an AVI looks cut short: a top-level RIFF chunk (``AVI `` or OpenDML's ``AVIX``) that
    declares more bytes than follow."""
    at = 0
    while at + 12 <= len(data) and bytes(data[at:at + 4]) == b"RIFF":
        (size,) = struct.unpack("<I", data[at + 4:at + 8])
        if at + 8 + size > len(data):
            form = bytes(data[at + 8:at + 12]).decode("latin-1")
            return (f"{_CUT} (its RIFF {form!r} chunk declares {size:,} bytes, "
                    f"{len(data) - at - 8:,} follow)")
        at += 8 + size + (size & 1)
    return None


def video_cut(data: Data) -> str | None:
    """Why an MP4/MOV, Matroska/WebM or AVI file looks cut short, from the sizes its container
    declares (and, for MP4, where its index places the video's frames); None when it does not,
    or when ``data`` is none of these. A cut file decodes to fewer frames than its header
    promises: decoders stop early or repeat the last frame they have, so it is a damaged sample,
    not a short video. The cost is a walk over the top-level boxes, elements or chunks."""
    head = bytes(data[:12])
    if head[4:8] in _MP4_TOP:
        return _mp4_cut(data)
    if head[:4] == b"\x1aE\xdf\xa3":
        return _matroska_cut(data)
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return _avi_cut(data)
    return None


def _video_problem(data: Data) -> str | None:
    info = video_info(data)
    if info is None:
        return f"is not an MP4, WebM/Matroska or AVI video (first bytes {bytes(data[:8])!r})"
    if info.container == "mp4" and info.codec is None:
        if bytes(data[:1 << 20]).find(b"moov") < 0 and bytes(data[-(1 << 20):]).find(b"moov") < 0:
            return "is truncated (no moov box: the file was cut, or never finished)"
    cut = video_cut(data)
    if cut:
        return cut
    if info.container == "mp4" and info.codec is None:
        return "holds no video track"
    return None


def check_header(ext: str, data: Data, max_pixels: int = MAX_PIXELS) -> str | None:
    """Returns why ``data`` is not a usable ``ext`` file, or None if it looks right."""
    if not data:
        return "is empty"
    ext = ext.lower()
    if ext in VIDEO_EXTS:
        return _video_problem(data)
    if ext in _IMAGE_EXTS:  # a PNG named .jpg decodes: check it as what it is
        ext = _image_format(data) or ext
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
    if ext == "wav":
        problem = _wav_format(data)
        if problem:
            return problem
        if _wav_frames(data) == 0:
            return "holds no audio frames"
        return _wav_cut(data)
    return _truncated(ext, data)
