"""NVDEC in the server, as the workers see it: what the draw sends, the backlog the server
publishes, the codecs each library is given."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mmproxy.pipelines import decode_clip, video_pipeline
from mmproxy.pipelines.video._nvdec import LIBRARY_CODECS
from video_helpers import (
    _clip_decoder,
    _encode,
)

from mmproxy.testing import synth_video, video_bytes

pytestmark = pytest.mark.timeout(240)


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
