"""The clip decoder in the server (NVDEC and TorchCodec sessions, PyAV where they refuse a clip),
and the GPU decodes."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
import torch
from mmproxy.datasets import video_label_dataset
from mmproxy.pipelines import decode_clip, video_pipeline
from mmproxy.pipelines.video._pynvvideocodec import PyNvSession
from video_helpers import (
    LUMA_TOLERANCE,
    MEAN_TOLERANCE,
    _clip_decoder,
    _encode,
    _luma,
    _reference,
    _run,
    _server,
)

from mmproxy.testing import synth_video, video_bytes, write_tar

pytestmark = pytest.mark.timeout(240)


_WHOLE = np.zeros(0, np.int32)  # no `at`: the clip from its start


class _FakeSlot(PyNvSession):
    """A decode thread's PyNvVideoCodec session without a GPU: ``nvdec(path)`` makes its decoder
    (or raises as PyNvVideoCodec does), frames stay in host memory."""

    def __init__(self, nvdec):
        self.nvdec, self.decoder, self.device = nvdec, None, 0

    def write(self, data):
        return "/proc/self/fd/-1"

    def point(self, path):
        if self.decoder is None:
            self.decoder = self.nvdec(path)
        return self.decoder

    def to_device(self, frames):
        return torch.from_numpy(frames)


class _FakeVideo:
    """A PyNvVideoCodec decoder of a 10-frame video whose frames hold their index."""

    def __len__(self):
        return 10

    def get_batch_frames_by_index(self, indices):
        return [np.full((2, 2, 3), i, np.uint8) for i in indices]


def _driver_error(path):
    raise RuntimeError("cuvidCreateDecoder returned error 999 (CUDA_ERROR_UNKNOWN)")


def test_a_clip_nvdec_refuses_is_damaged_only_when_pyav_cannot_decode_it_either(monkeypatch):
    from mmproxy.pipelines.video import _pyav

    from mmproxy._server.prepare import DamagedSampleError

    decoder = _clip_decoder(monkeypatch)
    data = np.frombuffer(b"not a video" * 10, np.uint8)
    with pytest.raises(DamagedSampleError, match=r"NVDEC cannot open the video: cuvidCreateDecoder "
                                                 r"returned error 999.*; PyAV cannot decode it"):
        decoder._decode(_FakeSlot(_driver_error), data, 0, _WHOLE)
    with pytest.raises(DamagedSampleError, match=r"PyAV cannot decode it either: .* \(frames "
                       r"counted in the clip the worker cut from the video, from the key frame "
                       r"before its frame 12\)"):  # a cut clip: its frame numbers are the cut's
        decoder._decode(_FakeSlot(_driver_error), data, 12, np.array([1, 2, 3], np.int32))

    monkeypatch.setattr(_pyav, "decode_clip", lambda data, start, frames, stride, **kw:
                        np.full((frames, 2, 2, 3), 7, np.uint8))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):  # NVDEC fails for every clip: PyAV decodes them, and a warning says so
            frames = decoder._decode(_FakeSlot(_driver_error), data, 0, _WHOLE)
            assert frames.shape == (3, 2, 2, 3) and int(frames.max()) == 7
    slow = [w for w in said if "PyAV decodes the clips it refuses" in str(w.message)]
    assert len(slow) == 1 and issubclass(slow[0].category, RuntimeWarning)
    assert "error 999" in str(slow[0].message)


def test_without_pyav_nvdec_refusing_clip_after_clip_fails_instead_of_dropping_them(monkeypatch):
    """A clip NVDEC refuses is damaged while NVDEC decodes others; refusing 8 in a row, NVDEC
    itself is failing (a driver error, exhausted sessions): not a sample to drop."""
    import sys

    from mmproxy._server.prepare import DamagedSampleError

    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    decoder = _clip_decoder(monkeypatch)
    data = np.frombuffer(b"\0" * 64, np.uint8)
    for _ in range(7):
        with pytest.raises(DamagedSampleError, match="NVDEC cannot open the video"):
            decoder._decode(_FakeSlot(_driver_error), data, 0, _WHOLE)
    clip = decoder._decode(_FakeSlot(lambda path: _FakeVideo()), data, 5, _WHOLE)  # one decodes: reset
    assert [int(f.max()) for f in clip] == [5, 7, 9]
    for _ in range(7):
        with pytest.raises(DamagedSampleError):
            decoder._decode(_FakeSlot(_driver_error), data, 0, _WHOLE)
    with pytest.raises(RuntimeError, match=r"NVDEC refused the last 8 clips, the last with: NVDEC "
                                           r"cannot open the video: cuvidCreateDecoder") as failed:
        decoder._decode(_FakeSlot(_driver_error), data, 0, _WHOLE)
    assert not isinstance(failed.value, DamagedSampleError)


def test_closing_the_clip_decoder_never_waits_for_a_decode_stuck_in_the_driver(monkeypatch):
    """close() cancels the clips not started, waits a bounded time for those under way and says
    which thread is still running; submit() then raises instead of starting new threads, until
    start(); a stuck thread frees its own decoder when it ends."""
    import threading

    freed = []

    class Slot:
        def __init__(self, device, options):
            pass

        def close(self):
            freed.append(threading.current_thread().name)

    release, running = threading.Event(), threading.Semaphore(0)

    def stuck(*args):  # a call into the driver that does not return
        running.release()
        release.wait(60)
        return {"videos": args[-1]["videos"]}

    decoder = _clip_decoder(monkeypatch, threads=2, slot=Slot)
    monkeypatch.setattr(decoder, "_prepare", stuck)
    futures = [decoder.submit({"videos": i, "start": 0}) for i in range(3)]
    assert running.acquire(timeout=10) and running.acquire(timeout=10)  # two decodes under way
    said = []

    def close():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            decoder.close()
        said.extend(caught)

    closing = threading.Thread(target=close, daemon=True)
    closing.start()
    closing.join(10)
    try:
        assert not closing.is_alive(), "close() waits for a stuck decode"
        assert futures[2].cancelled()  # not started: cancelled
        assert not futures[0].done() and not futures[1].done()
        assert len(said) == 1 and issubclass(said[0].category, RuntimeWarning)
        assert "mmproxy-nvdec_0, mmproxy-nvdec_1 still decoding" in str(said[0].message)
        with pytest.raises(RuntimeError, match="clip decoder is closed"):
            decoder.submit({"videos": 3, "start": 0})
    finally:
        release.set()
    assert [f.result(10)["videos"] for f in futures[:2]] == [0, 1]
    deadline = time.monotonic() + 10
    while len(freed) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(freed) == ["mmproxy-nvdec_0", "mmproxy-nvdec_1"]  # each by its own thread
    decoder.start()
    assert decoder.submit({"videos": 4, "start": 0}).result(10)["videos"] == 4
    decoder.close()


# -- TorchCodec's session (nvdec_library="torchcodec"), on its CPU decoder here -----------------


def _torchcodec_loads():
    from mmproxy.pipelines.video._nvdec import nvdec_available

    return nvdec_available("torchcodec")


needs_torchcodec = pytest.mark.skipif(not _torchcodec_loads(),
                                      reason="needs TorchCodec and FFmpeg's shared libraries")


@needs_torchcodec
def test_torchcodec_session_gives_the_clip_pyav_gives():
    """The session's frames are the clip's (start, stride, the last frame repeated past the
    end), as PyAV decodes them, in [T, H, W, 3] uint8, from read-only bytes."""
    from mmproxy.pipelines.video._torchcodec import TorchCodecSession

    data = np.frombuffer(_encode("h264", frames=30), np.uint8)  # read-only, like a run's bytes
    session = TorchCodecSession(None, {})
    for start, frames, stride in [(0, 4, 3), (7, 5, 2), (24, 4, 3), (0, None, 1)]:
        clip = session.clip(data, start, frames, stride).numpy()
        expected = decode_clip(data, start, frames, stride) if frames else _reference(data.tobytes())
        assert clip.dtype == np.uint8 and clip.shape == expected.shape, (start, clip.shape)
        assert _errors(clip, expected).max() <= 1.0, (start, frames)
    clip = session.clip(data, 24, 4, 3).numpy()  # frames 24, 27, 29, 29
    assert np.array_equal(clip[2], clip[3]) and not np.array_equal(clip[1], clip[2])


@needs_torchcodec
def test_a_clip_torchcodec_refuses_is_damaged_only_when_pyav_cannot_decode_it_either(monkeypatch):
    """Garbage, and an MP4 whose H.264 configuration is garbage (its header checks pass), are
    refused by TorchCodec and by PyAV: damaged samples whose record says what both said."""
    from mmproxy.pipelines.video._nvdec import ClipDecoder
    from mmproxy.pipelines.video._nvdec_session import Refused
    from mmproxy.pipelines.video._torchcodec import TorchCodecSession

    from mmproxy._server.prepare import DamagedSampleError

    session = TorchCodecSession(None, {})
    with pytest.raises(Refused, match="TorchCodec cannot open the video"):
        session.clip(np.frombuffer(b"not a video" * 100, np.uint8), 0, 4, 1)
    decoder = ClipDecoder("videos", 4, 2, 0, 1, None, (), "torchcodec")
    bad = np.frombuffer(_bad_config(_encode("h264")), np.uint8)
    with pytest.raises(DamagedSampleError, match=r"TorchCodec cannot .*; PyAV cannot decode it"):
        decoder._decode(session, bad, 0, _WHOLE)


def test_torchcodec_missing_or_without_ffmpeg_says_what_to_do(monkeypatch):
    import sys
    import types

    from mmproxy.pipelines.video._torchcodec import load_torchcodec

    monkeypatch.setitem(sys.modules, "torchcodec", None)
    with pytest.raises(ImportError,
                       match=r"TorchCodec: pip install torchcodec \(mmproxy's \[torchcodec\] extra\)"):
        load_torchcodec()
    no_ffmpeg = types.ModuleType("torchcodec")
    no_ffmpeg.ffmpeg_major_version = None
    monkeypatch.setitem(sys.modules, "torchcodec", no_ffmpeg)
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", types.ModuleType("torchcodec.decoders"))
    with pytest.raises(RuntimeError, match="loads none of the FFmpeg versions it supports"):
        load_torchcodec()
    with pytest.raises(ValueError, match=r"nvdec_library must be one of 'pynvvideocodec', "
                                         r"'torchcodec', got 'torchcodek'"):
        video_pipeline(batch_size=2, decoder="nvdec", device="gpu", nvdec_library="torchcodek")


def _nvdec_ready(library):
    if not torch.cuda.is_available():
        return False
    from mmproxy.pipelines.video._nvdec import nvdec_available

    return nvdec_available(library)


# Each GPU test of decoder="nvdec" runs with each library that drives NVDEC, where it loads
LIBRARIES = [pytest.param(library, marks=pytest.mark.skipif(
    not _nvdec_ready(library), reason=f"needs CUDA and {name}"), id=library)
    for library, name in (("pynvvideocodec", "PyNvVideoCodec"), ("torchcodec", "TorchCodec"))]


# What a library's own refusal says, in the skip records of the clips it refuses
REFUSAL = {"pynvvideocodec": "NVDEC cannot", "torchcodec": "TorchCodec cannot"}


def _gpu_server(decoder, library="pynvvideocodec", **kw):
    if decoder in ("nvdec", "mixed"):
        kw["nvdec_library"] = library
    return _server(decoder, device="gpu", **kw)


def _errors(a, b):
    return np.abs(a.astype(int) - b.astype(int)).mean(axis=(1, 2, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("library", LIBRARIES)
def test_nvdec_clips_match_pyav_frame_for_frame(library):
    """Training clips at twelve seeds (the same start, crop and flip drawn for both decoders):
    NVDEC's frames within the decoders' colour tolerance of PyAV's, and clearly farther from
    the neighbouring frame (the same frame index means the same frame)."""
    data = _encode("h264", frames=60)  # libx264's defaults: B-frames, so decode order differs
    seeds = list(range(12))
    with _gpu_server("pyav", train=True, batch_size=12) as pyav:
        expected = _run(pyav, [data] * 12, seeds).cpu().numpy()
    with _gpu_server("nvdec", library, train=True, batch_size=12, decode_threads=2) as nvdec:
        clips = _run(nvdec, [data] * 12, seeds).cpu().numpy()
    assert clips.shape == expected.shape == (12, 4, 64, 64, 3)
    for clip, reference in zip(clips, expected):
        errors = _errors(clip, reference)
        assert errors.max() <= MEAN_TOLERANCE, errors
        assert np.abs(_luma(clip.astype(float)) - _luma(reference)).mean() <= LUMA_TOLERANCE
    frames = _reference(data)
    start = (60 - 10) // 2
    with _gpu_server("nvdec", library, batch_size=1) as nvdec:
        centred = _run(nvdec, [data])[0].cpu().numpy()
    errors = _errors(centred, frames[start:start + 10:3, :, 16:80])
    shifted = _errors(centred, frames[start + 1:start + 11:3, :, 16:80])
    assert errors.max() <= MEAN_TOLERANCE and shifted.min() > 2 * errors.max() + 1, (errors, shifted)


@pytest.mark.gpu
@pytest.mark.parametrize("library", LIBRARIES)
def test_many_clips_of_different_sizes_through_one_decoder(library):
    """One decode thread, so one decoder re-pointed at every clip: sizes up and down (larger
    than its first clip too), short clips past their end (the last frame repeated), VP9 in MP4,
    and a VP9 clip smaller than NVDEC's VP9 minimum (128 pixels), which PyAV decodes instead."""
    sizes = [(64, 96), (240, 320), (48, 64), (120, 160), (64, 96), (360, 640), (96, 128)]
    videos = [video_bytes(synth_video(i, 40 if i % 3 else 9, h, w), "libx264", "mp4")
              for i, (h, w) in enumerate(sizes)]
    videos += [video_bytes(synth_video(9, 40, 144, 192), "libvpx-vp9", "mp4"),
               video_bytes(synth_video(10, 40, 64, 96), "libvpx-vp9", "mp4")]
    with _gpu_server("nvdec", library, batch_size=4, decode_threads=1, resize_size=64) as nvdec:
        clips = [c for part in (videos[:4], videos[4:8], videos[8:])
                 for c in _run(nvdec, part).cpu().numpy()]
    with _gpu_server("pyav", batch_size=4, resize_size=64) as pyav:
        expected = [c for part in (videos[:4], videos[4:8], videos[8:])
                    for c in _run(pyav, part).cpu().numpy()]
    assert len(clips) == len(expected) == 9
    for i, (clip, reference) in enumerate(zip(clips, expected)):
        assert _errors(clip, reference).max() <= MEAN_TOLERANCE, i


@pytest.mark.gpu
@pytest.mark.parametrize("library", LIBRARIES)
def test_nvdec_decodes_a_cut_clip_to_the_frames_pyav_gives(library):
    """The packets a worker cuts a clip to (from the key frame before it, without the pictures
    nothing refers to that it does not show) decode on NVDEC to PyAV's frames of the whole file,
    within the decoders' colour tolerance, H.264 and HEVC, at the start, in the middle and past
    the end; for H.264 they are the very frames NVDEC gives for the whole file."""
    from mmproxy.pipelines.video._nvdec import NVDEC_LIBRARIES
    from mmproxy.pipelines.video._nvdec_session import clip_indices
    from mmproxy.pipelines.video._pyav import cut_clip

    session = NVDEC_LIBRARIES[library](0, {})
    try:
        # PyNvVideoCodec is not given HEVC (LIBRARY_CODECS): its HEVC frames are not always
        # the ones asked for, from the whole file or a cut one
        codecs = ["libx264", "libx265"] if library == "torchcodec" else ["libx264"]
        for seed, codec in enumerate(codecs):
            data = np.frombuffer(video_bytes(synth_video(seed, 90, 144, 192), codec, "mp4",
                                             gop=30), np.uint8)
            frames = _reference(data.tobytes())
            for start in (0, 17, 60, 80):
                wanted = clip_indices(90, start, 8, 3)
                cut, at = cut_clip(data, wanted)
                assert len(cut) < len(data)
                part = session.clip(cut, 0, 8, 3, at).cpu().numpy()
                errors = _errors(part, frames[wanted])
                assert errors.max() <= MEAN_TOLERANCE, (codec, start, errors)
                if codec == "libx264":
                    whole = session.clip(data, start, 8, 3).cpu().numpy()
                    assert np.array_equal(whole, part), (codec, start)
    finally:
        session.close()


def _bad_config(data):
    """An MP4 whose H.264 configuration (the SPS and PPS in its avcC box) is garbage: the header
    checks pass, and only the decoder can tell."""
    at = data.find(b"avcC") + 4
    return data[:at + 6] + bytes([0xFF] * 24) + data[at + 30:]


@pytest.mark.gpu
@pytest.mark.parametrize("library", LIBRARIES)
def test_nvdec_damaged_clips_are_skipped_and_named_rows_aligned(tmp_path, library):
    good = [_encode("h264", seed=i, frames=30 + i) for i in range(6)]
    samples = [{"__key__": f"clip{i}", "mp4": v, "cls": str(i)} for i, v in enumerate(good)]
    samples.insert(2, {"__key__": "bad-config", "mp4": _bad_config(good[0]), "cls": "99"})
    samples.insert(5, {"__key__": "bad-cut", "mp4": good[1][: len(good[1]) // 2], "cls": "99"})
    write_tar(tmp_path / "v-0.tar", samples)
    with _gpu_server("nvdec", library, train=True, batch_size=4) as server:
        ds = video_label_dataset(str(tmp_path / "v-0.tar"), server, batch_size=4,
                                 on_error="skip", max_skipped=None)
        loader = ds.loader(server, num_workers=1)
        keys, labels = [], []
        for batch in loader:
            assert batch["video"].shape[1:] == (4, 64, 64, 3) and batch["video"].is_cuda
            keys += batch["__key__"]
            labels += batch["label"].tolist()
    assert keys == [f"clip{i}" for i in range(6)]
    assert labels == list(range(6))  # every row still its own sample's
    skipped = {r.key: r.reason for r in loader.skipped.records}
    assert sorted(skipped) == ["bad-config", "bad-cut"]
    assert "truncated" in skipped["bad-cut"] and REFUSAL[library] in skipped["bad-config"], skipped


@pytest.mark.gpu
@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("share", [0.5, "auto"])
def test_mixed_decoding_shares_the_clips_and_gives_pyav_clips(library, share):
    data = [_encode("h264", seed=i, frames=50) for i in range(8)]
    with _gpu_server("pyav", train=True, batch_size=8) as pyav:
        expected = _run(pyav, data).cpu().numpy()
    with _gpu_server("mixed", library, train=True, batch_size=8, cpu_share=share) as mixed:
        clips = _run(mixed, data).cpu().numpy()
    for clip, reference in zip(clips, expected):
        assert _errors(clip, reference).max() <= MEAN_TOLERANCE
