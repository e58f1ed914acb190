"""Image pipelines: encoded bytes in, normalized crops out.

Each pipeline is a graph function (:func:`image_train_graph`, :func:`image_eval_graph`: DALI nodes
in, DALI nodes out) behind a named ``fn.external_source``; the same graph serves behind a DALI
reader (``fn.readers.webdataset``, ``fn.readers.file``) inside a ``pipeline_def`` of your own.
docs/internals.md, ``mmproxy.pipelines.image``, has the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Literal

from mmproxy.pipelines._crop_draw import RandomResizedCrop
from mmproxy.pipelines.external import Device, external_pipeline, resolve_device

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "RandomResizedCrop", "centre_crop_position",
           "image_eval_graph", "image_eval_pipeline", "image_train_graph", "image_train_pipeline",
           "resize"]

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
Layout = Literal["CHW", "HWC"]
DType = Literal["float32", "float16", "uint8"]
CpuResize = Literal["torchvision", "dali"]


class _TorchvisionResize:
    """Resizes one HWC uint8 image with torchvision (antialiased bilinear); DALI calls it through
    ``fn.python_function``, one sample at a time. An int ``size`` is the shorter side."""

    def __init__(self, size: int | tuple[int, int]) -> None:
        self.size = [size] if isinstance(size, int) else list(size)
        # Imported when the pipeline is built, not in its first run: torchvision brings ~1,000
        # modules, and they should exist before the loader freezes the collector's heap.
        from torchvision.transforms.v2 import functional  # noqa: F401

    def __call__(self, image: Any) -> Any:
        import torch
        from torchvision.transforms.v2 import functional as F

        if image.ndim == 4:  # a sequence of frames, FHWC
            fchw = torch.from_numpy(image).permute(0, 3, 1, 2)
            return F.resize(fchw, self.size, antialias=True).permute(0, 2, 3, 1).contiguous().numpy()
        chw = torch.from_numpy(image).permute(2, 0, 1)
        return F.resize(chw, self.size, antialias=True).permute(1, 2, 0).contiguous().numpy()


def resize(images: Any, size: int, *, gpu: bool, cpu_resize: CpuResize = "torchvision",
           shorter: bool = False, layout: Literal["HWC", "FHWC"] = "HWC") -> Any:
    """Antialiased bilinear resize of decoded HWC images, or FHWC frame sequences (DALI nodes),
    to ``size x size``, or of their shorter side to ``size``: DALI's ``fn.resize`` on a GPU or
    with ``cpu_resize="dali"``, else torchvision inside the pipeline."""
    from nvidia.dali import fn, types

    if cpu_resize not in ("torchvision", "dali"):
        raise ValueError(f"cpu_resize must be 'torchvision' or 'dali', got {cpu_resize!r}")
    if gpu or cpu_resize == "dali":
        target: dict[str, Any] = {"resize_shorter": size} if shorter else {"size": [size, size]}
        return fn.resize(images, interp_type=types.INTERP_LINEAR, antialias=True, **target)
    return fn.python_function(images, function=_TorchvisionResize(size if shorter else (size, size)),
                              num_outputs=1, output_layouts=layout)


def centre_crop_position(images: Any, size: int, *, layout: Literal["HWC", "FHWC"] = "HWC"
                         ) -> tuple[Any, Any]:
    """``crop_pos_x`` and ``crop_pos_y`` (DALI nodes) that put a ``size`` square where
    torchvision's ``CenterCrop`` puts it in images at least that large: ``round((side - size) /
    2)`` pixels in, halves rounded to even as Python rounds them (a margin of 5 puts it 2 in, one
    of 7 puts it 4 in; DALI's own ``0.5`` rounds every half up, one pixel right or down for half
    the odd margins). Costs a few scalar operations per sample."""
    import nvidia.dali.math as dmath
    from nvidia.dali import types

    shape = images.shape(dtype=types.INT64)
    first = 1 if layout == "FHWC" else 0

    def position(side: Any) -> Any:
        margin = side - size
        half = margin // 2
        offset = half + (margin & 1) * (half & 1)  # an odd half rounds to the even neighbour
        return offset / dmath.max(margin, 1)  # DALI places it at round(position * margin)

    return position(shape[first + 1]), position(shape[first])


def _check_resize_size(size: int, resize_size: int | None) -> None:
    """Refuses a ``resize_size`` smaller than the ``size`` crop cut from the resized image."""
    if resize_size is not None and resize_size < size:
        raise ValueError(f"resize_size={resize_size} is smaller than size={size}: the "
                         f"{size}x{size} crop is cut from the image resized to {resize_size}")


def _normalize(images: Any, *, size: int, layout: Layout, dtype: DType, mean: Sequence[float],
               std: Sequence[float], mirror: Any = None, crop: bool = False) -> Any:
    from nvidia.dali import fn, types

    dali_type = {"float32": types.FLOAT, "float16": types.FLOAT16, "uint8": types.UINT8}[dtype]
    if dtype == "uint8":
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    kwargs: dict[str, Any] = {}
    if crop:
        x, y = centre_crop_position(images, size)
        kwargs = {"crop": (size, size), "crop_pos_x": x, "crop_pos_y": y}
    if mirror is not None:
        kwargs["mirror"] = mirror
    return fn.crop_mirror_normalize(images, dtype=dali_type, output_layout=layout,
                                    mean=list(mean), std=list(std), **kwargs)


def _decoder_share(gpu: bool, hw_decoder_load: float | None) -> float | None:
    """The share of JPEGs the GPU's hardware decoder takes (the rest are decoded by DALI's
    threads with the GPU): None (DALI's default) when not given, or on the CPU."""
    if hw_decoder_load is None:
        return None
    if isinstance(hw_decoder_load, bool) or not 0.0 <= hw_decoder_load <= 1.0:
        raise ValueError(f"hw_decoder_load must be between 0 and 1, got {hw_decoder_load!r}")
    return float(hw_decoder_load) if gpu else None


def image_train_graph(encoded: Any, *, gpu: bool, size: int = 224,
                      scale: tuple[float, float] = (0.08, 1.0),
                      ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_probability: float = 0.5,
                      mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                      layout: Layout = "CHW", dtype: DType = "float32",
                      cpu_resize: CpuResize = "torchvision", crop_anchor: Any = None,
                      crop_shape: Any = None, flip: Any = None, roi_decode: bool = True,
                      hw_decoder_load: float | None = None) -> Any:
    """The training graph: encoded images (a DALI node) to random-resized, flipped, normalized
    crops. Call it inside a ``pipeline_def``; arguments as in :func:`image_train_pipeline`, with
    ``gpu`` from :func:`~mmproxy.pipelines.resolve_device`.

    With ``crop_anchor``, ``crop_shape`` (relative, x then y) and ``flip`` (DALI nodes: the
    inputs :class:`RandomResizedCrop` draws), the crop and flip are those; without them DALI
    draws them (``fn.decoders.image_random_crop``, ``fn.random.coin_flip``), as behind a reader.
    ``roi_decode``: decode only the window (``fn.decoders.image_slice``), or the whole image and
    then slice it (``fn.decoders.image`` + ``fn.slice``).
    """
    from nvidia.dali import fn, types

    device = "mixed" if gpu else "cpu"
    load = _decoder_share(gpu, hw_decoder_load)
    if crop_anchor is None:
        images = fn.decoders.image_random_crop(
            encoded, device=device, output_type=types.RGB, random_area=list(scale),
            random_aspect_ratio=list(ratio), hw_decoder_load=load)
        flip = fn.random.coin_flip(probability=flip_probability)
    elif roi_decode:
        images = fn.decoders.image_slice(
            encoded, crop_anchor, crop_shape, device=device, output_type=types.RGB,
            normalized_anchor=True, normalized_shape=True, axis_names="WH",
            hw_decoder_load=load)
    else:
        images = fn.slice(fn.decoders.image(encoded, device=device, output_type=types.RGB,
                                            hw_decoder_load=load),
                          crop_anchor, crop_shape, normalized_anchor=True, normalized_shape=True,
                          axis_names="WH")
    images = resize(images, size, gpu=gpu, cpu_resize=cpu_resize)
    return _normalize(images, size=size, layout=layout, dtype=dtype, mean=mean, std=std,
                      mirror=flip)


def image_eval_graph(encoded: Any, *, gpu: bool, size: int = 224, resize_size: int | None = None,
                     mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                     layout: Layout = "CHW", dtype: DType = "float32",
                     cpu_resize: CpuResize = "torchvision",
                     hw_decoder_load: float | None = None) -> Any:
    """The evaluation graph: encoded images (a DALI node) to center crops of the resized image,
    normalized. Call it inside a ``pipeline_def``; arguments as in :func:`image_eval_pipeline`."""
    from nvidia.dali import fn, types

    images = fn.decoders.image(encoded, device="mixed" if gpu else "cpu", output_type=types.RGB,
                               hw_decoder_load=_decoder_share(gpu, hw_decoder_load))
    images = resize(images, resize_size or round(size * 256 / 224), gpu=gpu,
                    cpu_resize=cpu_resize, shorter=True)
    return _normalize(images, size=size, layout=layout, dtype=dtype, mean=mean, std=std, crop=True)


def image_train_pipeline(*, batch_size: int, size: int = 224,
                         scale: tuple[float, float] = (0.08, 1.0),
                         ratio: tuple[float, float] = (3 / 4, 4 / 3), flip_probability: float = 0.5,
                         mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                         layout: Layout = "CHW", dtype: DType = "float32", device: Device = "auto",
                         device_id: int | None = None, num_threads: int = 4, seed: int | None = None,
                         prefetch_queue_depth: int = 2, input_name: str = "images",
                         cpu_resize: CpuResize = "torchvision", sample_seeded: bool = False,
                         hw_decoder_load: float | None = None) -> Any:
    """Training: random-resized crop (like torchvision's RandomResizedCrop), flip, normalize.

    With ``sample_seeded=True`` the crop window and the flip are drawn by the proxy from each
    sample's seed (:class:`RandomResizedCrop`; a :class:`~mmproxy.datasets.MultiModalDataset`
    derives it from its seed, the epoch and the key) and the decoder decodes that window: a
    sample's augmentation does not depend on the worker, batch or run it lands in, so a resumed
    run repeats the uninterrupted one exactly. It costs throughput on a GPU (the decoder is
    given each sample's window instead of drawing it; on CPU the two match: BENCHMARKS.md,
    "Resume"), so by default DALI draws them from its ``seed`` (a resumed run then repeats the
    order, not the augmentation).

    Args:
        batch_size: The largest batch the server will be asked to run.
        size: Output height and width.
        scale: Range of the crop's area as a fraction of the image's.
        ratio: Range of the crop's aspect ratio.
        flip_probability: Chance of a horizontal flip.
        mean: Per-channel mean, 0-255 units.
        std: Per-channel standard deviation, 0-255 units.
        layout: "CHW" or "HWC".
        dtype: "float32", "float16" or "uint8".
        device: "auto" (GPU when CUDA is available), "gpu" or "cpu".
        device_id: The GPU to use; the current one when None.
        num_threads: DALI CPU threads.
        seed: DALI's random seed (None: random).
        prefetch_queue_depth: Runs the server keeps in flight.
        input_name: Name of the ``external_source`` (the proxy's argument).
        cpu_resize: On CPU, resize with "torchvision" (inside the DALI pipeline; the faster of
            the two, module docstring) or with DALI's own "dali" ``fn.resize``. Ignored on a GPU.
        sample_seeded: Draw the crop and flip per sample from its seed (above).
        hw_decoder_load: On a GPU, the share of JPEGs for its hardware decoder, the rest decoded
            by DALI's threads (None: DALI's default, 0.65). With several pipelines a server
            (docs/pipelines.md) a lower share can keep both busy. Ignored on the CPU.
    """
    gpu, dev_id = resolve_device(device, device_id)
    graph = partial(image_train_graph, gpu=gpu, size=size, scale=scale, ratio=ratio,
                    flip_probability=flip_probability, mean=mean, std=std, layout=layout,
                    dtype=dtype, cpu_resize=cpu_resize, hw_decoder_load=hw_decoder_load)
    drawn = RandomResizedCrop(input_name, scale, ratio, flip_probability) if sample_seeded else None
    pipe = external_pipeline(graph, input_name=input_name, batch_size=batch_size,
                             num_threads=num_threads, device_id=dev_id, seed=seed,
                             prefetch_queue_depth=prefetch_queue_depth,
                             more_inputs=drawn.names if drawn else ())
    from mmproxy.proxy import SampleSeeded  # the proxy draws the crop and flip per sample

    return pipe if drawn is None else SampleSeeded(pipe, drawn)


def image_eval_pipeline(*, batch_size: int, size: int = 224, resize_size: int | None = None,
                        mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                        layout: Layout = "CHW", dtype: DType = "float32", device: Device = "auto",
                        device_id: int | None = None, num_threads: int = 4,
                        prefetch_queue_depth: int = 2, input_name: str = "images",
                        cpu_resize: CpuResize = "torchvision",
                        hw_decoder_load: float | None = None) -> Any:
    """Evaluation: resize the shorter side to ``resize_size`` (default ``size * 256 / 224``),
    center crop ``size``, normalize. Deterministic. Other arguments as in
    :func:`image_train_pipeline`.
    """
    _check_resize_size(size, resize_size)
    gpu, dev_id = resolve_device(device, device_id)
    graph = partial(image_eval_graph, gpu=gpu, size=size, resize_size=resize_size, mean=mean,
                    std=std, layout=layout, dtype=dtype, cpu_resize=cpu_resize,
                    hw_decoder_load=hw_decoder_load)
    return external_pipeline(graph, input_name=input_name, batch_size=batch_size,
                             num_threads=num_threads, device_id=dev_id,
                             prefetch_queue_depth=prefetch_queue_depth)
