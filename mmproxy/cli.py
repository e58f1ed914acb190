"""Command line: ``mmproxy demo``, ``mmproxy bench``, ``mmproxy make-shards``.

Heavy modules load inside the commands, so ``mmproxy --help`` is quick. Errors of the user's
making (mmproxy's own errors, missing files, bad values) print one line, ``mmproxy COMMAND:
error: MESSAGE``, and exit with 1; ``--debug``, anywhere on the line, adds the traceback. An
interrupt (Ctrl-C) exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmproxy"


def make_demo_shards(folder: Path, samples: int, per_shard: int = 64) -> str:
    """Writes a small multi-modal shard set: JPEG + caption + FLAC speech + label per sample."""
    from mmproxy.testing import WORDS, audio_bytes, image_bytes, synth_image, synth_speech, write_tar

    folder.mkdir(parents=True, exist_ok=True)
    shards = (samples + per_shard - 1) // per_shard
    for s in range(shards):
        path = folder / f"demo-{s:04d}.tar"
        if path.exists():
            continue
        rows = []
        for i in range(s * per_shard, min(samples, (s + 1) * per_shard)):
            label = i % len(WORDS)
            rows.append({"__key__": f"demo{i:06d}",
                         "jpg": image_bytes(synth_image(i, 240, 320)),
                         "txt": f"{WORDS[label]}, take {i}",
                         "flac": audio_bytes(synth_speech(i, 1.0 + (i % 5) * 0.4, 22050), 22050, "FLAC"),
                         "cls": str(label)})
        write_tar(str(path) + ".part", rows)
        os.replace(str(path) + ".part", path)
    return str(folder / f"demo-{{0000..{shards - 1:04d}}}.tar")


def _first_sample_fields(urls: str) -> tuple[list[str], list[str]]:
    """The shards of ``urls`` and the extensions (fields) of the first shard's first sample."""
    from braceexpand import braceexpand

    shards = list(braceexpand(urls)) or [urls]
    first = shards[0]
    local = "://" not in first and not first.startswith("pipe:")
    if local and not os.path.isfile(first):
        raise FileNotFoundError(f"no shard at {first} (the first of --data {urls})")
    exts: list[str] = []
    try:
        if local:
            with tarfile.open(first) as tar:
                key = None
                for member in tar:  # KEY.EXT as webdataset splits it: at the name's first dot
                    match = re.match(r"^((?:.*/|)[^./][^.]*)[.]([^/]*)$", member.name)
                    if not member.isfile() or match is None:
                        continue
                    if key is not None and match[1] != key:
                        break
                    key = match[1]
                    exts.append(match[2].lower())
        else:
            import webdataset as wds

            sample: dict[str, Any] = next(iter(wds.WebDataset(first, shardshuffle=False)), {})
            exts = [k for k in sample if not k.startswith("__")]
    except (tarfile.TarError, OSError, ValueError) as err:
        raise ValueError(f"cannot read the first sample of {first}: {err}") from err
    if not exts:
        raise ValueError(f"{first} holds no samples (no tar members named KEY.EXT)")
    return shards, exts


def _demo(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    import mmproxy
    from mmproxy.datasets import MultiModalDataset, Tokenize, load_tokenizer
    from mmproxy.datasets.recipes import AUDIO_EXTS, IMAGE_EXTS
    from mmproxy.pipelines import audio_pipeline, image_train_pipeline
    from mmproxy.testing import WORDS, make_tokenizer

    cache = _cache_dir() / "demo"
    if args.data:
        urls = args.data
    else:
        print(f"mmproxy demo: writing {args.samples} synthetic samples (image, caption, audio, "
              f"label) to {cache} (once)")
        per_shard = max(1, min(64, args.samples // (2 * max(1, args.workers))))
        urls = make_demo_shards(cache / f"shards-{args.samples}-{per_shard}", args.samples, per_shard)
    shards, exts = _first_sample_fields(urls)
    first = shards[0]
    wanted = {"image": IMAGE_EXTS, "audio": AUDIO_EXTS, "text": "txt;caption", "label": "cls"}
    found = {name: [e for e in spec.split(";") if e in exts] for name, spec in wanted.items()}
    used = [name for name in wanted if found[name]]
    if "image" not in used and "audio" not in used:
        raise ValueError(f"the first sample of {first} has neither an image ({IMAGE_EXTS}) nor an "
                         f"audio ({AUDIO_EXTS}) field, only {', '.join(exts)}; the demo needs one")
    print(f"mmproxy demo: fields {', '.join(f'{n} ({found[n][0]})' for n in used)}; missing: "
          + (", ".join(f"{n} (no {wanted[n].replace(';', '/')})" for n in wanted if n not in used)
             or "none") + f" (from the first sample of {first})")
    tokenizer = None
    if "text" in used:
        tokenizer_dir = args.tokenizer or str(cache / "tokenizer")
        if not args.tokenizer and not Path(tokenizer_dir, "tokenizer.json").exists():
            make_tokenizer(tokenizer_dir, [f"{w}, take {i}" for i, w in enumerate(WORDS * 10)])
        tokenizer = load_tokenizer(tokenizer_dir)
    device = args.device
    gpu = device == "gpu" or (device == "auto" and torch.cuda.is_available())
    workers = min(args.workers, len(shards))  # every worker needs a shard of its own
    print(f"mmproxy demo: {'GPU' if gpu else 'CPU'} pipelines, {workers} worker{'' if workers == 1 else 's'}"
          + (f" (one per shard, not {args.workers})" if workers < args.workers else "") + ", "
          f"batch {args.batch_size}, shards {urls}")
    servers: dict[str, Any] = {}
    if "image" in used:
        servers["image"] = mmproxy.DALIServer(
            image_train_pipeline(batch_size=args.batch_size, size=args.image_size, device=device,
                                 num_threads=args.threads), name="image")
    if "audio" in used:
        servers["audio"] = mmproxy.DALIServer(
            audio_pipeline(batch_size=args.batch_size, sample_rate=16000, device=device,
                           num_threads=args.threads), name="audio", pad=[0])
    fields: dict[str, Any] = {name: (wanted[name], server.proxy) for name, server in servers.items()}
    if "text" in used:
        fields["text"] = (wanted["text"], lambda b: b.decode().strip())
    if "label" in used:
        fields["label"] = ("cls", int)
    dataset = MultiModalDataset(
        urls, fields, batch_size=args.batch_size, shuffle_buffer=64, on_error=args.on_error,
        batch_transform=Tokenize(tokenizer, 32, "longest") if tokenizer is not None else None)
    counts = dict.fromkeys(used, 0)
    skipped: list[Any] = []
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        for server in servers.values():
            stack.enter_context(server)
        loader = dataset.loader(list(servers.values()), num_workers=workers)
        for _ in range(args.epochs):
            for batch in tqdm(loader, desc="batches", unit="batch", disable=args.quiet):
                if "image" in counts:
                    counts["image"] += len(batch["image"])
                if "audio" in counts:
                    counts["audio"] += batch["audio"][0].data.shape[0]
                if "text" in counts:
                    counts["text"] += batch["input_ids"].shape[0]
                if "label" in counts:
                    counts["label"] += len(batch["label"])
                skipped += batch["__skipped__"]
        if gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        print(f"\nmmproxy demo: {elapsed:.1f} s for {args.epochs} epoch(s)")
        for name, n in counts.items():
            print(f"  {name:6s} {n:6d} samples  {n / elapsed:8.1f} samples/s")
        for server in servers.values():
            print(f"  main loop waited {server.wait_seconds:6.2f} s on server {server.name!r} "
                  f"(which waited {server.starved_seconds:.2f} s for inputs from workers)")
        print(f"  skipped {len(skipped)} samples" + (f", first: {skipped[:3]}" if skipped else ""))
    return 0


def _make_shards(args: argparse.Namespace) -> int:
    from mmproxy.datasets import make_shards

    written = make_shards(args.source, args.output, kind=args.kind, max_count=args.max_count,
                          max_size=args.max_size, prefix=args.prefix, overwrite=args.overwrite)
    print(written.summary())
    return 0


def _bench(args: argparse.Namespace) -> int:
    from mmproxy import bench

    return bench.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmproxy", description=(
        "Multi-modal data loading: DALI pipelines in the training process, fed by PyTorch "
        "DataLoader workers."))
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (also after the command)")
    common = argparse.ArgumentParser(add_help=False)  # --debug after the command, too
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="print the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", parents=[common],
                          help="stream a multi-modal shard set through image and audio servers",
                          description="Streams WebDataset shards (image, caption, audio, label) "
                          "through an image server and an audio server, with captions tokenized in "
                          "the workers, then prints a throughput summary. Without --data it first "
                          "writes a small synthetic set to the cache folder.")
    demo.add_argument("--data", help="your shards: a brace pattern or path (default: synthetic "
                      "set); the fields of its first sample pick the servers: image (jpg, png, "
                      "webp, bmp, tiff), audio (flac, wav, ogg), text (txt), label (cls)")
    demo.add_argument("--samples", type=int, default=256, help="size of the synthetic set (default 256)")
    demo.add_argument("--batch-size", type=int, default=32, help="samples per batch (default 32)")
    demo.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    demo.add_argument("--threads", type=int, default=2, help="DALI threads per server (default 2)")
    demo.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    demo.add_argument("--image-size", type=int, default=160, help="output crop size (default 160)")
    demo.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                      help="where the pipelines run (default: GPU when CUDA is available)")
    demo.add_argument("--tokenizer", help="a transformers tokenizer folder (default: a tiny one "
                      "trained on the synthetic captions)")
    demo.add_argument("--on-error", choices=["raise", "skip"], default="skip",
                      help="what to do with a bad sample (default: skip and report)")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(func=_demo)

    shards = sub.add_parser("make-shards", parents=[common], help="turn a folder into WebDataset shards",
                            description="Writes images with captions (ImageFolder tree or image + "
                            ".txt pairs) or audio files with labels (class folders) as shards, "
                            "each sample with its source path (src), and classes.json and "
                            "manifest.jsonl (key -> shard, source file) beside them; prints what "
                            "was written, which captions were guessed from folder names and "
                            "which files were left out and why.")
    shards.add_argument("source", help="the folder to read")
    shards.add_argument("output", help="the folder to write PREFIX-NNNNNN.tar files to")
    shards.add_argument("--kind", choices=["image-text", "audio-label"], default="image-text")
    shards.add_argument("--max-count", type=int, default=1000, help="samples per shard")
    shards.add_argument("--max-size", type=float, default=1e9, help="bytes per shard")
    shards.add_argument("--prefix", default="shard", help="shard names start with it (default shard)")
    shards.add_argument("--overwrite", action="store_true",
                        help="replace the shard set already in OUTPUT (otherwise refused)")
    shards.set_defaults(func=_make_shards)

    bench = sub.add_parser("bench", parents=[common],
                           help="compare mmproxy with plain PyTorch, DALI's proxy and a pure DALI "
                           "reader",
                           description="Runs the same data side by side through every system and "
                           "prints throughput ratios; writes JSON (and a PNG with --plot).")
    bench.add_argument("--workload", default="image",
                       help="image, audio, image-text, machinery, a comma-separated list, or all")
    bench.add_argument("--no-next-epoch-prefetch", dest="next_epoch", action="store_false",
                       help="mmproxy: do not prepare the next epoch's first batch early")
    bench.add_argument("--prefetch", type=int, default=2,
                       help="prefetch_queue_depth of the proxied pipelines (mmproxy, dali-proxy)")
    bench.add_argument("--systems", default="mmproxy,torch,torch-tensor,dali-proxy,dali-reader",
                       help="comma-separated subset of mmproxy, torch (PIL decode + torchvision "
                       "v2 in workers), torch-tensor (torchvision.io.decode_jpeg + v2), dali-proxy "
                       "(DALI's own proxy), dali-reader (fn.readers.webdataset, no Python)")
    bench.add_argument("--samples", type=int, default=1024, help="images (audio: clips / 4)")
    bench.add_argument("--batch-size", type=int, default=None, help="default: 256 images, 64 clips "
                       "on a GPU; 64 and 32 on CPU")
    bench.add_argument("--workers", type=int, default=2)
    bench.add_argument("--threads", type=int, default=2, help="DALI threads per pipeline")
    bench.add_argument("--epochs", type=int, default=3, help="the best epoch counts")
    bench.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    bench.add_argument("--cpu-resize", choices=["torchvision", "dali"], default="torchvision",
                       help="CPU image pipelines of every DALI system: resize with torchvision "
                       "inside the pipeline (default) or with DALI's fn.resize")
    bench.add_argument("--damage", type=float, default=0.0,
                       help="also run mmproxy on a copy of the image shards with this fraction of "
                       "the JPEGs damaged (e.g. 0.01), skip mode; reports damaged / clean")
    bench.add_argument("--damage-kind", choices=["truncate", "corrupt", "garbage"],
                       default="truncate",
                       help="truncate: cut to a third; corrupt: a broken Huffman table (both "
                       "caught by the header checks in the workers); garbage: random bytes after "
                       "the first 20 (only the decoder sees it: the server finds the samples)")
    bench.add_argument("--data-dir", default=None, help="where to write the benchmark shards")
    bench.add_argument("--json", default="bench.json", help="where to write the results")
    bench.add_argument("--plot", default=None, help="write a PNG bar chart here")
    bench.add_argument("--memory-epochs", type=int, default=0,
                       help="also run mmproxy this many epochs and record RSS and shared memory")
    bench.set_defaults(func=_bench)
    return parser


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if len(lines) > 2 and "Traceback (most recent call last)" in str(err):
        # torch re-raises a worker's error with its traceback in the message: keep its last line
        lines = [f"{lines[-1]} ({lines[0].rstrip('.')})"]
    text = " ".join(lines) or type(err).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns the exit code (0, 1 for an error, 130 for an interrupt)."""
    args = build_parser().parse_args(argv)
    where = f"mmproxy {args.command}"
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            traceback.print_exc()
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        from mmproxy.errors import MmproxyError

        if not isinstance(err, (MmproxyError, ValueError, OSError)):
            raise  # a bug: the whole traceback
        if args.debug:
            traceback.print_exc()
        print(f"{where}: error: {_one_line(err)}", file=sys.stderr)
        if not args.debug:
            print("(run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
