"""PyAV's decode of a clip on one thread, with and without the pictures nothing refers to left out
(``decode_clip``'s default, against every packet decoded), on your video files; each clip's
frames checked against a full decode first. Interleaved rounds, the best of each.

    python benchmarks/video_decode_cost.py FILE.mp4 [FILE ...] --clips 30 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from unittest import mock

import numpy as np
from mmproxy.pipelines.video import _pyav


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--clips", type=int, default=30, help="clips a file (random starts)")
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--stride", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import av

    for name in args.files:
        data = Path(name).read_bytes()
        with av.open(name) as container:
            full = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        with av.open(name) as container:
            stream = container.streams.video[0]
            referenced = _pyav._reference_test(stream)
            packets = [p for p in container.demux(stream) if p.size]
            left_out = 0 if referenced is None else sum(
                not referenced(memoryview(p)) for p in packets)
        span = (args.frames - 1) * args.stride + 1
        rng = random.Random(0)
        starts = [rng.randint(0, max(0, len(full) - span)) for _ in range(args.clips)]
        for start in starts:
            wanted = [min(start + i * args.stride, len(full) - 1) for i in range(args.frames)]
            clip = _pyav.decode_clip(data, start, args.frames, args.stride, threads=False)
            assert np.array_equal(clip, full[wanted]), f"{name}: start {start} differs"
        best = {"every packet": float("inf"), "left out": float("inf")}
        for _ in range(args.rounds):
            for way in best:
                with mock.patch.object(_pyav, "_reference_test",
                                       (lambda s: None) if way == "every packet"
                                       else _pyav._reference_test):
                    began = time.perf_counter()
                    for start in starts:
                        _pyav.decode_clip(data, start, args.frames, args.stride, threads=False)
                    best[way] = min(best[way], (time.perf_counter() - began) / len(starts))
        print(f"{Path(name).name}: {stream.codec_context.name} {stream.width}x{stream.height}, "
              f"{len(packets)} pictures, {left_out} that nothing refers to; ms a clip: every "
              f"packet {1000 * best['every packet']:.1f}, left out {1000 * best['left out']:.1f} "
              f"({best['every packet'] / best['left out']:.2f}x); frames checked", flush=True)


if __name__ == "__main__":
    main()
