"""A fact the image docs state: DALI's decoders turn a JPEG as its EXIF Orientation tag says,
where PIL's ``Image.open`` and torchvision's ``decode_image`` (by default) keep the stored
pixels; ``ImageOps.exif_transpose`` (or ``apply_exif_orientation=True``) gives DALI's image."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from mmproxy.pipelines import image_eval_pipeline
from nvidia.dali import fn, pipeline_def, types
from PIL import Image, ImageOps
from torch.utils.data import default_collate
from torchvision.io import decode_image

import mmproxy

pytestmark = pytest.mark.timeout(60)

ORIENTATION = 0x0112  # the EXIF tag; 6: shown turned 90 degrees clockwise


def _turned_jpeg() -> bytes:
    """24 rows x 40 columns stored, the left half white, tagged Orientation=6: shown 40 rows x 24
    columns with the top half white."""
    stored = np.zeros((24, 40, 3), np.uint8)
    stored[:, :20] = 255
    image = Image.fromarray(stored)
    exif = image.getexif()
    exif[ORIENTATION] = 6
    out = io.BytesIO()
    image.save(out, "JPEG", exif=exif.tobytes(), quality=95)
    return out.getvalue()


@pipeline_def(batch_size=1, num_threads=1)
def _decode(device):
    return fn.decoders.image(fn.external_source(name="jpeg", dtype=types.UINT8), device=device,
                             output_type=types.RGB)


@pytest.mark.parametrize("device", ["cpu", pytest.param("mixed", marks=pytest.mark.gpu)])
def test_dali_turns_a_jpeg_as_its_exif_orientation_says_and_pil_does_not(device):
    data = _turned_jpeg()
    pipe = _decode(device, device_id=None if device == "cpu" else 0)
    pipe.build()
    pipe.feed_input("jpeg", [np.frombuffer(data, np.uint8)])
    (out,) = pipe.run()
    dali = np.array(out.as_cpu()[0] if device == "mixed" else out[0])
    assert dali.shape == (40, 24, 3)
    assert dali[:16].min() > 200 and dali[24:].max() < 55  # the top half white

    pil = Image.open(io.BytesIO(data))
    assert pil.getexif()[ORIENTATION] == 6 and np.asarray(pil).shape == (24, 40, 3)
    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert tuple(decode_image(encoded).shape) == (3, 24, 40)

    turned = np.asarray(ImageOps.exif_transpose(pil))
    assert turned.shape == dali.shape and np.abs(turned.astype(int) - dali).max() <= 2
    turned = decode_image(encoded, apply_exif_orientation=True).permute(1, 2, 0).numpy()
    assert turned.shape == dali.shape and np.abs(turned.astype(int) - dali).max() <= 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_the_image_pipelines_crop_the_turned_image(device):
    """mmproxy's evaluation pipeline resizes and crops the image as shown: its centre crop of
    the tall image is white above and black below (of the stored one it would be white on the
    left)."""
    pipe = image_eval_pipeline(batch_size=2, size=16, dtype="uint8", layout="HWC", device=device,
                               num_threads=1)
    with mmproxy.DALIServer(pipe, name="image") as server:
        ref = server.proxy(np.frombuffer(_turned_jpeg(), np.uint8))
        (crop,) = server.produce_data(default_collate([ref])).cpu().numpy()
    assert crop.shape == (16, 16, 3)
    assert crop[:5].min() > 200 and crop[-5:].max() < 55
