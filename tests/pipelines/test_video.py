"""Video in the workers and on the CPU: clips against PyAV frame for frame, presentation order,
cuts, header checks, and the video datasets."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import pytest
import torch
from mmproxy.datasets import make_shards, video_label_dataset, video_text_dataset
from mmproxy.pipelines import decode_clip, video_pipeline
from video_helpers import (
    LUMA_TOLERANCE,
    MEAN_TOLERANCE,
    _encode,
    _luma,
    _reference,
    _run,
    _server,
    av,
)

import mmproxy
from mmproxy.testing import faststart_mp4, make_tokenizer, synth_video, video_bytes, write_tar

pytestmark = pytest.mark.timeout(240)


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
