"""Demo app: ``mmproxy demo``, multi-modal shards through image, audio and video servers.

Without ``--data`` it writes the synthetic demo set (:func:`mmproxy.testing.demo_shards`) first.
The fields of the first sample choose the servers (image, audio, video) and what stays in PyTorch (text,
tokenized in the workers; label); it prints samples/s per field, how long the main loop waited on
each server, and the samples skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

from mmproxy.apps.data import _first_sample, expand_data, first_sample_fields, sample_fields
from mmproxy.apps.noise import DecoderWarnings
from mmproxy.errors import install_hint

__all__ = ["run"]

_SCANNED = 16  # samples of a shard searched for one with a heavy field
_SHARDS = 4  # shards searched so


def run(args: argparse.Namespace) -> int:
    """Runs the demo; returns the exit code."""
    from mmproxy.datasets.recipes import AUDIO_EXTS, IMAGE_EXTS, VIDEO_EXTS
    from mmproxy.pipelines import resolve_device
    from mmproxy.testing import demo_shards

    def writing(where: Any) -> None:
        print(f"mmproxy demo: writing {args.samples} synthetic samples (image, caption, audio, "
              f"label{', video' if args.video else ''}) to {where}; later runs reuse them",
              flush=True)

    if args.data and (args.samples is not None or args.video):
        given = " and ".join(o for o, v in (("--samples", args.samples), ("--video", args.video))
                             if v)
        verb = "shape" if args.samples is not None and args.video else "shapes"
        raise ValueError(f"{given} {verb} the synthetic set; with --data the demo reads every "
                         "sample of your shards, and their fields pick the servers: drop "
                         f"{given}")
    if args.samples is None:
        args.samples = 256
    pyav_missing = _pyav_missing()
    if args.data:
        urls = expand_data(args.data)
    else:
        if args.video and pyav_missing:  # the clips are written with PyAV
            raise ValueError(f"--video needs av, which {pyav_missing}: {install_hint('av')}")
        urls = expand_data(demo_shards(args.samples,
                                        max(1, min(64, args.samples // (2 * max(1, args.workers)))),
                                        video=args.video, on_write=writing))
    first, exts = first_sample_fields(urls)
    wanted = {"image": IMAGE_EXTS, "audio": AUDIO_EXTS, "video": VIDEO_EXTS, "text": "txt;caption",
              "label": "cls"}
    media = {ext for name in ("image", "audio", "video") for ext in wanted[name].split(";")}
    origin = f"the first sample of {first}"
    if not media & set(exts):  # a set whose first samples lack the heavy field
        first, exts, key = _with_media(urls, first, media, wanted)
        without = ("skipped" if args.on_error == "skip" else
                   "an error (--on-error raise; skip takes them out)")
        origin = (f"sample {key!r} of {first}, the first with an image, audio or video field; "
                  f"samples without its fields are {without}")
    used = [name for name, spec in wanted.items() if set(spec.split(";")) & set(exts)]
    read = {name: spec.replace(";", "/") for name, spec in wanted.items()}  # every one is read
    print(f"mmproxy demo: fields {', '.join(f'{n} ({read[n]})' for n in used)}; not in these shards: "
          + (", ".join(f"{n} (no {read[n]})" for n in wanted if n not in used) or "none")
          + f" (from {origin})")
    gpu, _ = resolve_device(args.device)
    if "video" in used and not gpu and pyav_missing:
        _without_pyav(first, wanted["video"], pyav_missing)
    workers = min(args.workers, len(urls))  # every worker needs a shard of its own
    print(f"mmproxy demo: {'GPU' if gpu else 'CPU'} pipelines, {workers} worker{'' if workers == 1 else 's'}"
          + (f" (one per shard, not {args.workers})" if workers < args.workers else "") + ", "
          f"batch {args.batch_size}, {len(urls)} shard(s): "
          + (", ".join(urls) if len(urls) <= 3 else f"{urls[0]}, ..., {urls[-1]}"))
    servers = _servers(args, used)
    dataset = _dataset(args, urls, {name: wanted[name] for name in used}, servers)
    noise = DecoderWarnings()  # --debug: every line the decoders print, as it comes
    with contextlib.ExitStack() as stack:
        if not args.debug:
            stack.enter_context(noise)
        for server in servers.values():
            stack.enter_context(server)
        _stream(args, dataset.loader(list(servers.values()), num_workers=workers), used, servers,
                gpu, noise.terminal)
    for line in noise.summary():
        print("  " + line)
    return 0


def _with_media(urls: list[str], first: str, media: set[str], wanted: dict[str, str]
                ) -> tuple[str, list[str], str]:
    """The shard, the fields and the key of the first sample with a heavy field among the first
    :data:`_SCANNED` samples of each of the first :data:`_SHARDS` shards from ``first`` on
    (local ones after the first: a remote shard is read once); ``ValueError`` saying what the
    samples read have, where none has one."""
    import tarfile

    from mmproxy.datasets.shards import is_local

    rest = [u for u in urls[urls.index(first) + 1:] if is_local(u)]
    read, seen, shards = 0, {}, [first, *rest[:_SHARDS - 1]]
    for shard in shards:
        try:
            scanned = sample_fields(shard, _SCANNED)
        except (OSError, ValueError, tarfile.TarError):  # the run reports it
            continue
        read += len(scanned)
        seen.update(dict.fromkeys(ext for _, fields in scanned for ext in fields))
        for key, fields in scanned:
            if media & set(fields):
                return shard, fields, key
    where = first if len(shards) == 1 else f"{len(shards)} shards from {first} on"
    samples = "the one sample" if read == 1 else f"the first {read} samples"
    kinds = ", ".join(f"{name} ({wanted[name].replace(';', '/')})" for name in ("image", "audio", "video"))
    verb = "holds" if read == 1 else "hold"
    raise ValueError(f"{samples} of {where} {verb} no field the demo's servers read ({kinds}), only "
                     f"{', '.join(seen)}: give --data shards of images, audio or videos")


def _pyav_missing() -> str | None:
    """Why PyAV cannot be imported (worded after "which"), or None when it can."""
    try:
        import av  # noqa: F401
    except ImportError as err:
        return "is not installed" if err.name == "av" else f"cannot be imported ({err})"
    return None


def _without_pyav(first: str, exts: str, missing: str) -> None:
    """On CPU without PyAV the video server decodes with DALI's CPU decoder
    (``video_pipeline``'s ``"auto"``), which reads a few codecs only: shards whose first video is
    of another codec are refused (every sample would fail), saying what to install; else the
    demo says which codecs its server reads."""
    from mmproxy.datasets.checks import video_info
    from mmproxy.pipelines.video import CPU_CODECS

    sample = _first_sample(first)
    data = next((sample[ext] for ext in exts.split(";") if ext in sample), b"")
    info = video_info(memoryview(data)) if data else None
    codecs = ", ".join(codec.upper() for codec in CPU_CODECS)
    if info is not None and info.codec is not None and info.codec not in CPU_CODECS:
        raise ValueError(f"the first video of {first} is {info.codec.upper()}, which DALI's CPU "
                         f"video decoder does not read (it reads {codecs}); the demo decodes the "
                         f"others on CPU with PyAV, which {missing}: {install_hint('av')}; or run "
                         "on a GPU")
    print(f"mmproxy demo: videos decoded by DALI's CPU decoder, which reads {codecs} only; PyAV, "
          f"for the others, {missing}: {install_hint('av')}")


def _servers(args: argparse.Namespace, used: list[str]) -> dict[str, Any]:
    """An image, an audio and a video server, for the fields the shards have."""
    import mmproxy
    from mmproxy.pipelines import audio_pipeline, image_train_pipeline, video_pipeline

    servers: dict[str, Any] = {}
    if "image" in used:
        servers["image"] = mmproxy.DALIServer(
            image_train_pipeline(batch_size=args.batch_size, size=args.image_size,
                                 device=args.device, num_threads=args.threads), name="image")
    if "audio" in used:
        servers["audio"] = mmproxy.DALIServer(
            audio_pipeline(batch_size=args.batch_size, sample_rate=16000, device=args.device,
                           num_threads=args.threads), name="audio", pad=[0])
    if "video" in used:  # 8 frames at stride 2, decoded as video_pipeline's "auto" chooses
        servers["video"] = mmproxy.DALIServer(
            video_pipeline(batch_size=args.batch_size, frames=8, stride=2, size=112,
                           device=args.device, num_threads=args.threads), name="video")
    return servers


def _dataset(args: argparse.Namespace, urls: list[str], exts: dict[str, str],
             servers: dict[str, Any]) -> Any:
    """Heavy fields through their servers, text tokenized in the workers, labels as ints."""
    from mmproxy.datasets import MultiModalDataset, Tokenize, load_tokenizer
    from mmproxy.testing import demo_tokenizer

    fields: dict[str, Any] = {name: (exts[name], server.proxy) for name, server in servers.items()}
    transform = None
    if "text" in exts:
        fields["text"] = (exts["text"], _text)
        if args.data and not args.tokenizer:
            print("mmproxy demo: text tokenized by the demo's tiny tokenizer (trained on its "
                  "synthetic captions); give yours with --tokenizer FOLDER", flush=True)
        tokenizer = load_tokenizer(args.tokenizer or demo_tokenizer())
        transform = Tokenize(tokenizer, 32, "longest")
    if "label" in exts:
        fields["label"] = (exts["label"], int)
    return MultiModalDataset(urls, fields, batch_size=args.batch_size, shuffle_buffer=64,
                             on_error=args.on_error, max_skipped=args.max_skipped,
                             batch_transform=transform)


def _text(data: bytes) -> str:
    return data.decode("utf-8-sig").strip()  # a byte-order mark is no part of a caption


def _stream(args: argparse.Namespace, loader: Any, used: list[str], servers: dict[str, Any],
            gpu: bool, terminal: Any) -> None:
    """Runs the epochs, counting samples per field, then prints the summary."""
    import torch
    from tqdm import tqdm

    from mmproxy.skips import SkipReport

    sizes = {"image": lambda b: len(b["image"]), "audio": lambda b: b["audio"][0].data.shape[0],
             "video": lambda b: len(b["video"]),
             "text": lambda b: b["input_ids"].shape[0], "label": lambda b: len(b["label"])}
    counts = dict.fromkeys(used, 0)
    reports = []  # each epoch's skip report: samples and whole shards, with the reasons
    bar = not args.quiet and terminal.isatty()  # no bar fragments in a log file
    total = None if args.data else args.samples  # else known after the first epoch
    start = time.perf_counter()
    for epoch in range(args.epochs):
        delivered = 0
        with tqdm(desc=f"epoch {epoch + 1}/{args.epochs}", total=total, unit="sample",
                  disable=not bar, file=terminal) as progress:
            for batch in loader:
                for name in counts:
                    counts[name] += sizes[name](batch)
                n = sizes[used[0]](batch)
                delivered += n
                progress.update(n)
        total = total or delivered
        reports.append(loader.skipped)
    if gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    print(("\n" if bar else "") + f"mmproxy demo: {elapsed:.1f} s for {args.epochs} epoch(s)")
    for name, n in counts.items():
        print(f"  {name:6s} {n:6d} samples  {n / elapsed:8.1f} samples/s")
    for server in servers.values():
        print(f"  main loop waited {server.wait_seconds:6.2f} s on server {server.name!r} "
              f"(which waited {server.starved_seconds:.2f} s for inputs from workers)")
    total = SkipReport.merged([r.state_dict() for r in reports], epoch=0)
    over = f" over {args.epochs} epochs (each epoch counts its own)" if args.epochs > 1 else ""
    print(f"  skipped {total.samples_skipped} samples"
          + (f" and {total.shards_text()}" if total.shards else "") + over)
    shown: list[set[Any]] = []  # the records of the epochs summarized in full
    for report in reports:
        if report.skipped:
            lines = report.summary().split("\n")
            if set(report.records) in shown:  # the same samples as an earlier epoch
                lines = [lines[0] + " (the same as an earlier epoch)"]
            shown.append(set(report.records))
            print("  " + "\n  ".join(lines))
    _list_skipped(reports)


def _list_skipped(reports: list[Any], limit: int = 10) -> None:
    """Each skipped sample or shard once (every epoch skips the same), up to ``limit``."""
    seen = list(dict.fromkeys(r for report in reports for r in report.records))
    if not seen:
        return
    print(f"  skipped, each once ({len(seen)}):" if len(seen) <= limit else
          f"  skipped, each once (the first {limit} of {len(seen)}; a loader's "
          "skipped.records lists them all):")
    for record in seen[:limit]:
        where = f"{record.shard}, sample {record.key!r}" if record.key else record.shard
        print(f"    {where}: {record.reason}")
