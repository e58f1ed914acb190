"""``--stacks`` (``mmproxy bench``, ``benchmarks/video_bench.py``): where each thread group of this
process was found, sampled every 10 ms while a system runs.

A thread group is the threads' names without their ``_N``. Each group's innermost Python frames
are counted; a thread inside a C call that released the GIL is found at the line of that call,
so the counts say where the threads spend their time, not whether they hold the GIL. On a GPU,
the NVIDIA driver's NVML says beside them, every 200 ms, how busy the GPU's decoders (NVDEC) and
the GPU were.
"""

from __future__ import annotations

import collections
import ctypes
import re
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ThreadStacks"]


class _Nvml:
    """The GPU's decoder and GPU utilization (percent) from NVML (the driver's
    ``libnvidia-ml.so.1``, through ctypes). Raises OSError where there is none."""

    class _Rates(ctypes.Structure):
        _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]

    def __init__(self, device_id: int | None) -> None:
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit_v2 failed")
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByUUID(self._uuid(device_id), ctypes.byref(self.handle)):
            raise OSError("NVML does not know this process's GPU")

    @staticmethod
    def _uuid(device_id: int | None) -> bytes:
        """This process's GPU as NVML names it (NVML ignores CUDA_VISIBLE_DEVICES)."""
        import torch

        return f"GPU-{torch.cuda.get_device_properties(device_id or 0).uuid}".encode()

    def sample(self) -> tuple[float, float] | None:
        decoder, period, rates = ctypes.c_uint(), ctypes.c_uint(), self._Rates()
        if (self.lib.nvmlDeviceGetDecoderUtilization(self.handle, ctypes.byref(decoder),
                                                     ctypes.byref(period))
                or self.lib.nvmlDeviceGetUtilizationRates(self.handle, ctypes.byref(rates))):
            return None  # not supported here (some GPUs, MIG)
        return float(decoder.value), float(rates.gpu)


class ThreadStacks:
    """Each thread group's innermost Python frames, and on a GPU NVML's decoder and GPU
    utilization, sampled while the ``with`` block runs (module docstring)."""

    def __init__(self, gpu: bool, device_id: int | None = None, interval: float = 0.01) -> None:
        self.gpu, self.device_id, self.interval = gpu, device_id, interval
        self.stop = threading.Event()
        self.frames: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        # "bench-": the bench's own thread, counted in no CPU group (apps/bench/cpu.py)
        self.thread = threading.Thread(target=self._run, name="bench-stacks", daemon=True)
        self.util: list[tuple[float, float]] = []
        self.nvml_status = ""

    def __enter__(self) -> ThreadStacks:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        nvml = None
        if self.gpu:
            try:
                nvml = _Nvml(self.device_id)
            except Exception as err:  # noqa: BLE001 - no NVML, no torch GPU: the frames alone
                self.nvml_status = f"not run: {type(err).__name__}: {err}"
        ticks = 0
        while not self.stop.wait(self.interval):
            names = {t.ident: "native (not started by Python)"
                     if isinstance(t, threading._DummyThread)  # type: ignore[attr-defined]
                     else re.sub(r"_\d+$", "", t.name) for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    code = frame.f_code
                    self.frames[names.get(ident, "?")][
                        f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"] += 1
            ticks += 1
            if nvml is not None and ticks % 20 == 0:
                got = nvml.sample()
                if got is not None:
                    self.util.append(got)

    def report(self) -> dict[str, Any]:
        """Per thread group its samples and most frequent frames; ``nvml`` on a GPU."""
        out: dict[str, Any] = {group: {"samples": sum(c.values()), "top": c.most_common(8)}
                               for group, c in sorted(self.frames.items())}
        if self.gpu:
            util = np.array(self.util).reshape(-1, 2)
            some = len(util) > 0
            out["nvml"] = {
                "status": self.nvml_status or ("ran" if some else "no readings"),
                "samples": len(util),
                "decoder_util_pct_median": float(np.median(util[:, 0])) if some else None,
                "decoder_util_pct_max": float(util[:, 0].max()) if some else None,
                "gpu_util_pct_median": float(np.median(util[:, 1])) if some else None}
        return out
