"""Ready pipelines against the PyTorch references (torchvision, torchaudio)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torchaudio
from mmproxy.pipelines import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    audio_pipeline,
    image_eval_pipeline,
    image_train_pipeline,
)
from torch.utils.data import default_collate

import mmproxy
from mmproxy.testing import audio_bytes, image_bytes, synth_image, synth_speech

pytestmark = pytest.mark.timeout(180)


def run(server, payloads):
    batch = default_collate([server.proxy(np.frombuffer(p, np.uint8)) for p in payloads])
    return server.produce_data(batch)


def torchvision_eval(jpeg, size=64, resize=73):
    from PIL import Image
    from torchvision.transforms import v2

    img = Image.open(io.BytesIO(jpeg)).convert("RGB")
    t = v2.Compose([v2.PILToTensor(), v2.Resize(resize, antialias=True), v2.CenterCrop(size),
                    v2.ToDtype(torch.float32),
                    v2.Normalize(list(IMAGENET_MEAN), list(IMAGENET_STD))])
    return t(img)


def test_eval_matches_torchvision():
    # Both decode with libjpeg-turbo and the CPU pipeline resizes with torchvision, and the crop
    # sits where CenterCrop puts it (the odd margin 73 - 64 = 9 puts it 4 in): the values agree
    # up to float32 rounding in the normalization.
    jpegs = [image_bytes(synth_image(i, 120 + 16 * i, 160)) for i in range(6)]
    pipe = image_eval_pipeline(batch_size=8, size=64, resize_size=73, device="cpu", num_threads=1)
    with mmproxy.DALIServer(pipe) as server:
        out = run(server, jpegs)
    ref = torch.stack([torchvision_eval(j) for j in jpegs])
    assert out.shape == ref.shape == (6, 3, 64, 64)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("height,width,size,resize_size", [
    (86, 201, 28, 33), (201, 86, 28, 33), (86, 201, 32, 39), (90, 90, 31, 36)])
def test_eval_centre_crop_sits_where_torchvision_centre_crop_puts_it(height, width, size,
                                                                      resize_size):
    """Odd margins in both directions: 5 and 49 (torchvision rounds 2.5 to 2 and 24.5 to 24,
    halves to even), 7 and 59 (3.5 to 4, 29.5 to 30), 5 and 5 in a square. The CPU pipeline
    resizes with torchvision, so its crop of the same resized image is exact; with DALI's resize
    (``cpu_resize="dali"``) the interpolation differs by about a tenth of a level of 255 on
    average (a crop one pixel off differs by more than two levels)."""
    from torchvision.transforms import v2

    image = synth_image(5, height, width)
    resized = v2.Resize(resize_size, antialias=True)(torch.from_numpy(image).permute(2, 0, 1))
    margins = [side - size for side in resized.shape[1:]]
    assert all(m % 2 for m in margins), margins
    expected = v2.CenterCrop(size)(resized).permute(1, 2, 0)
    for resize in ("torchvision", "dali"):
        pipe = image_eval_pipeline(batch_size=2, size=size, resize_size=resize_size, layout="HWC",
                                   dtype="uint8", device="cpu", num_threads=1, cpu_resize=resize)
        with mmproxy.DALIServer(pipe) as server:
            out = run(server, [image_bytes(image, "PNG")])[0]
        diff = (out.int() - expected.int()).abs().float()
        if resize == "torchvision":
            assert diff.max() == 0, (diff.mean(), diff.max())
        else:
            assert diff.mean() < 0.5, diff.mean()


def test_eval_refuses_a_resize_smaller_than_the_crop():
    with pytest.raises(ValueError, match="resize_size=60 is smaller than size=64"):
        image_eval_pipeline(batch_size=2, size=64, resize_size=60, device="cpu")


@pytest.mark.parametrize("mode,fmt", [("L", "JPEG"), ("RGBA", "PNG"), ("RGB", "PNG")])
def test_grayscale_rgba_png_inputs_become_rgb(mode, fmt):
    payload = image_bytes(synth_image(3), fmt=fmt, mode=mode)
    pipe = image_eval_pipeline(batch_size=2, size=32, layout="HWC", dtype="uint8", device="cpu",
                               num_threads=1)
    with mmproxy.DALIServer(pipe) as server:
        out = run(server, [payload, payload])
    assert out.shape == (2, 32, 32, 3) and out.dtype == torch.uint8


@pytest.mark.parametrize("dtype,torch_dtype", [("float32", torch.float32),
                                               ("float16", torch.float16),
                                               ("uint8", torch.uint8)])
def test_train_shape_dtype_range(dtype, torch_dtype):
    jpegs = [image_bytes(synth_image(i)) for i in range(4)]
    pipe = image_train_pipeline(batch_size=4, size=48, dtype=dtype, device="cpu", num_threads=1,
                                seed=7)
    with mmproxy.DALIServer(pipe) as server:
        out = run(server, jpegs)
    assert out.shape == (4, 3, 48, 48) and out.dtype == torch_dtype
    if dtype == "uint8":
        assert out.max() > 50
    else:
        assert -2.2 < out.float().min() < 0 < out.float().max() < 2.7


def test_cpu_resize_with_torchvision_matches_dali_resize():
    # The crop is the whole image (area 1, the image's own aspect ratio) and nothing is flipped,
    # so the two differ only by the resize filters' rounding: about one level of 255.
    jpegs = [image_bytes(synth_image(i, 200, 300)) for i in range(4)]
    outs = {}
    for resize in ("torchvision", "dali"):
        pipe = image_train_pipeline(batch_size=4, size=64, device="cpu", num_threads=2, seed=3,
                                    scale=(1.0, 1.0), ratio=(1.5, 1.5), flip_probability=0.0,
                                    cpu_resize=resize)
        with mmproxy.DALIServer(pipe) as server:
            outs[resize] = run(server, jpegs)
    diff = (outs["torchvision"] - outs["dali"]).abs()
    assert outs["dali"].shape == (4, 3, 64, 64)
    assert diff.mean() < 0.005 and diff.max() < 0.05, (diff.mean(), diff.max())
    with pytest.raises(ValueError, match="cpu_resize must be"):
        image_train_pipeline(batch_size=4, device="cpu", cpu_resize="pil")


def _train_crops(seed):
    jpegs = [image_bytes(synth_image(i)) for i in range(8)]
    pipe = image_train_pipeline(batch_size=8, size=32, device="cpu", num_threads=1, seed=seed)
    with mmproxy.DALIServer(pipe) as server:
        return run(server, jpegs)


def test_train_crops_and_flips_follow_the_seed():
    a, b, c = _train_crops(1), _train_crops(1), _train_crops(2)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_sample_seeded_crops_follow_each_samples_seed_not_its_batch():
    """sample_seeded=True: a sample's crop and flip come from its own seed, so the same sample
    gets the same output alone, in another batch position, or in another server."""
    from mmproxy.worker import sample_key

    jpegs = [image_bytes(synth_image(i)) for i in range(6)]

    def crops(order, seeds):
        pipe = image_train_pipeline(batch_size=8, size=32, device="cpu", num_threads=1,
                                    sample_seeded=True)
        with mmproxy.DALIServer(pipe) as server:
            refs = []
            for i in order:
                with sample_key(f"s{i}", seed=seeds[i]):
                    refs.append(server.proxy(np.frombuffer(jpegs[i], np.uint8)))
            return dict(zip(order, server.produce_data(default_collate(refs))))

    seeds = [11, 12, 13, 14, 15, 16]
    a = crops([0, 1, 2, 3, 4, 5], seeds)
    b = crops([5, 3, 1], seeds)
    for i in (5, 3, 1):
        assert torch.equal(a[i], b[i])
    other = crops([0, 1, 2, 3, 4, 5], [s + 100 for s in seeds])
    assert sum(not torch.equal(a[i], other[i]) for i in range(6)) >= 5


def test_two_views_of_one_sample_get_two_crops():
    """Two proxy calls in one sample (two fields, SimCLR-style) draw from different streams."""
    from mmproxy.worker import sample_key

    jpeg = np.frombuffer(image_bytes(synth_image(1)), np.uint8)
    pipe = image_train_pipeline(batch_size=8, size=32, device="cpu", num_threads=1,
                                sample_seeded=True)
    with mmproxy.DALIServer(pipe) as server:
        refs = []
        for i in range(4):
            with sample_key(f"s{i}", seed=i):
                refs += [server.proxy(jpeg), server.proxy(jpeg)]
        out = server.produce_data(default_collate(refs))
    assert sum(not torch.equal(out[2 * i], out[2 * i + 1]) for i in range(4)) >= 3


def test_random_resized_crop_windows_stay_in_scale_and_ratio():
    import random

    from mmproxy.pipelines import RandomResizedCrop

    crop = RandomResizedCrop("images", (0.08, 1.0), (3 / 4, 4 / 3), 0.5)
    rng = random.Random(0)
    for width, height in [(640, 480), (100, 1000), (33, 17)]:
        for _ in range(200):
            x, y, w, h = crop.window(width, height, rng)
            assert 0 <= x and x + w <= width and 0 <= y and y + h <= height
            if (width, height) == (640, 480):  # a feasible image: the draw, not the fallback
                assert 0.07 <= w * h / (width * height) <= 1.0
                assert 0.7 <= w / h <= 1.4


def tone(freq, rate, seconds=0.5):
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def snr_db(ref, got):
    n = min(len(ref), len(got))
    ref, got = ref[:n], got[:n]
    return 10 * torch.log10((ref ** 2).sum() / ((ref - got) ** 2).sum()).item()


@pytest.mark.parametrize("cpu_resample,db", [("dali", 30), ("soxr", 50), ("torchaudio", 80)])
@pytest.mark.parametrize("signal", ["tone", "noise"])
def test_resampling_matches_torchaudio(signal, cpu_resample, db):
    """DALI's resampler within 30 dB of torchaudio's and the CPU default, libsoxr's, within 50
    dB; torchaudio's inside the pipeline is torchaudio's."""
    rate = 44100
    if signal == "tone":
        x = tone(440, rate) + tone(3000, rate) * 0.5
    else:  # white noise kept below the target's Nyquist, so both resamplers keep all of it
        spectrum = np.fft.rfft(np.random.default_rng(0).normal(0, 0.2, rate // 2))
        spectrum[np.fft.rfftfreq(rate // 2, 1 / rate) > 6000] = 0
        x = np.fft.irfft(spectrum).astype(np.float32)
    # 16-bit WAV: compare against the same quantized signal
    payload = audio_bytes(x, rate, "WAV")
    x16 = torch.from_numpy(np.round(np.clip(x, -1, 1) * 32767) / 32768).float()
    pipe = audio_pipeline(batch_size=2, device="cpu", num_threads=1, cpu_resample=cpu_resample)
    with mmproxy.DALIServer(pipe) as server:
        audio, length = run(server, [payload])
    ref = torchaudio.functional.resample(x16, rate, 16000)
    assert abs(int(length[0]) - len(ref)) <= 1
    # skip the edges, where the two resamplers pad differently
    assert snr_db(ref[200:-200], audio[0][200:-200]) > db


def test_cpu_resamplers_match_dali_resample():
    """Clips of several rates in one batch (up and down, one already at the target rate), mono
    and stereo: the same lengths from every CPU resampler, and samples within the filters'
    difference (content below every cutoff)."""
    rates = [44100, 48000, 8000, 16000, 22050]
    clips = [tone(440, rate, 0.3 + 0.1 * i) + tone(1800, rate, 0.3 + 0.1 * i) * 0.4
             for i, rate in enumerate(rates)]
    for mono in (True, False):
        payloads = [audio_bytes(np.stack([x, 0.5 * x], 1) if not mono else x, rate, "WAV")
                    for x, rate in zip(clips, rates)]
        outs = {}
        for resample in ("soxr", "torchaudio", "dali"):
            pipe = audio_pipeline(batch_size=5, device="cpu", num_threads=2, mono=mono,
                                  cpu_resample=resample)
            with mmproxy.DALIServer(pipe, pad=True) as server:
                audio, length = run(server, payloads)
            outs[resample] = (audio.data, length.data if hasattr(length, "data") else length)
        b, lb = outs["dali"]
        assert lb.tolist() == [round(16000 * (0.3 + 0.1 * i)) for i in range(5)]
        for resample in ("soxr", "torchaudio"):
            a, la = outs[resample]
            assert la.tolist() == lb.tolist(), resample
            assert a.shape == b.shape and a.shape[2:] == (() if mono else (2,))
            assert a.dtype == b.dtype == torch.float32, (resample, a.dtype)
            for i, n in enumerate(la.tolist()):
                diff = (a[i, 200:n - 200] - b[i, 200:n - 200]).abs()
                assert diff.max() < 0.01, (resample, mono, rates[i], diff.max())
    with pytest.raises(ValueError, match="cpu_resample must be"):
        audio_pipeline(batch_size=2, device="cpu", cpu_resample="scipy")


def test_cpu_resamplers_give_the_same_log_mel_within_40_db_of_the_peak():
    """Speech at 44.1 kHz to a 64-band log-mel at 16 kHz: libsoxr's and torchaudio's resamplers
    against DALI's (the GPU pipeline's) on CPU, within 0.1 dB in every bin down to 40 dB under
    the peak; below that their filters' transition bands differ (docs: audio_pipeline)."""
    wav = audio_bytes(synth_speech(0, 1.0, 44100), 44100, "WAV")
    res = {}
    for resample in ("soxr", "torchaudio", "dali"):
        pipe = audio_pipeline(batch_size=2, device="cpu", num_threads=2, n_mels=64,
                              cpu_resample=resample)
        with mmproxy.DALIServer(pipe, pad=[0]) as server:
            mel, _ = run(server, [wav])
        res[resample] = mel.data[0]
    loud = res["dali"] > res["dali"].max() - 40
    assert loud.sum() > loud.numel() // 5  # a good part of the spectrogram
    for resample in ("soxr", "torchaudio"):
        assert (res[resample][loud] - res["dali"][loud]).abs().max() < 0.1, resample


@pytest.mark.parametrize("mono", [True, False])
def test_cpu_resample_keeps_an_empty_clip_empty(mono):
    """A clip of no samples in a batch: length 0 from libsoxr's and torchaudio's resamplers, as
    from DALI's, and the batch's other clip resampled."""
    empty = audio_bytes(np.zeros((0,) if mono else (0, 2), np.float32), 44100, "WAV")
    x = tone(440, 44100, 0.1)
    other = audio_bytes(x if mono else np.stack([x, x], 1), 44100, "WAV")
    for resample in ("soxr", "torchaudio", "dali"):
        pipe = audio_pipeline(batch_size=2, device="cpu", num_threads=1, mono=mono,
                              cpu_resample=resample)
        with mmproxy.DALIServer(pipe, pad=True) as server:
            _, length = run(server, [empty, other])
        assert (length.data if hasattr(length, "data") else length).tolist() == [0, 1600], resample


_FORKS = """
import os, sys, threading
import numpy as np
from mmproxy.pipelines.audio import _RESAMPLERS

resample = _RESAMPLERS[sys.argv[1]](16000)
clips = [np.sin(np.arange(8820, dtype=np.float32) * 0.0627)] * 3
stop = threading.Event()
worker = threading.Thread(target=lambda: busy(), daemon=True)

def busy():
    while not stop.is_set():
        resample(clips, [44100.0] * 3)

for k in range(8):
    assert [len(c) for c in resample(clips, [44100.0] * 3)] == [3200] * 3
    if k == 4:  # the last four forks with a thread of the parent resampling
        worker.start()
    pid = os.fork()
    if pid == 0:  # the child: exits 0 only if the resampler answers within 10 s
        code = 1
        try:
            got = []
            call = threading.Thread(target=lambda: got.append(resample(clips, [44100.0] * 3)),
                                    daemon=True)
            call.start()
            call.join(10)
            code = 0 if got and [len(c) for c in got[0]] == [3200] * 3 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WEXITSTATUS(status):
        sys.exit(f"fork {k}: the child did not resample (status {status})")
stop.set()
worker.join()  # not at exit inside torch: its C++ statics go first ("terminate called")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["soxr", "torchaudio"])
def test_cpu_resampler_works_in_a_forked_child(kind):
    """A child forked after the resampler ran resamples too: with threads of its own, not
    waiting for threads of the parent's that the child does not have, nor hanging in MKL's
    buffers of them (torchaudio's convolution: one fork in three hung before they were freed at
    the fork), even while another thread of the parent resamples (a server's pipeline while the
    DataLoader forks its workers). In a fresh interpreter: eight forks."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FORKS, kind], capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG"])
def test_decodes_wav_flac_ogg_downmix_and_fixed_duration(fmt):
    x = synth_speech(1, 0.7, rate=16000, channels=2)
    pipe = audio_pipeline(batch_size=2, device="cpu", num_threads=1, duration=0.5)
    with mmproxy.DALIServer(pipe) as server:
        audio, length = run(server, [audio_bytes(x, 16000, fmt)])
    assert audio.shape == (1, 8000) and int(length[0]) == 8000


def test_log_mel_matches_torchaudio():
    # Same waveform (16 kHz input, no resampling), same Hann window, HTK mel scale, no norm.
    # Tolerance: 1e-3 of the peak in power, and 0.1 dB where the power is within 40 dB of the
    # peak (further down, float32 FFT rounding of two different FFT codes reaches tenths of a dB).
    x = synth_speech(2, 0.6, rate=16000)
    x16 = torch.from_numpy(np.round(x * 32767) / 32768).float()
    pipe = audio_pipeline(batch_size=2, device="cpu", num_threads=1, n_mels=40, n_fft=512,
                          win_length=400, hop_length=160, log_mel=False)
    with mmproxy.DALIServer(pipe) as server:
        mel, frames = run(server, [audio_bytes(x, 16000, "WAV")])
    ref = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=400, hop_length=160,
                                               n_mels=40, mel_scale="htk")(x16)
    got = mel[0]
    assert got.shape == ref.shape and int(frames[0]) == ref.shape[1]
    assert (got - ref).abs().max() / ref.max() < 1e-3
    loud = ref > ref.max() * 1e-4
    assert (10 * torch.log10(got[loud]) - 10 * torch.log10(ref[loud])).abs().max() < 0.1


def test_a_hardware_decoder_share_outside_0_to_1_is_refused():
    for load in (-0.1, 1.5):
        with pytest.raises(ValueError, match="hw_decoder_load must be between 0 and 1"):
            image_train_pipeline(batch_size=2, device="cpu", hw_decoder_load=load)
    jpegs = [image_bytes(synth_image(i, 120, 160)) for i in range(2)]
    with mmproxy.DALIServer(image_eval_pipeline(batch_size=2, size=32, device="cpu",
                                                hw_decoder_load=0.5)) as server:
        assert run(server, jpegs).shape == (2, 3, 32, 32)  # on the CPU the share has no say


@pytest.mark.gpu
def test_gpu_pipelines_agree_with_cpu():
    jpegs = [image_bytes(synth_image(i, 120, 160)) for i in range(4)]
    outs = {}
    for device, load in (("cpu", None), ("gpu", None), ("gpu", 0.0), ("gpu", 1.0)):
        pipe = image_eval_pipeline(batch_size=4, size=64, device=device, num_threads=2,
                                   hw_decoder_load=load)
        with mmproxy.DALIServer(pipe) as server:
            outs[device, load] = run(server, jpegs).cpu()
    # nvJPEG (GPU: its hardware decoder, or DALI's threads with the GPU) and libjpeg-turbo (CPU)
    # differ by IDCT rounding: a level or two.
    for key in (("gpu", None), ("gpu", 0.0), ("gpu", 1.0)):
        assert (outs["cpu", None] - outs[key]).abs().mean() < 0.05, key
    wav = audio_bytes(synth_speech(0, 1.0, 44100), 44100, "WAV")
    res = {}
    for device, resample in (("cpu", "dali"), ("cpu", "soxr"), ("gpu", "soxr")):
        pipe = audio_pipeline(batch_size=2, device=device, num_threads=2, n_mels=64,
                              cpu_resample=resample)  # a GPU pipeline resamples with DALI's
        with mmproxy.DALIServer(pipe, pad=[0]) as server:
            mel, _ = run(server, [wav])
            res[device if device == "gpu" else resample] = mel.data.cpu()
    # DALI's resampler on either device: the same log-mel down to 60 dB under the peak
    loud = res["dali"] > res["dali"].max() - 60
    assert (res["dali"][loud] - res["gpu"][loud]).abs().max() < 0.5
    # libsoxr's, the CPU default: the same within 40 dB of the peak (further down, in the
    # resamplers' transition bands near the cutoff, their filters differ by a few dB)
    loud = res["soxr"] > res["soxr"].max() - 40
    assert (res["soxr"][loud] - res["gpu"][loud]).abs().max() < 0.5


def _wav(signal, rate, width):
    """A WAV of ``signal`` (float, [time] or [time, channels]) with ``width``-byte samples."""
    import wave

    full = 2 ** (8 * width - 1) - 1
    ints = np.round(np.clip(signal, -1, 1) * full).astype("<i4")
    raw = ints.astype("<i2").tobytes() if width == 2 else b"".join(
        int(v).to_bytes(width, "little", signed=True) for v in ints.reshape(-1))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1 if signal.ndim == 1 else signal.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


@pytest.mark.gpu
def test_a_gpu_pipelines_16_bit_transfer_is_exact_for_16_bit_mono_sources():
    stereo = np.stack([synth_speech(3, 0.5, 22050), 0.5 * synth_speech(4, 0.5, 22050)], 1)
    clips = [_wav(stereo, 22050, 2), _wav(synth_speech(5, 0.5, 44100), 44100, 2),
             _wav(synth_speech(6, 0.5, 48000), 48000, 3)]  # the last one 24-bit
    out = {}
    for full in (False, True):
        pipe = audio_pipeline(batch_size=4, device="gpu", num_threads=2, full_precision=full)
        with mmproxy.DALIServer(pipe, pad=[0]) as server:
            audio, lengths = run(server, clips)
            out[full] = (audio.data.cpu(), lengths.tolist())
    (fast, n16), (precise, n32) = out[False], out[True]
    assert n16 == n32 == [8000, 8000, 8000]
    torch.testing.assert_close(fast[1], precise[1], rtol=0, atol=0)  # 16-bit mono: the same values
    for i in (0, 2):  # a downmix of two channels, and a 24-bit clip: rounded to 16 bits
        assert 0 < (fast[i] - precise[i]).abs().max() < 1e-4
