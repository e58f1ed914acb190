"""The member table of a tar held in memory (a mapped shard), without copying any member.

Python's ``tarfile`` parses each header through a file object, which makes tar parsing most of a
worker's time per small member. Here headers are read straight from the mapping: ustar / POSIX
(with the ``prefix`` field), GNU long names (``L``) and PAX ``path`` / ``size`` records, which
covers what ``tarfile``, GNU tar and webdataset's ``TarWriter`` write. Every header's checksum is
verified, so a damaged shard raises ``tarfile.ReadError`` instead of yielding garbage.
docs/internals.md, ``mmproxy.datasets._tar``, has the rest.
"""

from __future__ import annotations

import struct
import tarfile
import zlib
from collections.abc import Iterator
from itertools import chain, islice
from typing import cast

import numpy as np

_BLOCK = 512
_FILE_TYPES = frozenset(b"0\x007")  # type flags of regular files (header[156] is an int)
_META = frozenset(b"xLgK")  # PAX, GNU long name, PAX global, GNU long link: about the next one
_SPACES = 8 * 0x20
_CHUNK = 4096  # members checked at once: a 2 MiB gather of their headers
_SIZE_AND_TYPE = struct.Struct("12s20xB").unpack_from  # a header's size field and type flag
# A checksum field as writers write it: six octal digits (most significant first), NUL, space
_SHIFTS = np.array([15, 12, 9, 6, 3, 0, 0, 0], np.uint32)
_MASKS = np.array([7, 7, 7, 7, 7, 7, 0, 0], np.uint32)
_ZEROS = np.array([0x30, 0x30, 0x30, 0x30, 0x30, 0x30, 0, 0x20], np.uint32)


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


def _check(header: bytes, at: int) -> None:
    """Raises ``tarfile.ReadError`` unless the header's checksum is right (as an unsigned or, as
    some old writers made it, a signed byte sum)."""
    stored = _number(header[148:156], "checksum", at)
    unsigned = _byte_sum(header) - sum(header[148:156]) + _SPACES
    if stored != unsigned and stored != unsigned - 256 * sum(b > 127 for b in header):
        raise tarfile.ReadError(f"bad checksum in the header at byte {at} (damaged shard?)")


def _header_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    prefix = header[345:500].split(b"\0", 1)[0] if header[257:263] == b"ustar\x00" else b""
    return prefix.decode("utf-8", "surrogateescape") + "/" + name if prefix else name


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


def _walk(data: memoryview, heads: list[int] | None
          ) -> Iterator[tuple[str | None, int, int]]:
    """Yields ``(name, offset, size)`` of every regular file, walking from header to header.

    With ``heads`` None each header is checked and named here. Otherwise each header's position
    is appended to ``heads`` before it is read, and the checksums of the members' own headers
    are left to the caller, and so are their names, which come out as None unless a GNU long
    name or a PAX path gives them: a header that fails its checksum may then be walked past, or
    raise something else, before the caller finds it bad (but no member is read as a long name
    or PAX records under a header that fails its checksum).
    """
    end = len(data)
    pos = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    header = b""
    while pos + _BLOCK <= end:
        if heads is None:
            header = bytes(data[pos:pos + _BLOCK])
            if header.count(0) == _BLOCK:
                return  # end-of-archive marker
            _check(header, pos)
            field, kind = header[124:136], header[156]
        else:
            heads.append(pos)
            field, kind = _SIZE_AND_TYPE(data, pos + 124)
        try:
            size = int(field.rstrip(b"\0"), 8)  # what _number reads, in one step where it can
        except ValueError:
            if heads is not None and bytes(data[pos:pos + _BLOCK]).count(0) == _BLOCK:
                heads.pop()
                return  # end-of-archive marker
            size = _number(field, "size", pos)
        if pax and "size" in pax and kind in _FILE_TYPES:
            size = int(pax["size"])
        start = pos + _BLOCK
        if size < 0 or start + size > end:
            raise tarfile.ReadError(f"member at byte {pos} is truncated ({size} bytes declared)")
        pos = start + (size + _BLOCK - 1) // _BLOCK * _BLOCK
        if kind in _FILE_TYPES and long_name is None and not pax:  # a plain member
            yield (None if heads is not None else _header_name(header)), start, size
            continue
        if kind in _META:
            if heads is not None:  # checked before its member is read as a name or records
                _check(bytes(data[start - _BLOCK:start]), start - _BLOCK)
            if kind == 0x4C:  # L
                long_name = bytes(data[start:start + size]).split(b"\0", 1)[0].decode(
                    "utf-8", "surrogateescape")
            elif kind == 0x78:  # x
                pax = _pax(bytes(data[start:start + size]), start)
            continue
        if kind == 0x53:  # S
            raise tarfile.ReadError(f"GNU sparse member at byte {start - _BLOCK} is not supported")
        name = None
        if long_name is not None or pax:
            name = long_name or pax.get("path")
            long_name, pax = None, {}
        if name is None and heads is None:
            name = _header_name(header)
        if kind in _FILE_TYPES:
            yield name, start, size
    if pos < end and not any(data[pos:end]):
        return  # cut inside the end-of-archive zeros: every member is whole
    if pos != end:  # cut inside a header or a member's padding (a writer always pads); a member
        # whole before the cut came out above (shards._grouped says why its sample does not)
        where = "its last member's padding" if pos > end else f"the header at byte {pos}"
        raise tarfile.ReadError(f"the shard ends at byte {end}, inside {where} (truncated?)")


def streamed_members(data: memoryview) -> Iterator[tuple[str, int, int]]:
    """Yields ``(name, offset, size)`` of every regular file in the tar that ``data`` holds or
    is filling (a sequence whose slicing waits for its bytes), each as soon as its header is
    read. Raises ``tarfile.ReadError`` where the tar is damaged or cut, after the members
    before that point."""
    return cast(Iterator[tuple[str, int, int]], _walk(data, None))  # names every member


def members(data: memoryview) -> Iterator[tuple[str, int, int]]:
    """Yields ``(name, offset, size)`` of every regular file in the tar held by ``data``, like
    :func:`streamed_members` (the same members, the same errors after the same members), with
    headers checked and named in bulk."""
    return chain.from_iterable(_chunks(data))


def _chunks(data: memoryview) -> Iterator[list[tuple[str, int, int]]]:
    """The members of :func:`members`, a list for every few thousand headers."""
    blocks = np.frombuffer(data, np.uint8, count=len(data) // _BLOCK * _BLOCK).reshape(-1, _BLOCK)
    heads: list[int] = []
    walk = _walk(data, heads)
    while True:
        found: list[tuple[str | None, int, int]] = []
        error: Exception | None = None
        try:
            found.extend(islice(walk, _CHUNK))  # what came before an error stays in
        except Exception as err:  # raised once the headers before it are found sound
            error = err
        at = np.asarray(heads, dtype=np.int64)
        table = blocks[at // _BLOCK]
        failed = _checksums(table, heads)
        if failed is not None:
            found = [m for m in found if m[1] <= failed[0]]
            error = failed[1]
        if found:
            yield _named(table, at, found)
        if error is not None:
            raise error
        if len(found) < _CHUNK:
            return
        heads.clear()


def _checksums(table: np.ndarray, heads: list[int]) -> tuple[int, tarfile.ReadError] | None:
    """The position and error of the first header of ``table`` (found at ``heads``) whose
    checksum is wrong, if any."""
    for row in np.flatnonzero(~_formatted_checksums(table)):  # checked the exact way, one by one
        try:
            _check(table[row].tobytes(), heads[row])
        except tarfile.ReadError as err:
            return heads[row], err
    return None


def _named(table: np.ndarray, at: np.ndarray, found: list[tuple[str | None, int, int]]
           ) -> list[tuple[str, int, int]]:
    """The members ``found`` under the headers of ``table`` (found at ``at``), named from their
    headers where the walk did not name them."""
    walked, starts, sizes = zip(*found)
    rows = (slice(None) if len(found) == len(at) else
            np.searchsorted(at, np.asarray(starts) - _BLOCK))
    names = _names(table[rows])
    if walked.count(None) < len(walked):  # GNU long names or PAX paths
        names = [h if w is None else w for w, h in zip(walked, names)]
    return list(zip(names, starts, sizes))


def _formatted_checksums(table: np.ndarray) -> np.ndarray:
    """Which headers of ``table`` (rows of 512 bytes) hold their right unsigned checksum written
    as tar writers write it: six octal digits, a NUL and a space."""
    field = table[:, 148:156]
    unsigned = table.sum(axis=1, dtype=np.uint32) - field.sum(axis=1, dtype=np.uint32) + _SPACES
    return (field == (unsigned[:, None] >> _SHIFTS & _MASKS) + _ZEROS).all(axis=1)


def _names(table: np.ndarray) -> list[str]:
    """The names the headers of ``table`` hold, each up to its first NUL and after its ustar
    prefix. The name fields, stripped of their trailing NULs, are joined by NULs and decoded at
    once: UTF-8 never uses a NUL inside a character, so that decodes to the names decoded one
    by one, joined by NULs, unless a name field holds a NUL before other bytes."""
    fields = np.ascontiguousarray(table[:, :100]).view("S100").ravel().tolist()
    names = b"\0".join(fields).decode("utf-8", "surrogateescape").split("\0")
    if len(names) != len(table):  # bytes after a NUL in a name field
        names = [field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape") for field in fields]
    for row in np.flatnonzero(table[:, 345]):  # a prefix field, if the header is ustar's
        names[row] = _header_name(table[row].tobytes())
    return names
