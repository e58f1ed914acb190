"""PyAV clip decoding: the frames of a clip decoded in the worker, by presentation order.

The video pipeline's ``decoder="pyav"`` (and the clips ``"nvdec"`` and ``"mixed"`` leave to PyAV)
decode here: :func:`decode_clip` reads the packets' timestamps (no decoding), seeks to the key
frame before the clip's first frame and decodes only as far as its last one, leaving out the
pictures nothing refers to (H.264 and HEVC) that the clip does not show. A decode that ends
early is told apart from a video that simply ends there, so a damaged file fails saying why
instead of giving a clip of repeated frames.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

if TYPE_CHECKING:
    from mmproxy.media.checks import VideoInfo

__all__ = ["count_frames", "cut_clip", "decode_clip", "pyav_installed"]


def pyav_installed() -> bool:
    """Whether PyAV can be imported."""
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True



def count_frames(data: memoryview, info: VideoInfo | None) -> int | None:
    """Frames of a video: from its header (``info``: MP4, AVI), else counted by PyAV (WebM),
    else None."""
    if info is not None and info.frames:
        return info.frames
    try:
        import av
    except ImportError:
        return None
    with cast(Any, av.open(io.BytesIO(data))) as container:
        stream = container.streams.video[0]
        return stream.frames or sum(1 for packet in container.demux(stream) if packet.size)


def _presentation_order(container: Any, stream: Any) -> list[int] | None:
    """The pts of a video's frames in presentation order, from its packets (demuxed, not
    decoded); None where some packet has no pts (some AVI files) or two share one."""
    pts = [p.pts for p in container.demux(stream) if p.size and not p.is_discard]
    if None in pts or len(set(pts)) < len(pts):
        return None
    return sorted(pts)


def decode_clip(data: bytes | memoryview, start: int | None, frames: int | None,
                stride: int, *, threads: bool = True, at: Sequence[int] | None = None
                ) -> np.ndarray:
    """Frames ``start, start + stride, ...`` (``frames`` of them; every frame with
    ``frames=None``) decoded with PyAV, as uint8 ``[T, H, W, 3]`` RGB.

    Frame ``i`` is the ``i``-th frame in presentation order (what the header's frame count
    counts), also in variable-frame-rate videos: the packets' timestamps are read first (no
    decoding), then the decode seeks to the key frame before ``start``'s timestamp instead of
    starting from the beginning. A video whose packets lack timestamps, or where the seek lands
    past ``start``, is decoded from the beginning, counting frames.

    Pictures that no other picture refers to (H.264's with ``nal_ref_idc`` 0; HEVC's sub-layer
    non-reference ones in a stream of one temporal layer) are not decoded where the clip does
    not show them: the frames are the same, for less work (B-frames that are not references are
    typically a third of an x264 stream's frames).

    ``threads``: decode on FFmpeg's frame and slice threads, the fastest for one clip at a time;
    False decodes on the calling thread alone, which gets the most clips out of each core where
    many processes decode at once (DataLoader workers).

    ``at``: the frames to decode by index (ascending, the last repeated past the video's end as
    a clip's are), instead of ``start``, ``frames`` and ``stride`` (a clip :func:`cut_clip` made).

    A clip that runs past the last frame of a video that ends there (its header promises no
    more) repeats that last frame. Frames are never made up for a damaged file: where the
    decode ends before a frame the clip needs (or, with ``frames=None``, before the last one)
    while the header promises more frames or a longer duration, or where frames the file holds
    do not decode, it raises ValueError saying which. Telling the two apart reads the packets'
    timestamps again (no decoding), only where the decode ends before the clip does, or, with
    ``frames=None``, short of the header's frame count (always for Matroska: it has none).
    """
    wanted: list[int] | None = None
    if at is not None:
        wanted = [int(i) for i in at]
        frames = len(at)
    elif frames is not None:
        wanted = [(start or 0) + i * stride for i in range(frames)]
    decoded = _decode(data, wanted, seek=bool(wanted), threads=threads)
    if decoded is None:  # from the beginning, counting: never None
        decoded = cast(_Decoded, _decode(data, wanted, seek=False, threads=threads))
    out, reached, error, last, listed = decoded
    # the decode ended before the clip did, or short of every frame the header lists
    early = reached <= wanted[-1] if wanted else not 0 < listed <= reached
    if early:
        problem = _shortfall(data, reached, error)
        if problem:
            needs = "" if wanted is None else f"; the clip needs frames {wanted[0]}-{wanted[-1]}"
            raise ValueError(f"{problem}{needs}")
    if not out:
        raise ValueError("the video holds no decodable frame at the clip's position")
    if frames is not None and len(out) < frames:  # past the end: repeat the video's last frame
        out += [last.to_ndarray(format="rgb24")] * (frames - len(out))
    return np.stack(out)


class _Decoded(NamedTuple):
    """What a decode gave: the ``frames`` wanted, how many frames it ``reached`` (the index of
    the last one decoded, plus one), the decoder's ``error`` where one stopped it, and the
    ``last`` frame it decoded (PyAV's, not converted); ``listed``: the frames the header lists
    (0: not said)."""

    frames: list[np.ndarray]
    reached: int
    error: str | None
    last: Any
    listed: int


def _decode(data: bytes | memoryview, wanted: list[int] | None, seek: bool,
            threads: bool) -> _Decoded | None:
    """The frames ``wanted`` (every frame with None), counted from the beginning; with ``seek``
    from the key frame before the first: the first frame decoded takes its index from its pts,
    the next ones are counted, or, where the pictures nothing refers to are left out (H.264 and
    HEVC, :func:`_reference_test`), each takes it from its pts. None when seeking fails: packets
    without pts, the seek went past the first frame wanted (H.264 with B-frames in AVI, whose
    pts are guesses), a frame whose pts no packet has, or no frame decoded after it."""
    import av

    out: list[np.ndarray] = []
    error = frame = None
    with cast(Any, av.open(io.BytesIO(data))) as container:
        stream = container.streams.video[0]
        if threads:
            stream.thread_type = "AUTO"
        count: int | None = -1  # the last decoded frame's index (None: none after the seek yet)
        index_of: dict[int, int] = {}
        shown: set[int] = set()  # the pts of the frames the clip shows
        referenced = None  # the packet test of the pictures nothing refers to, if any
        if seek and wanted:
            order = _presentation_order(container, stream)
            if not order:
                return None
            index_of = {pts: i for i, pts in enumerate(order)}
            container.seek(order[min(wanted[0], len(order) - 1)], stream=stream, backward=True)
            count = None
            referenced = _reference_test(stream)
            if referenced is not None:
                shown = {order[min(i, len(order) - 1)] for i in wanted}
        needed = set(wanted) if wanted else None
        last = max(wanted) if wanted else None
        try:
            for frame in _frames(container, stream, shown, referenced):
                if count is not None and not shown:  # counted: every frame is decoded
                    count += 1
                elif frame.pts in index_of:
                    first = count is None
                    count = index_of[frame.pts]
                    if first and wanted and count > wanted[0]:
                        return None
                elif count is None:  # before the first frame after the seek
                    continue
                else:  # a frame no packet's pts names: cannot be placed
                    return None
                if needed is None or count in needed:
                    out.append(frame.to_ndarray(format="rgb24"))
                if last is not None and count >= last:
                    break
        except av.FFmpegError as err:  # damaged data: the frames decoded so far are good
            error = str(err)
        listed = stream.frames  # read while open (PyAV 19 refuses it once the file is closed)
    if count is None:
        return None
    return _Decoded(out, count + 1, error, frame, listed)


def _frames(container: Any, stream: Any, shown: set[int],
            referenced: Callable[[memoryview], bool] | None) -> Iterator[Any]:
    """The stream's decoded frames; with a ``referenced`` test, the packets of pictures no other
    picture refers to are decoded only when ``shown`` (the pts of the frames wanted) names them."""
    for packet in container.demux(stream):
        if referenced is not None and packet.size and packet.pts not in shown \
                and not referenced(memoryview(packet)):
            continue
        yield from packet.decode()


def _nal_form(stream: Any) -> tuple[str, int] | None:
    """("h264" or "hevc", the bytes of each NAL unit's length) for a stream in length-prefixed
    form (MP4, MOV, Matroska: ``avcC`` / ``hvcC`` extradata); None for other codecs and forms."""
    codec = stream.codec_context.name
    extra = bytes(stream.codec_context.extradata or b"")
    if codec == "h264" and len(extra) >= 7 and extra[0] == 1:
        return codec, (extra[4] & 3) + 1
    if codec == "hevc" and len(extra) >= 23 and extra[0] == 1:
        return codec, (extra[21] & 3) + 1
    return None


def _reference_test(stream: Any) -> Callable[[memoryview], bool] | None:
    """For H.264 and HEVC in length-prefixed form (:func:`_nal_form`), whether a packet holds a
    picture other pictures may refer to; None for other codecs and forms (every packet is
    decoded)."""
    form = _nal_form(stream)
    if form is None:
        return None
    codec, size = form
    if codec == "h264":
        return partial(_h264_referenced, size)
    # HEVC's non-reference pictures are so for their own temporal layer only: with one layer
    # (hvcC's numTemporalLayers is 1) nothing refers to them
    if (bytes(stream.codec_context.extradata)[21] >> 3) & 7 == 1:
        return partial(_hevc_referenced, size)
    return None


def _nal_units(size: int, data: memoryview) -> Iterator[memoryview]:
    """The NAL units of a packet, each after a ``size``-byte length."""
    at = 0
    while at + size < len(data):
        length = int.from_bytes(data[at:at + size], "big")
        yield data[at + size:at + size + length]
        at += size + length


def _h264_referenced(size: int, data: memoryview) -> bool:
    """Whether an H.264 packet may be referred to: False only where it holds slices, every
    slice's ``nal_ref_idc`` is 0, and no parameter set."""
    slices = 0
    for unit in _nal_units(size, data):
        head = unit[0] if len(unit) else 0
        if head & 31 in (7, 8):  # a sequence or picture parameter set: later pictures use it
            return True
        if head & 31 in (1, 2, 5):  # a slice (or its partition A); IDR slices are references
            if head & 0x60:
                return True
            slices += 1
    return slices == 0


def _hevc_referenced(size: int, data: memoryview) -> bool:
    """Whether an HEVC packet may be referred to: False only where it holds slices and each is
    a sub-layer non-reference picture's (TRAIL_N, TSA_N, STSA_N, RADL_N, RASL_N, RSV_VCL_N10-14)."""
    slices = 0
    for unit in _nal_units(size, data):
        kind = (unit[0] >> 1) & 63 if len(unit) else 63
        if 32 <= kind <= 34:  # a video, sequence or picture parameter set
            return True
        if kind < 32:  # a slice
            if kind > 14 or kind % 2:
                return True
            slices += 1
    return slices == 0


def cut_clip(data: bytes | memoryview, wanted: Sequence[int]) -> tuple[np.ndarray, list[int]] | None:
    """The packets a clip's frames need, as a small MP4 of their own: from the random-access
    key frame before the first frame ``wanted`` (indices in presentation order, ascending) to
    the last one in decode order, without the pictures nothing refers to that the clip does not
    show (:func:`_reference_test`). The packets are copied, not decoded; their timestamps are
    renumbered one frame apart (a decoder that places frames by frame rate finds them), so
    frame ``at[k]`` of the cut file is frame ``wanted[k]`` of the video, bit for bit. Returns the
    file and ``at``; None (the whole file then goes to the decoder, which says what is wrong
    with it) where the video is not H.264 or HEVC in length-prefixed form, its packets lack
    timestamps or share one, an edit list drops some, fewer packets demux than its header
    lists (damaged), no key frame before the clip is a point to decode from (H.264's IDR or
    intra-coded pictures, HEVC's IRAP ones: not x264's intra-refresh "key frames"), or it does
    not demux."""
    import av

    try:
        with cast(Any, av.open(io.BytesIO(data))) as container:
            stream = container.streams.video[0]
            referenced = _reference_test(stream)
            if referenced is None or not wanted:
                return None
            packets = [p for p in container.demux(stream) if p.size]
            order = sorted(p.pts for p in packets if p.pts is not None)
            if not order or len(order) < max(len(packets), stream.frames or 0) or len(
                    set(order)) < len(order) or any(p.is_discard for p in packets):
                return None
            shown = [order[min(i, len(order) - 1)] for i in wanted]
            needed = set(shown)
            places = [k for k, p in enumerate(packets) if p.pts in needed]
            starts = _random_access_test(stream)
            keys = [k for k in range(places[0] + 1) if packets[k].is_keyframe
                    and packets[k].pts <= shown[0] and starts(memoryview(packets[k]))]
            if not keys:
                return None
            key = packets[keys[-1]]
            kept = [p for p in packets[keys[-1]:places[-1] + 1] if p.pts >= key.pts and (
                p.pts in needed or referenced(memoryview(p)))]
            rank = {pts: r for r, pts in enumerate(sorted(p.pts for p in kept))}
            # decode order runs ahead of presentation by at most `delay` frames (B-frames):
            # presentation times that far later keep each one at or after its decode time
            delay = max(k - rank[p.pts] for k, p in enumerate(kept))
            step = 1
            if stream.average_rate and stream.time_base:
                step = max(1, round(1 / (stream.average_rate * stream.time_base)))
            buffer = io.BytesIO()
            with cast(Any, av.open(buffer, "w", format="mp4")) as out:
                target = out.add_stream_from_template(stream)
                for k, packet in enumerate(kept):
                    packet.stream = target
                    packet.dts, packet.pts = k * step, (rank[packet.pts] + delay) * step
                    packet.duration = step
                    out.mux(packet)
    # damaged files the header checks pass raise these from PyAV as well as FFmpegError
    except (av.FFmpegError, AttributeError, IndexError, UnicodeDecodeError, ValueError):
        return None
    return np.frombuffer(buffer.getvalue(), np.uint8), [rank[pts] for pts in shown]


def _random_access_test(stream: Any) -> Callable[[memoryview], bool]:
    """Whether a packet of an H.264 or HEVC stream (as :func:`_reference_test` takes them) is a
    point a decode can start from: an IDR picture or one whose slices are all intra-coded
    (H.264), an IRAP picture (HEVC)."""
    codec, size = cast(tuple[str, int], _nal_form(stream))
    return partial(_hevc_random_access if codec == "hevc" else _h264_random_access, size)


def _h264_random_access(size: int, data: memoryview) -> bool:
    slices = 0
    for unit in _nal_units(size, data):
        kind = unit[0] & 31 if len(unit) else 0
        if kind == 5:
            return True
        if kind == 1:  # slice_type, after first_mb_in_slice (both Exp-Golomb): I or SI
            kinds = _exp_golomb(unit[1:9], 2)
            if kinds is None or kinds[1] % 5 not in (2, 4):
                return False
            slices += 1
    return slices > 0


def _hevc_random_access(size: int, data: memoryview) -> bool:
    return any(len(unit) and 16 <= (unit[0] >> 1) & 63 <= 23 for unit in _nal_units(size, data))


def _exp_golomb(data: memoryview, count: int) -> list[int] | None:
    """The first ``count`` unsigned Exp-Golomb numbers of ``data`` (emulation prevention bytes
    cannot occur in the first few bytes of a slice header); None where they do not fit."""
    bits = "".join(f"{byte:08b}" for byte in data)
    at, out = 0, []
    for _ in range(count):
        zeros = bits.find("1", at) - at
        if zeros < 0 or at + 2 * zeros + 1 > len(bits):
            return None
        out.append(int(bits[at + zeros:at + 2 * zeros + 1], 2) - 1)
        at += 2 * zeros + 1
    return out


_FEWER = "the file holds fewer frames than its header promises"
_WHY = "(it ends early, or its data is damaged)"


def _shortfall(data: bytes | memoryview, reached: int, error: str | None) -> str | None:
    """Why a decode that ended after ``reached`` frames (stopped by the decoder's ``error``,
    if any) ended early on a damaged file; None where the video simply ends there. Damaged: the
    file holds fewer frames than its header lists (MP4, AVI), frames it holds did not decode,
    or (no frame count in the header: Matroska/WebM) its frames end before the duration its
    header declares."""
    import av

    present = shown = 0  # the video's packets in the file; those an edit list does not cut
    end = 0.0  # where the last of them ends, in seconds
    with cast(Any, av.open(io.BytesIO(data))) as container:
        stream = container.streams.video[0]
        listed = stream.frames
        declared = None  # the duration the header declares, where it has no frame count
        if not listed and container.duration and len(container.streams) == 1:
            declared = ((container.start_time or 0) + container.duration) / av.time_base
        try:
            for packet in container.demux(stream):
                if packet.size == 0 and packet.dts is None:  # the demuxer's final flush
                    continue
                present += 1
                if packet.size and not packet.is_discard:
                    shown += 1
                    end = float(((packet.pts or 0) + (packet.duration or 0)) * stream.time_base)
        except av.FFmpegError:  # the packets end where the data is damaged
            pass
    if listed and present < listed:
        return f"{_FEWER}: only {present:,} of the {listed:,} it lists can be read {_WHY}"
    if reached < shown:
        return f"frame {reached} of the {shown:,} in the file does not decode" + (
            f" ({error})" if error else "")
    if declared is not None and shown and end < declared - 1.5 * end / shown:
        return f"{_FEWER}: they end at {end:.2f} s, its header declares {declared:.2f} s {_WHY}"
    return None
