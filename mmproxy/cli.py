"""Command line: ``mmproxy demo``, ``mmproxy bench``, ``mmproxy make-shards``.

Heavy modules load inside the commands, so ``mmproxy --help`` is quick.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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


def _demo(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    import mmproxy
    from mmproxy.datasets import MultiModalDataset, Tokenize, load_tokenizer
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
    tokenizer_dir = args.tokenizer or str(cache / "tokenizer")
    if not args.tokenizer and not Path(tokenizer_dir, "tokenizer.json").exists():
        make_tokenizer(tokenizer_dir, [f"{w}, take {i}" for i, w in enumerate(WORDS * 10)])
    tokenizer = load_tokenizer(tokenizer_dir)
    device = args.device
    gpu = device == "gpu" or (device == "auto" and torch.cuda.is_available())
    print(f"mmproxy demo: {'GPU' if gpu else 'CPU'} pipelines, {args.workers} workers, "
          f"batch {args.batch_size}, shards {urls}")
    image = mmproxy.DALIServer(image_train_pipeline(batch_size=args.batch_size, size=args.image_size,
                                                    device=device, num_threads=args.threads),
                               name="image")
    audio = mmproxy.DALIServer(audio_pipeline(batch_size=args.batch_size, sample_rate=16000,
                                              device=device, num_threads=args.threads),
                               name="audio", pad=[0])
    dataset = MultiModalDataset(
        urls, {"image": ("jpg;jpeg;png", image.proxy), "audio": ("flac;wav;ogg", audio.proxy),
               "text": ("txt", lambda b: b.decode().strip()), "label": ("cls", int)},
        batch_size=args.batch_size, shuffle_buffer=64, on_error=args.on_error,
        batch_transform=Tokenize(tokenizer, 32, "longest"))
    counts = {"image": 0, "audio": 0, "text": 0}
    skipped: list[Any] = []
    start = time.perf_counter()
    with image, audio:
        loader = dataset.loader([image, audio], num_workers=args.workers)
        for _ in range(args.epochs):
            for batch in tqdm(loader, desc="batches", unit="batch", disable=args.quiet):
                counts["image"] += batch["image"].shape[0]
                counts["audio"] += batch["audio"][0].data.shape[0]
                counts["text"] += batch["input_ids"].shape[0]
                skipped += batch["__skipped__"]
        if gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        print(f"\nmmproxy demo: {elapsed:.1f} s for {args.epochs} epoch(s)")
        for name, n in counts.items():
            print(f"  {name:6s} {n:6d} samples  {n / elapsed:8.1f} samples/s")
        for server in (image, audio):
            print(f"  main loop waited {server.wait_seconds:6.2f} s on server {server.name!r} "
                  f"(which waited {server.starved_seconds:.2f} s for inputs from workers)")
        print(f"  skipped {len(skipped)} samples" + (f", first: {skipped[:3]}" if skipped else ""))
    return 0


def _make_shards(args: argparse.Namespace) -> int:
    from mmproxy.datasets import make_shards

    shards = make_shards(args.source, args.output, kind=args.kind, max_count=args.max_count,
                         max_size=args.max_size)
    print(f"wrote {len(shards)} shards to {args.output}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from mmproxy import bench

    return bench.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmproxy", description=(
        "Multi-modal data loading: DALI pipelines in the training process, fed by PyTorch "
        "DataLoader workers."))
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stream a multi-modal shard set through image and audio servers",
                          description="Streams WebDataset shards (image, caption, audio, label) "
                          "through an image server and an audio server, with captions tokenized in "
                          "the workers, then prints a throughput summary. Without --data it first "
                          "writes a small synthetic set to the cache folder.")
    demo.add_argument("--data", help="your shards: a brace pattern or path (default: synthetic set)")
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

    shards = sub.add_parser("make-shards", help="turn a folder into WebDataset shards",
                            description="Writes images with captions (ImageFolder tree or image + "
                            ".txt pairs) or audio files with labels (class folders) as shards.")
    shards.add_argument("source", help="the folder to read")
    shards.add_argument("output", help="the folder to write shard-NNNNNN.tar files to")
    shards.add_argument("--kind", choices=["image-text", "audio-label"], default="image-text")
    shards.add_argument("--max-count", type=int, default=1000, help="samples per shard")
    shards.add_argument("--max-size", type=float, default=1e9, help="bytes per shard")
    shards.set_defaults(func=_make_shards)

    bench = sub.add_parser("bench", help="compare mmproxy with plain PyTorch, DALI's proxy and a "
                           "pure DALI reader",
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
    bench.add_argument("--data-dir", default=None, help="where to write the benchmark shards")
    bench.add_argument("--json", default="bench.json", help="where to write the results")
    bench.add_argument("--plot", default=None, help="write a PNG bar chart here")
    bench.add_argument("--memory-epochs", type=int, default=0,
                       help="also run mmproxy this many epochs and record RSS and shared memory")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
