"""PyAV clip decoding: the frames of a clip decoded in the worker, by presentation order.

The video pipeline's ``decoder="pyav"`` (and the clips ``"nvdec"`` and ``"mixed"`` leave to PyAV)
decode here: :func:`decode_clip` reads the packets' timestamps (no decoding), seeks to the key
frame before the clip's first frame and decodes only as far as its last one. A decode that ends
early is told apart from a video that simply ends there, so a damaged file fails saying why
instead of giving a clip of repeated frames.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

if TYPE_CHECKING:
    from mmproxy.datasets.checks import VideoInfo

__all__ = ["count_frames", "decode_clip", "pyav_installed"]


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
                stride: int) -> np.ndarray:
    """Frames ``start, start + stride, ...`` (``frames`` of them; every frame with
    ``frames=None``) decoded with PyAV, as uint8 ``[T, H, W, 3]`` RGB.

    Frame ``i`` is the ``i``-th frame in presentation order (what the header's frame count
    counts), also in variable-frame-rate videos: the packets' timestamps are read first (no
    decoding), then the decode seeks to the key frame before ``start``'s timestamp instead of
    starting from the beginning. A video whose packets lack timestamps, or where the seek lands
    past ``start``, is decoded from the beginning, counting frames.

    A clip that runs past the last frame of a video that ends there (its header promises no
    more) repeats that last frame. Frames are never made up for a damaged file: where the
    decode ends before a frame the clip needs (or, with ``frames=None``, before the last one)
    while the header promises more frames or a longer duration, or where frames the file holds
    do not decode, it raises ValueError saying which. Telling the two apart reads the packets'
    timestamps again (no decoding), only where the decode ends before the clip does, or, with
    ``frames=None``, short of the header's frame count (always for Matroska: it has none).
    """
    wanted = None if frames is None else [(start or 0) + i * stride for i in range(frames)]
    decoded = _decode(data, wanted, seek=bool(wanted and wanted[0] > 0))
    if decoded is None:  # from the beginning, counting: never None
        decoded = cast(_Decoded, _decode(data, wanted, seek=False))
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


def _decode(data: bytes | memoryview, wanted: list[int] | None, seek: bool) -> _Decoded | None:
    """The frames ``wanted`` (every frame with None), counted from the beginning; with ``seek``
    from the key frame before the first: the first frame decoded takes its index from its pts,
    the next ones are counted. None when seeking fails: packets without pts, the seek went
    past the first frame wanted (H.264 with B-frames in AVI, whose pts are guesses), or no
    frame decoded after it."""
    import av

    out: list[np.ndarray] = []
    error = frame = None
    with cast(Any, av.open(io.BytesIO(data))) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        count: int | None = -1  # the last decoded frame's index (None: not known yet)
        index_of: dict[int, int] = {}
        if seek and wanted:
            order = _presentation_order(container, stream)
            if not order:
                return None
            index_of = {pts: i for i, pts in enumerate(order)}
            container.seek(order[min(wanted[0], len(order) - 1)], stream=stream, backward=True)
            count = None
        needed = set(wanted) if wanted else None
        last = max(wanted) if wanted else None
        try:
            for frame in container.decode(stream):
                if count is not None:
                    count += 1
                elif frame.pts in index_of:  # the first frame after the seek
                    count = index_of[frame.pts]
                    if wanted and count > wanted[0]:
                        return None
                else:
                    continue
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
