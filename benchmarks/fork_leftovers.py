"""What mmproxy leaves for Python's cyclic garbage collector once a loader and its servers are gone.

A forked child (a DataLoader worker, a multiprocessing pool) inherits every object of its parent;
if it collects a garbage cycle that holds a CUDA object (a tensor, event, stream or DALI pipeline),
the object's destructor calls CUDA in a process where CUDA cannot run, and the child aborts. So
nothing CUDA-owning may be left in a cycle. This script runs a GPU (or CPU) loader for two epochs
with each API (the seed-style ``mmproxy.DataLoader`` and ``dataset.loader``), drops everything,
and lists the tensors, CUDA objects, DALI and mmproxy objects that only the collector could
free; it exits 1 if there are any::

    python benchmarks/fork_leftovers.py [--device cpu|gpu]

``--then-fork`` instead keeps the collector off while mmproxy runs (so whatever it leaves is still
there at the fork, as it is in a program between two collections), then iterates a plain
``torch.utils.data.DataLoader`` with 4 fork workers that each run ``gc.collect()``, as an
evaluation loop after training would; it exits 0 when that loader completes.
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import tempfile
from typing import Any

import numpy as np
import torch


class _Collecting(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        gc.collect()  # what any long-running worker does sooner or later
        return torch.full((4,), float(i))


class _Bytes(torch.utils.data.Dataset):
    def __init__(self, proxy: Any) -> None:
        from mmproxy.testing import image_bytes, synth_image

        self.proxy = proxy
        self.items = [image_bytes(synth_image(i, 96, 128)) for i in range(32)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.proxy(np.frombuffer(self.items[i], np.uint8)), i


def _use_mmproxy(device: str, folder: str) -> None:
    """Two epochs of each API on one image server, then everything goes out of scope."""
    from mmproxy.datasets import MultiModalDataset
    from mmproxy.pipelines import image_train_pipeline

    import mmproxy

    server = mmproxy.DALIServer(image_train_pipeline(batch_size=16, size=64, device=device,
                                                     num_threads=2), name="image")
    with server:
        seed_style = mmproxy.DataLoader(server, _Bytes(server.proxy), batch_size=16, num_workers=2)
        ds = MultiModalDataset(f"{folder}/s-{{0..1}}.tar",
                               {"image": ("jpg", server.proxy), "label": ("cls", int)}, batch_size=16)
        for _ in range(2):
            for images, _ in seed_style:
                images.sum().item()
            for batch in ds.loader(server, num_workers=2):
                batch["image"].sum().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "gpu"],
                        default="gpu" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--then-fork", action="store_true")
    args = parser.parse_args()

    from mmproxy.testing import image_bytes, synth_image, write_tar

    folder = tempfile.mkdtemp()
    for s in range(2):
        write_tar(f"{folder}/s-{s}.tar", [{"__key__": f"k{s}{i:03d}", "cls": str(i),
                                           "jpg": image_bytes(synth_image(i, 96, 128))}
                                          for i in range(32)])
    gc.collect()
    if args.then_fork:
        gc.disable()
        _use_mmproxy(args.device, folder)
        gc.enable()
        loader = torch.utils.data.DataLoader(_Collecting(), batch_size=8, num_workers=4,
                                             multiprocessing_context="fork")
        total = sum(int(b.sum()) for _ in range(2) for b in loader)
        print("plain fork DataLoader after mmproxy: ok", total)
        return 0
    gc.set_debug(gc.DEBUG_SAVEALL)
    _use_mmproxy(args.device, folder)
    gc.collect()
    garbage = list(gc.garbage)
    gc.set_debug(0)
    gc.garbage.clear()
    kinds = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in garbage)
    ours = {k: n for k, n in kinds.items()
            if k.startswith(("torch.cuda", "nvidia.dali", "mmproxy")) or k == "torch.Tensor"}
    print(f"{len(garbage)} objects in garbage cycles; tensors, CUDA, DALI or mmproxy objects: "
          f"{sum(ours.values())}")
    for name, n in sorted(ours.items()):
        print(f"  {n:5d} {name}")
    return 1 if ours else 0


if __name__ == "__main__":
    sys.exit(main())
