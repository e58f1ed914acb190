"""Video: clips per second of mmproxy against PyTorch workers decoding with PyAV, DALI's own
video reader on the same files, and DALI's proxy; each system in turn, same process.

The workload: ``--clips`` H.264 clips of 5-10 s (25 fps, ``--resolution`` 320x240 by default,
a key frame every 12 frames, written once under ``--data-dir`` as shards for mmproxy and as .mp4
files for the reader), a training clip of 16 frames at stride 4 from a random start, the shorter
side resized to 256, a random 224 crop, a flip, normalized to float32 NCTHW. Each system reports
its best and sustained clips/s and the CPU it used: CPU milliseconds per clip (workers and the
main process's threads together) and the cores that kept busy. The systems:

- ``mmproxy-pyav`` (the default decoder): ``video_label_dataset`` on the shards; the worker reads
  the container header, draws the start, crop and flip, and decodes the clip's frames with PyAV;
  the server resizes, crops and normalizes (on the GPU when there is one).
- ``mmproxy-nvdec`` (GPU only): ``decoder="nvdec"``: the worker reads the header and draws the
  clip, the server decodes it with PyNvVideoCodec on ``--decode-threads`` threads (NVDEC) and the
  GPU resizes, crops and normalizes; ``mmproxy-nvdec[max_width=1280,max_height=720]`` passes
  options to ``SimpleDecoder``.
- ``mmproxy-torchcodec`` (GPU only): ``decoder="nvdec"`` with ``nvdec_library="torchcodec"``: the
  same, NVDEC driven by TorchCodec (a ``VideoDecoder`` per clip over its decoder cache);
  ``mmproxy-torchcodec[seek_mode='exact']`` passes options to ``VideoDecoder``;
  ``mmproxy-mixed-torchcodec`` is ``mmproxy-mixed`` with TorchCodec.
- ``mmproxy-mixed`` (GPU only): ``decoder="mixed"``: the workers decode with PyAV the clips
  NVDEC's queue would keep waiting longer than they take (``--cpu-share auto``, the default), the
  server's NVDEC the others (``mmproxy-mixed[0.3]``: a fixed share drawn per clip instead); the
  result's ``worker_share`` says how many the workers decoded, over all epochs.
- ``mmproxy-dali`` (GPU only): ``decoder="dali"``: DALI's in-memory NVDEC decoder
  (``fn.decoders.video``, ``mixed``); ``mmproxy-dali[build_index=False]`` passes options to it.
- ``torch``: a ``torch.utils.data.DataLoader`` over the files; each worker decodes the clip with
  PyAV (seeking to the key frame before the start, on FFmpeg's threads), resizes with
  torchvision, crops, flips and normalizes (what a PyTorch video pipeline does without DALI);
  ``torch[threads=False]`` decodes on each worker's own thread alone, as mmproxy's workers do.
- ``dali-reader``: ``fn.readers.video`` on the files (GPU only: DALI's video reader decodes with
  NVDEC), one 16-frame sequence per file (``step`` past the end), shuffled, then the same graph.
- ``dali-proxy``: DALI's own proxy feeding encoded clips to ``fn.decoders.video`` (GPU only), start
  frames drawn by DALI.

    python benchmarks/video_bench.py --clips 512 --resolution 596x336 --workers 15 --threads 8 \\
        --epochs 2 --systems mmproxy-pyav,torch,mmproxy-dali,dali-reader,dali-proxy \\
        --json benchmarks/results/gpu-h200/video-596x336-dali.json
    python benchmarks/video_bench.py --clips 128 --workers 2 --threads 2 --epochs 3 --batch-size 8 \\
        --systems mmproxy-pyav,torch --json benchmarks/results/cpu-2core/video.json

``--stacks`` adds to each system's result where this process's threads were found, sampled every
10 ms, and on a GPU NVDEC's utilization (:mod:`mmproxy.apps.bench.stacks`).
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import random
import re
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import _harness  # this script's folder is on the path
import numpy as np
import torch

from mmproxy.apps.bench.cpu import cores_apart, pin_threads
from mmproxy.apps.bench.stacks import ThreadStacks

FRAMES, STRIDE, SIZE, RESIZE = 16, 4, 224, 256
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1) * 255


def _clip(job: tuple[int, int, int]) -> bytes:
    from mmproxy.testing import synth_video, video_bytes

    i, width, height = job
    seconds = 5 + (i * 7919 % 1000) / 200  # 5-10 s
    return video_bytes(synth_video(i, int(25 * seconds), height, width), "libx264", "mp4", crf=23)


def write_clips(folder: Path, count: int, width: int, height: int) -> tuple[list[str], list[str]]:
    """(shards, files) of ``count`` clips under ``folder``, written once."""
    from mmproxy.testing import write_tar

    where = folder / f"video-{count}-{width}x{height}"
    files = [str(where / "files" / f"{i:05d}.mp4") for i in range(count)]
    shards = [str(where / f"shard-{s:04d}.tar") for s in range((count + 15) // 16)]
    if not Path(shards[-1]).exists():
        (where / "files").mkdir(parents=True, exist_ok=True)
        with multiprocessing.get_context("spawn").Pool(os.cpu_count()) as pool:
            clips = pool.map(_clip, [(i, width, height) for i in range(count)], chunksize=4)
        for path, data in zip(files, clips):
            Path(path).write_bytes(data)
        for s, shard in enumerate(shards):
            write_tar(shard + ".part", [{"__key__": f"clip{i:05d}", "mp4": clips[i],
                                         "cls": str(i % 400)}
                                        for i in range(s * 16, min(count, s * 16 + 16))])
            os.replace(shard + ".part", shard)
    return shards, files


class TorchClips(torch.utils.data.Dataset):
    """Files decoded with PyAV in the worker, then torchvision: the PyTorch-only system. PyAV
    decodes on FFmpeg's threads, as PyAV's documentation advises for speed (``threads=False``:
    on the worker's own thread alone, as mmproxy's workers do)."""

    def __init__(self, files: list[str], threads: bool = True) -> None:
        self.files, self.threads = files, threads

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from mmproxy.datasets.checks import video_info
        from mmproxy.pipelines.video import clip_start, decode_clip
        from torchvision.transforms.v2 import functional as F

        data = Path(self.files[i]).read_bytes()
        rng = random.Random()
        info = video_info(data)
        start = clip_start(info.frames if info else None, FRAMES, STRIDE, True, rng)
        clip = torch.from_numpy(decode_clip(data, start, FRAMES, STRIDE, threads=self.threads))
        clip = clip.permute(0, 3, 1, 2)
        clip = F.resize(clip, RESIZE, antialias=True)
        h, w = clip.shape[-2:]
        y, x = rng.randint(0, h - SIZE), rng.randint(0, w - SIZE)
        clip = clip[..., y:y + SIZE, x:x + SIZE]
        if rng.random() < 0.5:
            clip = clip.flip(-1)
        return ((clip.permute(1, 0, 2, 3).float() - MEAN) / STD), i % 400


def _pin_worker(args: Any) -> Any:
    """``--worker-cpus``: a ``worker_init_fn`` that moves each worker onto those cores."""
    from mmproxy.apps.bench.cpu import PinWorker
    from mmproxy.apps.bench.remote import cpu_list

    cores = cpu_list(args.worker_cpus)
    return None if cores is None else PinWorker(cores)


def _graph(video: Any, gpu: bool, train_draws: bool) -> Any:
    from mmproxy.pipelines import video_graph
    from nvidia.dali import fn

    draws = {"crop_x": fn.random.uniform(range=(0.0, 1.0)), "crop_y": fn.random.uniform(
        range=(0.0, 1.0)), "flip": fn.random.coin_flip()} if train_draws else {}
    return video_graph(video, gpu=gpu, size=SIZE, resize_size=RESIZE, **draws)


def _mmproxy(args: Any, gpu: bool, device_id: Any, shards: list[str], files: list[str],
             decoder: str, options: Any = None, library: str = "pynvvideocodec") -> Any:
    from mmproxy.datasets import video_label_dataset
    from mmproxy.pipelines import video_pipeline

    import mmproxy
    from mmproxy.apps.bench.timing import time_epochs

    share = options if isinstance(options, (float, str)) else args.cpu_share
    pipe = video_pipeline(batch_size=args.batch_size, frames=FRAMES, stride=STRIDE, size=SIZE,
                          resize_size=RESIZE, device="gpu" if gpu else "cpu", device_id=device_id,
                          num_threads=args.threads, decoder=decoder,  # type: ignore[arg-type]
                          decoder_options=None if isinstance(options, (float, str)) else options,
                          decode_threads=args.decode_threads, cpu_share=share,
                          nvdec_library=library)  # type: ignore[arg-type]
    with mmproxy.DALIServer(pipe, name="video", pipelines=args.pipelines) as server:
        ds = video_label_dataset(shards, server, batch_size=args.batch_size, shuffle_buffer=64,
                                 keep_keys=False, on_error="skip")
        loader = ds.loader(server, num_workers=args.workers, persistent_workers=True,
                           worker_init_fn=_pin_worker(args))
        result = time_epochs(lambda: loader, args.epochs, gpu, server)
        result["pipelines"] = server.pipelines
    if pipe.prepare is not None:  # NVDEC: where the clips were decoded, over all epochs (the
        # warm-up too), the workers' including any in a codec NVDEC does not take
        clips = pipe.prepare.clips
        result["clips_decoded"] = dict(clips)
        result["worker_share"] = round(clips["workers"] / max(1, sum(clips.values())), 3)
    return result


def _torch(args: Any, gpu: bool, device_id: Any, shards: list[str], files: list[str],
           options: dict[str, Any] | None = None) -> Any:
    """``torch[threads=False]``: PyAV on each worker's own thread alone."""
    from mmproxy.apps.bench.timing import time_epochs

    clips = TorchClips(files, **(options or {}))
    loader = torch.utils.data.DataLoader(clips, batch_size=args.batch_size, shuffle=True,
                                         num_workers=args.workers, pin_memory=gpu,
                                         persistent_workers=True, worker_init_fn=_pin_worker(args))
    return time_epochs(lambda: ((b[0].cuda(non_blocking=True) if gpu else b[0]) for b in loader),
                       args.epochs, gpu)


def _dali_reader(args: Any, gpu: bool, device_id: Any, shards: list[str], files: list[str]) -> Any:
    from nvidia.dali import fn, pipeline_def
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    from mmproxy.apps.bench.timing import time_epochs

    @pipeline_def
    def reader() -> Any:
        video = fn.readers.video(device="gpu", filenames=files, sequence_length=FRAMES,
                                 stride=STRIDE, step=100_000, random_shuffle=True,
                                 initial_fill=64, name="reader")
        return _graph(video, True, True)

    it = DALIGenericIterator(reader(batch_size=args.batch_size, num_threads=args.threads,
                                    device_id=device_id), ["video"], reader_name="reader",
                             auto_reset=True, last_batch_policy=LastBatchPolicy.PARTIAL)
    return time_epochs(lambda: (b[0]["video"] for b in it), args.epochs, gpu)


def _dali_proxy(args: Any, gpu: bool, device_id: Any, shards: list[str], files: list[str]) -> Any:
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch.experimental import proxy as dali_proxy

    from mmproxy.apps.bench.timing import time_epochs

    @pipeline_def
    def proxied() -> Any:
        encoded = fn.external_source(name="videos", no_copy=True, dtype=types.UINT8)
        start = fn.cast(fn.random.uniform(range=(0.0, 100.0)), dtype=types.INT32)
        video = fn.decoders.video(encoded, device="mixed", start_frame=start,
                                  sequence_length=FRAMES, stride=STRIDE, pad_mode="edge")
        return _graph(video, True, True)

    with dali_proxy.DALIServer(proxied(batch_size=args.batch_size, num_threads=args.threads,
                                       device_id=device_id)) as server:
        loader = dali_proxy.DataLoader(server, ProxyFiles(files, server.proxy),
                                       batch_size=args.batch_size, shuffle=True,
                                       num_workers=args.workers, persistent_workers=True,
                                       worker_init_fn=_pin_worker(args))
        return time_epochs(lambda: (b[0] for b in loader), args.epochs, gpu)


def _variant(system: str) -> tuple[str, Any]:
    """``mmproxy-dali[build_index=False,affine=False]`` -> the name and the decoder's extra
    arguments (Python literals); ``mmproxy-mixed[0.3]`` -> the name and the CPU share
    (``mmproxy-mixed[auto]``: balanced by load)."""
    name, _, rest = system.partition("[")
    rest = rest.rstrip("]")
    if rest and "=" not in rest:
        return name, rest if rest == "auto" else float(rest)
    pairs = (item.split("=", 1) for item in rest.split(",") if item)
    return name, {key.strip(): ast.literal_eval(value.strip()) for key, value in pairs}


SYSTEMS: dict[str, Callable[..., Any]] = {"mmproxy-pyav": partial(_mmproxy, decoder="pyav"),
           "mmproxy-nvdec": partial(_mmproxy, decoder="nvdec"),
           "mmproxy-mixed": partial(_mmproxy, decoder="mixed"),
           "mmproxy-torchcodec": partial(_mmproxy, decoder="nvdec", library="torchcodec"),
           "mmproxy-mixed-torchcodec": partial(_mmproxy, decoder="mixed", library="torchcodec"),
           "mmproxy-dali": partial(_mmproxy, decoder="dali"),
           "torch": _torch, "dali-reader": _dali_reader, "dali-proxy": _dali_proxy}
GPU_ONLY = ("dali-reader", "dali-proxy", "mmproxy-dali", "mmproxy-nvdec", "mmproxy-mixed",
            "mmproxy-torchcodec", "mmproxy-mixed-torchcodec")


def _cpu_per_clip(r: dict[str, Any]) -> None:
    """Adds the CPU milliseconds per clip (every group) and the cores they kept busy."""
    per_batch = sum((r.get("cpu_ms_per_batch") or {}).values())
    per_clip = per_batch * r["batches"] / max(1, r["samples"])
    r["cpu_ms_per_clip"] = round(per_clip, 2)
    r["cpu_cores_busy"] = round(per_clip * r["samples_per_s"] / 1000, 2)


def main() -> None:
    parser = _harness.parser(__doc__, workers=15, threads=8, batch_size=32)
    parser.add_argument("--clips", type=int, default=2048, help="clips written (5-10 s each)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per system (the first is "
                        "the warm-up)")
    parser.add_argument("--systems", default="mmproxy-nvdec,mmproxy-mixed,mmproxy-pyav,torch",
                        help="comma-separated, of " + ", ".join(SYSTEMS) + "; NAME[KEY=VALUE,...] "
                        "passes options to the decoder, mmproxy-mixed[SHARE] a CPU share")
    parser.add_argument("--decode-threads", type=int, default=8,
                        help="NVDEC decode threads in the server (mmproxy-nvdec, -mixed, -torchcodec)")
    parser.add_argument("--cpu-share", type=lambda v: v if v == "auto" else float(v),
                        default="auto", help="mmproxy-mixed: the share of the clips the workers "
                        "decode, or 'auto' (balanced by NVDEC's backlog)")
    parser.add_argument("--pipelines", type=lambda v: v if v == "auto" else int(v), default=1,
                        help="the mmproxy systems' pipelines side by side (N or auto; NVDEC's "
                        "decode threads are the server's, shared by them)")
    parser.add_argument("--resolution", default="320x240", help="WIDTHxHEIGHT of the clips")
    parser.add_argument("--stacks", action="store_true",
                        help="sample the threads' Python frames (and NVDEC's utilization) while "
                        "each system runs; the result's 'stacks' (module docstring)")
    parser.add_argument("--worker-cpus", default=None,
                        help="the DataLoader workers on these cores (like 6-15), this process's "
                        "threads (DALI's, the NVDEC decode threads, the main loop) on the others")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="Python's thread switch interval in seconds for this process "
                        "(sys.setswitchinterval; Python's default 0.005)")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    width, height = (int(v) for v in args.resolution.split("x"))
    gpu, device_id, _, folder = _harness.setup(args)
    shards, files = write_clips(folder, args.clips, width, height)
    apart = cores_apart(args.worker_cpus)
    results: dict[str, Any] = {}

    for system in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", args.systems):
        name, options = _variant(system)
        if name in GPU_ONLY and not gpu:
            print(f"{system}: GPU only (NVDEC), skipped", flush=True)
            continue
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
        more = {"options": options} if options else {}
        if apart:  # this process's threads off the workers' cores (dali-reader has no workers)
            pin_threads(apart[0] if name == "dali-reader" else apart[1])
        if args.stacks:
            with ThreadStacks(gpu, device_id) as sampler:
                results[system] = r = SYSTEMS[name](args, gpu, device_id, shards, files, **more)
            r["stacks"] = sampler.report()
        else:
            results[system] = r = SYSTEMS[name](args, gpu, device_id, shards, files, **more)
        _cpu_per_clip(r)
        share = (f", workers decoded {r['worker_share']:.0%}" if r.get("worker_share") is not None
                 else "")
        print(f"{system:14s} best epoch {r['samples_per_s']:.1f} clips/s, sustained "
              f"{r['sustained_samples_per_s'] or 0:.1f}, epochs {r['epochs']}, CPU "
              f"{r['cpu_ms_per_clip']:.1f} ms a clip ({r['cpu_cores_busy']:.1f} cores busy)"
              f"{share}", flush=True)
        # after every system: a run cut short keeps what it measured
        _harness.write_json(args.json, args, gpu, {"systems": results})
    for mine in ("mmproxy-torchcodec", "mmproxy-nvdec", "mmproxy-mixed", "mmproxy-pyav"):
        for system, r in results.items():
            if mine in results and system != mine:
                ratio = results[mine]["samples_per_s"] / r["samples_per_s"]
                print(f"{mine} / {system}: {ratio:.2f} (best epochs)")


class ProxyFiles(torch.utils.data.Dataset):
    """The files' bytes through DALI's proxy."""

    def __init__(self, files: list[str], proxy: Any) -> None:
        self.files, self.proxy = files, proxy

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.proxy(np.frombuffer(Path(self.files[i]).read_bytes(), np.uint8)), i % 400


if __name__ == "__main__":
    main()
