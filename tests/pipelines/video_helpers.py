"""Helpers the tests of this folder share."""

from __future__ import annotations

import io

import numpy as np
import pytest
from mmproxy.pipelines import video_pipeline
from torch.utils.data import default_collate

import mmproxy
from mmproxy.testing import synth_video, video_bytes
from mmproxy.worker import sample_key

av = pytest.importorskip("av")


# Decoders convert YUV to RGB differently (chroma upsampling, rounding): on these textured clips
# DALI's frames differ from PyAV's by ~4 levels on average in RGB and ~1.2 in luma; the
# neighbouring frame (off by one in time) differs by ~14. So: mean |RGB error| <= 6, mean |luma
# error| <= 2, and the neighbour must be clearly worse.
MEAN_TOLERANCE, LUMA_TOLERANCE = 6.0, 2.0


def _luma(x):
    return 0.299 * x[..., 0] + 0.587 * x[..., 1] + 0.114 * x[..., 2]


CODECS = {"h264": ("libx264", "mp4"), "vp9": ("libvpx-vp9", "webm"), "mjpeg": ("mjpeg", "avi")}


def _encode(codec, seed=0, frames=50, **kw):
    name, container = CODECS[codec]
    return video_bytes(synth_video(seed, frames), name, container, **kw)


def _reference(data):
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _run(server, videos, seeds=None):
    refs = []
    for i, data in enumerate(videos):
        with sample_key(f"v{i}", seed=(seeds or list(range(len(videos))))[i]):
            refs.append(server.proxy(np.frombuffer(data, np.uint8)))
    return server.produce_data(default_collate(refs))


def _server(decoder, **kw):
    options = dict(batch_size=4, frames=4, stride=3, size=64, resize_size=64, train=False,
                   decoder=decoder, device="cpu", num_threads=1, dtype="uint8", layout="THWC")
    return mmproxy.DALIServer(video_pipeline(**{**options, **kw}), name=f"video-{decoder}")


def _clip_decoder(monkeypatch, threads=1, slot=None):
    """A ClipDecoder on a machine without PyNvVideoCodec (its slots: ``slot``)."""
    from mmproxy.pipelines.video import _nvdec

    monkeypatch.setattr(_nvdec, "load_nvdec", lambda: None)
    if slot is not None:
        monkeypatch.setitem(_nvdec.NVDEC_LIBRARIES, "pynvvideocodec", slot)
    return _nvdec.ClipDecoder("videos", 3, 2, 0, threads, None, ())
