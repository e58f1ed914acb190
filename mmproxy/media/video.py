"""Video headers: a video's container, codec and frame count, and whether the file was cut short.

What the container says is read from its header without decoding (MP4/MOV boxes, Matroska/WebM
elements, AVI chunks); a file whose container declares more bytes than follow (or, for MP4,
whose index places frames past its end) decodes to fewer frames than its header promises, so it
is a damaged sample, not a short video. The cost is a walk over the top-level boxes, elements or
chunks.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import NamedTuple, cast

__all__ = ["VIDEO_EXTS", "VideoInfo", "video_cut", "video_info", "video_problem"]

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


def _mp4_boxes(data: bytes | memoryview, start: int, end: int) -> Iterator[tuple[bytes, int, int]]:
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


def _mp4_video(data: bytes | memoryview, start: int, end: int, found: dict[str, object],
               depth: int = 0) -> None:
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


def video_info(data: bytes | memoryview) -> VideoInfo | None:
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


def _mp4_data_end(data: bytes | memoryview, index: dict[str, object]) -> int | None:
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


def _mp4_cut(data: bytes | memoryview) -> str | None:
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


def _ebml_number(data: bytes | memoryview, at: int) -> tuple[int | None, int]:
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


def _matroska_cut(data: bytes | memoryview) -> str | None:
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


def _avi_cut(data: bytes | memoryview) -> str | None:
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


def video_cut(data: bytes | memoryview) -> str | None:
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


def video_problem(data: bytes | memoryview) -> str | None:
    """Why ``data`` is not a usable MP4/MOV, Matroska/WebM or AVI video, or None."""
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
