"""The member table of a tar held in memory (a mapped shard), without copying any member.

Python's ``tarfile`` parses each header through a file object, which makes tar parsing most of a
worker's time per small member. Here headers are read straight from the mapping: ustar / POSIX
(with the ``prefix`` field), GNU long names (``L``) and PAX ``path`` / ``size`` records, which
covers what ``tarfile``, GNU tar and webdataset's ``TarWriter`` write. Every header's checksum is
verified, so a damaged shard raises ``tarfile.ReadError`` instead of yielding garbage.
"""

from __future__ import annotations

import tarfile
import zlib
from collections.abc import Iterator

_BLOCK = 512
_FILE_TYPES = (b"0", b"\0", b"7")
_SPACES = 8 * 0x20


def _byte_sum(header: bytes) -> int:
    """The sum of a 512-byte header's bytes, in C: zlib's Adler-32 keeps ``1 + sum`` modulo
    65521, which is exact for each 256-byte half (at most 65280); a sum in Python would be a
    large part of the time a member's header takes."""
    return ((zlib.adler32(header[:256]) & 0xFFFF) + (zlib.adler32(header[256:]) & 0xFFFF) - 2)


def _number(field: bytes, what: str, at: int) -> int:
    if field[0] & 0x80:  # GNU base-256 for values that do not fit in octal
        value = int.from_bytes(field[1:], "big")
        return -value if field[0] & 0x40 else value
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise tarfile.ReadError(f"bad {what} field {text!r} in the header at byte {at}") from None


def _pax(records: bytes, at: int) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(records) and records[pos:pos + 1] != b"\0":
        space = records.find(b" ", pos)
        try:
            length = int(records[pos:space])
        except ValueError:
            raise tarfile.ReadError(f"bad PAX header at byte {at}") from None
        key, _, value = records[space + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def members(data: memoryview) -> Iterator[tuple[str, int, int]]:
    """Yields ``(name, offset, size)`` of every regular file in the tar held by ``data``."""
    end = len(data)
    pos = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    while pos + _BLOCK <= end:
        header = bytes(data[pos:pos + _BLOCK])
        if header.count(0) == _BLOCK:
            return  # end-of-archive marker
        stored = _number(header[148:156], "checksum", pos)
        unsigned = _byte_sum(header) - sum(header[148:156]) + _SPACES
        if stored != unsigned and stored != unsigned - 256 * sum(b > 127 for b in header):
            raise tarfile.ReadError(f"bad checksum in the header at byte {pos} (damaged shard?)")
        kind = header[156:157]
        size = _number(header[124:136], "size", pos)
        if "size" in pax and kind in _FILE_TYPES:
            size = int(pax["size"])
        start = pos + _BLOCK
        if size < 0 or start + size > end:
            raise tarfile.ReadError(f"member at byte {pos} is truncated ({size} bytes declared)")
        pos = start + (size + _BLOCK - 1) // _BLOCK * _BLOCK
        if kind == b"L":
            long_name = bytes(data[start:start + size]).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            continue
        if kind == b"x":
            pax = _pax(bytes(data[start:start + size]), start)
            continue
        if kind in (b"g", b"K"):
            continue
        if kind == b"S":
            raise tarfile.ReadError(f"GNU sparse member at byte {start - _BLOCK} is not supported")
        name = long_name or pax.get("path")
        if name is None:
            name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:263] == b"ustar\x00" else b""
            if prefix:
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
        long_name, pax = None, {}
        if kind in _FILE_TYPES:
            yield name, start, size
    if pos < end and not any(data[pos:end]):
        return  # cut inside the end-of-archive zeros: every member is whole
    if pos != end:  # cut inside a header or a member's padding (a writer always pads); a member
        # whole before the cut came out above (shards._grouped says why its sample does not)
        where = "its last member's padding" if pos > end else f"the header at byte {pos}"
        raise tarfile.ReadError(f"the shard ends at byte {end}, inside {where} (truncated?)")
