"""The shard's member table read in bulk: the same members as tarfile lists, and the same errors
after the same members as a header-by-header walk, on tars of every format, damaged or cut."""

from __future__ import annotations

import io
import random
import tarfile
import zlib

import numpy as np
import pytest
import webdataset as wds
from mmproxy.datasets import _tar
from mmproxy.datasets._tar import members, streamed_members
from mmproxy.datasets.shards import KEY_RUNS, _grouped

FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}
SIZES = (0, 1, 100, 511, 512, 513, 1023, 1024, 1025, 3000)


# The header-by-header walk the bulk reader replaced (with its field and PAX parsers, which stay),
# kept as the oracle for errors and for the members yielded before them.
def _old_members(data):
    end, pos, long_name, pax = len(data), 0, None, {}
    while pos + 512 <= end:
        header = bytes(data[pos:pos + 512])
        if header.count(0) == 512:
            return
        stored = _tar._number(header[148:156], "checksum", pos)
        unsigned = ((zlib.adler32(header[:256]) & 0xFFFF) + (zlib.adler32(header[256:]) & 0xFFFF)
                    - 2 - sum(header[148:156]) + 256)
        if stored != unsigned and stored != unsigned - 256 * sum(b > 127 for b in header):
            raise tarfile.ReadError(f"bad checksum in the header at byte {pos} (damaged shard?)")
        kind = header[156:157]
        size = _tar._number(header[124:136], "size", pos)
        if "size" in pax and kind in (b"0", b"\0", b"7"):
            size = int(pax["size"])
        start = pos + 512
        if size < 0 or start + size > end:
            raise tarfile.ReadError(f"member at byte {pos} is truncated ({size} bytes declared)")
        pos = start + (size + 511) // 512 * 512
        if kind == b"L":
            long_name = bytes(data[start:start + size]).split(b"\0", 1)[0].decode(
                "utf-8", "surrogateescape")
            continue
        if kind == b"x":
            pax = _tar._pax(bytes(data[start:start + size]), start)
            continue
        if kind in (b"g", b"K"):
            continue
        if kind == b"S":
            raise tarfile.ReadError(f"GNU sparse member at byte {start - 512} is not supported")
        name = long_name or pax.get("path")
        if name is None:
            name = header[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:263] == b"ustar\x00" else b""
            if prefix:
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
        long_name, pax = None, {}
        if kind in (b"0", b"\0", b"7"):
            yield name, start, size
    if pos < end and not any(data[pos:end]):
        return
    if pos != end:
        where = "its last member's padding" if pos > end else f"the header at byte {pos}"
        raise tarfile.ReadError(f"the shard ends at byte {end}, inside {where} (truncated?)")


def _outcome(read, data):
    """(members yielded, (type, message) of the error or None)."""
    got = []
    try:
        got.extend(read(memoryview(data)))
    except Exception as err:  # compared by type and message
        return got, (type(err), str(err))
    return got, None


def _entries(rng: random.Random, fmt: str) -> list[tuple[str, str, bytes]]:
    """(name, kind, data) of a tar's entries: files of odd sizes, dirs, links, long names."""
    out = []
    for i in range(rng.randint(1, 12)):
        base = rng.choice(["s", "deep/er/path", "x" * 90, "caf\u00e9", "a.b/c", "d" * 150])
        key = f"{base}/{i:04d}"
        roll = rng.random()
        if roll < 0.1:
            out.append((key, "dir", b""))
        elif roll < 0.15:
            out.append((key + ".lnk", "sym", b"l" * (rng.choice([5, 150]) if fmt != "ustar" else 5)))
        elif roll < 0.2:
            out.append((key + ".hard", "link", b"target"))
        for ext in rng.sample(["jpg", "txt", "cls", "Wav", "tar.gz", "json"], rng.randint(1, 3)):
            size = rng.choice(SIZES) if rng.random() < 0.7 else rng.randrange(5000)
            out.append((f"{key}.{ext}", "file", rng.randbytes(size)))
    return out


def _tar_bytes(entries, fmt: str, global_pax: bool = False) -> bytes:
    buf = io.BytesIO()
    extra = {"pax_headers": {"comment": "global"}} if global_pax else {}
    with tarfile.open(fileobj=buf, mode="w", format=FORMATS[fmt], **extra) as tar:
        for name, kind, data in entries:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind in ("sym", "link"):
                info.type = tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE
                info.linkname = data.decode()
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if kind == "file" else None)
    return buf.getvalue()


def _listed(data: bytes) -> list[tuple[str, int, int]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, m.offset_data, m.size) for m in tar if m.isreg()]


def _all_agree(data: bytes):
    want = _outcome(_old_members, data)
    assert _outcome(members, data) == want
    assert _outcome(streamed_members, data) == want
    return want


@pytest.fixture(params=[4096, 3], ids=["one chunk", "chunks of 3"])
def chunk(request, monkeypatch):
    monkeypatch.setattr(_tar, "_CHUNK", request.param)
    return request.param


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_table_of_a_sound_tar_is_what_tarfile_lists(fmt, chunk):
    rng = random.Random(fmt)
    for trial in range(40):
        data = _tar_bytes(_entries(rng, fmt), fmt, global_pax=fmt == "pax" and trial % 3 == 0)
        got, error = _all_agree(data)
        assert error is None and got == _listed(data)
        for name, offset, size in got:  # and the bytes are the members' own
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                assert data[offset:offset + size] == tar.extractfile(name).read()
            break


def test_webdatasets_tar_writer_is_read_like_tarfile(tmp_path, chunk):
    path = str(tmp_path / "w.tar")
    with wds.TarWriter(path) as sink:
        for i in range(20):
            sink.write({"__key__": f"k/{i:03d}", "jpg": bytes(range(i * 50 % 256)) * 3,
                        "txt": "caption " * i, "cls": i})
    data = open(path, "rb").read()
    got, error = _all_agree(data)
    assert error is None and got == _listed(data) and len(got) == 60


@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_and_cut_tars_fail_alike_after_the_same_members(fmt, chunk):
    rng = random.Random(f"damage {fmt}")
    failed = 0
    for _ in range(150):
        data = bytearray(_tar_bytes(_entries(rng, fmt), fmt, global_pax=fmt == "pax"))
        headers = [o - 512 for _, o, _ in members(memoryview(bytes(data)))]
        roll = rng.random()
        if roll < 0.4:  # a cut anywhere, or near a header
            at = rng.choice(headers) + rng.randrange(-3, 600) if rng.random() < 0.5 else 0
            data = data[:max(0, at or rng.randrange(len(data)))]
        elif roll < 0.8:  # bytes changed, in a header or anywhere
            for _ in range(rng.randint(1, 3)):
                at = (rng.choice(headers) + rng.randrange(512) if rng.random() < 0.7
                      else rng.randrange(len(data)))
                data[at] = rng.randrange(256)
        else:  # a field rewritten and the checksum made right again
            head = rng.choice(headers)
            field = rng.choice([(124, 136), (156, 157), (0, 100), (345, 500)])
            data[head + field[0]:head + field[1]] = bytes(
                rng.choice(b"0123 \0\x80xLgKS5a/.") for _ in range(field[1] - field[0]))
            _rechecksum(data, head)
        failed += _all_agree(bytes(data))[1] is not None
    assert failed > 50  # the damage is seen, not just survived


def _rechecksum(data: bytearray, head: int, fmt: str = "%06o\0 ") -> None:
    data[head + 148:head + 156] = b" " * 8
    data[head + 148:head + 156] = (fmt % sum(data[head:head + 512])).encode()[:8].ljust(8, b"\0")


def _plain_tar(sizes=(10, 600, 0)) -> bytearray:
    return bytearray(_tar_bytes([(f"k{i}.bin", "file", bytes(n)) for i, n in enumerate(sizes)],
                                "gnu"))


def test_checksums_written_other_ways_and_signed_sums_are_accepted():
    data = _plain_tar()
    for head, style in ((0, "%07o\0"), (1024, " %06o\0"), (2560, "%o")):
        _rechecksum(data, head, style)
    data[1024 + 90] = 0xE9  # a high byte in a name: a signed byte sum differs from an unsigned one
    data[1024 + 148:1024 + 156] = b" " * 8
    signed = sum(data[1024:1024 + 512]) - 256 * sum(b > 127 for b in data[1024:1024 + 512])
    data[1024 + 148:1024 + 156] = b"%06o\0 " % signed
    got, error = _all_agree(bytes(data))
    assert error is None and [n for n, _, _ in got] == ["k0.bin", "k1.bin", "k2.bin"]
    for junk in (b"12", b"\0\0", b"  ", b"\x00x"):  # the right six digits, then more or less
        _rechecksum(data, 2560)
        data[2560 + 154:2560 + 156] = junk
        assert _all_agree(bytes(data))[1] == (None if junk != b"12" else (
            tarfile.ReadError, "bad checksum in the header at byte 2560 (damaged shard?)"))


def test_base_256_sizes_pax_sizes_and_sparse_members():
    data = _plain_tar()
    data[1024 + 124:1024 + 136] = b"\x80" + (600).to_bytes(11, "big")  # GNU base-256
    _rechecksum(data, 1024)
    assert _all_agree(bytes(data)) == (_listed(bytes(data)), None)
    data[1024 + 156] = ord("S")
    _rechecksum(data, 1024)
    assert _all_agree(bytes(data))[1] == (tarfile.ReadError,
                                          "GNU sparse member at byte 1024 is not supported")
    # A PAX size record wins over the header's size field.
    info = tarfile.TarInfo("p.bin")
    info.size, info.pax_headers = 700, {"size": "700"}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(bytes(700)))
    pax = bytearray(buf.getvalue())
    pax[512 + 512 + 124:512 + 512 + 136] = b"00000000001\0"
    _rechecksum(pax, 1024)
    assert _all_agree(bytes(pax)) == ([("p.bin", 1536, 700)], None) == (_listed(bytes(pax)), None)


def test_the_end_of_archive_and_a_shard_of_zeros():
    data = bytes(_plain_tar())
    whole = _all_agree(data)
    for end in (len(data), 3072 + 100, 3072, 3072 + 1024):
        assert _all_agree(data[:end]) == whole
    assert _all_agree(bytes(1024)) == ([], None)
    assert _all_agree(b"") == ([], None)
    assert _all_agree(bytes(100))[1] is None  # cut inside the end-of-archive zeros


def test_names_come_out_as_tarfile_decodes_them():
    rng = np.random.default_rng(0)
    names = ["a/b.c", "\u00e9t\u00e9.txt", "x" * 100, "no-dot", ".hidden", "tab\there.jpg"]
    names += [bytes(rng.integers(1, 256, rng.integers(1, 100), dtype=np.uint8)).decode(
        "utf-8", "surrogateescape") for _ in range(200)]  # any bytes but NUL
    entries = [(n, "file", b"") for n in names]
    data = _tar_bytes(entries, "gnu")
    got, error = _all_agree(data)
    assert error is None and [n for n, _, _ in got] == [n for n, _, _ in _listed(data)] == names
    raw = bytearray(_tar_bytes([("abc.txt", "file", b"x")], "gnu"))
    raw[3:7] = b"\0\xffjk"  # bytes after the NUL that ends a name are not part of it
    _rechecksum(raw, 0)
    assert _all_agree(bytes(raw))[0] == [("abc", 512, 1)]


def test_samples_are_grouped_by_webdatasets_key_rule():
    """Keys and extensions as webdataset's base_plus_ext splits the names (a dot in a folder's
    name, none in the file's, a leading dot, a newline), so samples are webdataset's."""
    names = ["a.d/x.jpg", "a.d/x.TXT", "dir/.hidden", "dir/nodot", "dir/y.tar.gz", "dir/y.cls",
             "n\nl/z.jpg", "n\n.l/z.cls", "p/q.r/s.t", "p/q.r/s.u", "v.", "v.x", "./w.jpg"]
    data = _tar_bytes([(n, "file", n.encode()) for n in names], "gnu")
    got = [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in s.items()
            if k != KEY_RUNS}  # ours: what the field stage asks where a field is missing
           for s in _grouped(memoryview(data), "u")]
    want = list(wds.tariterators.group_by_keys(
        {"fname": n, "data": n.encode(), "__url__": "u"} for n in names))
    assert got == want and len(want) >= 6


def test_keys_and_extensions_are_base_plus_ext_s_for_any_name():
    rng = random.Random(0)
    names = ["".join(rng.choice("ab./\n\u00e9") for _ in range(rng.randint(1, 12))) for _ in range(600)]
    names += ["/.a", "a/.b", "a\n.b/c.d", "a\nb/c.d\n", ".a", "a.", "a/b", "\n.x"]
    names = [n for n in dict.fromkeys(names) if not n.endswith("/") and "//" not in n]
    entries = [e for i, n in enumerate(names)
               for e in ((n, "file", b"x"), (f"Z{i}.sep", "file", b""))]  # a sample each
    data = _tar_bytes(entries, "gnu")
    got = [(s["__key__"], [k for k in s if not k.startswith("__")])
           for s in _grouped(memoryview(data), "u") if "sep" not in s]
    want = [(key, [ext.lower()]) for key, ext in map(wds.tariterators.base_plus_ext, names)
            if key is not None]
    assert got == want and len(want) > 100
