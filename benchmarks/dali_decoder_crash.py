"""DALI's image decoder crashing the process on some undecodable files, without mmproxy.

A plain DALI pipeline (``fn.decoders.image``, CPU or ``mixed``) is fed batches of good JPEGs with
one damaged file each and asked for its outputs, catching the error it raises, 30 times. With DALI
2.4.0 and a batch of 64 (2 threads, this 2-core CPU) the process dies with a segmentation fault
within a few batches for some kinds of damage, while others only raise; with a batch of 8 it
survives 200 batches. The same happens on the H200 (batch 64 and 256, CPU and GPU decoders, with
and without the hardware decoder, 1 or 8 threads). mmproxy's header checks keep every kind that
crashed here away from the pipelines; this script is how to check a new DALI release::

    python benchmarks/dali_decoder_crash.py [--batch 64] [--runs 30] [--device cpu|gpu]

Each kind runs in its own process; it prints "raises" or "CRASHES (signal N)" per kind.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

KINDS = ("truncated", "no-end-marker", "huffman-table", "garbage-after-header", "not-an-image",
         "truncated-png")


def _one(kind: str, batch: int, runs: int, device: str) -> None:
    import numpy as np
    from nvidia.dali import fn, pipeline_def, types

    from mmproxy.testing import damage_jpeg, image_bytes, synth_image

    jpeg = image_bytes(synth_image(0, 375, 500))
    bad = {"truncated": damage_jpeg(jpeg, "truncate"), "no-end-marker": jpeg[:-2],
           "huffman-table": damage_jpeg(jpeg, "corrupt"),
           "garbage-after-header": damage_jpeg(jpeg, "garbage"),
           "not-an-image": b"hello world " * 100,
           "truncated-png": image_bytes(synth_image(0, 375, 500), "PNG")[:5000]}[kind]

    @pipeline_def
    def pipe():  # type: ignore[no-untyped-def]
        x = fn.external_source(name="x", no_copy=True, dtype=types.UINT8)
        return fn.decoders.image(x, device="mixed" if device == "gpu" else "cpu", output_type=types.RGB)

    p = pipe(batch_size=batch, num_threads=2, device_id=0 if device == "gpu" else None)
    p.build()
    good = [np.frombuffer(image_bytes(synth_image(i, 375, 500)), np.uint8) for i in range(16)]
    rng = np.random.default_rng(0)
    for _ in range(runs):
        items = [good[i % 16] for i in range(batch)]
        items[int(rng.integers(batch))] = np.frombuffer(bad, np.uint8)
        p.feed_input("x", items)
        p._run_once()
        try:
            p.outputs()
        except Exception:  # noqa: BLE001 - the error DALI reports is the expected outcome
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kind:
        _one(args.kind, args.batch, args.runs, args.device)
        return 0
    for kind in KINDS:
        done = subprocess.run([sys.executable, __file__, "--kind", kind, "--batch", str(args.batch),
                               "--runs", str(args.runs), "--device", args.device],
                              capture_output=True, timeout=600)
        outcome = "raises" if done.returncode == 0 else f"CRASHES (signal {-done.returncode})"
        print(f"{kind:22s} {outcome}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
