"""Video pipeline: encoded clips in, ``frames`` frames at a ``stride``, resized, cropped, flipped,
normalized.

Inputs:
    ``videos`` (the proxy's argument): the encoded bytes of one video file per sample (uint8,
    1-D): MP4/MOV, WebM/Matroska or AVI.
docs/internals.md, ``mmproxy.pipelines.video``, has the rest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from mmproxy.pipelines.external import Device, resolve_device
from mmproxy.pipelines.image import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CpuResize,
    DType,
    _check_resize_size,
    centre_crop_position,
    resize,
)
from mmproxy.pipelines.video._backlog import Backlog
from mmproxy.pipelines.video._clip_draw import CPU_CODECS, ClipDraw, clip_start
from mmproxy.pipelines.video._nvdec import (
    LIBRARY_CODECS,
    ClipDecoder,
    check_library,
    load_library,
    nvdec_available,
)
from mmproxy.pipelines.video._pyav import decode_clip, pyav_installed

from mmproxy.errors import install_hint

__all__ = ["CPU_CODECS", "ClipDraw", "VideoDecoder", "clip_start", "decode_clip", "video_graph",
           "video_pipeline"]

VideoDecoder = Literal["auto", "dali", "mixed", "nvdec", "pyav"]
VideoLayout = Literal["CTHW", "THWC"]


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
                   cpu_share: float | Literal["auto"] = "auto",
                   nvdec_library: Literal["pynvvideocodec", "torchcodec"] = "pynvvideocodec"
                   ) -> Any:
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
            ``decoder_cache_size``) or, with ``nvdec_library="torchcodec"``, TorchCodec's
            ``VideoDecoder`` (``seek_mode``: ``"approximate"`` unless given).
        decode_threads: With ``"nvdec"`` and ``"mixed"``: the server's NVDEC decode threads.
        cpu_share: With ``"mixed"``: ``"auto"``, a worker decodes a clip with PyAV when the
            server's NVDEC work queued would take longer than the worker takes to decode it
            (balanced by load; which decoder decodes a clip then varies from run to run), or
            the share of the clips the workers decode, drawn per clip from its seed (0-1).
        nvdec_library: With ``"nvdec"`` and ``"mixed"``: the library that drives NVDEC,
            ``"pynvvideocodec"`` (``pip install pynvvideocodec``) or ``"torchcodec"``
            (``pip install torchcodec``, and FFmpeg's shared libraries).
    """
    from nvidia.dali import fn, pipeline_def, types

    if decoder not in ("auto", "dali", "mixed", "nvdec", "pyav"):
        raise ValueError(f"decoder must be 'auto', 'nvdec', 'mixed', 'pyav' or 'dali', got "
                         f"{decoder!r}")
    check_library(nvdec_library)
    if cpu_share != "auto" and not (isinstance(cpu_share, (int, float)) and 0 <= cpu_share <= 1):
        raise ValueError(f"cpu_share must be 'auto' or between 0 and 1, got {cpu_share!r}")
    gpu, dev_id = resolve_device(device, device_id)
    if decoder == "auto":
        decoder = ("nvdec" if gpu and nvdec_available(nvdec_library) else
                   "pyav" if pyav_installed() else "dali")
    if decoder in ("nvdec", "mixed"):
        if not gpu:
            raise ValueError(f"decoder={decoder!r} decodes on the GPU (NVDEC): use device='gpu' "
                             "or 'auto' on a machine with CUDA, or decoder='pyav' on CPU")
        load_library(nvdec_library)
    if decoder in ("pyav", "mixed") and not pyav_installed():
        raise ImportError(f"decoder={decoder!r} needs PyAV: {install_hint('av')}")
    _check_resize_size(size, resize_size)
    if frames < 1 or stride < 1 or size < 1:
        raise ValueError(f"frames, stride and size must be at least 1, got {frames}, {stride} "
                         f"and {size}")
    nvdec = decoder in ("nvdec", "mixed")
    balanced = decoder == "mixed" and cpu_share == "auto"
    backlog = Backlog() if balanced else None
    share = float(cpu_share) if decoder == "mixed" and not balanced else 0.0
    draw = ClipDraw(input_name, frames, stride, train, flip_probability, every_frame,
                    decode_in_worker=decoder == "pyav", cpu_decoder=decoder == "dali" and not gpu,
                    nvdec=nvdec, cpu_share=share, backlog=backlog,
                    nvdec_codecs=LIBRARY_CODECS[nvdec_library])

    @pipeline_def
    def pipe() -> Any:
        drawn = {name: fn.external_source(name=name, no_copy=True) for name in draw.names
                 if name not in ("frames", "start", "at") or name == "start" and decoder == "dali"}
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
                              tuple(n for n in draw.names if n not in ("start", "at")),
                              nvdec_library, backlog)
    return SampleSeeded(built, draw, draw.arguments, prepare)
