"""Commands: the parser of the ``mmproxy`` command line, each command's options and their checks.

A command's ``func`` is the ``run`` of its app (:mod:`mmproxy.apps`), imported when the command
runs, so that ``mmproxy --help`` is quick; ``command_parser`` is its own parser, for errors
worded with its usage. Values out of range are refused here (exit 2); :mod:`mmproxy.cli` runs
the command.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable, Sequence

__all__ = ["build_parser", "unrecognized"]


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


def _pipelines(text: str) -> int | str:
    """``--pipelines``: a whole number >= 1, or ``auto``."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or auto, got {text!r}")
    return value


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
    demo.add_argument("--samples", type=_POSITIVE, default=None,
                      help="size of the synthetic set (default 256; not with --data)")
    demo.add_argument("--video", action="store_true",
                      help="add an H.264 clip to every synthetic sample, and a video server "
                      "(needs PyAV: pip install av; not with --data, whose fields pick the servers)")
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
                            ".txt pairs), audio files with labels (class folders) or videos "
                            "with labels or captions (--kind video-label, video-text) as shards, "
                            "each sample with its source path (src), and classes.json, "
                            "manifest.jsonl (key -> shard, source file) and, when any file was "
                            "left out, left_out.jsonl (each, and why) beside them; prints what "
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
    bench.add_argument("--workload", default=None,
                       help="image, audio, image-text, video, machinery, a comma-separated "
                       "list, or all (default image; with --data, what your shards' field is)")
    bench.add_argument("--no-next-epoch-prefetch", dest="next_epoch", action="store_false",
                       help="mmproxy: do not prepare the next epoch's first batch early")
    bench.add_argument("--stacks", action="store_true",
                       help="sample this process's threads' Python frames every 10 ms (and on a "
                       "GPU NVML's decoder and GPU utilization) while each system runs: "
                       "each result's 'stacks'")
    bench.add_argument("--prefetch", type=_POSITIVE, default=2,
                       help="prefetch_queue_depth of the proxied pipelines (mmproxy, dali-proxy)")
    bench.add_argument("--systems", default="mmproxy,torch,torch-tensor,dali-proxy,dali-reader",
                       help="comma-separated subset of mmproxy, torch (PIL decode + torchvision "
                       "v2 in workers; audio: soundfile + torchaudio; video: PyAV + torchvision), "
                       "torch-tensor (torchvision.io.decode_jpeg + v2), dali-proxy "
                       "(DALI's own proxy), dali-proxy-seed (the same with its documentation's "
                       "prefetch_queue_depth=2*workers), dali-reader (fn.readers.webdataset, no Python), "
                       "spdl (SPDL's thread pipeline and FFmpeg decoding, --workers decoding "
                       "threads; image, audio; pip install spdl), spdl-gpu (the same "
                       "with nvJPEG on the GPU; image), mmproxy-http, mmproxy-s3, mmproxy-cached "
                       "(the image shards served by a local HTTP or S3 server, or through the "
                       "node cache)")
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
    bench.add_argument("--pipelines", type=_pipelines, default="auto",
                       help="mmproxy and dali-graph: pipelines a server runs side by side, a number "
                       "or auto (default; one on a CPU)")
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
    bench.add_argument("--hw-decoder-load", type=_FRACTION, default=None,
                       help="image systems on a GPU: the share of JPEGs for the GPU's hardware "
                       "decoder, the rest decoded by DALI's threads (default: DALI's, 0.65)")
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


def unrecognized(parser: argparse.ArgumentParser, tokens: Sequence[str], extra: Sequence[str]) -> str:
    """The error for the ``extra`` words a command's ``parser`` left over from its command line
    (``tokens``). More words after an option of one value than it takes, or more than the
    command's own paths, are most often a pattern the shell expanded (``--data dir/*.tar``
    unquoted): said so, with what to write instead. Anything else is argparse's "unrecognized
    arguments"."""
    plain = "unrecognized arguments: " + " ".join(extra)
    if any(word.startswith("-") for word in extra):
        return plain
    options = {name: action for action in parser._actions for name in action.option_strings}
    positionals = [action for action in parser._actions if not action.option_strings]
    command = parser.prog.split()[-1]
    i = tokens.index(command) + 1 if command in tokens else 0
    free: list[str] = []  # the words no option took: the command's own paths
    while i < len(tokens):
        action = _option(options, tokens[i])
        if action is None:
            free.append(tokens[i])
        elif action.nargs is None and "=" not in tokens[i]:  # an option of one value
            run = _words(tokens, i + 1)
            if not positionals and len(run) > 1 and all(map(os.path.lexists, run)):
                return _expanded(action.option_strings[-1], run)
            free += run[1:]  # the command's own paths may follow an option's value
            i += len(run)
        i += 1
    expanded = free[:len(free) - len(positionals) + 1]  # the first path's, most likely
    if positionals and len(free) > len(positionals) and all(map(os.path.lexists, expanded)):
        names = " and ".join(a.dest.upper() for a in positionals)
        return (f"the command takes {len(positionals)} paths, {names}; got {len(free)} (the "
                f"shell expanded a pattern?): name the folder, {parser.prog} {_folder(expanded)} "
                + " ".join(free[len(expanded):]))
    return plain


def _expanded(option: str, paths: list[str]) -> str:
    """What to say of an option of one value followed by several existing ``paths``."""
    folder = f", or name the folder, {option} {_folder(paths)}" if option == "--data" else ""
    return (f"{option} takes one argument; got {len(paths)} paths after it (the shell expanded a "
            f"pattern?): quote it, {option} '{_pattern(paths)}'{folder}")


def _words(tokens: Sequence[str], start: int) -> list[str]:
    """The words from ``start`` up to the next option."""
    end = next((i for i in range(start, len(tokens)) if tokens[i].startswith("-")), len(tokens))
    return list(tokens[start:end])


def _option(options: dict[str, argparse.Action], token: str) -> argparse.Action | None:
    """The option ``token`` names (``--name``, ``--name=value`` or a unique abbreviation)."""
    if not token.startswith("-") or token == "-":
        return None
    name = token.split("=", 1)[0]
    if name in options:
        return options[name]
    matches = {options[o] for o in options if o.startswith(name) and o.startswith("--")}
    return matches.pop() if len(matches) == 1 else None


def _folder(paths: Sequence[str]) -> str:
    """The folder that holds every one of ``paths`` (``FOLDER`` when they share none)."""
    try:
        return os.path.commonpath([os.path.dirname(p) or "." for p in paths]) or "."
    except ValueError:  # absolute and relative paths mixed
        return "FOLDER"


def _pattern(paths: Sequence[str]) -> str:
    """A glob for ``paths``: their folder, and the start and end their names share (without the
    digits of a shard's number), ``shard-*.tar`` for ``shard-000.tar shard-001.tar``."""
    names = [os.path.basename(p) for p in paths]
    start = os.path.commonprefix(names).rstrip("0123456789")
    end = os.path.commonprefix([n[::-1] for n in names])[::-1].lstrip("0123456789")
    if len(start) + len(end) > min(map(len, names)):  # the two overlap
        end = ""
    folder = _folder(paths)
    return f"{start}*{end}" if folder == "." else os.path.join(folder, f"{start}*{end}")
