"""Testing: synthetic data for tests, the demo, the examples and the benchmarks.

The one place for it: media (images with gradients and shapes, speech-like audio, damaged JPEGs),
captions, shards, an ImageFolder tree, a tiny tokenizer trained on the captions, and the cache
folder they are kept in. Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["WORDS", "audio_bytes", "cache_dir", "caption", "damage_jpeg", "demo_shards",
           "demo_tokenizer", "faststart_mp4", "image_bytes", "image_folder", "make_tokenizer",
           "synth_image", "synth_speech", "synth_video", "video_bytes", "write_tar",
           "writing_cache"]

WORDS = ("a red circle on a blue field", "green stripes over a yellow sky",
         "a small square in the corner", "waves of orange and purple light",
         "two dots beside a long line", "a bright ring around a dark center")


def cache_dir() -> Path:
    """mmproxy's cache folder: ``$XDG_CACHE_HOME/mmproxy``, else ``~/.cache/mmproxy``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmproxy"


@contextlib.contextmanager
def writing_cache(where: str | os.PathLike[str]) -> Iterator[None]:
    """Writing under ``where``: an ``OSError`` there (a read-only or full disk, no permission)
    says, when ``where`` is in :func:`cache_dir`, where that folder comes from and how to move it
    (``XDG_CACHE_HOME``); elsewhere it goes on as it is."""
    try:
        yield
    except OSError as err:
        cache = cache_dir()
        if not Path(where).is_relative_to(cache):
            raise
        base = os.environ.get("XDG_CACHE_HOME")
        origin = f"$XDG_CACHE_HOME/mmproxy (XDG_CACHE_HOME={base})" if base else (
            "~/.cache/mmproxy, as XDG_CACHE_HOME is not set")
        what = f"{err.filename}: " if err.filename else ""
        raise type(err)(f"cannot write to mmproxy's cache folder {cache}: {what}"
                        f"{err.strerror or err}; that folder is {origin}: set XDG_CACHE_HOME to a "
                        "writable folder") from err


def caption(i: int) -> str:
    """The caption of synthetic sample ``i``: one of :data:`WORDS` (label ``i % len(WORDS)``)."""
    return f"{WORDS[i % len(WORDS)]}, take {i}"


def synth_image(seed: int, height: int = 96, width: int = 128) -> np.ndarray:
    """An RGB uint8 image with gradients and a filled shape, different for every seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(0, 255, 3)
    angle = rng.uniform(0, np.pi)
    grad = (np.cos(angle) * x / width + np.sin(angle) * y / height)
    img = base[None, None, :] * 0.5 + 120 * grad[..., None] * rng.uniform(0.3, 1.0, 3)
    cy, cx, r = rng.uniform(0.2, 0.8) * height, rng.uniform(0.2, 0.8) * width, rng.uniform(8, 30)
    mask = (y - cy) ** 2 + (x - cx) ** 2 < r * r
    img[mask] = rng.uniform(0, 255, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


def image_bytes(array: np.ndarray, fmt: str = "JPEG", mode: str | None = None,
                quality: int = 90) -> bytes:
    """Encodes an array with Pillow (``fmt``: JPEG, PNG, ...; ``mode``: L, RGBA, ...)."""
    from PIL import Image

    img = Image.fromarray(array)
    if mode:
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": quality} if fmt == "JPEG" else {}))
    return buf.getvalue()


def damage_jpeg(data: bytes, kind: str) -> bytes:
    """A JPEG damaged as web corpora damage them: ``truncate`` cuts it to a third (an interrupted
    download), ``corrupt`` overwrites its first Huffman table: the header checks catch both in the
    workers (see mmproxy.datasets.checks). ``garbage`` keeps the first 20 bytes (the file's
    signature and the start of its JFIF header) and replaces the rest with random bytes: it
    passes the checks and fails the decoder, so the server must find it."""
    if kind == "truncate":
        return data[:len(data) // 3]
    if kind == "garbage":
        return data[:20] + np.random.default_rng(len(data)).bytes(len(data) - 20)
    if kind != "corrupt":
        raise ValueError(f"damage kind must be 'truncate', 'corrupt' or 'garbage', got {kind!r}")
    out = bytearray(data)
    at = out.find(b"\xff\xc4")
    length = int.from_bytes(out[at + 2:at + 4], "big")
    out[at + 5:at + 4 + length] = b"\xff" * (length - 1)
    return bytes(out)


def synth_video(seed: int, frames: int = 50, height: int = 64, width: int = 96) -> np.ndarray:
    """RGB uint8 frames ``[T, H, W, 3]`` of a scene that moves: a textured background panning
    sideways (a camera pan), a lit gradient, and a shape crossing the frame."""
    rng = np.random.default_rng(seed)
    # noise at a quarter of the resolution, enlarged: texture rather than pixel noise
    coarse = rng.normal(0, 25, (-(-height // 4), -(-4 * width // 4), 3))
    texture = np.repeat(np.repeat(coarse, 4, axis=0), 4, axis=1)[:height, :4 * width]
    base = synth_image(seed, height, width).astype(np.float32)
    y, x = np.mgrid[0:height, 0:width]
    colour, r = rng.uniform(0, 255, 3), rng.uniform(6, 14)
    out = np.empty((frames, height, width, 3), np.uint8)
    for t in range(frames):
        pan = int(t * 2) % (3 * width)
        frame = base * 0.7 + texture[:, pan:pan + width]
        cx, cy = (t * 3) % (width + 2 * r) - r, height / 2 + height / 4 * np.sin(t / 7)
        frame[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = colour
        out[t] = np.clip(frame, 0, 255).astype(np.uint8)
    return out


def video_bytes(frames: np.ndarray, codec: str = "libx264", container: str = "mp4", fps: int = 25,
                gop: int = 12, crf: int = 18) -> bytes:
    """Encodes RGB frames with PyAV (``codec``: libx264, libvpx-vp9, mjpeg, mpeg4, ...;
    ``container``: mp4, webm, avi, ...); a key frame every ``gop`` frames."""
    # through a file, not a BytesIO: an interrupt raised in FFmpeg's callbacks into Python is lost
    with tempfile.TemporaryDirectory(prefix="mmproxy-video-") as folder:
        path = os.path.join(folder, f"clip.{container}")
        _encode_video(path, frames, codec, container, fps, gop, crf)
        with open(path, "rb") as f:
            return f.read()


def _encode_video(path: str, frames: np.ndarray, codec: str, container: str, fps: int, gop: int,
                  crf: int) -> None:
    import av

    with av.open(path, "w", format=container) as out:
        stream: Any = out.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        stream.gop_size = gop
        if codec == "libx264":
            stream.options = {"crf": str(crf), "preset": "veryfast"}
        elif codec == "libvpx-vp9":
            stream.options = {"crf": str(crf + 12), "b:v": "0", "deadline": "realtime",
                              "cpu-used": "8"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def faststart_mp4(data: bytes, folder: str | os.PathLike[str]) -> bytes:
    """The video of the MP4 ``data``, remuxed without re-encoding so that its index (the ``moov``
    box) comes before its frames, as ``ffmpeg -movflags +faststart`` writes files for streaming.
    The muxer rewrites its output to move the index, so it writes a file in ``folder`` (and
    removes it)."""
    import av

    path = Path(folder) / f"faststart-{os.getpid()}-{id(data)}.mp4"
    try:
        with av.open(io.BytesIO(data), "r") as source, \
                av.open(str(path), "w", format="mp4", options={"movflags": "faststart"}) as out:
            streams = {s.index: out.add_stream_from_template(s) for s in source.streams.video}
            for packet in source.demux(*source.streams.video):
                if packet.dts is not None:  # not the demuxer's final flush
                    packet.stream = streams[packet.stream.index]
                    out.mux(packet)
        return path.read_bytes()
    finally:
        path.unlink(missing_ok=True)


def synth_speech(seed: int, seconds: float, rate: int = 16000, channels: int = 1) -> np.ndarray:
    """A float32 signal with a gliding fundamental, harmonics and syllable-like bursts."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = rng.uniform(90, 220) * (1 + 0.1 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 * (1 + np.sin(2 * np.pi * rng.uniform(2, 5) * t)) ** 2
    signal = (0.2 * voice * envelope).astype(np.float32)
    if channels > 1:
        signal = np.stack([signal * (1 - 0.2 * c) for c in range(channels)], axis=1)
    return signal


def audio_bytes(signal: np.ndarray, rate: int, fmt: str = "WAV") -> bytes:
    """Encodes a float signal as 16-bit WAV (standard library), FLAC or OGG/Vorbis (soundfile)."""
    buf = io.BytesIO()
    if fmt == "WAV":
        import wave

        pcm = np.round(np.clip(signal, -1, 1) * 32767).astype("<i2")
        with wave.open(buf, "wb") as w:
            w.setnchannels(1 if pcm.ndim == 1 else pcm.shape[1])
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(pcm.tobytes())
        return buf.getvalue()
    import soundfile as sf

    # through a file, not a BytesIO: libsndfile would call back into Python to write, and an
    # interrupt (Ctrl-C) raised in such a callback is printed and lost
    with tempfile.TemporaryFile() as f:
        sf.write(f.fileno(), signal, rate, format=fmt, closefd=False,
                 subtype={"FLAC": "PCM_16", "OGG": "VORBIS"}[fmt])
        f.seek(0)
        return f.read()


def write_tar(path: str | os.PathLike[str], samples: Iterable[dict[str, Any]]) -> int:
    """Writes WebDataset samples (``{"__key__": ..., "jpg": bytes, "cls": 3, ...}``) to a tar,
    atomically: a reader (or another process writing the same shard) never sees half of it, and
    an error or an interrupt leaves nothing behind."""
    from mmproxy._parts import part_path

    count = 0
    part = part_path(path)
    try:
        with tarfile.open(part, "w") as tar:
            for sample in samples:
                key = sample["__key__"]
                for ext, value in sample.items():
                    if ext.startswith("__"):
                        continue
                    data = value if isinstance(value, bytes) else str(value).encode()
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    info.mode = 0o644
                    tar.addfile(info, io.BytesIO(data))
                count += 1
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)
        raise
    return count


def demo_shards(samples: int = 128, per_shard: int = 16,
                folder: str | os.PathLike[str] | None = None, video: bool = False,
                on_write: Callable[[Path], None] | None = None) -> str:
    """Writes (once) the demo's multi-modal shards: per sample a JPEG, its :func:`caption`, FLAC
    speech and a label (``cls``), and with ``video`` an H.264 clip (``mp4``, 2 s, needs PyAV);
    keys ``demo000000`` on. Returns their brace pattern. Shards half-written by a process that
    ended are removed; those already whole are kept.

    Args:
        samples: How many samples.
        per_shard: Samples per shard.
        folder: Where; default ``cache_dir()/demo/shards-SAMPLES-PER_SHARD[-video]``.
        video: Add a video field.
        on_write: Called with the folder once, before the first shard is written (not when every
            shard is there already).
    """
    from mmproxy._parts import remove_stale_parts

    name = f"shards-{samples}-{per_shard}" + ("-video" if video else "")
    where = Path(folder or cache_dir() / "demo" / name)
    shards = (samples + per_shard - 1) // per_shard
    missing = [s for s in range(shards) if not (where / f"demo-{s:04d}.tar").exists()]
    if missing:
        with writing_cache(where):
            where.mkdir(parents=True, exist_ok=True)
            remove_stale_parts(where)
            if on_write is not None:
                on_write(where)
            for s in missing:
                write_tar(where / f"demo-{s:04d}.tar", (
                    _demo_sample(i, video)
                    for i in range(s * per_shard, min(samples, (s + 1) * per_shard))))
    return str(where / f"demo-{{0000..{shards - 1:04d}}}.tar")


def _demo_sample(i: int, video: bool = False) -> dict[str, Any]:
    speech = synth_speech(i, 1.0 + (i % 5) * 0.4, 22050)
    sample = {"__key__": f"demo{i:06d}", "jpg": image_bytes(synth_image(i, 240, 320)),
              "txt": caption(i), "flac": audio_bytes(speech, 22050, "FLAC"),
              "cls": str(i % len(WORDS))}
    if video:
        sample["mp4"] = video_bytes(synth_video(i, 50, 120, 160))
    return sample


def image_folder(root: str | os.PathLike[str], per_class: int = 8) -> str:
    """Writes an ImageFolder tree of synthetic JPEGs, two classes (``circles``, ``stripes``)."""
    for c, name in enumerate(("circles", "stripes")):
        (Path(root) / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (Path(root) / name / f"{i}.jpg").write_bytes(image_bytes(synth_image(100 * c + i)))
    return str(root)


def make_tokenizer(folder: str | os.PathLike[str], texts: Sequence[str] = WORDS,
                   vocab_size: int = 200) -> str:
    """Trains a tiny word-piece tokenizer with ``tokenizers`` and saves it for AutoTokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size,
                                        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
                                        show_progress=False)  # blank lines in a log
    tok.train_from_iterator(list(texts) * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]")
    Path(folder).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return str(folder)


def demo_tokenizer(folder: str | os.PathLike[str] | None = None) -> str:
    """A tiny tokenizer trained on the synthetic captions, made once in ``folder`` (default
    ``cache_dir()/demo/tokenizer``); processes making it at the same time (ranks) all get one
    whole copy. Returns the folder, for :func:`mmproxy.datasets.load_tokenizer`."""
    from mmproxy._parts import part_path, remove_stale_parts

    where = Path(folder or cache_dir() / "demo" / "tokenizer")
    if not (where / "tokenizer.json").exists():
        part = Path(part_path(where))
        with writing_cache(where):
            remove_stale_parts(where.parent)
            try:
                make_tokenizer(part, [caption(i) for i in range(10 * len(WORDS))])
                part.rename(where)  # atomic; refused if another process's copy is already there
            except OSError:
                if not (where / "tokenizer.json").exists():
                    raise
            finally:
                shutil.rmtree(part, ignore_errors=True)
    return str(where)
