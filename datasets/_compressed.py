"""Compressed shards: what a shard's first bytes say it is, and a gzip shard decompressed into an
anonymous memory file (memfd) that is then read like a tar on disk.

Cost: the shard's uncompressed size in anonymous shared memory from the start of its reading
until the worker has let go of its samples and the server of its mapping (for a remote shard
streamed without the node cache, its compressed bytes as well, until they are decompressed);
and its first sample waits for the whole stream (figures: docs/multi-gpu.md, "Gzip shards").
docs/internals.md, ``mmproxy.datasets._compressed``, has the rest.
"""

from __future__ import annotations

import mmap
import os
import re
import tarfile
import zlib
from enum import Enum
from typing import NamedTuple, Protocol

__all__ = ["Compression", "Decompressed", "HEAD", "SUFFIXES", "Sliced", "compression", "decompress"]

SUFFIXES = (".tar", ".tar.gz", ".tgz")  # the shards of a folder, or of an s3:// prefix
HEAD = 10  # the first bytes of a shard that tell a compressed one


class Compression(Enum):
    """A compressed shard's format, by the signature its bytes start with (a tar starts with a
    member's name, never one of these)."""

    GZIP = re.compile(rb"\x1f\x8b")
    BZIP2 = re.compile(rb"BZh[1-9](\x31\x41\x59\x26\x53\x59|\x17\x72\x45\x38\x50\x90)", re.S)
    XZ = re.compile(rb"\xfd7zXZ\x00")
    ZSTD = re.compile(rb"\x28\xb5\x2f\xfd")
    LZ4 = re.compile(rb"\x04\x22\x4d\x18")


_IN = 1 << 20  # compressed bytes decompressed at a time
_OUT = 8 << 20  # the most decompressed bytes one step holds in memory
_WORDS = {"incorrect data check": "its CRC-32 does not match what it decompresses to",
          "incorrect length check": "its length field does not match what it decompresses to",
          "incorrect header check": "not a gzip header"}  # zlib's reasons, as a user reads them


def compression(head: bytes) -> Compression | None:
    """The compression whose signature starts ``head`` (a shard's first :data:`HEAD` bytes);
    None for anything else (a tar)."""
    return next((kind for kind in Compression if kind.value.match(head)), None)


class Sliced(Protocol):
    """Bytes that are sliced (a memoryview, or a remote shard's view whose slicing waits)."""

    def __len__(self) -> int: ...

    def __getitem__(self, item: slice, /) -> memoryview: ...


class Decompressed(NamedTuple):
    """A gzip stream's bytes in a memfd: its read-only ``mapping`` and descriptor ``fd`` (the
    caller's to close), and ``error`` where the stream is cut short or corrupt (the mapping then
    holds what was decompressed before that point)."""

    mapping: mmap.mmap
    fd: int
    error: tarfile.ReadError | None


def decompress(data: Sliced, kind: Compression) -> Decompressed:
    """Decompresses ``data``, a stream of the compression ``kind`` (:func:`compression`), into a
    memfd, slicing it from start to end. A gzip stream's members are read one after another, and
    zeros after the last one ignored, as gzip does.

    Raises ``tarfile.ReadError`` for a compression other than gzip, and when nothing could be
    decompressed (the stream holds no bytes, or breaks before its first)."""
    if kind is not Compression.GZIP:
        raise tarfile.ReadError(f"the shard is compressed with {kind.name.lower()}, which mmproxy "
                                "does not read: decompress it to a .tar, or compress it with gzip "
                                "(.tar.gz)")
    fd = os.memfd_create("mmproxy-gunzip", os.MFD_CLOEXEC)
    try:
        written, error = _inflate(data, fd)
        if not written:
            raise error or tarfile.ReadError("the gzip stream holds no bytes (not a tar; an empty "
                                             "tar is 1,024 zero bytes)")
        return Decompressed(mmap.mmap(fd, written, access=mmap.ACCESS_READ), fd, error)
    except BaseException:
        os.close(fd)
        raise


def _inflate(data: Sliced, fd: int) -> tuple[int, tarfile.ReadError | None]:
    """Writes the stream's bytes to ``fd``; how many, and the error that stopped it, if any."""
    end, written = len(data), 0
    member = pos = 0  # where the current gzip member starts, and the next byte to feed
    inflater = zlib.decompressobj(wbits=31)  # gzip's header and trailer (CRC-32, length) checked
    while pos < end:
        step = min(pos + _IN, end)
        tail: bytes | memoryview = data[pos:step]
        try:
            while True:
                out = inflater.decompress(tail, _OUT)
                written += _write(fd, out)
                tail = inflater.unconsumed_tail
                if inflater.eof or (not tail and len(out) < _OUT):
                    break
        except zlib.error as err:
            reason = str(err).split(": ", 1)[-1]
            return written, tarfile.ReadError(f"the gzip stream is corrupt in its bytes {pos:,} "
                                              f"to {step:,} ({_WORDS.get(reason, reason)})")
        pos = step
        if inflater.eof:  # a member ends: another may follow
            pos = member = step - len(inflater.unused_data)
            if pos < end and not _zeros(data, pos, end):
                if bytes(data[pos:pos + 2]) != b"\x1f\x8b":
                    return written, tarfile.ReadError(
                        f"the gzip stream is corrupt: its bytes {pos:,} to {end:,}, after its "
                        "last whole member, are not gzip")
                inflater = zlib.decompressobj(wbits=31)
                continue
            return written, None
    where = f"inside the member that starts at byte {member:,}" if member else "before its end"
    return written, tarfile.ReadError(f"the gzip stream is cut short: it ends at byte {end:,}, "
                                      f"{where} (truncated?)")


def _zeros(data: Sliced, start: int, end: int) -> bool:
    """Whether ``data[start:end]`` holds only zero bytes."""
    for at in range(start, end, _IN):
        piece = bytes(data[at:min(at + _IN, end)])
        if piece.count(0) != len(piece):
            return False
    return True


def _write(fd: int, out: bytes) -> int:
    view = memoryview(out)
    while view:  # a write may take only part of it
        view = view[os.write(fd, view):]
    return len(out)
