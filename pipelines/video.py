"""Video pipeline: encoded clips in, ``frames`` frames at a ``stride``, resized, cropped, flipped,
normalized.

Inputs:
    ``videos`` (the proxy's argument): the encoded bytes of one video file per sample (uint8,
    1-D): MP4/MOV, WebM/Matroska or AVI.

Outputs:
    One clip per sample, ``frames x size x size`` RGB, as ``"CTHW"`` (a batch is NCTHW, what 3-D
    CNNs take) or ``"THWC"`` (NTHWC, what video transformers often take), in ``dtype`` (float32 and
    float16 normalized with ``mean``/``std`` in 0-255 units; uint8 not normalized). With
    ``every_frame=True`` a second output, ``length``: every frame of each video is decoded, the
    clips are zero-padded to the longest of the batch, and ``length`` (int64) says how many frames
    are real.

Clip sampling: training clips start at a random frame (uniform over the starts that fit the
clip; a video shorter than the clip repeats its last frame), evaluation clips are centred. The
start, the crop position and the flip are drawn by the proxy in the worker from the sample's seed
(a :class:`~mmproxy.datasets.MultiModalDataset` derives it from its seed, the epoch and the key),
so a resumed run repeats them exactly. The start needs the number of frames: read from the MP4 or
AVI header, or counted by PyAV for WebM (without PyAV a WebM clip starts at frame 0).

Damaged videos: only a video whose header says it is shorter than the clip has frames repeated.
A file that ends before the frames its header promises (an interrupted download) fails in the
worker before any decoder sees it, whichever the decoder and the clip's position (its boxes,
elements or chunks declare more bytes than follow:
:func:`~mmproxy.datasets.checks.video_cut`), and a PyAV decode that ends early for any other
reason fails saying why (:func:`decode_clip`): a skip record with ``on_error="skip"``.

Decoders, and which codec is decoded where (DALI 2.4):

=============  ===================================  ============================================
``decoder``    where                                codecs
=============  ===================================  ============================================
``"dali"``     the server: NVDEC (``mixed``) on a   GPU: H.264, HEVC, VP8, VP9, AV1, MPEG-4,
               GPU, FFmpeg on CPU threads           MJPEG. CPU: VP8, VP9, MJPEG only (DALI's
                                                    wheel has no CPU H.264 decoder)
``"pyav"``     the worker (PyAV, FFmpeg), only the  everything FFmpeg decodes; the server
               frames of the clip; the server       resizes, crops and normalizes
               resizes, crops, normalizes
``"nvdec"``    the server: PyNvVideoCodec (NVDEC)   H.264, HEVC, VP8, VP9, AV1 in MP4/MOV; the
               on ``decode_threads`` threads, one   rest (WebM, AVI, MJPEG, MPEG-4, and clips
               re-pointed decoder each; frames      NVDEC refuses) decoded by PyAV, in the
               stay on the GPU                      worker (or the decode thread)
``"mixed"``    ``"nvdec"``, with ``cpu_share`` of   as ``"nvdec"``
               the clips decoded by PyAV in the
               workers (drawn from each seed)
=============  ===================================  ============================================

``"auto"`` is ``"nvdec"`` on a GPU where PyNvVideoCodec loads (``pip install 'mmproxy[nvdec]'``
and the driver's NVDEC library), else ``"pyav"`` when PyAV is installed, else ``"dali"``.
BENCHMARKS.md ("Video") has the figures: on an H200, 596x336 H.264 clips, ``"nvdec"`` gives
nearly twice PyAV in the workers with a sixth of their CPU, and DALI's in-memory decoder
(``"dali"``) far less than either; a sample the chosen decoder cannot decode fails with a
message naming its codec (a skip record with ``on_error="skip"``).

Cost: the decode dominates. With ``"pyav"`` the workers decode only the clip's frames (seeking
to the key frame before its start, after reading the packets' timestamps: ~1 ms for a 10 s
596x336 clip, ~2% of its decode) and send them to the server (a 16-frame 596x336 clip is 9.6
MB of RGB, through shared memory); the resize, crop and normalize run on the GPU, or on CPU in
torchvision inside the pipeline (``cpu_resize``). With ``"dali"``, ``"nvdec"`` and ``"mixed"`` on
a GPU the worker reads only the container header (~10-50 us a clip) and sends the encoded bytes;
with ``"nvdec"`` each clip is written once into a decode thread's memory file (PyNvVideoCodec's
re-pointing takes a path) and its frames are copied out of the decoder on the GPU
(:mod:`mmproxy.pipelines._nvdec`).
"""

from __future__ import annotations

import io
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

import numpy as np
from mmproxy.pipelines._device import Device, resolve_device
from mmproxy.pipelines._nvdec import NVDEC_CODECS, ClipDecoder, load_nvdec, nvdec_available
from mmproxy.pipelines.image import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CpuResize,
    DType,
    _check_resize_size,
    centre_crop_position,
    resize,
)

if TYPE_CHECKING:
    from mmproxy.datasets.checks import VideoInfo

__all__ = ["CPU_CODECS", "ClipDraw", "VideoDecoder", "decode_clip", "video_graph", "video_pipeline"]

VideoDecoder = Literal["auto", "dali", "mixed", "nvdec", "pyav"]
VideoLayout = Literal["CTHW", "THWC"]
CPU_CODECS = ("vp8", "vp9", "mjpeg")  # what DALI 2.4's CPU video decoder decodes
_NAMES = {"h264": "H.264", "hevc": "HEVC", "av1": "AV1", "mpeg4": "MPEG-4", "vp8": "VP8",
          "vp9": "VP9", "mjpeg": "MJPEG"}


def _count_frames(data: memoryview, info: VideoInfo | None) -> int | None:
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


def clip_start(total: int | None, frames: int, stride: int, train: bool, rng: random.Random) -> int:
    """The first frame of a clip of ``frames`` frames at ``stride`` in a video of ``total``
    frames: uniform over the starts that fit (training), centred (evaluation), 0 if unknown."""
    if not total:
        return 0
    room = max(0, total - ((frames - 1) * stride + 1))
    return rng.randint(0, room) if train else room // 2


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


class ClipDraw:
    """The video pipeline's per-sample draws (a :class:`~mmproxy.proxy.SampleRandom`): the clip's
    start frame (or, with ``decode_in_worker``, its decoded frames), the crop position and the
    flip, from the sample's seed. Refuses a codec the server's decoder cannot decode, by name.

    With ``nvdec`` the start is drawn as for DALI's decoder and the encoded clip goes to the
    server's NVDEC decoder; a clip NVDEC cannot take (:data:`NVDEC_CODECS` in MP4/MOV) and, with
    ``cpu_share``, that share of the others (one more draw, after the clip's), are decoded here
    with PyAV and sent as frames instead.
    """

    def __init__(self, input_name: str, frames: int, stride: int, train: bool,
                 flip_probability: float, every_frame: bool, decode_in_worker: bool,
                 cpu_decoder: bool, nvdec: bool = False, cpu_share: float = 0.0) -> None:
        self.input_name, self.frames, self.stride, self.train = input_name, frames, stride, train
        self.flip_probability, self.every_frame = flip_probability, every_frame
        self.decode_in_worker, self.cpu_decoder = decode_in_worker, cpu_decoder
        self.nvdec, self.cpu_share = nvdec, cpu_share
        place = ("frames",) if decode_in_worker else ("start",) if nvdec or not every_frame else ()
        self.names = (*place, *(("crop_x", "crop_y") if train else ()), "flip")
        self.arguments = (input_name,)

    def __call__(self, given: dict[str, np.ndarray], rng: random.Random) -> dict[str, np.ndarray]:
        from mmproxy.datasets.checks import video_cut, video_info

        data = given[self.input_name].data.cast("B")
        info = video_info(data)
        cut = video_cut(data)  # a decoder would stop early, or repeat its last frame
        if cut:
            raise ValueError(f"the video {cut}")
        if info is not None and self.cpu_decoder and info.codec not in (None, *CPU_CODECS):
            raise ValueError(
                f"{_NAMES.get(info.codec, info.codec)} video: DALI's CPU video decoder decodes "
                f"only {', '.join(_NAMES[c] for c in CPU_CODECS)}; use "
                "video_pipeline(decoder='pyav') (PyAV decodes it in the workers) or a GPU")
        here = self.decode_in_worker or (self.nvdec and not _nvdec_takes(info))
        if here and self.nvdec:
            _need_pyav(info)
        out: dict[str, np.ndarray] = {}
        start = 0
        if not self.every_frame:
            start = clip_start(_count_frames(data, info), self.frames, self.stride, self.train, rng)
        if self.train:  # evaluation crops sit at the centre (the pipeline places them)
            out["crop_x"] = np.array(rng.random(), np.float32)
            out["crop_y"] = np.array(rng.random(), np.float32)
        out["flip"] = np.array(self.train and rng.random() < self.flip_probability, np.int32)
        if self.nvdec and not here and self.cpu_share > 0:
            here = self.cpu_share >= 1 or rng.random() < self.cpu_share
        if here:
            decoded = decode_clip(data, start, None if self.every_frame else self.frames,
                                  self.stride)
            out[self.input_name if self.nvdec else "frames"] = decoded
        if "start" in self.names:
            out["start"] = np.array(start, np.int32)
        return out


def _nvdec_takes(info: VideoInfo | None) -> bool:
    """Whether the server's NVDEC decoder takes this video (the codec in an MP4/MOV file)."""
    return info is not None and info.container == "mp4" and info.codec in NVDEC_CODECS


def _has_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def _need_pyav(info: VideoInfo | None) -> None:
    """Refuses, by codec and container, a video NVDEC does not take when PyAV is not here."""
    if _has_pyav():
        return
    what = "an unknown kind of" if info is None else (
        f"{_NAMES.get(info.codec or '', info.codec or 'unknown codec')} in {info.container}")
    raise ValueError(
        f"{what} video: NVDEC decodes only {', '.join(_NAMES[c] for c in NVDEC_CODECS)} in "
        "MP4/MOV files, and the others are decoded in the workers by PyAV, which is not "
        "installed: pip install av (or 'mmproxy[video]')")


def video_graph(video: Any, *, gpu: bool, size: int = 224, resize_size: int | None = None,
                crop_x: Any = None, crop_y: Any = None, flip: Any = 0,
                mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                layout: VideoLayout = "CTHW", dtype: DType = "float32",
                cpu_resize: CpuResize = "torchvision") -> Any:
    """Decoded clips (a DALI node, ``FHWC`` uint8) to resized, cropped, flipped, normalized
    clips: the shorter side to ``resize_size`` (default ``size * 256 / 224``), a ``size`` square
    at ``crop_x``/``crop_y`` (0-1, same for every frame of a clip; None: at the centre, where
    torchvision's ``CenterCrop`` puts it), mirrored where ``flip``."""
    from nvidia.dali import fn, types

    if layout not in ("CTHW", "THWC"):
        raise ValueError(f"layout must be 'CTHW' or 'THWC', got {layout!r}")
    if gpu:
        video = video.gpu()
    video = resize(video, resize_size or round(size * 256 / 224), gpu=gpu, cpu_resize=cpu_resize,
                   shorter=True, layout="FHWC")
    if crop_x is None or crop_y is None:
        centre_x, centre_y = centre_crop_position(video, size, layout="FHWC")
        crop_x = centre_x if crop_x is None else crop_x
        crop_y = centre_y if crop_y is None else crop_y
    dali_type = {"float32": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}[dtype]
    if dtype == "uint8":
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    return fn.crop_mirror_normalize(video, crop=(size, size), crop_pos_x=crop_x, crop_pos_y=crop_y,
                                    mirror=flip, dtype=dali_type, mean=list(mean), std=list(std),
                                    output_layout="CFHW" if layout == "CTHW" else "FHWC")


def video_pipeline(*, batch_size: int, frames: int = 16, stride: int = 4, size: int = 224,
                   resize_size: int | None = None, train: bool = True, every_frame: bool = False,
                   flip_probability: float = 0.5, mean: Sequence[float] = IMAGENET_MEAN,
                   std: Sequence[float] = IMAGENET_STD, layout: VideoLayout = "CTHW",
                   dtype: DType = "float32", decoder: VideoDecoder = "auto",
                   device: Device = "auto", device_id: int | None = None, num_threads: int = 4,
                   prefetch_queue_depth: int = 2, input_name: str = "videos",
                   cpu_resize: CpuResize = "torchvision",
                   decoder_options: Mapping[str, Any] | None = None, decode_threads: int = 8,
                   cpu_share: float = 0.25) -> Any:
    """Builds the video pipeline (see the module docstring for inputs, outputs and decoders).

    Args:
        batch_size: The largest batch the server will be asked to run.
        frames: Frames per clip.
        stride: Frames between two frames of a clip (4: every fourth frame).
        size: Output height and width.
        resize_size: The shorter side before cropping (default ``size * 256 / 224``).
        train: Random start, crop position and flip; otherwise a centred clip and crop.
        every_frame: Decode every frame (no clip sampling); clips padded, with a ``length`` output.
        flip_probability: Chance of a horizontal flip (training).
        mean: Per-channel mean, 0-255 units.
        std: Per-channel standard deviation, 0-255 units.
        layout: "CTHW" (batches NCTHW) or "THWC" (batches NTHWC).
        dtype: "float32", "float16" or "uint8".
        decoder: "auto", "nvdec", "mixed", "pyav" or "dali" (module docstring).
        device: "auto" (GPU when CUDA is available), "gpu" or "cpu".
        device_id: The GPU to use; the current one when None.
        num_threads: DALI CPU threads.
        prefetch_queue_depth: Runs the server keeps in flight.
        input_name: The proxy's argument.
        cpu_resize: On CPU, resize with "torchvision" or DALI's "dali" ``fn.resize``.
        decoder_options: More keyword arguments for the decoder: with ``decoder="dali"`` for
            DALI's ``fn.decoders.video`` (``build_index``, ``affine``, ...); with ``"nvdec"`` and
            ``"mixed"`` for ``PyNvVideoCodec.SimpleDecoder`` (``max_width``, ``max_height``,
            ``decoder_cache_size``).
        decode_threads: With ``"nvdec"`` and ``"mixed"``: the server's NVDEC decode threads.
        cpu_share: With ``"mixed"``: the share of the clips the workers decode with PyAV (drawn
            per clip from its seed, 0-1).
    """
    from nvidia.dali import fn, pipeline_def, types

    gpu, dev_id = resolve_device(device, device_id)
    if decoder not in ("auto", "dali", "mixed", "nvdec", "pyav"):
        raise ValueError(f"decoder must be 'auto', 'nvdec', 'mixed', 'pyav' or 'dali', got "
                         f"{decoder!r}")
    if decoder == "auto":
        decoder = "nvdec" if gpu and nvdec_available() else "pyav" if _has_pyav() else "dali"
    if decoder in ("nvdec", "mixed"):
        if not gpu:
            raise ValueError(f"decoder={decoder!r} decodes on the GPU (NVDEC): use device='gpu' "
                             "or 'auto' on a machine with CUDA, or decoder='pyav' on CPU")
        load_nvdec()
        if decoder == "mixed" and not 0 <= cpu_share <= 1:
            raise ValueError(f"cpu_share must be between 0 and 1, got {cpu_share}")
    if decoder in ("pyav", "mixed") and not _has_pyav():
        raise ImportError(f"decoder={decoder!r} needs PyAV: pip install av (or 'mmproxy[video]')")
    _check_resize_size(size, resize_size)
    if frames < 1 or stride < 1:
        raise ValueError(f"frames and stride must be at least 1, got {frames} and {stride}")
    nvdec = decoder in ("nvdec", "mixed")
    draw = ClipDraw(input_name, frames, stride, train, flip_probability, every_frame,
                    decode_in_worker=decoder == "pyav", cpu_decoder=decoder == "dali" and not gpu,
                    nvdec=nvdec, cpu_share=cpu_share if decoder == "mixed" else 0.0)

    @pipeline_def
    def pipe() -> Any:
        drawn = {name: fn.external_source(name=name, no_copy=True) for name in draw.names
                 if name not in ("frames", "start") or name == "start" and decoder == "dali"}
        if decoder == "pyav":
            video = fn.external_source(name="frames", no_copy=True, dtype=types.UINT8,
                                       layout="FHWC")
        elif nvdec:  # decoded in the server before the feed (pipelines/_nvdec.py)
            video = fn.external_source(name=input_name, device="gpu", no_copy=True,
                                       dtype=types.UINT8, layout="FHWC")
        else:
            encoded = fn.external_source(name=input_name, no_copy=True, dtype=types.UINT8)
            chosen = {} if every_frame else {"start_frame": drawn["start"], "stride": stride,
                                             "sequence_length": frames, "pad_mode": "edge"}
            video = fn.decoders.video(encoded, device="mixed" if gpu else "cpu", **chosen,
                                      **(decoder_options or {}))
        length = video.shape(dtype=types.INT64)[0]
        clip = video_graph(video, gpu=gpu, size=size, resize_size=resize_size,
                           crop_x=drawn.get("crop_x"), crop_y=drawn.get("crop_y"),
                           flip=drawn["flip"],
                           mean=mean, std=std, layout=layout, dtype=dtype, cpu_resize=cpu_resize)
        if every_frame:
            return fn.pad(clip, axes=[1 if layout == "CTHW" else 0], fill_value=0), length
        return clip

    built = pipe(batch_size=batch_size, num_threads=num_threads, device_id=dev_id,
                 prefetch_queue_depth=prefetch_queue_depth)
    from mmproxy.proxy import SampleSeeded  # the proxy draws the clip's place per sample

    prepare = None
    if nvdec:
        assert dev_id is not None
        prepare = ClipDecoder(input_name, None if every_frame else frames, stride, dev_id,
                              decode_threads, decoder_options,
                              tuple(n for n in draw.names if n != "start"))
    return SampleSeeded(built, draw, draw.arguments, prepare)
