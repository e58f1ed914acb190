"""Command line: ``mmproxy demo``, ``mmproxy bench``, ``mmproxy make-shards``.

This module parses and dispatches; each command's body is an app (:mod:`mmproxy.apps`). Heavy
modules load inside the commands, so ``mmproxy --help`` is quick. Errors of the user's
making (mmproxy's own errors, missing files, bad values) print one line, ``mmproxy COMMAND:
error: MESSAGE``, and exit with 1; ``--debug``, anywhere on the line, adds the traceback. An
interrupt (Ctrl-C) exits with 130.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import traceback
from collections.abc import Callable

__all__ = ["main"]


def _app(name: str) -> Callable[[argparse.Namespace], int]:
    """The ``run`` of ``mmproxy.apps.NAME``, imported when the command runs."""
    def run(args: argparse.Namespace) -> int:
        return int(importlib.import_module(f"mmproxy.apps.{name}").run(args))

    return run


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
    demo.add_argument("--data", help="your shards: a folder of .tar files, or paths, brace patterns "
                      "and quoted globs, several joined by :: (default: synthetic "
                      "set); the fields of its first sample pick the servers: image (jpg, png, "
                      "webp, bmp, tiff), audio (flac, wav, ogg), video (mp4, mov, webm, mkv, avi), "
                      "text (txt), label (cls)")
    demo.add_argument("--samples", type=int, default=256, help="size of the synthetic set (default 256)")
    demo.add_argument("--video", action="store_true",
                      help="add an H.264 clip to every synthetic sample, and a video server "
                      "(needs PyAV: pip install 'mmproxy[video]')")
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
    demo.add_argument("--max-skipped", type=float, default=0.1,
                      help="fail when more than this fraction of an epoch's samples is skipped, "
                      "or of its shards unreadable (default 0.1)")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(func=_app("demo"), command_parser=demo)

    shards = sub.add_parser("make-shards", parents=[common], help="turn a folder into WebDataset shards",
                            description="Writes images with captions (ImageFolder tree or image + "
                            ".txt pairs) or audio files with labels (class folders) as shards, "
                            "each sample with its source path (src), and classes.json and "
                            "manifest.jsonl (key -> shard, source file) beside them; prints what "
                            "was written, which captions were guessed from folder names and "
                            "which files were left out and why.")
    shards.add_argument("source", help="the folder to read")
    shards.add_argument("output", help="the folder to write PREFIX-NNNNNN.tar files to")
    shards.add_argument("--kind", choices=["image-text", "audio-label", "video-text", "video-label"],
                        default="image-text",
                        help="image-text: images with captions (default); audio-label: audio files "
                        "in class folders; video-text, video-label: the same for videos")
    shards.add_argument("--max-count", type=int, default=1000, help="samples per shard")
    shards.add_argument("--max-size", type=float, default=1e9, help="bytes per shard")
    shards.add_argument("--prefix", default="shard", help="shard names start with it (default shard)")
    shards.add_argument("--overwrite", action="store_true",
                        help="replace the shard set already in OUTPUT (otherwise refused)")
    shards.set_defaults(func=_app("shards"), command_parser=shards)

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
                       "(DALI's own proxy), dali-proxy-seed (the same with its documentation's "
                       "prefetch_queue_depth=2*workers), dali-reader (fn.readers.webdataset, no Python), "
                       "mmproxy-http, mmproxy-s3, mmproxy-cached (the image shards served by a local "
                       "HTTP or S3 server, or through the node cache)")
    bench.add_argument("--server-cpus", default=None,
                       help="mmproxy-http/-s3/-cached: run the local shard servers on these cores "
                       "(like 16-31), apart from the loader's, as a remote server would be")
    bench.add_argument("--worker-cpus", default=None,
                       help="the DataLoader workers of every system on these cores (like 8-15), "
                       "the rest of the process (DALI's threads, the servers, the main loop) on "
                       "the others it may use, so that neither takes the other's cores")
    bench.add_argument("--samples", type=int, default=1024, help="images (audio: clips / 4)")
    bench.add_argument("--batch-size", type=int, default=None, help="default: 256 images, 64 clips "
                       "on a GPU; 64 and 32 on CPU")
    bench.add_argument("--workers", type=int, default=2)
    bench.add_argument("--threads", type=int, default=2, help="DALI threads per pipeline")
    bench.add_argument("--epochs", type=int, default=3,
                       help="epochs per run: the first (warm-up) is reported apart; the best one "
                       "and the sustained rate over the rest count (use 5 or more for figures)")
    bench.add_argument("--runs", type=int, default=1,
                       help="run every system this many times, interleaved; reports the median and "
                       "the range over the runs of the rates and of mmproxy's ratios")
    bench.add_argument("--data", help="your own shards (a folder of .tar files, or paths, brace "
                       "patterns and quoted globs, several joined by ::) instead of the bench's "
                       "synthetic ones: every system on them, mmproxy first; when it skips "
                       "damaged files, DALI's proxy and reader are not run (they may crash on them)")
    bench.add_argument("--field", help="with --data: the extension of the field to load, or several "
                       "joined by ; (image or audio ones; default: every image extension, or every "
                       "audio one, as the first sample has an image or audio field)")
    bench.add_argument("--max-skipped", type=float, default=0.1,
                       help="mmproxy's run fails when more than this fraction of an epoch's samples "
                       "is skipped as damaged (default 0.1)")
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
    bench.set_defaults(func=_app("bench"), command_parser=bench)
    return parser


def _one_line(err: BaseException) -> str:
    """The error's message on one line; a skip limit's summary follows on lines of its own."""
    from mmproxy.errors import EmptyEpochError, SkipLimitError

    text = str(err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    caught = re.match(r"Caught (\w+) in DataLoader (worker process \d+)", lines[0]) if lines else None
    if caught and "Traceback (most recent call last)" in text:
        # torch re-raises a worker's error with its traceback in the message: keep the error's
        # own line(s), its type without its module, and say which worker
        name, where = caught[1], caught[2]
        own = re.compile(rf"^(?:[\w.]+\.)?{name}(?=: |$)")
        at = max((i for i, line in enumerate(lines) if own.match(line)), default=len(lines) - 1)
        message = " ".join([own.sub(name, lines[at]), *lines[at + 1:]])
        return f"{message} (in DataLoader {where})"
    if isinstance(err, SkipLimitError):  # worded with the option that sets the limit
        head = (f"{err.counted}, more than --max-skipped={err.limit:.1%} "
                "(raise --max-skipped to accept it):")
        return "\n".join([head, *("  " + line for line in err.summary.splitlines() if line)])
    if isinstance(err, EmptyEpochError) and len(lines) > 1:
        return "\n".join([lines[0], *("  " + line for line in text.splitlines()[1:] if line)])
    text = " ".join(lines) or type(err).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns the exit code (0, 1 for an error, 130 for an interrupt)."""
    args, extra = build_parser().parse_known_args(argv)
    command_parser = args.__dict__.pop("command_parser")  # not a setting (bench writes them out)
    if extra:  # a mistyped option: the command's own usage, not the top level's
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
