"""Bench: the same data through mmproxy, plain PyTorch, DALI's proxy and a pure DALI reader.

Every system reads the same WebDataset shards (written here from synthetic data) with the same
batch size and worker count; each runs ``--epochs`` epochs and its best epoch counts. Results are
printed as ratios to mmproxy and written as JSON (and a PNG bar chart with ``--plot``).
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmproxy.testing import damage_jpeg

if TYPE_CHECKING:
    from mmproxy.pipelines.image import CpuResize

__all__ = ["run"]

TORCH = ("torch", "torch-tensor")
IMAGE_MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
IMAGE_STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def _damaged(i: int, damage: float) -> bool:
    """Whether sample ``i`` is damaged: a fraction ``damage`` of the samples, evenly spread."""
    return damage > 0 and math.floor((i + 1) * damage) > math.floor(i * damage)


def _write_shard(job: tuple[str, str, int, int, float, str]) -> str:
    from mmproxy.testing import WORDS, audio_bytes, image_bytes, synth_image, synth_speech, write_tar

    path, kind, lo, hi, damage, damage_kind = job
    if os.path.exists(path):
        return path
    rows = []
    for i in range(lo, hi):
        if kind == "image":  # ~45 KB JPEGs, like the reference workload
            jpeg = image_bytes(synth_image(i, 375, 500))
            if _damaged(i, damage):
                jpeg = damage_jpeg(jpeg, damage_kind)
            rows.append({"__key__": f"{i:07d}", "jpg": jpeg,
                         "txt": f"{WORDS[i % len(WORDS)]} number {i}", "cls": str(i % 10)})
        else:  # 44.1 kHz WAV, 2-10 s
            secs = 2 + (i * 7919 % 800) / 100
            rows.append({"__key__": f"{i:07d}",
                         "wav": audio_bytes(synth_speech(i, secs, 44100), 44100, "WAV"),
                         "cls": str(i % 10)})
    write_tar(path + ".part", rows)
    os.replace(path + ".part", path)
    return path


def _shards(folder: Path, kind: str, count: int, workers: int = 1, damage: float = 0.0,
            damage_kind: str = "truncate") -> list[str]:
    """Writes (once) ``count`` synthetic samples as shards of 64, in parallel processes; smaller
    shards when 64 would leave a worker without one. With ``damage``, that fraction of the
    images is damaged (see :func:`damage_jpeg`), spread evenly over the shards."""
    from concurrent.futures import ProcessPoolExecutor

    per_shard = min(64, max(1, count // max(1, workers)))
    name = f"{kind}-{count}" if per_shard == 64 else f"{kind}-{count}-by{per_shard}"
    folder = folder / (name + (f"-{damage_kind}{damage:g}" if damage else ""))
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(str(folder / f"{kind}-{s:04d}.tar"), kind, s * per_shard, min(count, (s + 1) * per_shard),
             damage, damage_kind) for s in range(math.ceil(count / per_shard))]
    if all(os.path.exists(j[0]) for j in jobs):
        return [j[0] for j in jobs]
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        return list(pool.map(_write_shard, jobs))


CPU_GROUPS = ("workers", "main-thread", "server-threads", "dali-threads")


def _cpu_seconds() -> dict[tuple[str, int], float]:
    """CPU time so far of each worker (child process) and of each of this process's threads,
    keyed by (group, pid or thread id)."""
    import threading

    import psutil

    me = psutil.Process()
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
            out["workers", child.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    for t in me.threads():
        name = names.get(t.id)
        group = ("main-thread" if name == "MainThread" else "dali-threads" if name is None
                 else "server-threads")  # DALI's own threads are not Python threads
        out[group, t.id] = t.user_time + t.system_time
    return out


def _cpu_ms_per_batch(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float],
                      batches: int) -> dict[str, float]:
    """CPU per batch by group, between two snapshots (a process or thread that ended in between
    is not counted; one that started counts from zero)."""
    out = dict.fromkeys(CPU_GROUPS, 0.0)
    for (group, ident), seconds in after.items():
        out[group] += seconds - before.get((group, ident), 0.0)
    return {k: round(1000 * v / batches, 2) for k, v in out.items()}


def _time_epochs(make_iter: Callable[[], Iterable[Any]], count: Callable[[Any], int], epochs: int,
                 gpu: bool, server: Any = None) -> dict[str, Any]:
    """Times each epoch; the best one counts. Reports, for that epoch, the CPU time per batch of
    the workers and of the main process's threads, and (for mmproxy) the server's idle time."""
    rates, best, n, batches, total, since = [], None, 0, 0, 0, 0.0
    for epoch in range(epochs):
        if epoch == 1:
            since = time.perf_counter()
        n, batches = 0, 0
        cpu0 = _cpu_seconds()
        starved0 = server.starved_seconds if server else 0.0
        waited0 = server.wait_seconds if server else 0.0
        start = time.perf_counter()
        for batch in make_iter():
            n += count(batch)
            batches += 1
        if gpu:
            torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - start))
        total += n if epoch else 0
        if rates[-1] == max(rates):
            cpu1 = _cpu_seconds()
            best = {"cpu_ms_per_batch": _cpu_ms_per_batch(cpu0, cpu1, batches)}
            if server:
                best["server_starved_per_batch_ms"] = round(
                    1000 * (server.starved_seconds - starved0) / batches, 3)
                best["main_loop_wait_per_batch_ms"] = round(
                    1000 * (server.wait_seconds - waited0) / batches, 3)
    # Also the rate over every epoch after the first, wall clock, gaps between epochs included.
    sustained = total / (time.perf_counter() - since) if epochs > 1 else None
    return {"samples_per_s": max(rates), "epochs": [round(r, 1) for r in rates], "samples": n,
            "batches": batches, "sustained_samples_per_s": sustained, **(best or {})}


def _error_line(err: BaseException) -> str:
    """One line for a failed system; for an error raised in a DataLoader worker, its own line
    (torch's message starts with "Caught X in DataLoader worker process N" and a traceback)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()] or [""]
    line = lines[-1] if "Original Traceback" in str(err) else f"{type(err).__name__}: {lines[0]}"
    return line[:300]


# -- pipelines shared by the DALI-based systems ---------------------------------------------------

def _image_ops(jpegs: Any, gpu: bool, cpu_resize: CpuResize) -> Any:
    from nvidia.dali import fn, types

    from mmproxy.pipelines.image import resize as _resize

    images = fn.decoders.image_random_crop(jpegs, device="mixed" if gpu else "cpu",
                                           output_type=types.RGB, random_area=[0.08, 1.0],
                                           random_aspect_ratio=[3 / 4, 4 / 3])
    images = _resize(images, 224, gpu=gpu, cpu_resize=cpu_resize)
    return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                    mean=IMAGE_MEAN, std=IMAGE_STD,
                                    mirror=fn.random.coin_flip(probability=0.5))


def _audio_ops(data: Any, gpu: bool) -> Any:
    from nvidia.dali import fn, types

    audio, rate = fn.decoders.audio(data, dtype=types.FLOAT, downmix=True)
    if gpu:
        audio = audio.gpu()
    audio = fn.audio_resample(audio, in_rate=rate, out_rate=16000.0, dtype=types.FLOAT)
    return fn.pad(audio, axes=[0], fill_value=0.0)


def _input_pipe(kind: str, batch: int, threads: int, device_id: int | None, gpu: bool,
                machinery: bool = False, prefetch: int = 2,
                cpu_resize: CpuResize = "torchvision") -> Any:
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def
    def pipe() -> Any:
        data = fn.external_source(name="data", no_copy=True, dtype=types.UINT8)
        if machinery:
            return data
        return _image_ops(data, gpu, cpu_resize) if kind == "image" else _audio_ops(data, gpu)

    return pipe(batch_size=batch, num_threads=threads, device_id=device_id,
                prefetch_queue_depth=prefetch)


def _reader_pipe(kind: str, paths: list[str], batch: int, threads: int, device_id: int | None,
                 gpu: bool, cpu_resize: CpuResize = "torchvision") -> Any:
    from nvidia.dali import fn, pipeline_def

    ext = "jpg" if kind == "image" else "wav"

    @pipeline_def
    def pipe() -> Any:
        data = fn.readers.webdataset(paths=paths, ext=[ext], random_shuffle=True,
                                     initial_fill=256, name="reader", missing_component_behavior="skip")
        return _image_ops(data, gpu, cpu_resize) if kind == "image" else _audio_ops(data, gpu)

    return pipe(batch_size=batch, num_threads=threads, device_id=device_id)


# -- the systems ----------------------------------------------------------------------------------

class _WdsSamples(torch.utils.data.IterableDataset):
    """Raw samples of the shards, split by worker (used by the torch and DALI-proxy systems)."""

    def __init__(self, paths: list[str], ext: str, fn: Callable[[bytes], Any]) -> None:
        self.paths, self.ext, self.fn = paths, ext, fn

    def __iter__(self) -> Iterator[Any]:
        import webdataset as wds

        info = torch.utils.data.get_worker_info()
        mine = self.paths[info.id::info.num_workers] if info else self.paths
        for sample in wds.tariterators.tarfile_samples({"url": u} for u in mine):
            yield self.fn(sample[self.ext])


class _TorchImage:
    """torchvision in the workers: PIL decode (ImageFolder's default loader) or decode_jpeg."""

    def __init__(self, decoder: str) -> None:
        from torchvision.transforms import v2

        self.decoder = decoder
        first = [v2.PILToTensor()] if decoder == "pil" else []
        self.t = v2.Compose([*first, v2.RandomResizedCrop(224, antialias=True),
                             v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32),
                             v2.Normalize(IMAGE_MEAN, IMAGE_STD)])

    def __call__(self, data: bytes) -> torch.Tensor:
        if self.decoder == "pil":
            import io

            from PIL import Image

            return self.t(Image.open(io.BytesIO(data)).convert("RGB"))
        from torchvision.io import decode_jpeg

        return self.t(decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8)))


def _torch_audio(data: bytes) -> torch.Tensor:
    import io
    import wave

    import torchaudio

    with wave.open(io.BytesIO(data)) as w:
        rate, frames = w.getframerate(), w.readframes(w.getnframes())
    x = torch.from_numpy(np.frombuffer(frames, np.int16).astype(np.float32) / 32768)
    return torchaudio.functional.resample(x, rate, 16000)


def _pad_collate(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(x) for x in items])
    return torch.nn.utils.rnn.pad_sequence(items, batch_first=True), lengths


class _Call:
    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy

    def __call__(self, data: bytes) -> Any:
        return self.proxy(np.frombuffer(data, np.uint8))


def _system(name: str, kind: str, paths: list[str], a: Any, gpu: bool, dev: int | None,
            batch: int, tokenizer: Any = None) -> dict[str, Any]:
    ext = "jpg" if kind in ("image", "image-text", "machinery") else "wav"
    to_gpu = (lambda t: t.cuda(non_blocking=True)) if gpu else (lambda t: t)

    def first(b: Any) -> int:
        x = b[0] if isinstance(b, (tuple, list)) else b
        x = x["image"] if isinstance(x, dict) else x
        x = x.data if hasattr(x, "lengths") else x
        return int(x.shape[0])

    if name in ("torch", "torch-tensor"):
        fn = _TorchImage("pil" if name == "torch" else "tensor") if ext == "jpg" else _torch_audio
        loader = torch.utils.data.DataLoader(
            _WdsSamples(paths, ext, fn), batch_size=batch, num_workers=a.workers,
            collate_fn=None if ext == "jpg" else _pad_collate, pin_memory=gpu,
            persistent_workers=True)

        def it() -> Iterator[Any]:
            for b in loader:
                yield to_gpu(b) if ext == "jpg" else tuple(to_gpu(x) for x in b)

        return _time_epochs(it, first, a.epochs, gpu)
    if name == "dali-reader":
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        pipe = _reader_pipe("image" if ext == "jpg" else "audio", paths, batch, a.threads, dev, gpu,
                            a.cpu_resize)
        reader = DALIGenericIterator(pipe, ["data"], reader_name="reader", auto_reset=True,
                                     last_batch_policy=LastBatchPolicy.PARTIAL)
        return _time_epochs(lambda: (b[0]["data"] for b in reader), lambda b: int(b.shape[0]),
                            a.epochs, gpu)
    machinery = kind == "machinery"
    pipe = _input_pipe("image" if ext == "jpg" else "audio", batch, a.threads, dev, gpu, machinery,
                       a.prefetch, a.cpu_resize)
    if name == "dali-proxy":
        from nvidia.dali.plugin.pytorch.experimental import proxy as dali_proxy

        reference = dali_proxy.DALIServer(pipe)
        with reference:
            data = (_Tiny(reference.proxy, a.samples) if machinery
                    else _WdsSamples(paths, ext, _Call(reference.proxy)))
            ref_loader = dali_proxy.DataLoader(reference, data, batch_size=batch,
                                               num_workers=a.workers, persistent_workers=True)
            return _time_epochs(lambda: ref_loader, lambda b: int(b.shape[0]), a.epochs, gpu)
    import mmproxy
    from mmproxy.datasets import MultiModalDataset, Tokenize

    if name == "mmproxy-damaged":
        paths = _shards(Path(a.data_dir or _default_dir()), "image", a.samples, a.workers,
                        a.damage, a.damage_kind)
    server = mmproxy.DALIServer(pipe, name=kind)
    with server:
        if machinery:
            loader = mmproxy.DataLoader(server, _Tiny(server.proxy, a.samples), batch_size=batch,
                                        num_workers=a.workers, persistent_workers=True)
            count: Callable[[Any], int] = lambda b: int(b.shape[0])  # noqa: E731
        else:
            fields: dict[str, Any] = {"image" if ext == "jpg" else "audio": (ext, server.proxy)}
            transform = None
            if kind == "image-text":
                fields["text"] = ("txt", lambda b: b.decode())
                transform = Tokenize(tokenizer, 32, "longest")
            ds = MultiModalDataset(paths, fields, batch_size=batch, shuffle_buffer=256,
                                   keep_keys=False, batch_transform=transform,
                                   prefetch_next_epoch=a.next_epoch, on_error="skip")
            loader = ds.loader(server, num_workers=a.workers, persistent_workers=True)
            count = lambda b: first(b["image"] if "image" in b else b["audio"])  # noqa: E731
        return _time_epochs(lambda: loader, count, a.epochs, gpu, server)


class _Tiny(torch.utils.data.Dataset):
    """The proxy machinery alone: 16-byte samples."""

    def __init__(self, proxy: Any, n: int) -> None:
        self.proxy, self.n = proxy, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.proxy(np.full(16, i % 251, np.uint8))


def _memory(paths: list[str], a: Any, gpu: bool, dev: int | None, batch: int) -> dict[str, Any]:
    import psutil

    import mmproxy
    from mmproxy.datasets import MultiModalDataset

    me = psutil.Process()
    server = mmproxy.DALIServer(_input_pipe("image", batch, a.threads, dev, gpu,
                                            cpu_resize=a.cpu_resize), name="mem")
    rows = []
    with server:
        ds = MultiModalDataset(paths, {"image": ("jpg", server.proxy)}, batch_size=batch)
        loader = ds.loader(server, num_workers=a.workers, persistent_workers=True)
        for epoch in range(a.memory_epochs):
            for k, _ in enumerate(loader):
                if epoch % 2 and k == 2:
                    break  # abandon every other epoch early
            rss = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))
            shm = sum(f.stat().st_size for f in Path("/dev/shm").iterdir() if f.is_file())
            meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
            rows.append({"epoch": epoch, "rss_mb": round(rss / 2**20, 1),
                         "dev_shm_mb": round(shm / 2**20, 2),
                         "shmem_mb": round(int(meminfo["Shmem"].split()[0]) / 1024, 1),
                         "server_runs_held": len(server._runs)})
    return {"per_epoch": rows}


def _default_dir() -> Path:
    return Path.home() / ".cache" / "mmproxy" / "bench"


def run(a: Any) -> int:
    gpu = a.device == "gpu" or (a.device == "auto" and torch.cuda.is_available())
    dev = torch.cuda.current_device() if gpu else None
    folder = Path(a.data_dir or _default_dir())
    workloads = (["image", "audio", "image-text", "machinery"] if a.workload == "all"
                 else [w.strip() for w in a.workload.split(",")])
    unknown = set(workloads) - {"image", "audio", "image-text", "machinery"}
    if unknown:
        raise SystemExit(f"mmproxy bench: unknown workload(s) {sorted(unknown)}")
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    out: dict[str, Any] = {"machine": {"gpu": torch.cuda.get_device_name() if gpu else None,
                                       "cpus": os.cpu_count(), "python": platform.python_version(),
                                       "torch": torch.__version__},
                           "settings": {k: v for k, v in vars(a).items() if k != "func"},
                           "results": {}}
    import nvidia.dali

    out["machine"]["dali"] = nvidia.dali.__version__
    for kind in workloads:
        audio = kind == "audio"
        batch = a.batch_size or ((64 if audio else 256) if gpu else (32 if audio else 64))
        paths = _shards(folder, "audio" if audio else "image", a.samples // 4 if audio else a.samples,
                        a.workers)
        tokenizer = None
        if kind == "image-text":
            from mmproxy.testing import WORDS, make_tokenizer

            tokenizer = make_tokenizer(folder / "tokenizer", [f"{w} number {i}" for i, w in
                                                             enumerate(WORDS * 20)])
        chosen = [s for s in systems if not (kind == "machinery" and s in TORCH + ("dali-reader",))]
        if kind == "audio":
            chosen = [s for s in chosen if s != "torch-tensor"]
        if kind == "image-text":
            chosen = [s for s in chosen if s in ("mmproxy", "dali-reader")]
        if kind == "image" and a.damage and "mmproxy" in chosen:
            chosen.insert(chosen.index("mmproxy") + 1, "mmproxy-damaged")
        res: dict[str, Any] = {}
        for name in chosen:
            gc.collect()  # destroy the last system's pipelines here, not in forked workers
            try:
                res[name] = _system(name, kind, paths, a, gpu, dev, batch, tokenizer)
            except Exception as err:  # a reference system that cannot run is reported, not fatal
                res[name] = {"error": _error_line(err)}
            print(f"[{kind}] {name:12s} {res[name]}", flush=True)
        base = res.get("mmproxy", {}).get("samples_per_s")
        for name, r in res.items():
            if base and "samples_per_s" in r:
                r["mmproxy_ratio"] = round(base / r["samples_per_s"], 3)
        damaged = res.get("mmproxy-damaged", {})
        if base and "samples_per_s" in damaged:  # samples per second over the samples delivered
            damaged["damaged_vs_clean"] = round(damaged["samples_per_s"] / base, 3)
            damaged["sustained_damaged_vs_clean"] = (
                round(damaged["sustained_samples_per_s"] / res["mmproxy"]["sustained_samples_per_s"], 3)
                if damaged.get("sustained_samples_per_s") else None)
        out["results"][kind] = {"batch_size": batch, "samples": a.samples // 4 if audio else a.samples,
                                "systems": res}
    if a.memory_epochs:
        out["memory"] = _memory(_shards(folder, "image", a.samples, a.workers), a, gpu, dev,
                                a.batch_size or (256 if gpu else 64))
        print("[memory]", out["memory"])
    Path(a.json).write_text(json.dumps(out, indent=2))
    print(f"\nmmproxy bench ({'GPU ' + str(out['machine']['gpu']) if gpu else 'CPU'}, "
          f"{a.workers} workers): throughput, and mmproxy's ratio to each system")
    for kind, r in out["results"].items():
        for name, s in r["systems"].items():
            if "samples_per_s" in s:
                print(f"  {kind:10s} {name:12s} {s['samples_per_s']:10.1f} samples/s   "
                      f"mmproxy / this = {s.get('mmproxy_ratio', float('nan')):.2f}")
            else:
                print(f"  {kind:10s} {name:12s} {s['error']}")
    if a.plot:
        _plot(out, a.plot)
    return 0


def _plot(out: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(out["results"])
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        systems = {k: v["samples_per_s"] for k, v in out["results"][kind]["systems"].items()
                   if "samples_per_s" in v}
        ax.bar(list(systems), list(systems.values()),
               color=["tab:green" if k == "mmproxy" else "tab:gray" for k in systems])
        ax.set_title(kind)
        ax.set_ylabel("samples/s")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
