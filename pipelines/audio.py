"""Audio pipeline: encoded audio in, resampled waveform (or log-mel spectrogram) and length out.

The pipeline is a graph function (:func:`audio_graph`: DALI nodes in, DALI nodes out) behind a
named ``fn.external_source``; the same graph serves behind a DALI reader in a ``pipeline_def`` of
your own. docs/internals.md, ``mmproxy.pipelines.audio``, has the rest.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Literal

from mmproxy.pipelines.external import Device, external_pipeline, resolve_device

__all__ = ["CpuResample", "THREAD_PREFIX", "audio_graph", "audio_pipeline", "map_batch",
           "pool_cpu_seconds"]

CpuResample = Literal["soxr", "torchaudio", "dali"]

# A batch's samples on threads of the call's own, for functions DALI runs through
# ``fn.python_function(..., batch_processing=True)``: DALI runs such a function one call at a time,
# with the GIL, so :func:`map_batch` spreads the samples over up to 8 threads (no more than the
# cores this process may use); the work must release the GIL (torch's and libsoxr's kernels do).
# The threads start and end with the call: nothing outlives a server's stop, and a forked child
# starts threads of its own.
THREAD_PREFIX = "mmproxy-pyfn"  # their names
_MOST = 8
_spent = 0.0  # CPU seconds the pools' threads have spent in this process, all calls together
_spent_lock = threading.Lock()


def pool_cpu_seconds() -> float:
    """CPU seconds spent on :func:`map_batch`'s threads so far in this process (threads that
    live for one call each, which a count of the live threads misses): the bench counts them as
    the pipeline's."""
    return _spent


def map_batch(function: Callable[..., Any], *columns: Sequence[Any]) -> list[Any]:
    """``[function(*row) for row in zip(*columns)]``, the rows on threads of this call's own."""
    n = len(columns[0]) if columns else 0
    threads = min(_MOST, len(os.sched_getaffinity(0)), n)
    if threads <= 1:
        return [function(*row) for row in zip(*columns)]
    with ThreadPoolExecutor(threads, thread_name_prefix=THREAD_PREFIX) as pool:
        return list(pool.map(lambda *row: _timed(function, row), *columns))


def _timed(function: Callable[..., Any], row: tuple[Any, ...]) -> Any:
    global _spent
    start = time.thread_time()
    try:
        return function(*row)
    finally:
        spent = time.thread_time() - start
        with _spent_lock:
            _spent += spent


class _Resample:
    """Resamples a batch of clips (float32, ``[time]`` or ``[time, channels]``) to ``rate``. DALI
    calls it through ``fn.python_function`` once a batch with the clips and their rates; the
    clips are resampled on threads of the call's own (:func:`map_batch`;
    the resamplers release the GIL while they compute). Subclasses resample one clip."""

    def __init__(self, rate: int) -> None:
        self.rate = rate

    def __call__(self, clips: list[Any], rates: list[Any]) -> list[Any]:
        return map_batch(self._clip, clips, rates)

    def _clip(self, audio: Any, in_rate: Any) -> Any:
        source = round(float(in_rate))
        if source == self.rate or audio.shape[0] == 0:  # nothing to resample
            return audio
        return self._one(audio, source)

    def _one(self, audio: Any, source: int) -> Any:
        raise NotImplementedError


class _SoxrResample(_Resample):
    """libsoxr's resampler at its "HQ" quality; ``[time, channels]`` as it is. Its clip is as
    long as DALI's and torchaudio's, ``ceil(n * rate / source)`` samples (libsoxr may give one
    fewer: a zero is added)."""

    def __init__(self, rate: int) -> None:
        super().__init__(rate)
        try:  # imported when the pipeline is built, before the loader freezes the collector's heap
            import soxr  # noqa: F401
        except ImportError as e:
            raise ImportError(f"cpu_resample='soxr' cannot import soxr ({e}): pip install "
                              "'soxr>=0.4' (one of mmproxy's dependencies); cpu_resample="
                              "'torchaudio' or 'dali' resample without it") from e

    def _one(self, audio: Any, source: int) -> Any:
        import numpy as np
        import soxr

        out = soxr.resample(audio, source, self.rate, quality="HQ")
        n = -(-audio.shape[0] * self.rate // source)
        if out.shape[0] < n:
            out = np.concatenate([out, np.zeros((n - out.shape[0],) + out.shape[1:], out.dtype)])
        return out[:n]


class _MklForkGate:
    """Keeps forks of this process and torch's CPU convolutions apart, and has every fork free
    MKL's unused buffers first.

    torch's CPU convolution runs MKL's sgemm on OpenMP threads, and MKL keeps buffers per thread;
    a child forked after the resampler's threads used them found that bookkeeping inconsistent
    and hung in its first convolution (MKL's ``mm_account_ptr_by_tid``) about one fork in three,
    and so did a child forked while another thread was inside a convolution. Before a fork this
    gate waits for the convolutions under way (new ones wait for the fork), then calls
    ``mkl_serv_free_buffers`` (exported by torch's own library where torch links MKL), so the
    child starts with no buffer of a thread it does not have. One per process; a forked child
    starts with a fresh gate."""

    def __init__(self) -> None:
        import ctypes
        import threading
        from pathlib import Path

        import torch

        self._cond = threading.Condition()
        self._inside = 0
        self._forking = False
        self._free: Any = None
        try:
            lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
            self._free = lib.mkl_serv_free_buffers
            self._free.restype = None
        except (OSError, AttributeError):
            pass  # torch without MKL (or another build): nothing of MKL's to free

    def __enter__(self) -> None:
        with self._cond:
            while self._forking:
                self._cond.wait()
            self._inside += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._inside -= 1
            self._cond.notify_all()

    def before_fork(self) -> None:
        self._cond.acquire()
        self._forking = True
        while self._inside:
            self._cond.wait()
        if self._free is not None:
            self._free()

    def after_fork_in_parent(self) -> None:
        self._forking = False
        self._cond.notify_all()
        self._cond.release()


_gate: _MklForkGate | None = None


def _mkl_gate() -> _MklForkGate:
    """This process's gate (made, and hooked to ``os.fork``, on first use)."""
    global _gate
    if _gate is None:
        import os

        _gate = _MklForkGate()
        os.register_at_fork(before=lambda: _gate.before_fork() if _gate else None,
                            after_in_parent=lambda: _gate.after_fork_in_parent() if _gate else None,
                            after_in_child=_forget_gate)
    return _gate


def _forget_gate() -> None:
    """A forked child makes a gate of its own (the parent's lock is held in its copy)."""
    global _gate
    if _gate is not None:
        _gate = _MklForkGate()


class _TorchaudioResample(_Resample):
    """torchaudio's windowed-sinc resampler, its kernel made once per input rate."""

    def __init__(self, rate: int) -> None:
        super().__init__(rate)
        self._kernels: dict[int, Any] = {}
        import torchaudio.transforms  # noqa: F401  (as above)

        _mkl_gate()  # forks of this process now wait for its convolutions

    def _one(self, audio: Any, source: int) -> Any:
        import torch
        import torchaudio.transforms

        resample = self._kernels.get(source)
        if resample is None:  # two threads may both make it: the same kernel
            resample = self._kernels[source] = torchaudio.transforms.Resample(source, self.rate)
        clip = torch.from_numpy(audio)
        with torch.no_grad(), _mkl_gate():
            if clip.ndim == 1:
                return resample(clip).numpy()
            return resample(clip.T).T.contiguous().numpy()


_RESAMPLERS: dict[str, type[_Resample]] = {"soxr": _SoxrResample, "torchaudio": _TorchaudioResample}


def audio_graph(encoded: Any, *, gpu: bool, sample_rate: int = 16000, mono: bool = True,
                duration: float | None = None, pad_to_longest: bool = False,
                n_mels: int | None = None, n_fft: int = 400, win_length: int | None = None,
                hop_length: int = 160, log_mel: bool = True,
                cpu_resample: CpuResample = "soxr", full_precision: bool = False) -> tuple[Any, Any]:
    """The audio graph: encoded clips (a DALI node) to (audio, length) nodes. Call it inside a
    ``pipeline_def``; arguments as in :func:`audio_pipeline`, with ``gpu`` from
    :func:`~mmproxy.pipelines.resolve_device`."""
    import numpy as np
    from nvidia.dali import fn, types

    if cpu_resample not in (*_RESAMPLERS, "dali"):
        raise ValueError(f"cpu_resample must be 'soxr', 'torchaudio' or 'dali', got {cpu_resample!r}")
    if gpu and not full_precision:  # half the bytes to the GPU, and a faster decode
        audio, rate = fn.decoders.audio(encoded, dtype=types.INT16, downmix=mono)
        audio = fn.cast(audio.gpu(), dtype=types.FLOAT) * (1 / 32768)
    else:
        audio, rate = fn.decoders.audio(encoded, dtype=types.FLOAT, downmix=mono)
        audio = audio.gpu() if gpu else audio
    if gpu or cpu_resample == "dali":
        audio = fn.audio_resample(audio, in_rate=rate, out_rate=float(sample_rate),
                                  dtype=types.FLOAT)
    else:
        audio = fn.python_function(audio, rate, function=_RESAMPLERS[cpu_resample](sample_rate),
                                   num_outputs=1, batch_processing=True)
    if duration is not None:
        audio = fn.slice(audio, start=[0], shape=[round(duration * sample_rate)], axes=[0],
                         out_of_bounds_policy="pad", fill_values=0.0)
    samples = audio.shape(dtype=types.INT64)[0]
    if pad_to_longest:
        audio = fn.pad(audio, axes=[0], fill_value=0.0)
    if n_mels is None:
        return audio, samples
    window = win_length or n_fft
    hann = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(window) / window)).astype(np.float32)
    spec = fn.spectrogram(audio, nfft=n_fft, window_length=window, window_step=hop_length,
                          window_fn=hann.tolist(), center_windows=True, reflect_padding=True,
                          power=2, layout="ft")
    mel = fn.mel_filter_bank(spec, sample_rate=float(sample_rate), nfilter=n_mels, freq_low=0.0,
                             freq_high=sample_rate / 2, normalize=False, mel_formula="htk")
    if log_mel:
        mel = fn.to_decibels(mel, multiplier=10.0, reference=1.0, cutoff_db=-100.0)
    return mel, samples // hop_length + 1  # frames of the unpadded clip (centered windows)


def audio_pipeline(*, batch_size: int, sample_rate: int = 16000, mono: bool = True,
                   duration: float | None = None, pad_to_longest: bool = False,
                   n_mels: int | None = None, n_fft: int = 400,
                   win_length: int | None = None, hop_length: int = 160, log_mel: bool = True,
                   device: Device = "auto", device_id: int | None = None, num_threads: int = 4,
                   prefetch_queue_depth: int = 2, input_name: str = "audio",
                   cpu_resample: CpuResample = "soxr", full_precision: bool = False) -> Any:
    """Builds the audio pipeline.

    Args:
        batch_size: The largest batch the server will be asked to run.
        sample_rate: Target rate in Hz; every clip is resampled to it.
        mono: Downmix to one channel.
        duration: Trim or zero-pad every clip to this many seconds; None keeps lengths.
        pad_to_longest: Zero-pad every clip to the longest of its batch inside the pipeline, so
            the output is one dense tensor (the lengths still say what is real).
        n_mels: Compute a mel spectrogram with this many mel bands; None returns the waveform.
        n_fft: FFT size of the spectrogram.
        win_length: Window length in samples (Hann, periodic); ``n_fft`` when None.
        hop_length: Hop between windows in samples.
        log_mel: Return the mel spectrogram in decibels (``10 * log10(max(power, 1e-10))``).
        device: "auto" (GPU when CUDA is available), "gpu" or "cpu".
        device_id: The GPU to use; the current one when None.
        num_threads: DALI CPU threads.
        prefetch_queue_depth: Runs the server keeps in flight.
        input_name: Name of the ``external_source`` (the proxy's argument).
        cpu_resample: On CPU, resample with libsoxr ("soxr", the fastest) or "torchaudio" inside
            the DALI pipeline, or with DALI's "dali" ``fn.audio_resample`` (module docstring).
        full_precision: On a GPU, decode to float32 too (module docstring: by default a GPU
            pipeline's clips travel as 16-bit integers).
    """
    gpu, dev_id = resolve_device(device, device_id)
    graph = partial(audio_graph, gpu=gpu, sample_rate=sample_rate, mono=mono, duration=duration,
                    pad_to_longest=pad_to_longest, n_mels=n_mels, n_fft=n_fft,
                    win_length=win_length, hop_length=hop_length, log_mel=log_mel,
                    cpu_resample=cpu_resample, full_precision=full_precision)
    return external_pipeline(graph, input_name=input_name, batch_size=batch_size,
                             num_threads=num_threads, device_id=dev_id,
                             prefetch_queue_depth=prefetch_queue_depth)
