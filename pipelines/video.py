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
=============  ===================================  ============================================

``"auto"`` is ``"pyav"`` when PyAV is installed, else ``"dali"``. Measured on an H200 with 15
workers (BENCHMARKS.md, "Video"): on 596x336 H.264 clips PyAV in the workers with the resize
and crop on the GPU gave 124 clips/s, DALI's in-memory NVDEC decoder 11.6 (DALI's own file
reader, which decodes with NVDEC too, 48.5; PyTorch workers doing everything on CPU 72); on
320x240 clips NVDEC gave 62. So NVDEC is opt-in (``decoder="dali"``) until DALI's in-memory
decoder catches up. A sample the chosen decoder cannot decode fails with a message naming its
codec (a skip record with ``on_error="skip"``).

Cost: the decode dominates. With ``"pyav"`` the workers decode only the clip's frames (seeking
to the key frame before its start, after reading the packets' timestamps: ~1 ms for a 10 s
596x336 clip, ~2% of its decode) and send them to the server (a 16-frame 596x336 clip is 9.6
MB of RGB, through shared memory); the resize, crop and normalize run on the GPU, or on CPU in
torchvision inside the pipeline (``cpu_resize``). With ``"dali"`` on a GPU the worker only reads
the container header (~10-50 us a clip) and NVDEC decodes.
"""

from __future__ import annotations

import io
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
from mmproxy.pipelines._device import Device, resolve_device
from mmproxy.pipelines.image import IMAGENET_MEAN, IMAGENET_STD, CpuResize, DType, resize

if TYPE_CHECKING:
    from mmproxy.datasets.checks import VideoInfo

__all__ = ["CPU_CODECS", "ClipDraw", "VideoDecoder", "decode_clip", "video_graph", "video_pipeline"]

VideoDecoder = Literal["auto", "dali", "pyav"]
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
    """Frames ``start, start + stride, ...`` (``frames`` of them, the last repeated past the end;
    every frame with ``frames=None``) decoded with PyAV, as uint8 ``[T, H, W, 3]`` RGB.

    Frame ``i`` is the ``i``-th frame in presentation order (what the header's frame count
    counts), also in variable-frame-rate videos: the packets' timestamps are read first (no
    decoding), then the decode seeks to the key frame before ``start``'s timestamp instead of
    starting from the beginning. A video whose packets lack timestamps, or where the seek lands
    past ``start``, is decoded from the beginning, counting frames."""
    wanted = None if frames is None else [(start or 0) + i * stride for i in range(frames)]
    out = _decode(data, wanted, seek=bool(wanted and wanted[0] > 0))
    if out is None:
        out = _decode(data, wanted, seek=False)
    if not out:
        raise ValueError("the video holds no decodable frame at the clip's position")
    clip = np.stack(out)
    if frames is not None and len(clip) < frames:  # past the end: repeat the last frame
        clip = np.concatenate([clip, np.repeat(clip[-1:], frames - len(clip), axis=0)])
    return clip


def _decode(data: bytes | memoryview, wanted: list[int] | None,
            seek: bool) -> list[np.ndarray] | None:
    """The frames ``wanted`` (every frame with None), counted from the beginning; with ``seek``
    from the key frame before the first: the first frame decoded takes its index from its pts,
    the next ones are counted. None when seeking fails: packets without pts, or the seek went
    past the first frame wanted (H.264 with B-frames in AVI, whose pts are guesses)."""
    import av

    out: list[np.ndarray] = []
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
    return out


class ClipDraw:
    """The video pipeline's per-sample draws (a :class:`~mmproxy.proxy.SampleRandom`): the clip's
    start frame (or, with ``decode_in_worker``, its decoded frames), the crop position and the
    flip, from the sample's seed. Refuses a codec the server's decoder cannot decode, by name."""

    def __init__(self, input_name: str, frames: int, stride: int, train: bool,
                 flip_probability: float, every_frame: bool, decode_in_worker: bool,
                 cpu_decoder: bool) -> None:
        self.input_name, self.frames, self.stride, self.train = input_name, frames, stride, train
        self.flip_probability, self.every_frame = flip_probability, every_frame
        self.decode_in_worker, self.cpu_decoder = decode_in_worker, cpu_decoder
        place = ("frames",) if decode_in_worker else () if every_frame else ("start",)
        self.names = (*place, "crop_x", "crop_y", "flip")
        self.arguments = (input_name,)

    def __call__(self, given: dict[str, np.ndarray], rng: random.Random) -> dict[str, np.ndarray]:
        from mmproxy.datasets.checks import video_info

        data = given[self.input_name].data.cast("B")
        info = video_info(data)
        if info is not None and self.cpu_decoder and info.codec not in (None, *CPU_CODECS):
            raise ValueError(
                f"{_NAMES.get(info.codec, info.codec)} video: DALI's CPU video decoder decodes "
                f"only {', '.join(_NAMES[c] for c in CPU_CODECS)}; use "
                "video_pipeline(decoder='pyav') (PyAV decodes it in the workers) or a GPU")
        out: dict[str, np.ndarray] = {}
        if not self.every_frame or self.decode_in_worker:
            start = 0 if self.every_frame else clip_start(
                _count_frames(data, info), self.frames, self.stride, self.train, rng)
            if self.decode_in_worker:
                out["frames"] = decode_clip(data, start, None if self.every_frame else self.frames,
                                            self.stride)
            else:
                out["start"] = np.array(start, np.int32)
        centre = not self.train
        out["crop_x"] = np.array(0.5 if centre else rng.random(), np.float32)
        out["crop_y"] = np.array(0.5 if centre else rng.random(), np.float32)
        out["flip"] = np.array(0 if centre else rng.random() < self.flip_probability, np.int32)
        return out


def video_graph(video: Any, *, gpu: bool, size: int = 224, resize_size: int | None = None,
                crop_x: Any = 0.5, crop_y: Any = 0.5, flip: Any = 0,
                mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                layout: VideoLayout = "CTHW", dtype: DType = "float32",
                cpu_resize: CpuResize = "torchvision") -> Any:
    """Decoded clips (a DALI node, ``FHWC`` uint8) to resized, cropped, flipped, normalized
    clips: the shorter side to ``resize_size`` (default ``size * 256 / 224``), a ``size`` square
    at ``crop_x``/``crop_y`` (0-1, same for every frame of a clip), mirrored where ``flip``."""
    from nvidia.dali import fn, types

    if layout not in ("CTHW", "THWC"):
        raise ValueError(f"layout must be 'CTHW' or 'THWC', got {layout!r}")
    if gpu:
        video = video.gpu()
    video = resize(video, resize_size or round(size * 256 / 224), gpu=gpu, cpu_resize=cpu_resize,
                   shorter=True, layout="FHWC")
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
                   decoder_options: Mapping[str, Any] | None = None) -> Any:
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
        decoder: "auto", "dali" or "pyav" (module docstring).
        device: "auto" (GPU when CUDA is available), "gpu" or "cpu".
        device_id: The GPU to use; the current one when None.
        num_threads: DALI CPU threads.
        prefetch_queue_depth: Runs the server keeps in flight.
        input_name: The proxy's argument.
        cpu_resize: On CPU, resize with "torchvision" or DALI's "dali" ``fn.resize``.
        decoder_options: With ``decoder="dali"``: more keyword arguments for DALI's
            ``fn.decoders.video`` (``build_index``, ``affine``, ...).
    """
    from nvidia.dali import fn, pipeline_def, types

    gpu, dev_id = resolve_device(device, device_id)
    if decoder not in ("auto", "dali", "pyav"):
        raise ValueError(f"decoder must be 'auto', 'dali' or 'pyav', got {decoder!r}")
    if decoder == "auto":
        try:
            import av  # noqa: F401
            decoder = "pyav"
        except ImportError:
            decoder = "dali"
    if decoder == "pyav":
        try:
            import av  # noqa: F401
        except ImportError:
            raise ImportError("decoder='pyav' needs PyAV: pip install av (or 'mmproxy[video]')") \
                from None
    if frames < 1 or stride < 1:
        raise ValueError(f"frames and stride must be at least 1, got {frames} and {stride}")
    draw = ClipDraw(input_name, frames, stride, train, flip_probability, every_frame,
                    decode_in_worker=decoder == "pyav", cpu_decoder=decoder == "dali" and not gpu)

    @pipeline_def
    def pipe() -> Any:
        drawn = {name: fn.external_source(name=name, no_copy=True) for name in draw.names
                 if name != "frames"}
        if decoder == "pyav":
            video = fn.external_source(name="frames", no_copy=True, dtype=types.UINT8,
                                       layout="FHWC")
        else:
            encoded = fn.external_source(name=input_name, no_copy=True, dtype=types.UINT8)
            chosen = {} if every_frame else {"start_frame": drawn["start"], "stride": stride,
                                             "sequence_length": frames, "pad_mode": "edge"}
            video = fn.decoders.video(encoded, device="mixed" if gpu else "cpu", **chosen,
                                      **(decoder_options or {}))
        length = video.shape(dtype=types.INT64)[0]
        clip = video_graph(video, gpu=gpu, size=size, resize_size=resize_size,
                           crop_x=drawn["crop_x"], crop_y=drawn["crop_y"], flip=drawn["flip"],
                           mean=mean, std=std, layout=layout, dtype=dtype, cpu_resize=cpu_resize)
        if every_frame:
            return fn.pad(clip, axes=[1 if layout == "CTHW" else 0], fill_value=0), length
        return clip

    built = pipe(batch_size=batch_size, num_threads=num_threads, device_id=dev_id,
                 prefetch_queue_depth=prefetch_queue_depth)
    from mmproxy.proxy import SampleSeeded  # the proxy draws the clip's place per sample

    return SampleSeeded(built, draw, draw.arguments)
