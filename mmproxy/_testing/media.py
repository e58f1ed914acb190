"""Synthetic media: images, video and speech drawn from a seed, the encoders that make files of
them (JPEG, PNG, ...; H.264, VP9, ...; WAV, FLAC, OGG), and JPEGs damaged as web corpora damage
them (:func:`damage_jpeg`). Public through :mod:`mmproxy.testing`."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["audio_bytes", "damage_jpeg", "faststart_mp4", "image_bytes", "synth_image", "synth_speech",
           "synth_video", "video_bytes"]


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
