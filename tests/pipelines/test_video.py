"""Video: clips decoded by DALI (VP9, MJPEG on CPU; NVDEC on a GPU) or by PyAV in the workers
(H.264 on CPU), compared with PyAV's own decode; clip sampling; damaged videos; recipes and
make-shards."""

from __future__ import annotations

import io
import time
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from mmproxy.datasets import make_shards, video_label_dataset, video_text_dataset
from mmproxy.pipelines import decode_clip, video_pipeline
from mmproxy.pipelines.video._nvdec import LIBRARY_CODECS
from mmproxy.pipelines.video._pynvvideocodec import PyNvSession
from torch.utils.data import default_collate

import mmproxy
from mmproxy.testing import faststart_mp4, make_tokenizer, synth_video, video_bytes, write_tar
from mmproxy.worker import sample_key

av = pytest.importorskip("av")
pytestmark = pytest.mark.timeout(240)

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


def _vfr_bytes(frames, gaps_ms, container="mp4", gop=12):
    """H.264 with each frame's pts set by hand (time base 1/1000): ``gaps_ms[i]`` ms between
    frames i and i + 1, so irregular gaps make a variable-frame-rate video."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream("libx264", rate=25)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt, stream.gop_size = "yuv420p", gop
        stream.time_base = stream.codec_context.time_base = Fraction(1, 1000)
        stream.options = {"crf": "18", "preset": "veryfast"}
        pts = 0
        for frame, gap in zip(frames, gaps_ms):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts, picture.time_base = pts, Fraction(1, 1000)
            pts += int(gap)
            for packet in stream.encode(picture):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _pts(data):
    with av.open(io.BytesIO(data)) as container:
        return [f.pts for f in container.decode(video=0)]


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


@pytest.mark.parametrize("decoder,codec", [("dali", "vp9"), ("dali", "mjpeg"), ("pyav", "h264"),
                                           ("pyav", "vp9")])
def test_centred_clips_match_pyav_frame_for_frame(decoder, codec):
    data = _encode(codec)
    with _server(decoder) as server:
        clip = _run(server, [data])[0].numpy()
    frames = _reference(data)
    start = (len(frames) - 10) // 2  # 4 frames at stride 3 span 10 frames, centred
    expected = frames[start:start + 10:3, :, 16:80]  # a 96x64 video, its centre 64x64
    assert clip.shape == expected.shape == (4, 64, 64, 3)
    errors = np.abs(clip.astype(int) - expected).mean(axis=(1, 2, 3))
    assert errors.max() <= MEAN_TOLERANCE, errors
    assert np.abs(_luma(clip.astype(float)) - _luma(expected)).mean() <= LUMA_TOLERANCE
    shifted = np.abs(clip[1:].astype(int) - frames[start + 1:start + 10:3, :, 16:80][:3]).mean()
    assert shifted > 2 * errors.max() + 1  # the comparison can tell a frame from its neighbour


@pytest.mark.parametrize("decoder,codec", [("pyav", "h264"), ("dali", "vp9")])
def test_eval_clips_are_cropped_where_torchvision_centre_crop_puts_them(decoder, codec):
    """96x64 frames resized to 49x33 and cropped to 28: odd margins of 21 and 5, which
    torchvision's CenterCrop rounds to 10 and 2 (halves to even). PyAV's frames, resized with
    torchvision as the CPU pipeline does, give its crop exactly; DALI's decoder converts colours
    differently, and one pixel off is clearly worse than its colour error."""
    from torchvision.transforms import v2

    data = _encode(codec)
    with _server(decoder, size=28, resize_size=33) as server:
        clip = _run(server, [data])[0]
    start = (50 - 10) // 2
    frames = torch.from_numpy(_reference(data)[start:start + 10:3]).permute(0, 3, 1, 2)
    resized = v2.Resize(33, antialias=True)(frames)
    assert [side - 28 for side in resized.shape[2:]] == [5, 21]
    expected = v2.CenterCrop(28)(resized).permute(0, 2, 3, 1)
    errors = [(clip.int() - expected.int()).abs().float().mean()]
    for dy, dx in ((1, 0), (0, 1)):  # DALI's own rounding of crop_pos 0.5: one pixel down, right
        shifted = resized[:, :, 2 + dy:30 + dy, 10 + dx:38 + dx].permute(0, 2, 3, 1)
        errors.append((clip.int() - shifted.int()).abs().float().mean())
    if decoder == "pyav":
        assert errors[0] == 0, errors
    assert errors[0] <= MEAN_TOLERANCE and min(errors[1:]) > 2 * errors[0], errors


@pytest.mark.parametrize("codec,container,expect", [
    ("libx264", "mp4", ("mp4", "h264", 30)), ("libx264", "mov", ("mp4", "h264", 30)),
    ("libx264", "matroska", ("matroska", "h264", None)), ("mjpeg", "avi", ("avi", "mjpeg", 30)),
    ("libvpx-vp9", "webm", ("matroska", "vp9", None)), ("mpeg4", "mp4", ("mp4", "mpeg4", 30))])
def test_container_headers_say_codec_and_frames(codec, container, expect):
    """QuickTime (.mov) holds a second handler box (the data handler) after the media's: the
    media's says whether a track is video."""
    from mmproxy.datasets.checks import check_header, video_info

    data = video_bytes(synth_video(3, 30), codec, container)
    assert tuple(video_info(data)) == expect
    assert check_header("mp4", data) is None


def test_a_crafted_deep_mp4_is_a_bad_header_not_a_crash():
    from mmproxy.datasets.checks import check_header

    depth = 5000  # moov inside moov inside ...: 8 bytes a level
    data = b"".join((8 * (depth - i)).to_bytes(4, "big") + b"moov" for i in range(depth))
    assert check_header("mp4", b"\x00\x00\x00\x08ftyp" + data) is not None


_GAPS = np.random.default_rng(1).integers(10, 81, 60)  # 10-80 ms between frames


@pytest.mark.parametrize("name,data", [
    ("vfr-random", lambda: _vfr_bytes(synth_video(0, 60), _GAPS)),
    ("vfr-20-60", lambda: _vfr_bytes(synth_video(1, 60), [20, 60] * 30)),
    ("vfr-matroska", lambda: _vfr_bytes(synth_video(2, 60), _GAPS, "matroska")),
    ("cfr-hand-set-pts", lambda: _vfr_bytes(synth_video(3, 60), [40] * 60)),
    ("cfr", lambda: _encode("h264", seed=4, frames=60)),
    ("cfr-avi-b-frames", lambda: video_bytes(synth_video(5, 60), "libx264", "avi"))])
def test_decode_clip_takes_frames_in_presentation_order(name, data):
    """Frame i of a clip is the i-th frame shown, as counted by the header's frame count and
    ``clip_start``, whatever the gaps between timestamps; the starts past the first key frame
    take the seek path. AVI holds no presentation timestamps: FFmpeg's guesses are the decode
    order, H.264's B-frames reorder it."""
    from mmproxy.datasets.checks import video_info

    data = data()
    frames = _reference(data)
    gaps = set(np.diff(sorted(_pts(data))).tolist())
    assert (len(gaps) > 1) == name.startswith("vfr")  # the video really is (or is not) VFR
    if name != "vfr-matroska":  # Matroska headers hold no frame count
        assert video_info(data).frames == len(frames) == 60
    total, span = len(frames), 10  # 4 frames at stride 3
    starts, wrong = range(total - span + 1), {}
    for start in starts:  # every start the clip fits, most of them past the first key frame
        clip = decode_clip(data, start, 4, 3)
        expected = frames[start:start + span:3]
        if clip.shape != expected.shape or not np.array_equal(clip, expected):
            wrong[start] = [next((j for j in range(total) if np.array_equal(c, frames[j])), None)
                            for c in clip]  # which frames came instead
    assert not wrong, f"{len(wrong)} of {len(starts)} starts: start -> frames decoded {wrong}"
    assert np.array_equal(decode_clip(data, 0, None, 3), frames)  # frames=None: all
    tail = decode_clip(data, total - 2, 4, 1)  # past the end: the last frame repeated
    assert np.array_equal(tail, frames[[total - 2, total - 1, total - 1, total - 1]])


def _unreferenced(data):
    """The pts of the frames FFmpeg's own decoder leaves out with ``skip_frame="NONREF"``
    (the pictures no other picture refers to), and the ones ``_pyav``'s packet test flags."""
    from mmproxy.pipelines.video import _pyav

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        every = {p.pts for p in container.demux(stream) if p.size}
    with av.open(io.BytesIO(data)) as container:
        container.streams.video[0].codec_context.skip_frame = "NONREF"
        kept = {f.pts for f in container.decode(video=0)}
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        referenced = _pyav._reference_test(stream)
        flagged = {p.pts for p in container.demux(stream)
                   if p.size and not referenced(memoryview(p))}
    return every - kept, flagged


@pytest.mark.parametrize("codec", ["libx264", "libx265"])
def test_decode_clip_leaves_out_the_pictures_nothing_refers_to_and_gives_the_same_frames(codec):
    """The packets decode_clip leaves undecoded are exactly those FFmpeg's decoder itself finds
    to be pictures no other refers to (a third or so of an x264 or x265 stream with B-frames),
    and every clip, at every start and stride, holds the frames a full decode gives."""
    data = video_bytes(synth_video(7, 60), codec, "mp4", gop=24)
    ffmpeg_skips, flagged = _unreferenced(data)
    assert len(ffmpeg_skips) >= 10 and flagged == ffmpeg_skips
    frames = _reference(data)
    for stride in (1, 2, 5):
        for start in range(0, len(frames) - 3 * stride):
            assert np.array_equal(decode_clip(data, start, 4, stride, threads=False),
                                  frames[start:start + 4 * stride:stride]), (stride, start)


def _x264(frames, params):
    """H.264 in MP4 from PyAV's libx264 with ``x264-params``."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=25)
        stream.height, stream.width, stream.pix_fmt = 64, 96, "yuv420p"
        stream.options = {"x264-params": params}
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode(None))
    return buf.getvalue()


def test_a_cut_starts_where_a_decode_can_start_and_gives_the_full_decodes_frames():
    """x264's intra refresh marks P-frames as key frames (recovery points): a cut starts at the
    IDR picture before them instead, and every clip, cut or not, holds a full decode's frames."""
    from mmproxy.pipelines.video._nvdec_session import clip_indices
    from mmproxy.pipelines.video._pyav import cut_clip

    data = _x264(synth_video(5, 60), "bframes=0:intra-refresh=1:keyint=15")
    frames = _reference(data)
    for start in range(0, 57):
        wanted = clip_indices(60, start, 4, 1)
        assert np.array_equal(decode_clip(data, start, 4, 1, threads=False), frames[wanted])
        cut, at = cut_clip(data, wanted)
        assert np.array_equal(decode_clip(cut.tobytes(), None, None, 1, at=at), frames[wanted])


def test_a_damaged_file_the_header_checks_pass_is_not_cut_but_sent_whole(tmp_path):
    """An MP4 whose index is garbled (fewer packets demux than its header lists, or none) passes
    the worker's header checks; it is sent whole, where the decoder says it is damaged, instead
    of a cut that pads the clip with a repeated frame, or an IndexError in the worker."""
    import random

    from mmproxy.datasets.checks import video_cut, video_info
    from mmproxy.pipelines import ClipDraw
    from mmproxy.pipelines.video._pyav import cut_clip

    good = faststart_mp4(_x264(synth_video(6, 60), "bframes=3:keyint=20"), tmp_path)
    fewer = bytearray(good)
    fewer[fewer.find(b"stsc") + 17] = 17  # the first chunk's sample count garbled
    fewer[fewer.find(b"stsz") + 16 + 4 * 37 + 2] = 189  # and sample 37's size
    none = good.replace(b"stsc", b"stsX", 1)  # no sample-to-chunk table: nothing demuxes
    draw = ClipDraw("videos", 4, 1, True, 0.5, False, decode_in_worker=False, cpu_decoder=False,
                    nvdec=True)
    for damaged in (bytes(fewer), none):
        assert video_info(damaged).frames == 60 and video_cut(damaged) is None
        assert cut_clip(damaged, [50, 51, 52, 53]) is None
        sent = draw({"videos": np.frombuffer(damaged, np.uint8)}, random.Random(0))
        assert len(sent["at"]) == 0 and "videos" not in sent  # the input goes as it came
        with pytest.raises(ValueError, match="fewer frames than its header promises"):
            decode_clip(damaged, 50, 4, 1)


def test_no_picture_is_left_out_of_a_stream_whose_pictures_are_all_references():
    """An x264 stream without B-frames: every picture may be referred to, so none is flagged;
    the packet test is only made for the codecs whose headers say it (H.264, HEVC)."""
    from mmproxy.pipelines.video import _pyav

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=25)
        stream.height, stream.width, stream.pix_fmt = 64, 96, "yuv420p"
        stream.options = {"bf": "0", "preset": "veryfast"}
        for frame in synth_video(8, 30):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode(None))
    ffmpeg_skips, flagged = _unreferenced(buf.getvalue())
    assert ffmpeg_skips == flagged == set()
    with av.open(io.BytesIO(_encode("vp9", frames=10))) as container:
        assert _pyav._reference_test(container.streams.video[0]) is None


@pytest.mark.parametrize("bad", [{"frames": 0}, {"stride": 0}, {"size": 0}])
def test_a_clip_shape_of_nothing_is_refused_when_the_pipeline_is_built(bad):
    with pytest.raises(ValueError, match="frames, stride and size must be at least 1"):
        video_pipeline(batch_size=2, decoder="pyav", device="cpu", **bad)


def test_h264_on_the_cpu_decoder_is_refused_by_codec_name():
    with _server("dali") as server:
        with pytest.raises(ValueError, match="H.264 video: DALI's CPU video decoder decodes only"):
            _run(server, [_encode("h264")])


def test_training_clips_follow_the_sample_seed_and_the_layouts():
    data = _encode("vp9", frames=60)
    with _server("dali", train=True, layout="CTHW", dtype="float32") as server:
        a = _run(server, [data, data], seeds=[1, 2])
        b = _run(server, [data], seeds=[1])
    assert a.shape == (2, 3, 4, 64, 64) and a.dtype == torch.float32
    assert torch.equal(a[0], b[0])  # the same seed, the same clip, crop and flip
    assert not torch.equal(a[0], a[1])


def test_every_frame_pads_clips_and_says_their_lengths():
    short, long = _encode("mjpeg", frames=20), _encode("mjpeg", seed=1, frames=33)
    with _server("dali", every_frame=True, batch_size=2) as server:
        clips, lengths = _run(server, [short, long])
    assert lengths.tolist() == [20, 33]
    assert clips.shape == (2, 33, 64, 64, 3)
    assert clips[0, 20:].abs().sum() == 0 and clips[0, :20].float().mean() > 10


@pytest.fixture(scope="module")
def video_shards(tmp_path_factory):
    """Two shards of H.264 clips with labels; three damaged ones among them."""
    root = tmp_path_factory.mktemp("video")
    good = [_encode("h264", seed=i, frames=30 + i) for i in range(10)]
    damaged = {
        "cut": good[0][: len(good[0]) // 2],  # an interrupted download: no moov box
        "garbage": bytes(np.random.default_rng(0).integers(0, 255, 5000, dtype=np.uint8)),
        "mdat": good[1][:200] + bytes(4000) + good[1][4200:],  # zeros over the video data
    }
    samples = [{"__key__": f"clip{i:02d}", "mp4": v, "cls": str(i % 3), "txt": f"clip {i}"}
               for i, v in enumerate(good)]
    samples += [{"__key__": f"bad-{k}", "mp4": v, "cls": "0", "txt": "bad"}
                for k, v in damaged.items()]
    write_tar(root / "v-0.tar", samples[::2])
    write_tar(root / "v-1.tar", samples[1::2])
    return str(root / "v-{0..1}.tar")


def test_video_label_shards_with_damaged_clips_in_skip_mode(video_shards):
    with _server("pyav", train=True, batch_size=4) as server:
        ds = video_label_dataset(video_shards, server, batch_size=4, on_error="skip",
                                 max_skipped=None)
        loader = ds.loader(server, num_workers=2)
        keys = []
        for batch in loader:
            assert batch["video"].shape[1:] == (4, 64, 64, 3)
            assert batch["label"].dtype == torch.int64 and len(batch["label"]) == len(batch["__key__"])
            keys += batch["__key__"]
    assert sorted(k for k in keys if k.startswith("clip")) == [f"clip{i:02d}" for i in range(10)]
    skipped = {r.key: r.reason for r in loader.skipped.records}
    assert "no moov box" in skipped["bad-cut"] and "not an MP4" in skipped["bad-garbage"]
    assert keys.count("bad-mdat") + ("bad-mdat" in skipped) == 1  # decoded (concealed) or skipped


def test_h264_shards_on_a_cpu_dali_decoder_fail_fast_naming_the_codec(video_shards):
    with _server("dali", batch_size=4) as server:
        ds = video_label_dataset(video_shards, server, batch_size=4, on_error="skip")
        with pytest.raises(mmproxy.EmptyEpochError, match="H.264 video: DALI's CPU video decoder"):
            for _ in ds.loader(server, num_workers=1):
                pass


def test_video_text_dataset_and_make_shards_from_a_folder(tmp_path):
    src = tmp_path / "videos"
    for label in ("cats", "dogs"):
        (src / label).mkdir(parents=True)
        for i in range(3):
            (src / label / f"{i}.mp4").write_bytes(_encode("h264", seed=i + len(label), frames=24))
    (src / "dogs" / "2.txt").write_text("a dog runs across the lawn")
    (src / "cats" / "notes.md").write_text("not a video")
    written = make_shards(src, tmp_path / "shards", kind="video-text", max_count=4)
    assert written.samples == 6 and written.captions_from_txt == 1
    assert any("notes.md" in path for path, _ in written.left_out)
    tok = make_tokenizer(tmp_path / "tok", ["cats", "dogs", "a dog runs across the lawn"])
    from mmproxy.datasets import load_tokenizer

    with _server("pyav", batch_size=4) as server:
        ds = video_text_dataset(list(written), server, load_tokenizer(tok), batch_size=4)
        batches = list(ds.loader(server, num_workers=1))
    assert sum(len(b["__key__"]) for b in batches) == 6
    assert all(b["input_ids"].shape[0] == b["video"].shape[0] for b in batches)
    labels = make_shards(src, tmp_path / "labels", kind="video-label")
    assert labels.samples == 6


CUT = "the file ends before the frames its header promises"


@pytest.fixture(scope="module")
def cut_videos(tmp_path_factory):
    """60-frame videos, whole and cut at 60% (an interrupted download), by name: H.264 in an MP4
    whose index comes first (so the index survives the cut), VP9 in WebM, MJPEG in AVI."""
    folder = tmp_path_factory.mktemp("cut")
    frames = synth_video(7, 60)
    whole = {"mp4": faststart_mp4(_encode("h264", seed=7, frames=60), folder),
             "webm": video_bytes(frames, "libvpx-vp9", "webm"),
             "avi": video_bytes(frames, "mjpeg", "avi")}
    return {name: (data, data[:len(data) * 6 // 10]) for name, data in whole.items()}


def _decodable(data):
    """How many frames PyAV decodes from the start of ``data`` before the data runs out."""
    count = 0
    try:
        with av.open(io.BytesIO(data)) as container:
            for _ in container.decode(video=0):
                count += 1
    except av.FFmpegError:
        pass
    return count


@pytest.mark.parametrize("name", ["mp4", "webm", "avi"])
def test_the_header_check_refuses_a_cut_video(cut_videos, name):
    from mmproxy.datasets.checks import check_header

    whole, cut = cut_videos[name]
    assert check_header(name, whole) is None
    assert check_header(name, whole + bytes(64)) is None  # zero padding after the end is harmless
    for damaged in (cut, whole[:-1]):  # cut in the middle, or one byte short
        assert CUT in check_header(name, damaged)
    if name == "mp4":  # cut where the frames begin: only the index says frames are missing
        index_only = whole[:whole.find(b"mdat") - 4]
        assert "its index places the video's frames up to byte" in check_header(name, index_only)


@pytest.mark.parametrize("name", ["mp4", "webm", "avi"])
def test_decode_clip_never_makes_up_the_frames_a_cut_file_lacks(cut_videos, name):
    """Straddling the cut, past it, or every frame: an error saying the file ends early; a clip
    that lies before the cut is what the whole file gives."""
    whole, cut = cut_videos[name]
    frames, n = _reference(whole), _decodable(cut)
    assert 20 < n < 50
    assert np.array_equal(decode_clip(cut, n - 8, 4, 2), frames[n - 8:n:2])  # before the cut
    fewer = "the file holds fewer frames than its header promises: " + (  # WebM: a duration
        r"they end at 1\.\d\d s, its header declares 2\.40 s" if name == "webm" else
        r"only \d\d of the 60 it lists can be read")
    for start, stride in ((n - 2, 1), (n - 9, 3), (n + 3, 1)):  # straddling, straddling, past
        with pytest.raises(ValueError, match=f"{fewer}.*the clip needs frames {start}-"):
            decode_clip(cut, start, 4, stride)
    with pytest.raises(ValueError, match=fewer):
        decode_clip(cut, 0, None, 1)


def test_frames_that_do_not_decode_are_an_error_not_a_shorter_video(cut_videos):
    """Zeros over a twentieth of the frames' data: the sizes and index are intact (the header
    check passes), the decoder fails there; clips before the damage decode."""
    whole, _ = cut_videos["mp4"]
    damaged = bytearray(whole)
    damaged[len(whole) // 2:len(whole) * 11 // 20] = bytes(len(whole) * 11 // 20 - len(whole) // 2)
    damaged = bytes(damaged)
    from mmproxy.datasets.checks import check_header

    assert check_header("mp4", damaged) is None
    assert np.array_equal(decode_clip(damaged, 0, 4, 1), _reference(whole)[:4])
    for start, frames in ((0, None), (31, 8)):
        with pytest.raises(ValueError, match=r"frame \d+ of the 60 in the file does not decode"):
            decode_clip(damaged, start, frames, 4)


def test_a_video_that_is_short_by_its_header_repeats_its_last_frame(tmp_path):
    """The one case where frames repeat: the header promises 20 frames and the file holds 20, so
    a clip of 8 frames at stride 4 (29 frames) repeats the video's last frame past its end, with
    either decoder."""
    data = faststart_mp4(_encode("h264", seed=8, frames=20), tmp_path)
    frames = _reference(data)
    assert len(frames) == 20
    assert np.array_equal(decode_clip(data, 0, 8, 4), frames[[0, 4, 8, 12, 16, 19, 19, 19]])
    for decoder, video in (("pyav", data), ("dali", _encode("vp9", seed=8, frames=20))):
        with _server(decoder, frames=8, stride=4) as server:
            clip = _run(server, [video])[0].numpy()
        reference = _reference(video)[[16, 19], :, 16:80]  # the 64x64 centre of a 96x64 video
        assert np.abs(clip[4].astype(int) - reference[0]).mean() <= MEAN_TOLERANCE, decoder
        for i in (5, 6, 7):
            assert np.abs(clip[i].astype(int) - reference[1]).mean() <= MEAN_TOLERANCE, decoder


@pytest.mark.parametrize("decoder,name,mode", [
    ("pyav", "mp4", "train"), ("pyav", "mp4", "eval"), ("pyav", "mp4", "every_frame"),
    ("dali", "webm", "eval"), ("dali", "avi", "eval"), ("dali", "avi", "every_frame")])
def test_a_cut_video_is_refused_on_every_decoding_path(cut_videos, decoder, name, mode):
    """Through the proxy without a dataset (no header check before it): training clips at twelve
    seeds (whichever the start, also those straddling the cut), the centred evaluation clip
    (frames 15-43 of 60, across the cut), every frame; DALI's decoders, fed a cut file, would
    repeat their last frame or end the video early."""
    whole, cut = cut_videos[name]
    with _server(decoder, frames=8, stride=4, train=mode == "train",
                 every_frame=mode == "every_frame") as server:
        good = _run(server, [whole])
        assert (good[0] if mode == "every_frame" else good).shape[1] in (8, 60)
        for seed in range(12 if mode == "train" else 1):
            with pytest.raises(ValueError, match=f"the video is truncated: {CUT}"):
                _run(server, [cut], seeds=[seed])


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_cut_mp4_in_a_shard_is_a_damaged_sample_every_epoch(cut_videos, tmp_path, on_error):
    whole, cut = cut_videos["mp4"]
    samples = [{"__key__": f"clip{i}", "mp4": whole, "cls": "0"} for i in range(3)]
    samples.insert(1, {"__key__": "clip-cut", "mp4": cut, "cls": "1"})
    write_tar(tmp_path / "cut-0.tar", samples)
    with _server("pyav", train=True, frames=8, stride=4) as server:
        ds = video_label_dataset(str(tmp_path / "cut-0.tar"), server, batch_size=4,
                                 on_error=on_error, max_skipped=None)
        loader = ds.loader(server, num_workers=1)
        if on_error == "raise":
            with pytest.raises(mmproxy.SampleError, match=rf"cut-0\.tar, sample 'clip-cut'.*{CUT}"):
                list(loader)
            return
        for _ in range(3):
            keys = [k for batch in loader for k in batch["__key__"]]
            assert keys == ["clip0", "clip1", "clip2"]
            (record,) = loader.skipped.records
            assert record.key == "clip-cut" and CUT in record.reason


@pytest.mark.gpu
def test_nvdec_decodes_h264_like_pyav():
    data = _encode("h264")
    pipe = video_pipeline(batch_size=2, frames=4, stride=3, size=64, resize_size=64, train=False,
                          device="gpu", dtype="uint8", layout="THWC", decoder="dali")
    with mmproxy.DALIServer(pipe, name="nvdec") as server:
        clip = _run(server, [data])[0].cpu().numpy()
    frames = _reference(data)
    start = (len(frames) - 10) // 2
    errors = np.abs(clip.astype(int) - frames[start:start + 10:3, :, 16:80]).mean(axis=(1, 2, 3))
    assert errors.max() <= MEAN_TOLERANCE, errors


# -- NVDEC in the server (decoder="nvdec" / "mixed", PyNvVideoCodec) --------------------------


class _BrokenDriver:
    """Imports PyNvVideoCodec as it fails on a machine without the driver's video libraries."""

    def find_spec(self, name, path=None, target=None):
        import importlib.util

        if name != "PyNvVideoCodec":
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise RuntimeError("libnvidia-encode.so.1: cannot open shared object file: No such file")


def test_nvdec_without_its_package_or_driver_says_what_to_do(monkeypatch):
    import sys

    from mmproxy.pipelines.video._nvdec import load_nvdec

    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", None)
    with pytest.raises(ImportError,
                       match=r"PyNvVideoCodec: pip install pynvvideocodec \(mmproxy's \[nvdec\] extra\)"):
        load_nvdec()
    monkeypatch.delitem(sys.modules, "PyNvVideoCodec")
    monkeypatch.setattr(sys, "meta_path", [_BrokenDriver(), *sys.meta_path])
    with pytest.raises(RuntimeError, match="cannot load the NVIDIA driver's video libraries.*"
                                           "PyNvVideoCodec said: libnvidia-encode.so.1"):
        load_nvdec()
    with pytest.raises(ValueError, match="decoder='nvdec' decodes on the GPU"):
        video_pipeline(batch_size=2, decoder="nvdec", device="cpu")
    auto = video_pipeline(batch_size=2, decoder="auto", device="cpu")
    assert auto.sample_random.decode_in_worker  # no NVDEC: PyAV in the workers


def test_the_nvdec_draw_sends_what_nvdec_decodes_and_decodes_the_rest_in_the_worker():
    """H.264 in MP4 goes to the server as bytes, cut to the packets the clip needs, with the
    frames to take from them (``at``), which decode to the frames the PyAV path gives; VP9 in
    WebM (a container NVDEC's decoder has no frame count for) is decoded here; the start, crop
    and flip are those the PyAV path draws for the same seed, whichever decodes; ``cpu_share=1``
    decodes every clip here."""
    import random

    from mmproxy.pipelines import ClipDraw

    def draw(data, seed, **kw):
        options = dict(input_name="videos", frames=4, stride=3, train=True, flip_probability=0.5,
                       every_frame=False, cpu_decoder=False)
        given = {"videos": np.frombuffer(data, np.uint8)}
        return ClipDraw(**{**options, **kw})(given, random.Random(seed))

    h264, vp9 = _encode("h264", frames=60), _encode("vp9", frames=60)
    for seed in range(6):
        pyav = draw(h264, seed, decode_in_worker=True)
        sent = draw(h264, seed, decode_in_worker=False, nvdec=True)
        assert sent["videos"].ndim == 1 and int(sent["start"]) >= 0 and len(sent["at"]) == 4
        assert len(sent["videos"]) < len(h264) / 2  # 60 frames in the file, 10 in the clip
        assert np.array_equal(decode_clip(sent["videos"].tobytes(), None, None, 1,
                                          at=sent["at"]), pyav["frames"])
        assert all(np.array_equal(sent[k], pyav[k]) for k in ("crop_x", "crop_y", "flip"))
        assert np.array_equal(draw(h264, seed, decode_in_worker=False, nvdec=True,
                                   cpu_share=1.0)["videos"], pyav["frames"])
        here = draw(vp9, seed, decode_in_worker=False, nvdec=True)
        assert np.array_equal(here["videos"], draw(vp9, seed, decode_in_worker=True)["frames"])
    shared = [draw(h264, seed, decode_in_worker=False, nvdec=True, cpu_share=0.5)
              for seed in range(40)]
    assert 5 < sum(s["videos"].ndim == 4 for s in shared) < 35  # about half decoded here


def _read_backlog(backlog, answer):
    answer.put(backlog.seconds())


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_backlog_the_server_publishes_is_what_every_worker_reads(method):
    """The page is the publishing process's: a worker of any start method reads its latest
    value; a forked child that publishes gets a page of its own and leaves the parent's alone."""
    import multiprocessing
    import pickle

    from mmproxy.pipelines.video._backlog import Backlog

    backlog = Backlog()
    backlog.publish(1.25)
    ctx = multiprocessing.get_context(method)
    answer = ctx.Queue()
    worker = ctx.Process(target=_read_backlog, args=(backlog, answer))
    worker.start()
    assert answer.get(timeout=60) == 1.25
    worker.join(30)
    backlog.publish(0.5)
    assert pickle.loads(pickle.dumps(backlog)).seconds() == 0.5
    if method == "fork":
        child = ctx.Process(target=_write_backlog, args=(backlog, answer))
        child.start()
        assert answer.get(timeout=60) == (0.5, 9.0)  # the parent's, then its own page's
        child.join(30)
        assert backlog.seconds() == 0.5


def _write_backlog(backlog, answer):
    before = backlog.seconds()
    backlog.publish(9.0)
    answer.put((before, backlog.seconds()))


class _DrawnClips(torch.utils.data.Dataset):
    """Each item: whether the balanced clip draw decoded the clip in this DataLoader worker."""

    def __init__(self, draw, data, count):
        self.draw, self.data, self.count = draw, data, count

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        import random

        out = self.draw({"videos": np.frombuffer(self.data, np.uint8)}, random.Random(i))
        return out["videos"].ndim == 4  # frames, not the encoded clip


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_follow_the_backlog_the_training_process_publishes(method):
    """Through real DataLoader workers: with NVDEC's queue empty every clip goes to NVDEC; with
    seconds of work queued, the workers decode the clips themselves; back to empty, NVDEC again."""
    from mmproxy.pipelines import ClipDraw
    from mmproxy.pipelines.video._backlog import Backlog

    backlog = Backlog()
    draw = ClipDraw("videos", 4, 3, True, 0.5, False, decode_in_worker=False, cpu_decoder=False,
                    nvdec=True, backlog=backlog)
    clips = _DrawnClips(draw, _encode("h264", frames=40), 8)

    def decoded_here():
        loader = torch.utils.data.DataLoader(clips, batch_size=None, num_workers=2,
                                             multiprocessing_context=method)
        return [bool(here) for here in loader]

    backlog.publish(0.0)
    assert decoded_here() == [False] * 8
    backlog.publish(60.0)  # a minute of NVDEC work queued: longer than any decode here
    assert decoded_here() == [True] * 8
    backlog.publish(0.0)
    assert decoded_here() == [False] * 8


def test_a_backlog_that_cannot_be_read_sends_every_clip_to_nvdec_and_says_so():
    """A page whose process has ended, or whose descriptor now names another file (the page
    freed, its number reused), reads as 0 with a warning, never as the other file's bytes."""
    import gc
    import os
    import pickle
    import subprocess
    import tempfile

    from mmproxy.pipelines.video._backlog import Backlog

    ended = subprocess.Popen(["true"])
    ended.wait()
    backlog = Backlog()
    backlog.publish(2.0)
    gone = pickle.loads(pickle.dumps(backlog))
    gone.pid = ended.pid
    with pytest.warns(RuntimeWarning, match="cannot read the server's NVDEC backlog"):
        assert gone.seconds() == 0.0
    copy = pickle.dumps(backlog)
    fd = backlog.fd
    del backlog
    gc.collect()
    with tempfile.TemporaryFile() as other:
        other.write(np.array([123456.0]).tobytes() + b"\0" * 4096)
        other.flush()
        if other.fileno() != fd:  # take the freed number for the other file
            os.dup2(other.fileno(), fd)
        try:
            with pytest.warns(RuntimeWarning, match="no longer the backlog's page"):
                assert pickle.loads(copy).seconds() == 0.0
        finally:
            if other.fileno() != fd:
                os.close(fd)


def test_balanced_mixed_draws_decode_here_only_while_nvdec_has_more_queued_than_a_decode_takes():
    """``cpu_share="auto"``: no NVDEC work queued, the clip goes to NVDEC; work queued and no
    time of its own yet, the worker decodes (and learns its time a clip); queued work shorter than
    that time, NVDEC again. The start, crop and flip are the seed's whichever decodes."""
    import random

    from mmproxy.pipelines import ClipDraw
    from mmproxy.pipelines.video._backlog import Backlog

    backlog = Backlog()
    draw = ClipDraw("videos", 4, 3, True, 0.5, False, decode_in_worker=False, cpu_decoder=False,
                    nvdec=True, backlog=backlog)
    pyav = ClipDraw("videos", 4, 3, True, 0.5, False, decode_in_worker=True, cpu_decoder=False)
    given = {"videos": np.frombuffer(_encode("h264", frames=60), np.uint8)}
    backlog.publish(0.0)
    sent = draw(given, random.Random(1))
    assert sent["videos"].ndim == 1 and draw.pace == 0.0
    backlog.publish(1e-9)
    here = draw(given, random.Random(1))
    expected = pyav(given, random.Random(1))
    assert np.array_equal(here["videos"], expected["frames"]) and draw.pace > 0
    assert all(np.array_equal(sent[k], here[k]) for k in ("start", "crop_x", "crop_y", "flip"))
    backlog.publish(draw.pace / 2)
    assert draw(given, random.Random(2))["videos"].ndim == 1
    backlog.publish(draw.pace * 4)
    assert draw(given, random.Random(2))["videos"].ndim == 4
    with pytest.raises(ValueError, match="cpu_share must be 'auto' or between 0 and 1"):
        video_pipeline(batch_size=2, decoder="mixed", device="cpu", cpu_share="half")


def test_the_clip_decoder_publishes_the_nvdec_work_it_has_queued(monkeypatch):
    """Encoded clips queued behind busy decode threads count (times the threads' time a clip,
    over the threads); frames a worker decoded do not; the backlog is 0 once all are taken and after
    close(); the decoder counts where the clips were decoded."""
    import threading

    from mmproxy.pipelines.video._backlog import Backlog

    class Slot:
        def __init__(self, device, options):
            pass

        def close(self):
            pass

    gate = threading.Event()

    def slow(session, sample):
        gate.wait(30)
        time.sleep(0.01)
        return dict(sample)

    decoder = _clip_decoder(monkeypatch, threads=2, slot=Slot)
    decoder.backlog = backlog = Backlog()
    monkeypatch.setattr(decoder, "_prepare", slow)
    encoded = np.zeros(100, np.uint8)
    frames = np.zeros((2, 2, 2, 3), np.uint8)
    first = [decoder.submit({"videos": encoded, "start": 0}) for _ in range(2)]
    deadline = time.monotonic() + 10
    while decoder._queued and time.monotonic() < deadline:  # both threads took one
        time.sleep(0.01)
    assert decoder._queued == 0 and backlog.seconds() == 0.0  # no time a clip known yet
    gate.set()
    for f in first:
        f.result(timeout=10)
    assert decoder._pace >= 0.01
    gate.clear()
    more = [decoder.submit({"videos": encoded, "start": 0}) for _ in range(6)]
    more += [decoder.submit({"videos": frames, "start": 0}) for _ in range(3)]
    deadline = time.monotonic() + 10
    while decoder._queued > 4 and time.monotonic() < deadline:  # two of the six taken
        time.sleep(0.01)
    assert decoder._queued == 4  # the worker's frames not counted
    assert backlog.seconds() == pytest.approx(4 * decoder._pace / 2)
    gate.set()
    for f in more:
        f.result(timeout=10)
    assert backlog.seconds() == 0.0
    assert decoder.clips == {"nvdec": 8, "workers": 3}
    gate.clear()
    decoder.submit({"videos": encoded, "start": 0})
    decoder.submit({"videos": encoded, "start": 0})
    decoder.submit({"videos": encoded, "start": 0})
    time.sleep(0.1)
    assert backlog.seconds() > 0
    gate.set()
    decoder.close()
    assert backlog.seconds() == 0.0


def test_a_codec_nvdec_lacks_without_pyav_is_refused_by_name(monkeypatch):
    import random
    import sys

    from mmproxy.pipelines import ClipDraw

    mjpeg = np.frombuffer(_encode("mjpeg"), np.uint8)
    hevc = np.frombuffer(video_bytes(synth_video(0, 20), "libx265", "mp4"), np.uint8)
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    draw = ClipDraw("videos", 4, 3, False, 0.5, False, decode_in_worker=False, cpu_decoder=False,
                    nvdec=True)
    with pytest.raises(ValueError, match=r"MJPEG in avi video: NVDEC decodes only H.264, HEVC, "
                                         r"VP8, VP9, AV1 in MP4/MOV files.*pip install av"):
        draw({"videos": mjpeg}, random.Random(0))
    draw = ClipDraw("videos", 4, 3, False, 0.5, False, decode_in_worker=False, cpu_decoder=False,
                    nvdec=True, nvdec_codecs=LIBRARY_CODECS["pynvvideocodec"])
    with pytest.raises(ValueError, match=r"HEVC in mp4 video: NVDEC decodes only H.264, VP8, VP9, "
                                         r"AV1 .* \(HEVC too with PyNvVideoCodec.*pip install av"):
        draw({"videos": hevc}, random.Random(0))


def test_hevc_goes_to_pyav_in_the_worker_with_pynvvideocodec_and_to_nvdec_with_torchcodec():
    """PyNvVideoCodec's HEVC frames are not always the ones asked for (x265 with B-frames): with
    it an HEVC clip is decoded in the worker; with TorchCodec it goes to NVDEC, cut."""
    import random

    from mmproxy.pipelines import ClipDraw

    hevc = np.frombuffer(video_bytes(synth_video(0, 40), "libx265", "mp4"), np.uint8)

    def draw(library):
        return ClipDraw("videos", 4, 3, True, 0.5, False, decode_in_worker=False,
                        cpu_decoder=False, nvdec=True, nvdec_codecs=LIBRARY_CODECS[library])(
                            {"videos": hevc}, random.Random(3))

    here, sent = draw("pynvvideocodec"), draw("torchcodec")
    assert here["videos"].ndim == 4 and sent["videos"].ndim == 1 and len(sent["at"]) == 4
    assert np.array_equal(decode_clip(sent["videos"].tobytes(), None, None, 1, at=sent["at"]),
                          here["videos"])
    assert video_pipeline(batch_size=2, decoder="pyav", device="cpu").sample_random.nvdec_codecs \
        == LIBRARY_CODECS["pynvvideocodec"]  # the default library's


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


def _clip_decoder(monkeypatch, threads=1, slot=None):
    """A ClipDecoder on a machine without PyNvVideoCodec (its slots: ``slot``)."""
    from mmproxy.pipelines.video import _nvdec

    monkeypatch.setattr(_nvdec, "load_nvdec", lambda: None)
    if slot is not None:
        monkeypatch.setitem(_nvdec.NVDEC_LIBRARIES, "pynvvideocodec", slot)
    return _nvdec.ClipDecoder("videos", 3, 2, 0, threads, None, ())


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
