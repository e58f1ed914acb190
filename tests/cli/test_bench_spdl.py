"""The bench's SPDL systems: the same batches as the torch system, errors that name the sample,
"not run" with the reason where SPDL or its FFmpeg is missing, and PyAV's bundled FFmpeg loaded
in the process where the system has none."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmproxy.apps.bench.shards import write_shards
from mmproxy.apps.bench.systems import SYSTEMS, Setup

ROOT = Path(__file__).resolve().parents[2]


def _setup(tmp_path, workload, count, batch, damage=0.0, gpu=False):
    args = argparse.Namespace(workers=1, threads=1, epochs=2, prefetch=2, cpu_resize="torchvision",
                              samples=count)
    paths = write_shards(tmp_path / "shards", workload, count, 2, damage, "garbage")
    return Setup(args, workload, paths, tmp_path, gpu, 0 if gpu else None, batch)


def _spdl_or_skip(gpu_decode=False):
    from mmproxy.apps.bench.spdl_loader import spdl_missing

    missing = spdl_missing(gpu_decode)
    if missing:  # pip install spdl, and FFmpeg's libraries or PyAV
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
    assert "pip install spdl, mmproxy's [spdl] extra" in systems["spdl"]["error"]
    assert systems["torch"]["samples"] == 16


def test_spdl_without_ffmpeg_is_not_run_with_each_builds_reason(monkeypatch):
    """No build loads with the system's libraries, and PyAV's FFmpeg cannot serve either."""
    pytest.importorskip("spdl.io.utils")
    import spdl.io.utils

    from mmproxy.apps.bench import spdl_ffmpeg
    from mmproxy.apps.bench.spdl_loader import spdl_missing

    def missing():  # SPDL's own message when no build loads
        raise RuntimeError(
            'Failed to import libspdl. "spdl.io.lib._spdl_ffmpeg6: libavutil.so.58: cannot open '
            'shared object file: No such file or directory", "spdl.io.lib._spdl_ffmpeg5: '
            'libavutil.so.57: cannot open shared object file: No such file or directory" Enable '
            "DEBUG logging to see details about the failure. ")

    def no_pyav():
        raise RuntimeError("PyAV is not installed (pip install av)")

    monkeypatch.delenv(spdl_ffmpeg.FFMPEG_ENV, raising=False)
    monkeypatch.setattr(spdl_ffmpeg, "_loaded", {})  # as in a process that has loaded nothing
    monkeypatch.setattr(spdl_ffmpeg, "_load_pyav", no_pyav)
    monkeypatch.setattr(spdl.io.utils, "get_ffmpeg_versions", missing)
    reason = spdl_missing()
    assert reason is not None and reason.startswith(
        "not run: SPDL loads none of its FFmpeg builds (FFmpeg 4 to 9) with the system's "
        "libraries: _spdl_ffmpeg6: libavutil.so.58: cannot open shared object file: No such file "
        "or directory; _spdl_ffmpeg5: libavutil.so.57: cannot open shared object file: No such "
        "file or directory; PyAV's bundled FFmpeg cannot serve either: PyAV is not installed "
        "(pip install av); install FFmpeg's libraries (Debian 12: ")
    assert reason.endswith("or PyAV, whose bundled FFmpeg SPDL can use (pip install av)")


def test_the_ffmpeg_spdl_takes_is_checked(monkeypatch):
    """A value of MMPROXY_SPDL_FFMPEG other than pyav and system is refused; pyav, once the
    process has loaded the system's FFmpeg, says so (SPDL loads one build a process)."""
    _spdl_or_skip()
    from mmproxy.apps.bench import spdl_ffmpeg

    monkeypatch.setenv(spdl_ffmpeg.FFMPEG_ENV, "ffmpeg8")
    with pytest.raises(ValueError, match=r"^MMPROXY_SPDL_FFMPEG='ffmpeg8': use 'pyav' "):
        spdl_ffmpeg.load_ffmpeg()
    if spdl_ffmpeg._loaded:
        pytest.skip("this process decodes with PyAV's FFmpeg (the system has none)")
    monkeypatch.setenv(spdl_ffmpeg.FFMPEG_ENV, "pyav")
    with pytest.raises(RuntimeError, match=r"^MMPROXY_SPDL_FFMPEG=pyav, but SPDL has already "
                                           r"loaded the system's FFmpeg in this process: the "
                                           r"system's FFmpeg \d \(libavcodec \d+\."):
        spdl_ffmpeg.load_ffmpeg()


def test_spdl_gpu_is_not_run_without_a_gpu(tmp_path, monkeypatch):
    _spdl_or_skip()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = SYSTEMS["spdl-gpu"].run(_setup(tmp_path, "image", 4, 4))
    assert result == {"error": "not run: spdl-gpu decodes on a GPU, and there is none"}


_DECODE = """
import sys

import torch

if sys.argv[1] == "hide":  # every SPDL build but PyAV's unimportable: as without the system's FFmpeg
    from mmproxy.apps.bench import spdl_ffmpeg

    pyav = {lib: major for lib, (_, major) in spdl_ffmpeg._pyav_libraries().items()}
    keep = spdl_ffmpeg._build_for(pyav).name[len("lib"):-len(".so")]
    for major in range(4, 10):
        if f"spdl_ffmpeg{major}" != keep:
            sys.modules[f"spdl.io.lib._spdl_ffmpeg{major}"] = None
from mmproxy.apps.bench.spdl_decode import Normalize, SpdlAudio, SpdlImage
from mmproxy.apps.bench.spdl_ffmpeg import load_ffmpeg
from mmproxy.testing import audio_bytes, image_bytes, synth_image, synth_speech

decode = SpdlImage(seed=0)
images = [decode(image_bytes(synth_image(i, 96 + 8 * i, 128))) for i in range(6)]
audio = SpdlAudio()(audio_bytes(synth_speech(0, 1.5, 44100), 44100, "FLAC"))
torch.save({"ffmpeg": load_ffmpeg(), "images": Normalize()(decode.collate(images)),
            "audio": audio}, sys.argv[2])
"""


def _decoded_in_a_new_process(tmp_path, hide_systems_ffmpeg):
    script, out = tmp_path / "decode.py", tmp_path / f"decoded-{hide_systems_ffmpeg}.pt"
    script.write_text(_DECODE)
    env = {k: v for k, v in os.environ.items() if k != "MMPROXY_SPDL_FFMPEG"}
    done = subprocess.run([sys.executable, str(script), "hide" if hide_systems_ffmpeg else "show",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    return torch.load(out)


def _pyavs_ffmpeg():
    av = pytest.importorskip("av")
    codec = ".".join(map(str, av.library_versions["libavcodec"]))
    return re.compile(rf"PyAV's bundled FFmpeg \d \(libavcodec {re.escape(codec)}\)")


@pytest.mark.timeout(240)
def test_without_the_systems_ffmpeg_spdl_decodes_with_pyavs_as_with_the_systems(tmp_path):
    """A process whose SPDL finds no FFmpeg build with the system's libraries loads PyAV's
    bundled FFmpeg itself (no LD_LIBRARY_PATH), says so, and decodes JPEG (FFmpeg's crop, flip
    and resize filters) and FLAC (its resampler) as a process with the system's FFmpeg does."""
    _spdl_or_skip()
    pyavs = _pyavs_ffmpeg()
    theirs = _decoded_in_a_new_process(tmp_path, hide_systems_ffmpeg=False)
    mine = _decoded_in_a_new_process(tmp_path, hide_systems_ffmpeg=True)
    assert pyavs.fullmatch(mine["ffmpeg"]), mine["ffmpeg"]
    assert re.fullmatch(r"the system's FFmpeg \d \(libavcodec [\d.]+\)", theirs["ffmpeg"]) or (
        pyavs.fullmatch(theirs["ffmpeg"]))  # where the system has no FFmpeg, PyAV's twice
    assert mine["images"].shape == (6, 3, 224, 224)
    torch.testing.assert_close(mine["images"], theirs["images"], atol=0.05, rtol=0)  # 3 levels
    assert mine["audio"].shape == theirs["audio"].shape == (24000,)
    torch.testing.assert_close(mine["audio"], theirs["audio"], atol=1e-4, rtol=0)


@pytest.mark.timeout(300)
def test_the_bench_reports_whose_ffmpeg_spdl_decoded_with(tmp_path):
    """In the JSON: the system's FFmpeg (or PyAV's where it has none) by default; PyAV's with
    MMPROXY_SPDL_FFMPEG=pyav, which needs nothing set before Python starts."""
    _spdl_or_skip()
    pyavs = _pyavs_ffmpeg()
    result = SYSTEMS["spdl"].run(_setup(tmp_path, "image", 8, 4))
    assert re.fullmatch(r"the system's FFmpeg \d \(libavcodec [\d.]+\)", result["ffmpeg"]) or (
        pyavs.fullmatch(result["ffmpeg"]))
    out = tmp_path / "bench.json"
    env = dict(os.environ, MMPROXY_SPDL_FFMPEG="pyav")
    done = subprocess.run([
        sys.executable, "-m", "mmproxy.cli", "bench", "--workload", "image", "--systems", "spdl",
        "--samples", "16", "--batch-size", "8", "--workers", "1", "--epochs", "2", "--device",
        "cpu", "--data-dir", str(tmp_path / "data"), "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    spdl = json.loads(out.read_text())["results"]["image"]["systems"]["spdl"]
    assert pyavs.fullmatch(spdl["ffmpeg"]), spdl
    assert spdl["samples"] == 16


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


def test_the_torch_tensor_system_reads_a_16_bit_png():
    """torchvision's decode_image gives a 16-bit PNG as uint16, which its flip does not take:
    the torch-tensor system failed on such a photograph and lost its whole run. (The torch
    system reads it as ImageFolder's loader does: Pillow's RGB conversion clips it.)"""
    import io

    import numpy as np
    from PIL import Image

    from mmproxy.apps.bench.workers import TorchImage

    gray = np.linspace(0, 65535, 64 * 48).astype(np.uint16).reshape(48, 64)
    buf = io.BytesIO()
    Image.fromarray(gray).save(buf, "PNG")  # mode I;16
    out = TorchImage("tensor")(buf.getvalue())
    assert out.shape == (3, 224, 224) and out.dtype == torch.float32
    assert torch.isfinite(out).all() and out.std() > 0
