"""Media checks: what a file's first bytes say of it, below both the datasets and the pipelines.

:mod:`mmproxy.media.checks` is the check a dataset runs on each field (signature, declared size,
damage, by extension); :mod:`~mmproxy.media.image`, :mod:`~mmproxy.media.audio` and
:mod:`~mmproxy.media.video` read their formats' headers. Pure Python over bytes: no torch, no DALI.
"""

from __future__ import annotations

__all__ = ["Unread"]


class Unread(str):
    """A problem that is no damage: a file of a variant of its format (a sound file's, a TIFF's)
    that DALI's decoders do not read."""
