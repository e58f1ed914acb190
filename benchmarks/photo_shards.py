"""Shards of real photographs for `mmproxy bench --data`: natural images, not the bench's synthetic
ones, written as a photo corpus would be (varied sizes and JPEG settings).

The photographs are the colour photos that ship with scikit-image (astronaut, coffee, chelsea,
rocket, the Hubble deep field, a microscope slide) and matplotlib's Grace Hopper portrait: few, so
each output image is a random crop of one of them (10-100% of its area, aspect 3:4 to 4:3),
resized so its longer side is 400-640 px, and JPEG-encoded at quality 75-95 with 4:2:0 or 4:4:4
chroma: 8,192 distinct JPEGs of natural content, ~45-110 KB each. A caption per image (``.txt``).

    python benchmarks/photo_shards.py /tmp/photos --count 8192
    mmproxy bench --data '/tmp/photos/photo-{0000..0127}.tar' --systems mmproxy,dali-reader ...

Needs scikit-image (and matplotlib for the portrait, optional) and Pillow.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import random
from pathlib import Path

import numpy as np
from PIL import Image

PER_SHARD = 64


def photos() -> dict[str, np.ndarray]:
    """The colour photographs at hand, RGB uint8."""
    from skimage import data

    found = {name: getattr(data, name)() for name in
             ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field",
              "immunohistochemistry")}
    try:
        import matplotlib.cbook

        with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
            found["grace_hopper"] = np.asarray(Image.open(f).convert("RGB"))
    except (ImportError, OSError, ValueError):
        pass
    return {name: image[..., :3] for name, image in found.items() if image.ndim == 3}


def _jpeg(image: Image.Image, rng: random.Random) -> bytes:
    w, h = image.size
    area = rng.uniform(0.1, 1.0) * w * h
    aspect = rng.uniform(3 / 4, 4 / 3)
    cw, ch = min(w, int((area * aspect) ** 0.5)), min(h, int((area / aspect) ** 0.5))
    x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
    longer = rng.randint(400, 640)
    scale = longer / max(cw, ch)
    crop = image.crop((x, y, x + cw, y + ch)).resize(
        (max(1, round(cw * scale)), max(1, round(ch * scale))), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    crop.save(buf, "JPEG", quality=rng.randint(75, 95), subsampling=rng.choice([0, 2]))
    return buf.getvalue()


_images: dict[str, Image.Image] = {}  # each pool process's photographs, loaded once


def _load() -> None:
    _images.update((name, Image.fromarray(array)) for name, array in photos().items())


def _shard(job: tuple[str, int, int, int]) -> str:
    import webdataset as wds

    folder, index, count, seed = job
    names = sorted(_images)
    rng = random.Random(seed * 100_003 + index)
    path = f"{folder}/photo-{index:04d}.tar"
    with wds.TarWriter(path) as sink:
        for i in range(count):
            name = rng.choice(names)
            sink.write({"__key__": f"{index:04d}-{i:03d}", "jpg": _jpeg(_images[name], rng),
                        "txt": f"a photograph: {name.replace('_', ' ')}, crop {i}"})
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--count", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    Path(args.folder).mkdir(parents=True, exist_ok=True)
    shards = -(-args.count // PER_SHARD)
    jobs = [(args.folder, i, min(PER_SHARD, args.count - i * PER_SHARD), args.seed)
            for i in range(shards)]
    with multiprocessing.Pool(initializer=_load) as pool:
        paths = pool.map(_shard, jobs)
    size = sum(Path(p).stat().st_size for p in paths)
    print(f"{args.count} JPEGs of {len(photos())} photographs in {len(paths)} shards under "
          f"{args.folder} ({size / args.count / 1e3:.0f} KB an image): "
          f"{args.folder}/photo-{{0000..{len(paths) - 1:04d}}}.tar")


if __name__ == "__main__":
    main()
