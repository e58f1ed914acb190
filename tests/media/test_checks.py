"""Header checks where one walk answers what two used to: a JPEG's size and damage, a WAV's
format, frames and cut, an OGG's last page. The verdicts are the ones of the walks apart."""

from __future__ import annotations

import io
import struct

import pytest
from mmproxy.datasets.checks import check_header, image_size
from PIL import Image

SOI, EOI = b"\xff\xd8", b"\xff\xd9"


def _segment(marker: int, body: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(body) + 2) + body


SOF = _segment(0xC0, b"\x08" + struct.pack(">HH", 30, 40) + b"\x01\x01\x11\x00")  # 40x30
DHT = _segment(0xC4, b"\x00" + bytes([0, 1] + [0] * 14) + b"\x05")  # one table of one code
BAD_DHT = _segment(0xC4, b"\x00" + bytes([255] * 16))  # 4,080 codes
TABLE = bytes([0, 2] + [0] * 14) + b"\x05\x06"  # two codes
TWO_DHT = _segment(0xC4, b"\x00" + TABLE + b"\x11" + TABLE)  # two tables in one segment
SOS = _segment(0xDA, b"\x01\x01\x00\x00\x3f\x00")
MALFORMED = "has a malformed header (data where a marker belongs, before the image data)"


def _jpeg(*segments: bytes, scan: bytes = b"\x12\x34") -> bytes:
    return SOI + b"".join(segments) + scan + EOI


@pytest.mark.parametrize("data, verdict", [
    (_jpeg(SOF, DHT, SOS), None),
    (_jpeg(DHT, b"\xff\xff\xff", SOF, SOS), None),  # fill bytes before a marker
    (_jpeg(BAD_DHT, SOF, SOS), "has a malformed Huffman table"),
    (_jpeg(TWO_DHT, SOF, SOS), None),
    (_jpeg(_segment(0xC4, b"\x00" + TABLE + b"\x14" + TABLE), SOF, SOS),
     "has a malformed Huffman table"),  # a second table with id 4
    (_jpeg(_segment(0xC4, b"\x24" + TABLE), SOF, SOS), "has a malformed Huffman table"),  # class 2
    (_jpeg(_segment(0xC4, b"\x00" + TABLE + b"\x00"), SOF, SOS), "has a malformed Huffman table"),
    (_jpeg(_segment(0xC4, b"\x00" + TABLE[:-1]), SOF, SOS), "has a malformed Huffman table"),
    (_jpeg(_segment(0xC4, b"\x00" + bytes([0] * 15 + [1]) + b"\x07"), SOF, SOS), None),
    (_jpeg(BAD_DHT, _segment(0xC0, b"\x08" + bytes(4) + b"\x01"), SOS),
     "declares an empty image (0x0)"),  # the size after the bad table is still read first
    (_jpeg(SOS, SOF), None),  # a scan before the frame: the size is looked for past it
    (_jpeg(SOF[:-3]), "is truncated (it ends inside its header)"),
    (SOI + SOF + b"\xff\xc4\x40\x00" + bytes(20), "declares 40x30 pixels, more than max_pixels=100"),
    # A DHT whose length is shorter than its length field: its table is not looked at, and the
    # next marker is looked for inside it
    (SOI + b"\xff\xc4\x00\x01" + SOF + SOS + EOI, MALFORMED),
    (SOI + b"\xff\xc4\x00\x00" + SOF + SOS + EOI, MALFORMED),
    (SOI + b"\xff\xc4\x00\x02" + SOF + SOS + EOI, None),
    (_jpeg(SOF, b"\x00\xc4", SOS), MALFORMED),
    # a stuffed zero among the header's segments (FF 00 00 02: a "segment" of no body), which
    # crashed DALI 2.4's CPU decoder in a photo from Pillow's tests; a restart marker likewise
    (_jpeg(SOF, b"\xff\x00\x00\x02", DHT, SOS), MALFORMED),
    (_jpeg(SOF, b"\xff\xd0", DHT, SOS), MALFORMED),
    (_jpeg(SOF, SOS)[:-2] + b"\x00", "is truncated (no end-of-image marker after its image data)"),
    (_jpeg(SOF, SOS) + b"trailing", None),
])
def test_one_jpeg_walk_gives_the_size_and_the_damage(data, verdict):
    max_pixels = 100 if verdict and "max_pixels=100" in verdict else 1 << 26
    assert check_header("jpg", data, max_pixels) == verdict
    assert check_header("jpg", memoryview(data), max_pixels) == verdict


def test_a_jpeg_from_pil_and_its_size():
    buf = io.BytesIO()
    Image.new("RGB", (50, 37), "red").save(buf, "JPEG")
    data = buf.getvalue()
    assert check_header("jpeg", data) is None and image_size("jpg", data) == (50, 37)
    assert check_header("jpg", data, max_pixels=50 * 37 - 1) == \
        "declares 50x37 pixels, more than max_pixels=1849"


def _wav(fmt: bytes | None, frames: int, declared: int | None = None, big: bool = False,
         before: bytes = b"") -> bytes:
    order = ">" if big else "<"
    chunks = before
    if fmt is not None:
        chunks += b"fmt " + struct.pack(order + "I", len(fmt)) + fmt
    chunks += b"data" + struct.pack(order + "I", frames if declared is None else declared)
    chunks += bytes(frames)
    return (b"RIFX" if big else b"RIFF") + struct.pack(order + "I", 4 + len(chunks)) + b"WAVE" + chunks


def _fmt(channels=1, rate=16000, bits=16, tag=1, big=False) -> bytes:
    return struct.pack(">HHIIHH" if big else "<HHIIHH", tag, channels, rate, rate * 2, 2, bits)


@pytest.mark.parametrize("big", [False, True], ids=["RIFF", "RIFX"])
@pytest.mark.parametrize("case, verdict", [
    (dict(frames=100), None),
    (dict(frames=0), "holds no audio frames"),
    (dict(frames=90, declared=100), "is truncated (its data chunk declares 100 bytes, 90 follow)"),
    (dict(frames=90, declared=0xFFFFFFFF), None),  # a streaming writer's "to the end"
    (dict(frames=10, fmt=None), "has no 'fmt ' chunk before its audio data"),
    (dict(frames=10, channels=0), "has a malformed 'fmt ' chunk (0 channels, 16000 Hz, 16 bits "
                                  "per sample)"),
    (dict(frames=0, channels=0), "has a malformed 'fmt ' chunk (0 channels, 16000 Hz, 16 bits "
                                 "per sample)"),  # the format is reported before the frames
    (dict(frames=10, short=True), "has a malformed 'fmt ' chunk (8 bytes)"),
    (dict(frames=10, before=b"LIST\x03\x00\x00\x00abc\x00"), None),  # an odd chunk, padded
])
def test_one_wav_walk_gives_format_frames_and_cut(big, case, verdict):
    fmt = None if "fmt" in case else _fmt(case.get("channels", 1), big=big)
    if case.get("short"):
        fmt = fmt[:8]
    before = case.get("before", b"")
    if big and before:
        before = before[:4] + before[4:8][::-1] + before[8:]
    data = _wav(fmt, case["frames"], case.get("declared"), big, before)
    assert check_header("wav", data) == verdict
    assert check_header("wav", memoryview(data)) == verdict


def test_a_wav_without_fmt_or_data():
    data = b"RIFF\x00\x00\x00\x00WAVE" + b"JUNK" + struct.pack("<I", 100)
    assert check_header("wav", data) == "has no 'fmt ' chunk (its chunks run past the end of the file)"
    long = b"RIFF\x00\x00\x00\x00WAVE" + b"JUNK" + struct.pack("<I", 1 << 21) + bytes((1 << 21) + 100)
    assert check_header("wav", long) is None  # the header goes on past what is read


@pytest.mark.parametrize("tail, verdict", [
    (b"OggS\x00\x04" + bytes(100), None),
    (b"OggS\x00\x00" + bytes(100), "is truncated (its last page does not end the stream)"),
    (b"OggS\x00\x04" + bytes(20_000), None),  # a last page longer than the first look
    (b"OggS\x00\x00" + bytes(20_000), "is truncated (its last page does not end the stream)"),
    (b"OggS\x00\x04" + bytes(70_000), "is truncated (its last page does not end the stream)"),
    (b"OggS\x00\x04" + bytes(8186), None),
    (bytes(8190) + b"OggS\x00", "is truncated (its last page does not end the stream)"),
])
def test_an_oggs_last_page_is_found_near_the_end(tail, verdict):
    data = b"OggS\x00\x02" + bytes(30) + tail
    assert check_header("ogg", data) == verdict


@pytest.mark.parametrize("fmt, frames, verdict", [
    (_fmt(bits=24), 30, None),
    (_fmt(bits=36), 30, "has 36-bit integer samples (DALI's decoder reads at most 32)"),
    (_fmt(tag=0xFFFE, bits=64) + struct.pack("<HHI", 22, 64, 0) + struct.pack("<H", 1) + bytes(14),
     32, "has 64-bit integer samples (DALI's decoder reads at most 32)"),  # extensible, PCM
    (_fmt(tag=0xFFFE, bits=64) + struct.pack("<HHI", 22, 64, 0) + struct.pack("<H", 3) + bytes(14),
     32, None),  # extensible, float
    (_fmt(tag=3, bits=64), 32, None),
])
def test_wav_sample_sizes_decoders_read(fmt, frames, verdict):
    # scipy's test files of 36-, 45-, 53- and 64-bit integer samples: DALI cannot decode them
    assert check_header("wav", _wav(fmt, frames)) == verdict


def test_a_wav_that_ends_before_its_data_chunk_or_is_rf64():
    no_data = b"RIFF\x00\x00\x00\x00WAVE" + b"fmt " + struct.pack("<I", 16) + _fmt()
    assert check_header("wav", no_data) == "has no 'data' chunk (no audio data before its end)"
    assert check_header("wav", no_data + b"dat") == \
        "has no 'data' chunk (no audio data before its end)"  # cut inside the chunk's header
    ds64 = b"ds64" + struct.pack("<IQQQI", 28, 0, 20, 10, 0)  # riff, data and frame counts
    rf64 = b"RF64" + _wav(_fmt(), 20, declared=0xFFFFFFFF, before=ds64)[4:]
    assert check_header("wav", rf64) is None
    # a chunk that claims to run past the first MiB in a file that ends first: no data chunk
    huge = no_data + b"LIST" + struct.pack("<I", 2 << 20) + bytes(10_000)
    assert check_header("wav", huge) == "has no 'data' chunk (no audio data before its end)"
    longer = huge + bytes(2 << 20)  # the header goes on past what is walked: not known
    assert check_header("wav", longer) is None


def _tiff(mode: str = "RGB", size=(24, 16), **save) -> bytes:
    buf = io.BytesIO()
    image = Image.new(mode, size)
    if save.pop("pages", 1) == 2:
        save.update(save_all=True, append_images=[Image.new(mode, size)])
    image.save(buf, "TIFF", **save)
    return buf.getvalue()


def _tiff_field(data: bytes, tag: int, value: int) -> bytes:
    """A little-endian classic TIFF with its first image's (SHORT or LONG, one value) field
    ``tag`` set to ``value``."""
    out = bytearray(data)
    at = struct.unpack_from("<I", out, 4)[0]
    for k in range(struct.unpack_from("<H", out, at)[0]):
        e = at + 2 + 12 * k
        if struct.unpack_from("<H", out, e)[0] == tag:
            kind = struct.unpack_from("<H", out, e + 2)[0]
            struct.pack_into("<H" if kind == 3 else "<I", out, e + 8, value)
            return bytes(out)
    raise AssertionError(f"no field {tag}")


def _planar_tiff(bits: int, size=(6, 4), planar: tuple[int, int] = (3, 2)) -> bytes:
    """An uncompressed little-endian RGB TIFF whose three samples lie in planes apart (planar
    configuration 2, its field of type SHORT), one strip a plane; Pillow writes none.
    ``planar``: the field's type and value."""
    width, height = size
    plane = width * height * bits // 8
    entries = 10
    arrays = 8 + 2 + 12 * entries + 4  # the bits, the strips' offsets and sizes follow the IFD
    pixels = arrays + 6 + 12 + 12
    fields = [(256, 3, 1, width), (257, 3, 1, height), (258, 3, 3, arrays), (259, 3, 1, 1),
              (262, 3, 1, 2), (273, 4, 3, arrays + 6), (277, 3, 1, 3), (278, 3, 1, height),
              (279, 4, 3, arrays + 18), (284, *planar[:1], 1, planar[1])]
    out = b"II*\0" + struct.pack("<IH", 8, entries)
    out += b"".join(struct.pack("<HHII", tag, kind, count, value)
                    for tag, kind, count, value in fields) + struct.pack("<I", 0)
    out += struct.pack("<3H", bits, bits, bits)
    out += struct.pack("<3I", *(pixels + k * plane for k in range(3)))
    out += struct.pack("<3I", plane, plane, plane)
    return out + (bytes(range(256)) * (3 * plane // 256 + 1))[:3 * plane]


@pytest.mark.parametrize("data, verdict", [
    (_tiff("RGB"), None),
    (_planar_tiff(8), None),  # decoded right
    # DALI 2.4 decoded these into noise, different on every run (Pillow's planar 16-bit tests)
    (_planar_tiff(16), "is a TIFF variant DALI does not read (16-bit samples in planes apart)"),
    (_planar_tiff(8, planar=(8, 2)), None),  # a signed type (SSHORT), which libtiff takes too
    (_planar_tiff(16, planar=(9, 2)),  # SLONG
     "is a TIFF variant DALI does not read (16-bit samples in planes apart)"),
    (_planar_tiff(8, planar=(3, 3)), "is a TIFF variant DALI does not read (planar configuration 3)"),
    (_planar_tiff(8, planar=(8, 0xFFFF)), "has a malformed planar field (the value -1)"),
    (_tiff("RGBA"), None),
    (_tiff("L"), None),
    (_tiff("1"), None),  # 1-bit
    (_tiff("I;16"), None),
    (_tiff("CMYK"), None),
    (_tiff("P"), None),  # a palette
    (_tiff("RGB", compression="tiff_lzw"), None),
    (_tiff("RGB", compression="tiff_adobe_deflate"), None),
    (_tiff("RGB", compression="packbits"), None),
    (_tiff("RGB", compression="jpeg"), None),
    (_tiff("L", pages=2), None),  # DALI decodes the first page
    # samples of more than 16 bits crashed DALI 2.4's CPU decoder (a batch of 32 holding one)
    (_tiff("I"), "is a TIFF variant DALI does not read (32-bit samples)"),
    (_tiff("F"), "is a TIFF variant DALI does not read (32-bit samples)"),
    (_tiff_field(_tiff("RGB"), 277, 65535),  # samples a pixel, as in a file that crashed libtiff
     "is a TIFF variant DALI does not read (65535 samples a pixel)"),
    (_tiff_field(_tiff("L"), 258, 4), "is a TIFF variant DALI does not read (4-bit samples)"),
    (_tiff_field(_tiff("L"), 259, 34925),  # LZMA
     "is a TIFF variant DALI does not read (compression scheme 34925)"),
    (_tiff_field(_tiff("I"), 258, 16),  # 16-bit signed integers
     "is a TIFF variant DALI does not read (signed or floating-point samples)"),
    (_tiff("RGB")[:12], "is truncated (it ends inside its header)"),
    (_tiff("RGB")[:4] + struct.pack("<I", 1 << 30) + _tiff("RGB")[8:],
     "has its first image's header at byte 1073741824, outside the file (damaged?)"),
])
def test_a_tiffs_first_image_header_says_whether_dali_reads_it(data, verdict):
    assert check_header("tif", data) == verdict
    assert check_header("png", memoryview(data)) == verdict  # checked as what it is


def test_a_tiff_variant_dali_does_not_read_is_no_damage_and_its_size_is_read():
    from mmproxy.media import Unread

    assert isinstance(check_header("tiff", _tiff("F")), Unread)
    assert not isinstance(check_header("tiff", _tiff("RGB")[:12]), Unread)
    data = _tiff("RGB", size=(300, 200))
    assert image_size("tiff", data) == (300, 200)
    assert check_header("tiff", data, max_pixels=300 * 200 - 1) == \
        "declares 300x200 pixels, more than max_pixels=59999"
    big = io.BytesIO()
    Image.new("RGB", (30, 20)).save(big, "TIFF", big_tiff=True)
    assert big.getvalue()[2:4] == b"\x2b\x00" and check_header("tiff", big.getvalue()) is None
    assert image_size("tiff", big.getvalue()) == (30, 20)


def test_a_tiff_listing_several_bit_depths_and_no_samples_a_pixel_is_refused():
    """Pillow's old-style JPEG TIFF without a SamplesPerPixel field (three bits-per-sample
    values) crashed DALI 2.4's CPU decoder in the demo every time; one that names its samples
    a pixel, even with one bits-per-sample value too many, decodes."""
    rgb = _tiff("RGB")
    at = struct.unpack_from("<I", rgb, 4)[0]
    entries = struct.unpack_from("<H", rgb, at)[0]
    no_samples = bytearray(rgb)
    for k in range(entries):
        e = at + 2 + 12 * k
        if struct.unpack_from("<H", no_samples, e)[0] == 277:
            struct.pack_into("<H", no_samples, e, 0xFFF0)  # a private tag, not SamplesPerPixel
    assert check_header("tif", bytes(no_samples)) == (
        "has a malformed header (3 bits-per-sample values and no samples a pixel)")
    assert check_header("tif", rgb) is None
