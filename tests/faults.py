"""Fault helpers for the reliability suite: corrupt media, leak snapshots, misbehaving datasets."""

from __future__ import annotations

import os
import random
import signal
import struct
import threading
from pathlib import Path

import numpy as np
import psutil
import torch

from mmproxy.testing import audio_bytes, image_bytes, synth_image, synth_speech


def good_media():
    img = synth_image(5, 48, 64)
    sig = synth_speech(5, 0.3, 16000)
    return {"jpg": image_bytes(img), "png": image_bytes(img, "PNG"),
            "wav": audio_bytes(sig, 16000, "WAV"), "flac": audio_bytes(sig, 16000, "FLAC"),
            "ogg": audio_bytes(sig, 16000, "OGG")}


def corruptions(data: bytes, seed: int):
    """Truncated, bit-flipped and empty variants of ``data``."""
    rng = random.Random(seed)
    flipped = bytearray(data)
    for _ in range(8):
        i = rng.randrange(len(flipped) // 4, len(flipped))
        flipped[i] ^= 1 << rng.randrange(8)
    return {"truncated-half": data[: len(data) // 2], "truncated-header": data[:10],
            "bitflip": bytes(flipped), "empty": b""}


def huge_png() -> bytes:
    png = bytearray(image_bytes(np.zeros((4, 4, 3), np.uint8), "PNG"))
    png[16:24] = struct.pack(">II", 100_000, 100_000)
    return bytes(png)


def snapshot():
    """What must not leak: mmproxy threads, child processes, open fds, /dev/shm entries."""
    me = psutil.Process()
    return {
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("mmproxy-")),
        "children": len(me.children(recursive=True)),
        "fds": len(os.listdir("/proc/self/fd")),
        "shm": sorted(p.name for p in Path("/dev/shm").iterdir()),
        "rss": me.memory_info().rss,
    }


class KillingDataset(torch.utils.data.Dataset):
    """SIGKILLs its worker at sample ``at``."""

    def __init__(self, proxy, at):
        self.proxy, self.at = proxy, at

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.proxy(np.full((3,), i, np.float32)), i


class RaisingDataset(torch.utils.data.Dataset):
    def __init__(self, proxy):
        self.proxy = proxy

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 13:
            raise KeyError(f"user code failed on sample {i}")
        return self.proxy(np.full((3,), i, np.float32)), i
