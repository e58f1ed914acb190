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


def _tagged_jpeg(orientation: int, width: int = 40, height: int = 24) -> bytes:
    image = Image.fromarray(np.full((height, width, 3), 128, np.uint8))
    exif = image.getexif()
    exif[ORIENTATION] = orientation
    out = io.BytesIO()
    image.save(out, "JPEG", exif=exif.tobytes(), quality=90)
    return out.getvalue()


def _big_endian_exif_jpeg(orientation: int) -> bytes:
    """A JPEG whose EXIF block is Motorola-ordered ("MM"), as many cameras write it."""
    tiff = (b"MM\x00\x2a\x00\x00\x00\x08" + b"\x00\x01"  # one entry in the first directory
            + b"\x01\x12\x00\x03\x00\x00\x00\x01" + bytes([0, orientation, 0, 0]) + b"\x00" * 4)
    app1 = b"Exif\x00\x00" + tiff
    plain = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(plain, "JPEG")
    data = plain.getvalue()
    return data[:2] + b"\xff\xe1" + (len(app1) + 2).to_bytes(2, "big") + app1 + data[2:]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_jpeg_orientation_reads_the_exif_tag(orientation):
    from mmproxy.media.checks import jpeg_orientation

    assert jpeg_orientation(_tagged_jpeg(orientation)) == orientation
    assert jpeg_orientation(memoryview(_big_endian_exif_jpeg(orientation))) == orientation


def test_jpeg_orientation_of_a_jpeg_without_exif_or_with_a_damaged_block():
    from mmproxy.media.checks import jpeg_orientation

    plain = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(plain, "JPEG")
    assert jpeg_orientation(plain.getvalue()) == 1
    cut = _big_endian_exif_jpeg(6)
    assert jpeg_orientation(cut[:30]) == 1  # the block ends inside its directory
    assert jpeg_orientation(b"not a jpeg") == 1


@pytest.mark.parametrize("orientation", [1, 6, 8])
def test_sample_seeded_crops_keep_their_ratio_in_a_turned_image(orientation):
    """The window is drawn in the image DALI decodes: a JPEG tagged 5-8 comes out turned, its
    width and height swapped, and the relative window is cut from that."""
    import random

    from mmproxy.pipelines._crop_draw import RandomResizedCrop

    data = _tagged_jpeg(orientation, width=400, height=240)
    shown = (240, 400) if orientation >= 5 else (400, 240)  # (width, height) as decoded
    draw = RandomResizedCrop("images", (0.08, 1.0), (3 / 4, 4 / 3), 0.5)
    given = {"images": np.frombuffer(data, np.uint8)}
    for seed in range(200):
        out = draw(given, random.Random(seed))
        w, h = out["crop_shape"][0] * shown[0], out["crop_shape"][1] * shown[1]
        assert 3 / 4 - 0.02 <= w / h <= 4 / 3 + 0.02, (seed, w, h)
        assert out["crop_anchor"][0] + out["crop_shape"][0] <= 1 + 1e-6
        assert out["crop_anchor"][1] + out["crop_shape"][1] <= 1 + 1e-6
