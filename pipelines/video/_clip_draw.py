"""Clip draw: the video pipeline's per-sample randomness, drawn in the worker from the sample's seed.

A :class:`ClipDraw` (the :class:`~mmproxy.proxy.SampleRandom` of every ``video_pipeline``)
reads the container header, refuses a codec the server's decoder cannot decode (by name),
draws the clip's start frame, the crop position and the flip, and decodes the clip with PyAV
where the frames are decoded in the worker.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

import numpy as np
from mmproxy.pipelines.video._backlog import Backlog, paced
from mmproxy.pipelines.video._nvdec import NVDEC_CODECS
from mmproxy.pipelines.video._nvdec_session import clip_indices
from mmproxy.pipelines.video._pyav import count_frames, cut_clip, decode_clip, pyav_installed

from mmproxy.errors import install_hint

if TYPE_CHECKING:
    from mmproxy.media.checks import VideoInfo

__all__ = ["CPU_CODECS", "ClipDraw", "clip_start"]

CPU_CODECS = ("vp8", "vp9", "mjpeg")  # what DALI 2.4's CPU video decoder decodes
_PACE = 0.2  # weight of the latest clip in a worker's running PyAV time a clip
_NAMES = {"h264": "H.264", "hevc": "HEVC", "av1": "AV1", "mpeg4": "MPEG-4", "vp8": "VP8",
          "vp9": "VP9", "mjpeg": "MJPEG"}


def clip_start(total: int | None, frames: int, stride: int, train: bool, rng: random.Random) -> int:
    """The first frame of a clip of ``frames`` frames at ``stride`` in a video of ``total``
    frames: uniform over the starts that fit (training), centred (evaluation), 0 if unknown."""
    if not total:
        return 0
    room = max(0, total - ((frames - 1) * stride + 1))
    return rng.randint(0, room) if train else room // 2


class ClipDraw:
    """The video pipeline's per-sample draws (a :class:`~mmproxy.proxy.SampleRandom`): the clip's
    start frame (or, with ``decode_in_worker``, its decoded frames), the crop position and the
    flip, from the sample's seed. Refuses a codec the server's decoder cannot decode, by name.

    With ``nvdec`` the start is drawn as for DALI's decoder and the encoded clip goes to the
    server's NVDEC decoder, cut to the packets its frames need where it can be (``at`` then
    names the frames to take from the cut clip); a clip NVDEC cannot take
    (``nvdec_codecs`` in MP4/MOV) and, with ``cpu_share``, that share of the others (one
    more draw, after the clip's), are decoded here with PyAV and sent as frames instead. With a
    ``backlog`` instead (``cpu_share="auto"``), a clip is decoded here when the server's NVDEC
    work queued (:class:`Backlog`) would take longer than this worker takes to decode a clip
    (its running time a clip with PyAV, starting at 0: the first clip with any NVDEC work
    queued is decoded here).
    """

    def __init__(self, input_name: str, frames: int, stride: int, train: bool,
                 flip_probability: float, every_frame: bool, decode_in_worker: bool,
                 cpu_decoder: bool, nvdec: bool = False, cpu_share: float = 0.0,
                 backlog: Backlog | None = None,
                 nvdec_codecs: tuple[str, ...] = NVDEC_CODECS) -> None:
        self.input_name, self.frames, self.stride, self.train = input_name, frames, stride, train
        self.flip_probability, self.every_frame = flip_probability, every_frame
        self.decode_in_worker, self.cpu_decoder = decode_in_worker, cpu_decoder
        self.nvdec, self.cpu_share, self.backlog = nvdec, cpu_share, backlog
        self.nvdec_codecs = nvdec_codecs  # what the server's NVDEC library is given
        self.pace = 0.0  # this process's running time to decode a clip with PyAV, seconds
        place = (("frames",) if decode_in_worker else ("start", "at") if nvdec else
                 ("start",) if not every_frame else ())
        self.names = (*place, *(("crop_x", "crop_y") if train else ()), "flip")
        self.arguments = (input_name,)

    def __call__(self, given: dict[str, np.ndarray], rng: random.Random) -> dict[str, np.ndarray]:
        from mmproxy.media.checks import video_cut, video_info

        data = given[self.input_name].data.cast("B")
        info = video_info(data)
        cut = video_cut(data)  # a decoder would stop early, or repeat its last frame
        if cut:
            raise ValueError(f"the video {cut}")
        if info is not None and self.cpu_decoder and info.codec not in (None, *CPU_CODECS):
            raise ValueError(
                f"{_NAMES.get(info.codec, info.codec)} video: DALI's CPU video decoder decodes "
                f"only {', '.join(_NAMES[c] for c in CPU_CODECS)}; use "
                "video_pipeline(decoder='pyav') (PyAV decodes it in the workers) or a GPU")
        here = self.decode_in_worker or (self.nvdec and not _nvdec_takes(info, self.nvdec_codecs))
        if here and self.nvdec:
            _need_pyav(info, self.nvdec_codecs)
        out: dict[str, np.ndarray] = {}
        start, total = 0, None
        if not self.every_frame:
            total = count_frames(data, info)
            start = clip_start(total, self.frames, self.stride, self.train, rng)
        if self.train:  # evaluation crops sit at the centre (the pipeline places them)
            out["crop_x"] = np.array(rng.random(), np.float32)
            out["crop_y"] = np.array(rng.random(), np.float32)
        out["flip"] = np.array(self.train and rng.random() < self.flip_probability, np.int32)
        if self.nvdec and not here and self.cpu_share > 0:
            here = self.cpu_share >= 1 or rng.random() < self.cpu_share
        elif self.nvdec and not here and self.backlog is not None:
            here = self.backlog.seconds() > self.pace
        if here:
            began = time.perf_counter()
            # one thread: many workers decode at once, so each is best on its own core
            decoded = decode_clip(data, start, None if self.every_frame else self.frames,
                                  self.stride, threads=False)
            self.pace = paced(self.pace, time.perf_counter() - began, _PACE)
            out[self.input_name if self.nvdec else "frames"] = decoded
        if "start" in self.names:
            out["start"] = np.array(start, np.int32)
        if "at" in self.names:
            out["at"] = np.zeros(0, np.int32)  # the clip from its start
            if not here and total:
                self._cut(data, total, start, out)
        return out

    def _cut(self, data: memoryview, total: int, start: int, out: dict[str, np.ndarray]) -> None:
        """An encoded clip for NVDEC cut to the packets its frames need (:func:`cut_clip`: from
        the key frame before it, without the pictures nothing refers to that it does not show),
        with the frames to take from it in ``at``; left whole where it cannot be cut or PyAV is
        not here."""
        if not pyav_installed():
            return
        cut = cut_clip(data, clip_indices(total, start, self.frames, self.stride))
        if cut is not None:
            out[self.input_name], at = cut
            out["at"] = np.asarray(at, np.int32)


def _nvdec_takes(info: VideoInfo | None, codecs: tuple[str, ...]) -> bool:
    """Whether the server's NVDEC decoder takes this video (one of its ``codecs`` in an MP4/MOV
    file)."""
    return info is not None and info.container == "mp4" and info.codec in codecs


def _need_pyav(info: VideoInfo | None, codecs: tuple[str, ...]) -> None:
    """Refuses, by codec and container, a video NVDEC does not take when PyAV is not here."""
    if pyav_installed():
        return
    what = "an unknown kind of" if info is None else (
        f"{_NAMES.get(info.codec or '', info.codec or 'unknown codec')} in {info.container}")
    hevc = "" if "hevc" in codecs else (
        " (HEVC too with PyNvVideoCodec, whose HEVC frames are not always the ones asked for; "
        "nvdec_library='torchcodec' decodes HEVC on NVDEC)")
    raise ValueError(
        f"{what} video: NVDEC decodes only {', '.join(_NAMES[c] for c in codecs)} in "
        f"MP4/MOV files, and the others are decoded in the workers by PyAV{hevc}, which is not "
        f"installed: {install_hint('av')}")
