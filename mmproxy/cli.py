"""Command line: ``mmproxy demo``, ``mmproxy bench``, ``mmproxy make-shards``.

This module parses and dispatches; each command's body is an app (:mod:`mmproxy.apps`). Heavy
modules load inside the commands, so ``mmproxy --help`` is quick. Values out of range are
refused by the parser (exit 2), and an option whose optional package is missing before the
command runs. Errors print one line, ``mmproxy COMMAND: error: MESSAGE``, and exit with 1: the
user's making (mmproxy's own errors, missing files, bad values), a missing package (with the
``pip install`` that adds it), and anything else (said to be unexpected, to report); ``--debug``,
anywhere on the line, adds the traceback.

An interrupt (Ctrl-C) ends the command with one line, ``mmproxy COMMAND: interrupted``, and exit
code 130: the first raises ``KeyboardInterrupt``, and the command cleans up on its way out (its
servers and workers stop, half-written files go); one more while it does exits at once. An
interrupt that library code swallowed (a callback from C that cannot raise) still ends with 130.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["main"]

# optional package -> the extra that installs it
_EXTRAS = {"matplotlib": "plot", "av": "video", "boto3": "s3", "botocore": "s3", "moto": "test"}
# (command, option) -> the package it needs, checked before the command runs
_NEEDS = {("bench", "plot"): "matplotlib", ("demo", "video"): "av"}


def _app(name: str) -> Callable[[argparse.Namespace], int]:
    """The ``run`` of ``mmproxy.apps.NAME``, imported when the command runs."""
    def run(args: argparse.Namespace) -> int:
        return int(importlib.import_module(f"mmproxy.apps.{name}").run(args))

    return run


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number, ``low`` or more."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"at_least_{low}"
    return parse


def _number(low: float, high: float | None = None, low_included: bool = True) -> Callable[[str], float]:
    """An argparse type: a number from ``low`` (excluded unless ``low_included``) to ``high``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < low or (value == low and not low_included) or (high is not None and value > high):
            where = (f"from {low:g} to {high:g}" if high is not None else
                     f"at least {low:g}" if low_included else f"more than {low:g}")
            raise argparse.ArgumentTypeError(f"must be {where}, got {text}")
        return value

    return parse


_COUNT, _POSITIVE, _FRACTION = _at_least(0), _at_least(1), _number(0.0, 1.0)


def _version() -> str:
    from mmproxy import __version__

    return f"mmproxy {__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmproxy", description=(
        "Multi-modal data loading: DALI pipelines in the training process, fed by PyTorch "
        "DataLoader workers."))
    parser.add_argument("--version", action="version", version=_version())
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
    demo.add_argument("--samples", type=_POSITIVE, default=256,
                      help="size of the synthetic set (default 256)")
    demo.add_argument("--video", action="store_true",
                      help="add an H.264 clip to every synthetic sample, and a video server "
                      "(needs PyAV: pip install 'mmproxy[video]')")
    demo.add_argument("--batch-size", type=_POSITIVE, default=32, help="samples per batch (default 32)")
    demo.add_argument("--workers", type=_COUNT, default=2, help="DataLoader workers (default 2)")
    demo.add_argument("--threads", type=_POSITIVE, default=2, help="DALI threads per server (default 2)")
    demo.add_argument("--epochs", type=_POSITIVE, default=1, help="passes over the data (default 1)")
    demo.add_argument("--image-size", type=_POSITIVE, default=160, help="output crop size (default 160)")
    demo.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto",
                      help="where the pipelines run (default: GPU when CUDA is available)")
    demo.add_argument("--tokenizer", help="a transformers tokenizer folder (default: a tiny one "
                      "trained on the synthetic captions)")
    demo.add_argument("--on-error", choices=["raise", "skip"], default="skip",
                      help="what to do with a bad sample (default: skip and report)")
    demo.add_argument("--max-skipped", type=_FRACTION, default=0.1,
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
    shards.add_argument("--max-count", type=_POSITIVE, default=1000,
                        help="samples per shard (default 1000)")
    shards.add_argument("--max-size", type=_number(0, low_included=False), default=1e9,
                        help="bytes per shard (default 1e9)")
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
                       help="image, audio, image-text, video, machinery, a comma-separated "
                       "list, or all (default image)")
    bench.add_argument("--no-next-epoch-prefetch", dest="next_epoch", action="store_false",
                       help="mmproxy: do not prepare the next epoch's first batch early")
    bench.add_argument("--prefetch", type=_POSITIVE, default=2,
                       help="prefetch_queue_depth of the proxied pipelines (mmproxy, dali-proxy)")
    bench.add_argument("--systems", default="mmproxy,torch,torch-tensor,dali-proxy,dali-reader",
                       help="comma-separated subset of mmproxy, torch (PIL decode + torchvision "
                       "v2 in workers; audio: soundfile + torchaudio; video: PyAV + torchvision), "
                       "torch-tensor (torchvision.io.decode_jpeg + v2), dali-proxy "
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
    bench.add_argument("--samples", type=_POSITIVE, default=1024,
                       help="images (audio: clips / 4; video: clips / 16; default 1024)")
    bench.add_argument("--batch-size", type=_POSITIVE, default=None, help="default: 256 images, 64 audio "
                       "clips, 32 video clips on a GPU; 64, 32 and 8 on CPU")
    bench.add_argument("--workers", type=_COUNT, default=2, help="DataLoader workers (default 2)")
    bench.add_argument("--threads", type=_POSITIVE, default=2, help="DALI threads per pipeline")
    bench.add_argument("--epochs", type=_POSITIVE, default=3,
                       help="epochs per run: the first (warm-up) is reported apart; the best one "
                       "and the sustained rate over the rest count (use 5 or more for figures)")
    bench.add_argument("--runs", type=_POSITIVE, default=1,
                       help="run every system this many times, interleaved; reports the median and "
                       "the range over the runs of the rates and of mmproxy's ratios")
    bench.add_argument("--data", help="your own shards (a folder of .tar files, or paths, brace "
                       "patterns and quoted globs, several joined by ::) instead of the bench's "
                       "synthetic ones: every system on them, mmproxy first; when it skips "
                       "damaged files, DALI's proxy and reader are not run (they may crash on them)")
    bench.add_argument("--field", help="with --data: the extension of the field to load, or several "
                       "joined by ; (image, audio or video ones; default: every extension of the "
                       "family of the first sample's image, audio or video field)")
    bench.add_argument("--max-skipped", type=_FRACTION, default=0.1,
                       help="mmproxy's run fails when more than this fraction of an epoch's samples "
                       "is skipped as damaged (default 0.1)")
    bench.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    bench.add_argument("--cpu-resize", choices=["torchvision", "dali"], default="torchvision",
                       help="CPU image pipelines of every DALI system: resize with torchvision "
                       "inside the pipeline (default) or with DALI's fn.resize")
    bench.add_argument("--damage", type=_FRACTION, default=0.0,
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
    bench.add_argument("--memory-epochs", type=_COUNT, default=0,
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


def _missing(module: str) -> str:
    """What to install for ``module``: the extra of mmproxy that holds it, or the package."""
    extra = _EXTRAS.get(module.split(".")[0])
    return f"pip install 'mmproxy[{extra}]'" if extra else f"pip install {module.split('.')[0]}"


class _Interrupts:
    """SIGINT while a command runs: the first raises ``KeyboardInterrupt`` in the main thread, as
    Python's own handler does; another one before the command has ended exits at once, saying
    so in one line (no traceback from code cleaning up, nor from the interpreter's exit)."""

    def __init__(self, where: str) -> None:
        self.where, self.count, self.said = where, 0, False
        self.pid = os.getpid()  # forked workers inherit the handler: theirs stays Python's
        self.previous: Any = None

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False  # only the main thread may set a handler
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return True

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self.previous)

    def interrupted(self) -> None:
        """The command ended by an interrupt (a signal, or ``KeyboardInterrupt`` raised for
        one): says so; the next one exits at once."""
        self.count = max(self.count, 1)
        self.say()

    def say(self) -> None:
        if not self.said:
            self.said = True
            print(f"{self.where}: interrupted", file=sys.stderr, flush=True)

    def _handle(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1 or os.getpid() != self.pid:
            raise KeyboardInterrupt
        if not self.said:
            os.write(2, f"{self.where}: interrupted\n".encode())
        os._exit(130)


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns the exit code (0, 1 for an error, 130 for an interrupt).

    As the ``mmproxy`` program (no ``argv``) its interrupt handling stays until the process
    exits; called with ``argv`` it gives the caller its own SIGINT handler back.
    """
    args, extra = build_parser().parse_known_args(argv)
    command_parser = args.__dict__.pop("command_parser")  # not a setting (bench writes them out)
    if extra:  # a mistyped option: the command's own usage, not the top level's
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    for (command, option), module in _NEEDS.items():
        if args.command == command and getattr(args, option) and not importlib.util.find_spec(module):
            command_parser.error(f"--{option} needs {module}, which is not installed: "
                                 f"{_missing(module)}")
    where = f"mmproxy {args.command}"
    interrupts = _Interrupts(where)
    installed = interrupts.install()
    try:
        code = int(args.func(args) or 0)
        if interrupts.count:  # raised where it could not propagate (a callback from C)
            interrupts.say()
            return 130
        return code
    except KeyboardInterrupt:
        if args.debug:
            traceback.print_exc()
        interrupts.interrupted()
        return 130
    except Exception as err:
        from mmproxy.errors import MmproxyError

        if args.debug:
            traceback.print_exc()
        if interrupts.count:  # what an interrupt that was swallowed left behind
            interrupts.say()
            return 130
        if isinstance(err, ModuleNotFoundError) and err.name:
            message = f"needs {err.name}, which is not installed: {_missing(err.name)}"
        elif isinstance(err, (MmproxyError, ValueError, OSError)):
            message = _one_line(err)
        else:  # not the user's doing
            message = (f"{type(err).__name__}: {_one_line(err)} (unexpected: please report it, "
                       "with the traceback --debug prints)")
        print(f"{where}: error: {message}", file=sys.stderr)
        if not args.debug:
            print("(run with --debug for the traceback)", file=sys.stderr)
        return 1
    finally:
        if installed and argv is not None:
            interrupts.restore()


if __name__ == "__main__":
    sys.exit(main())
