"""Audio headers: a WAV file's ``fmt `` chunk and data size, and an OGG's last page.

A WAV file is sound when its ``fmt `` chunk (within the first 1 MiB of chunks) declares a
channel count, a rate and a sample size a decoder takes, its ``data`` chunk holds frames, and
that chunk does not declare more bytes than follow; an OGG is cut short when its last page does
not end the stream. The cost is a walk over the WAV chunk headers, or a look at the last 64 KiB.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

__all__ = ["ogg_cut", "wav_cut", "wav_format", "wav_frames"]


def _wav_chunks(data: bytes | memoryview) -> Iterator[tuple[bytes, int, int]]:
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


def wav_format(data: bytes | memoryview) -> str | None:
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


def wav_cut(data: bytes | memoryview) -> str | None:
    """Why a WAV file looks cut short (its data chunk declares more bytes than follow), or None."""
    for chunk, size, body in _wav_chunks(data):
        if chunk == b"data":
            there = len(data) - body
            if size > there and size not in _OPEN_ENDED:
                return f"is truncated (its data chunk declares {size} bytes, {there} follow)"
            return None
    return None


def wav_frames(data: bytes | memoryview) -> int | None:
    """Bytes in a WAV file's data chunk, or None if the chunk is not found in the header."""
    for chunk, size, body in _wav_chunks(data):
        if chunk == b"data":
            return min(size, len(data) - body)
    return None


def ogg_cut(data: bytes | memoryview) -> str | None:
    """Why an OGG file looks cut short (the last page of a stream carries the end-of-stream
    flag), or None."""
    tail = bytes(data[-65536:])
    last = tail.rfind(b"OggS")
    if last < 0 or last + 6 > len(tail) or not tail[last + 5] & 0x04:
        return "is truncated (its last page does not end the stream)"
    return None
