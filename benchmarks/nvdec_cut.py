"""NVDEC on whole clips against clips cut to the packets their frames need (``cut_clip``, as the
video pipeline's workers cut them for ``decoder="nvdec"``): the same clips held in memory,
decoded on 12 threads outside the loader, one session a thread, for TorchCodec and
PyNvVideoCodec, each way twice (the first pass warms the decoders up); the first 24 clips'
frames compared between the two ways. On a GPU machine with both libraries:

    python benchmarks/nvdec_cut.py --resolution 596x336 --clips 192 --json nvdec-cut.json
"""

from __future__ import annotations

import argparse
import io
import json
import random
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import _harness  # this script's folder is on the path
import numpy as np
from mmproxy.pipelines.video._nvdec_session import clip_indices
from mmproxy.pipelines.video._pyav import cut_clip

FRAMES, STRIDE, THREADS, COMPARED = 16, 4, 12, 24


def _clip(job: tuple[int, int, int]) -> dict[str, Any]:
    """One clip of 5-10 s (as video_bench.py writes them), its random start, and its cut."""
    import av

    from mmproxy.testing import synth_video, video_bytes

    seed, height, width = job
    rng = random.Random(seed)
    total = 25 * rng.randint(5, 10)
    data = np.frombuffer(video_bytes(synth_video(seed, total, height, width), "libx264", "mp4",
                                     crf=23), np.uint8)
    start = rng.randint(0, total - (FRAMES - 1) * STRIDE - 1)
    began = time.perf_counter()
    cut, at = cut_clip(data, clip_indices(total, start, FRAMES, STRIDE))
    seconds = time.perf_counter() - began
    with av.open(io.BytesIO(cut.tobytes())) as container:
        kept = sum(1 for p in container.demux(video=0) if p.size)
    return {"data": data, "start": start, "cut": cut, "at": at, "kept": kept, "seconds": seconds}


def _decode_all(library: str, clips: list[dict[str, Any]], cut: bool) -> tuple[float, list[Any]]:
    """Clips a second on THREADS threads (a session each), and the first clips' frames."""
    import torch
    from mmproxy.pipelines.video._nvdec import NVDEC_LIBRARIES

    pending = iter(range(len(clips)))
    lock = threading.Lock()
    frames: dict[int, Any] = {}

    def work() -> None:
        session = NVDEC_LIBRARIES[library](0, {})
        with torch.cuda.stream(session.stream):
            while True:
                with lock:
                    i = next(pending, None)
                if i is None:
                    break
                c = clips[i]
                got = (session.clip(c["cut"], 0, FRAMES, STRIDE, c["at"]) if cut else
                       session.clip(c["data"], c["start"], FRAMES, STRIDE))
                session.stream.synchronize()
                if i < COMPARED:
                    frames[i] = got.cpu()
        session.close()

    began = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        for done in [pool.submit(work) for _ in range(THREADS)]:
            done.result()  # a thread's error ends the measure
    return len(clips) / (time.perf_counter() - began), [frames[i] for i in sorted(frames)]


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolution", default="596x336")
    parser.add_argument("--clips", type=int, default=192)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    width, height = (int(v) for v in args.resolution.split("x"))
    with ProcessPoolExecutor() as pool:
        clips = list(pool.map(_clip, [(i, height, width) for i in range(args.clips)]))
    out: dict[str, Any] = {
        "resolution": args.resolution, "clips": args.clips,
        "packets_kept": float(np.mean([c["kept"] for c in clips])),
        "cut_ms": 1000 * float(np.mean([c["seconds"] for c in clips]))}
    print(out, flush=True)
    for library in ("torchcodec", "pynvvideocodec"):
        for _ in range(2):  # the first pass warms the decoders up
            whole, whole_frames = _decode_all(library, clips, cut=False)
            cut, cut_frames = _decode_all(library, clips, cut=True)
        same = sum(bool(torch.equal(a, b)) for a, b in zip(whole_frames, cut_frames))
        out[library] = {"whole": round(whole, 1), "cut": round(cut, 1),
                        "equal": f"{same} of {len(whole_frames)}"}
        print(library, out[library], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_harness.stamped(out), f, indent=1)


if __name__ == "__main__":
    main()
