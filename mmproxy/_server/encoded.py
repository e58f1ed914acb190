"""Encoded inputs: what a pipeline input that a decoder reads must look like.

A pipeline whose ``external_source`` feeds a DALI decoder directly (found in its graph by
:mod:`mmproxy._server.dali`) expects the bytes of a file there. The proxy checks each such input when
it is called, in the worker, so that a decoded array (an HWC image a transform already decoded)
or a file that is not an image is refused at once with a message that says what the pipeline
expects, instead of failing a whole batch in the server and being searched for sample by sample.
The check is cheap (the array's shape and type, and a few leading bytes); damage inside a file
is still the decoder's to find.
"""

from __future__ import annotations

import enum

import numpy as np

__all__ = ["Encoded", "expected", "problem"]


class Encoded(enum.Enum):
    """What a decoder reads from a pipeline input."""

    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"


# The image formats DALI's decoders read (nvImageCodec's parsers), by their leading bytes.
_IMAGE_SIGNATURES = (
    ("JPEG", (b"\xff\xd8\xff",)),
    ("PNG", (b"\x89PNG\r\n\x1a\n",)),
    ("BMP", (b"BM",)),
    ("TIFF", (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")),
    ("JPEG 2000", (b"\x00\x00\x00\x0cjP  \r\n\x87\n", b"\xff\x4f\xff\x51")),
    ("PNM", tuple(b"P%d" % n for n in range(1, 7))),
)
IMAGE_FORMATS = ", ".join([name for name, _ in _IMAGE_SIGNATURES] + ["WebP"])
_EVERY_SIGNATURE = tuple(s for _, signatures in _IMAGE_SIGNATURES for s in signatures)


def _is_image(head: bytes) -> bool:
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return True
    return head.startswith(_EVERY_SIGNATURE)


def expected(kind: Encoded) -> str:
    """What the pipeline expects, in words."""
    if kind is Encoded.IMAGE:
        return f"encoded images (the bytes of an image file: {IMAGE_FORMATS}) as a 1-D uint8 array"
    return f"encoded {kind.value} (the bytes of a file) as a 1-D uint8 array"


def problem(kind: Encoded, array: np.ndarray) -> str | None:
    """Why ``array`` cannot be what a decoder of ``kind`` reads, or None when it may be."""
    if array.ndim != 1 or array.dtype != np.uint8:
        return (f"got a {array.dtype} array of shape {tuple(array.shape)}, which is not encoded "
                "data (already decoded?)")
    if kind is Encoded.IMAGE:
        head = array[:12].tobytes()
        if not _is_image(head):
            what = "empty data" if not len(array) else f"{len(array)} bytes starting with {head!r}"
            return f"got {what}, which is not an image file of a format it reads"
    return None
