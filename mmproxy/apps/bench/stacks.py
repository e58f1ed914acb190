"""``--stacks`` (``mmproxy bench``, ``benchmarks/video_bench.py``): where each thread group of this
process was found, sampled every 10 ms while a system runs.

A thread group is the threads' names without their ``_N``. Each group's innermost Python frames
are counted; a thread inside a C call that released the GIL is found at the line of that call,
so the counts say where the threads spend their time, not whether they hold the GIL. On a GPU,
``nvidia-smi``'s decoder (NVDEC) and GPU utilization are sampled beside them every 200 ms.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ThreadStacks"]


class ThreadStacks:
    """Each thread group's innermost Python frames, and on a GPU ``nvidia-smi``'s decoder and GPU
    utilization, sampled while the ``with`` block runs (module docstring)."""

    def __init__(self, gpu: bool, interval: float = 0.01) -> None:
        self.gpu, self.interval, self.stop = gpu, interval, threading.Event()
        self.frames: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        # "bench-": the bench's own thread, counted in no CPU group (apps/bench/cpu.py)
        self.thread = threading.Thread(target=self._run, name="bench-stacks", daemon=True)
        self.smi: subprocess.Popen[str] | None = None
        self.util = np.zeros((0, 2))

    def __enter__(self) -> ThreadStacks:
        if self.gpu:
            try:
                self.smi = subprocess.Popen(
                    ["nvidia-smi", "--query-gpu=utilization.decoder,utilization.gpu",
                     "--format=csv,noheader,nounits", "-lms", "200"],
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            except OSError:  # no nvidia-smi here: the frames alone
                self.smi = None
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        if self.smi is not None:
            self.smi.terminate()
            rows = [line.split(",") for line in self.smi.communicate()[0].splitlines()
                    if "," in line]
            self.util = np.array([[float(v) for v in row] for row in rows]).reshape(-1, 2)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self.stop.wait(self.interval):
            names = {t.ident: re.sub(r"_\d+$", "", t.name) for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    code = frame.f_code
                    self.frames[names.get(ident, "?")][
                        f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"] += 1

    def report(self) -> dict[str, Any]:
        """Per thread group its samples and most frequent frames; ``nvidia_smi`` on a GPU."""
        out: dict[str, Any] = {group: {"samples": sum(c.values()), "top": c.most_common(8)}
                               for group, c in sorted(self.frames.items())}
        if self.smi is not None:
            util, some = self.util, len(self.util) > 0
            out["nvidia_smi"] = {
                "samples": len(util),
                "decoder_util_pct_median": float(np.median(util[:, 0])) if some else None,
                "decoder_util_pct_max": float(util[:, 0].max()) if some else None,
                "gpu_util_pct_median": float(np.median(util[:, 1])) if some else None}
        return out
