"""What a header check says of a file that is not damaged but that DALI's decoders do not read."""

from __future__ import annotations

__all__ = ["Unread"]


class Unread(str):
    """A problem that is no damage: a file of a variant of its format (a sound file's, a TIFF's)
    that DALI's decoders do not read."""
