"""DALI proxy example 1, with `import mmproxy as dali_proxy`: ImageFolder + the proxy DataLoader.

Run: python examples/dali_proxy_example1.py [--data IMAGEFOLDER]
"""

import argparse
import tempfile

import numpy as np
import torchvision
from mmproxy.pipelines import resolve_device
from nvidia.dali import fn, pipeline_def, types

import mmproxy as dali_proxy
from mmproxy.testing import image_folder

GPU, DEVICE_ID = resolve_device()  # the GPU when there is one, else DALI's CPU operators


@pipeline_def
def rn50_train_pipe():
    rng = fn.random.coin_flip(probability=0.5)
    filepaths = fn.external_source(name="images", no_copy=True)
    jpegs = fn.io.file.read(filepaths)
    images = fn.decoders.image_random_crop(
        jpegs,
        device="mixed" if GPU else "cpu",
        output_type=types.RGB,
        random_aspect_ratio=[0.75, 4.0 / 3.0],
        random_area=[0.08, 1.0],
    )
    images = fn.resize(images, size=[224, 224], interp_type=types.INTERP_LINEAR, antialias=False)
    return fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT,
        output_layout="CHW",
        crop=(224, 224),
        mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
        std=[0.229 * 255, 0.224 * 255, 0.225 * 255],
        mirror=rng,
    )


def read_filepath(path):
    return np.frombuffer(path.encode(), dtype=np.int8)


def main(run):
    """Parses --data (default: a tiny synthetic ImageFolder), --batch-size, --workers; runs ``run``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", help="an ImageFolder tree (default: a tiny synthetic one)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(args.data or image_folder(tmp), args.batch_size, args.workers)


def run(jpeg, batch_size, nworkers):
    pipe = rn50_train_pipe(batch_size=batch_size, num_threads=2, device_id=DEVICE_ID,
                           prefetch_queue_depth=2)
    # The scope makes sure the server starts and stops at enter/exit
    with dali_proxy.DALIServer(pipe) as dali_server:
        # DALI proxy instance can be used as a transform callable
        dataset = torchvision.datasets.ImageFolder(jpeg, transform=dali_server.proxy,
                                                   loader=read_filepath)
        # Same interface as torch DataLoader, but takes a dali_server as first argument
        loader = dali_proxy.DataLoader(dali_server, dataset, batch_size=batch_size,
                                       num_workers=nworkers, drop_last=True)
        for data, target in loader:
            assert data.shape == (batch_size, 3, 224, 224), data.shape
        print(f"example 1: last batch {tuple(data.shape)} {data.dtype} on {data.device}, "
              f"targets {target.tolist()}")


if __name__ == "__main__":
    main(run)
