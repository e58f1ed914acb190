"""Damage: JPEGs broken as web corpora break them, for the header checks and the decoder to find.
Public through :mod:`mmproxy.testing`."""

from __future__ import annotations

import numpy as np

__all__ = ["damage_jpeg"]


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
