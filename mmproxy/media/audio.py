"""Audio headers: a WAV file's ``fmt `` chunk and data size, and an OGG's last page.

A WAV file is sound when its ``fmt `` chunk (within the first 1 MiB of chunks) declares a
channel count, a rate and a sample size a decoder takes (integer samples of at most 32 bits),
it has a ``data`` chunk that holds frames, and that chunk does not declare more bytes than
follow; an OGG is cut short when its last page does
not end the stream. The cost is one walk over the WAV chunk headers, or a look at the last
8 KiB of an OGG (64 KiB when its last page starts before them).
"""

from __future__ import annotations

import struct

from mmproxy.media import Unread

__all__ = ["ogg_cut", "wav_problem"]


_PCM_TAGS = (1, 3, 0xFFFE)  # integer PCM, IEEE float, extensible: bits per sample must be set
_OPEN_ENDED = (0xFFFFFFFF, 0x7FFFFFFF)  # a streaming writer's data size: "to the end of the file"
_CHUNK = {False: struct.Struct("<4sI"), True: struct.Struct(">4sI")}
_FMT = {False: struct.Struct("<HHI6xH"), True: struct.Struct(">HHI6xH")}
_SUB = {False: struct.Struct("<I"), True: struct.Struct(">I")}


def wav_problem(data: bytes | memoryview) -> str | None:
    """What is wrong with a WAV file, or None: its ``fmt `` chunk is malformed or missing, its
    ``data`` chunk holds no frames, or that chunk declares more bytes than follow.

    One walk over the chunk headers, in the file's byte order (RIFX is big-endian), up to the
    ``data`` chunk; a ``fmt `` chunk not found within the first 1 MiB of chunks is not known to
    be missing when the chunks go on past that."""
    big = data[:4] == b"RIFX"
    chunks = _CHUNK[big]
    n = len(data)
    form: str | None = "has no 'fmt ' chunk (its chunks run past the end of the file)"
    seen_fmt = False
    end = 12
    i = 12
    while i + 8 <= n and i < 1 << 20:
        chunk, size = chunks.unpack_from(data, i)
        body = i + 8
        if not seen_fmt:
            end = body + size + (size & 1)
            if chunk == b"fmt ":
                form, seen_fmt = _fmt_problem(data, body, size, big), True
        if chunk == b"data":
            if not seen_fmt:
                return "has no 'fmt ' chunk before its audio data"
            if form:
                return form
            there = n - body
            if min(size, there) == 0:
                return "holds no audio frames"
            if size > there and size not in _OPEN_ENDED:
                return f"is truncated (its data chunk declares {size} bytes, {there} follow)"
            return None
        i = body + size + (size & 1)
    if not seen_fmt and end < n and end >= 1 << 20:
        return None  # the header goes on past what is read: not known
    if seen_fmt and not form:  # the walk ran out of file (not out of its 1 MiB) before data
        return None if i + 8 <= n else "has no 'data' chunk (no audio data before its end)"
    return form


def _fmt_problem(data: bytes | memoryview, body: int, size: int, big: bool) -> str | None:
    """What is wrong with the ``fmt `` chunk of ``size`` bytes at ``body``, or None."""
    if size < 16 or body + 16 > len(data):
        return f"has a malformed 'fmt ' chunk ({size} bytes)"
    tag, channels, rate, bits = _FMT[big].unpack_from(data, body)
    bits_ok = 0 < bits <= 64 or (tag not in _PCM_TAGS and bits == 0)  # e.g. GSM 6.10
    if not (0 < channels <= 256 and 0 < rate <= 10_000_000 and bits_ok):
        return (f"has a malformed 'fmt ' chunk ({channels} channels, {rate} Hz, "
                f"{bits} bits per sample)")
    if tag == 0xFFFE and size >= 28 and body + 28 <= len(data):  # extensible: its sub-format
        sub = _SUB[big].unpack_from(data, body + 24)[0]  # the GUID's first field
        tag = 1 if sub in (1, 0x01000000) else sub  # RIFX writers store it either way
    if tag == 1 and bits > 32:
        return Unread(f"has {bits}-bit integer samples (DALI's decoder reads at most 32)")
    return None


def ogg_cut(data: bytes | memoryview) -> str | None:
    """Why an OGG file looks cut short (the last page of a stream carries the end-of-stream
    flag), or None. The last page is looked for in the last 8 KiB, then the last 64 KiB."""
    for window in (8192, 65536):
        tail = bytes(data[-window:])
        last = tail.rfind(b"OggS")
        if last >= 0 or len(tail) < window:
            break
    if last < 0 or last + 6 > len(tail) or not tail[last + 5] & 0x04:
        return "is truncated (its last page does not end the stream)"
    return None
