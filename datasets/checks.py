"""The header checks a field runs (:mod:`mmproxy.media.checks`), under the datasets' name."""

from __future__ import annotations

from mmproxy.media.checks import (
    MAX_PIXELS,
    SIGNATURES,
    VIDEO_EXTS,
    VideoInfo,
    check_header,
    image_size,
    video_cut,
    video_info,
)

__all__ = ["MAX_PIXELS", "SIGNATURES", "VIDEO_EXTS", "VideoInfo", "check_header", "image_size",
           "video_cut", "video_info"]
