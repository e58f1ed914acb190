"""The bench's SPDL systems: the same batches as the torch system, errors that name the sample,
"not run" with the reason where SPDL or its FFmpeg is missing, and PyAV's FFmpeg made usable."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmproxy.apps.bench.shards import write_shards
from mmproxy.apps.bench.systems import SYSTEMS, Setup

ROOT = Path(__file__).resolve().parents[1]


def _setup(tmp_path, workload, count, batch, damage=0.0, gpu=False):
    args = argparse.Namespace(workers=1, threads=1, epochs=2, prefetch=2, cpu_resize="torchvision",
                              samples=count)
    paths = write_shards(tmp_path / "shards", workload, count, 2, damage, "garbage")
    return Setup(args, workload, paths, tmp_path, gpu, 0 if gpu else None, batch)


def _spdl_or_skip(gpu_decode=False):
    from mmproxy.apps.bench.spdl_loader import spdl_missing

    missing = spdl_missing(gpu_decode)
    if missing:  # pip install 'mmproxy[spdl]' and FFmpeg's libraries (or benchmarks/spdl_ffmpeg.sh)
        pytest.skip(missing)


def _spdl_epoch(setup, gpu_decode=False):
    from mmproxy.apps.bench.spdl_loader import running

    with running(setup, gpu_decode) as pipeline:
        return list(pipeline.get_iterator(timeout=60))


def _torch_epoch(setup):
    from mmproxy.apps.bench.workers import TorchImage, WdsSamples, pad_collate, torch_audio

    audio = setup.modality == "audio"
    data = WdsSamples(setup.paths, setup.ext, torch_audio if audio else TorchImage("pil"))
    return list(torch.utils.data.DataLoader(data, batch_size=setup.batch,
                                            collate_fn=pad_collate if audio else None))


@pytest.mark.timeout(120)
def test_spdl_gives_the_torch_systems_image_batches(tmp_path):
    _spdl_or_skip()
    setup = _setup(tmp_path, "image", 20, 8)
    mine, theirs = _spdl_epoch(setup), _torch_epoch(setup)
    assert sorted(b.shape for b in mine) == sorted(b.shape for b in theirs) == [
        (4, 3, 224, 224), (8, 3, 224, 224), (8, 3, 224, 224)]  # the last batch partial, as torch's
    assert {b.dtype for b in mine} == {torch.float32} and all(b.is_contiguous() for b in mine)
    from mmproxy.pipelines import IMAGENET_MEAN, IMAGENET_STD

    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    for batch in mine:  # normalized as torch's: 0-255 RGB pixels, ImageNet's mean and std
        pixels = batch * std + mean
        assert pixels.min() > -0.01 and pixels.max() < 255.01 and pixels.std() > 1


@pytest.mark.timeout(120)
def test_spdl_gives_the_torch_systems_audio_batches(tmp_path):
    """Padded as pad_collate pads, each clip as long as torchaudio resamples it, the same
    samples (the same resampler on the same WAV samples)."""
    _spdl_or_skip()
    setup = _setup(tmp_path, "audio", 10, 4)
    mine = sorted(_spdl_epoch(setup), key=lambda b: b[1].tolist())
    theirs = sorted(_torch_epoch(setup), key=lambda b: b[1].tolist())
    assert [b[1].tolist() for b in mine] == [b[1].tolist() for b in theirs]
    assert [b[0].shape for b in mine] == [b[0].shape for b in theirs]
    assert {b[0].dtype for b in mine} == {torch.float32}
    for (data, _), (reference, _) in zip(mine, theirs):
        torch.testing.assert_close(data, reference.to(torch.float32), atol=1e-4, rtol=0)


def test_spdl_decodes_other_audio_formats_through_ffmpeg(tmp_path):
    """FLAC (not WAV) goes through FFmpeg's decoder and resampler: mono, 16 kHz, float32."""
    _spdl_or_skip()
    from mmproxy.apps.bench.spdl_decode import SpdlAudio
    from mmproxy.testing import audio_bytes, synth_speech

    clip = SpdlAudio()(audio_bytes(synth_speech(0, 1.5, 44100), 44100, "FLAC"))
    assert clip.dtype == torch.float32 and clip.ndim == 1
    assert abs(len(clip) - 24000) <= 2 and clip.abs().max() > 0.01


@pytest.mark.timeout(120)
def test_a_sample_spdl_cannot_decode_stops_the_run_naming_it(tmp_path):
    _spdl_or_skip()
    setup = _setup(tmp_path, "image", 16, 4, damage=0.25)  # samples 3, 7, 11 and 15: garbage
    with pytest.raises(RuntimeError, match=r"^sample '00000(03|07|11|15)' of .*image-000[01]\.tar: "):
        SYSTEMS["spdl"].run(setup)


@pytest.mark.timeout(120)
def test_the_bench_reports_spdl_as_not_run_when_it_is_not_installed(tmp_path, monkeypatch):
    """The reason in the JSON and the table; the other systems still run."""
    from mmproxy._commands import build_parser
    from mmproxy.apps.bench import session

    monkeypatch.setitem(sys.modules, "spdl", None)  # import spdl... raises ImportError
    monkeypatch.setitem(sys.modules, "spdl.io", None)
    out = tmp_path / "bench.json"
    args = build_parser().parse_args([
        "bench", "--workload", "image", "--systems", "spdl,torch", "--samples", "16",
        "--batch-size", "8", "--workers", "1", "--epochs", "2", "--device", "cpu",
        "--data-dir", str(tmp_path / "data"), "--json", str(out)])
    assert session.run(args) == 0
    systems = json.loads(out.read_text())["results"]["image"]["systems"]
    assert systems["spdl"]["error"].startswith("not run: SPDL is not installed (")
    assert "pip install 'mmproxy[spdl]'" in systems["spdl"]["error"]
    assert systems["torch"]["samples"] == 16


def test_spdl_without_ffmpeg_is_not_run_with_each_builds_reason(monkeypatch):
    pytest.importorskip("spdl.io.utils")
    import spdl.io.utils

    from mmproxy.apps.bench.spdl_loader import spdl_missing

    def missing():  # SPDL's own message when no build loads
        raise RuntimeError(
            'Failed to import libspdl. "spdl.io.lib._spdl_ffmpeg6: libavutil.so.58: cannot open '
            'shared object file: No such file or directory", "spdl.io.lib._spdl_ffmpeg5: '
            'libavutil.so.57: cannot open shared object file: No such file or directory" Enable '
            "DEBUG logging to see details about the failure. ")

    monkeypatch.setattr(spdl.io.utils, "get_ffmpeg_versions", missing)
    reason = spdl_missing()
    assert reason is not None and reason.startswith(
        "not run: SPDL loads none of its FFmpeg builds (FFmpeg 4 to 9): _spdl_ffmpeg6: "
        "libavutil.so.58: cannot open shared object file: No such file or directory; "
        "_spdl_ffmpeg5: libavutil.so.57: ")
    assert "benchmarks/spdl_ffmpeg.sh" in reason


def test_spdl_gpu_is_not_run_without_a_gpu(tmp_path, monkeypatch):
    _spdl_or_skip()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = SYSTEMS["spdl-gpu"].run(_setup(tmp_path, "image", 4, 4))
    assert result == {"error": "not run: spdl-gpu decodes on a GPU, and there is none"}


@pytest.mark.timeout(120)
def test_spdl_ffmpeg_sh_makes_pyavs_ffmpeg_the_one_spdl_loads(tmp_path):
    """benchmarks/spdl_ffmpeg.sh: a folder of links to PyAV's bundled FFmpeg under the names
    SPDL's builds look for, and the export line; a new process with it decodes with PyAV's."""
    av = pytest.importorskip("av")
    pytest.importorskip("spdl.io")
    if not (Path(av.__file__).resolve().parent.parent / "av.libs").is_dir():
        pytest.skip("this PyAV uses the system's FFmpeg (no av.libs/)")
    env = dict(os.environ, PYTHON=sys.executable)
    made = subprocess.run(["bash", str(ROOT / "benchmarks" / "spdl_ffmpeg.sh"),
                           str(tmp_path / "ffmpeg")], env=env, capture_output=True, text=True,
                          timeout=100)
    assert made.returncode == 0, made.stderr
    line = made.stdout.strip()
    assert line == (f"export LD_LIBRARY_PATH={tmp_path / 'ffmpeg'}"
                    "${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    assert "SPDL loads PyAV's FFmpeg (libavcodec " in made.stderr
    check = ("import av, spdl.io, spdl.io.utils\n"
             "from mmproxy.testing import image_bytes, synth_image\n"
             "assert spdl.io.utils.get_ffmpeg_versions()['libavcodec'][0] == "
             "av.library_versions['libavcodec'][0]\n"
             "frames = spdl.io.decode_packets(spdl.io.demux_image(image_bytes(synth_image(0, 30, "
             "40))))\n"
             "print(spdl.io.to_numpy(spdl.io.convert_frames(frames)).shape)\n")
    decoded = subprocess.run(["bash", "-c", f"{line}; exec {sys.executable} -c \"$0\"", check],
                             cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert decoded.returncode == 0, decoded.stderr
    assert decoded.stdout.split() == ["(30,", "40,", "3)"]


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("system", ["spdl", "spdl-gpu"])
def test_spdl_systems_on_a_gpu_give_normalized_batches_there(tmp_path, system):
    _spdl_or_skip(gpu_decode=system == "spdl-gpu")
    setup = _setup(tmp_path, "image", 12, 8, gpu=True)
    batches = _spdl_epoch(setup, gpu_decode=system == "spdl-gpu")
    assert sorted(b.shape for b in batches) == [(4, 3, 224, 224), (8, 3, 224, 224)]
    assert all(b.is_cuda and b.dtype == torch.float32 for b in batches)


class _StalledPipeline:
    """What SPDL's pipeline sometimes does after a stage fails: no batch, no end of the epoch."""

    def get_iterator(self, timeout):
        self.timeout = timeout
        return self

    def __next__(self):
        raise TimeoutError(f"no item in {self.timeout} s")


@pytest.mark.timeout(30)
def test_a_stalled_spdl_pipeline_raises_the_failed_stages_error_or_times_out(monkeypatch):
    from mmproxy.apps.bench import spdl_loader

    monkeypatch.setattr(spdl_loader, "_POLL_S", 0.01)
    errors = spdl_loader._FirstError()
    failing = errors.wrap(lambda item: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing(0)
    with pytest.raises(ZeroDivisionError):  # the stage's error, not a wait for ever
        list(spdl_loader._epoch(_StalledPipeline(), errors))
    monkeypatch.setattr(spdl_loader, "_ITEM_TIMEOUT_S", 0.05)
    with pytest.raises(TimeoutError, match=r"^SPDL's pipeline gave no batch in 0.05 s; no stage "):
        list(spdl_loader._epoch(_StalledPipeline(), spdl_loader._FirstError()))
