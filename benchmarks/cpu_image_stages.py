"""Where a CPU image pipeline spends its time: single-thread CPU per image, stage by stage, for the
DALI pipeline every DALI system of `mmproxy bench` runs (resizing with DALI's `fn.resize`, or with
torchvision inside the pipeline, the default of `mmproxy.pipelines` on CPU) and for the torchvision
one of its torch system (the same ops: decode, random-resized crop 224 with antialiasing, flip,
normalize).

    python benchmarks/cpu_image_stages.py --data-dir /tmp/bench [--json out.json]

Uses the bench's image shards (`mmproxy bench --data-dir DIR` writes them); one process, one thread.
"""

from __future__ import annotations

import argparse
import io
import time
from typing import TYPE_CHECKING

import _harness  # this script's folder is on the path

if TYPE_CHECKING:
    from mmproxy.pipelines.image import CpuResize


def dali_stages(paths: list[str], batches: int, cpu_resize: CpuResize) -> dict[str, int]:
    from mmproxy.pipelines import image_train_graph, resize
    from nvidia.dali import fn, pipeline_def, types

    def build(stage: int):  # type: ignore[no-untyped-def]
        @pipeline_def(batch_size=64, num_threads=1, device_id=None, seed=1)
        def pipe():  # type: ignore[no-untyped-def]
            x = fn.readers.webdataset(paths=paths, ext=["jpg"])
            if stage == 3:  # the whole graph, as every DALI system of the bench runs it
                return image_train_graph(x, gpu=False, size=224, cpu_resize=cpu_resize)
            if stage >= 1:  # its first steps
                x = fn.decoders.image_random_crop(x, device="cpu", output_type=types.RGB,
                                                  random_area=[0.08, 1.0],
                                                  random_aspect_ratio=[3 / 4, 4 / 3])
            if stage >= 2:
                x = resize(x, 224, gpu=False, cpu_resize=cpu_resize)
            return x
        return pipe()

    names = ["read", "decode + random crop (ROI)", f"resize 224 (antialias, {cpu_resize})",
             "flip + normalize"]
    total, out = 0.0, {}
    for stage, name in enumerate(names):
        pipe = build(stage)
        pipe.build()
        for _ in range(2):
            pipe.run()
        start = time.process_time()
        for _ in range(batches):
            pipe.run()
        us = (time.process_time() - start) / (batches * 64) * 1e6
        out[name], total = round(us - total), us  # each stage: the increment over the one before
    out["total"] = round(total)
    return out


def torch_stages(paths: list[str], count: int) -> dict[str, int]:
    import torch
    import webdataset as wds
    from mmproxy.pipelines import IMAGENET_MEAN, IMAGENET_STD
    from PIL import Image
    from torchvision.transforms import v2

    torch.set_num_threads(1)
    jpegs = [s["jpg"] for s in wds.tariterators.tarfile_samples({"url": u} for u in paths)][:count]
    steps = [("PIL decode", lambda b: Image.open(io.BytesIO(b)).convert("RGB")),
             ("to tensor", v2.PILToTensor()),
             ("random-resized crop 224 (antialias)", v2.RandomResizedCrop(224, antialias=True)),
             ("flip + normalize", v2.Compose([v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32),
                                              v2.Normalize(list(IMAGENET_MEAN), list(IMAGENET_STD))]))]
    out, xs = {}, jpegs
    for name, step in steps:
        start = time.process_time()
        xs = [step(x) for x in xs]
        out[name] = round((time.process_time() - start) / len(jpegs) * 1e6)
    out["total"] = sum(out.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="/tmp/bench")
    parser.add_argument("--batches", type=int, default=16, help="DALI batches of 64 per stage")
    parser.add_argument("--json")
    a = parser.parse_args()
    from mmproxy.apps.bench.shards import written_shards

    paths = written_shards(a.data_dir, "image")
    if not paths:
        raise SystemExit(f"no image shards under {a.data_dir}: run `mmproxy bench` first")
    systems = {"dali": dali_stages(paths, a.batches, "dali"),
               "dali, torchvision resize": dali_stages(paths, a.batches, "torchvision"),
               "torchvision": torch_stages(paths, a.batches * 64)}
    for system, stages in systems.items():
        for name, us in stages.items():
            print(f"{system:26s} {name:44s} {us:6d} us")
    _harness.write_json(a.json, a, False, {"unit": "CPU microseconds per image, one thread",
                                           **systems})


if __name__ == "__main__":
    main()
