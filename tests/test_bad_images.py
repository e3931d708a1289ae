"""Bad data is found before training, or skipped and counted (issue #16, class 5): every image of
an imagefolder is checked (its header against the pixel limit, then decoded once) before the first
step; the first bad one is one line and exit 2 naming it, or, with --skip-bad-images, the bad ones
are left out and counted in the summary and the JSON."""
import io
import re
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

import minitorch_fft as mt
from minitorch_fft import cli


def png_bytes(h, w, seed=0):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def bomb_header(h=15000, w=15000):
    """A small PNG whose header (IHDR, its CRC recomputed) says h x w: what Pillow sees before decoding."""
    data = bytearray(png_bytes(12, 12))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", w, h)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


BAD = {
    "bomb": (bomb_header, r"over the pixel limit \(Image size \(225000000 pixels\) exceeds limit"),   # Pillow's
    "large": (lambda: bomb_header(10000, 10000), r"10000x10000 pixels, more than the limit of 89,478,485"),
    "truncated": (lambda: png_bytes(12, 12)[:120], r"not an image Pillow can decode"),
    "not_an_image": (lambda: b"these are my notes, not a picture\n", r"not an image Pillow can decode"),
}


def image_folder(root, bad=()):
    """Two classes of five 12x12 RGB PNGs under root, and one file per name in `bad` in class a."""
    for c, cls in enumerate("ab"):
        (root / cls).mkdir(parents=True)
        for i in range(5):
            (root / cls / f"{i}.png").write_bytes(png_bytes(12, 12, seed=10 * c + i))
    for name in bad:
        (root / "a" / f"{name}.png").write_bytes(BAD[name][0]())
    return root


def train(folder, *flags):
    return cli.main(["--no-progress", "--data", f"imagefolder:{folder}", "--epochs", "1", "--batch-size", "4",
                     "--device", "cpu", *flags])


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_image_is_refused_before_training_naming_the_file(tmp_path, capsys, name):
    """Before: the bomb and the broken files raised from Pillow mid-epoch (exit 1, a traceback)."""
    folder = image_folder(tmp_path / "imgs", [name])
    assert train(folder) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and "epoch" not in err, err
    assert f"{name}.png" in lines[0] and "--skip-bad-images" in lines[0]
    assert re.search(BAD[name][1], lines[0]), lines[0]


def test_skip_bad_images_leaves_them_out_and_counts_them(tmp_path, capsys):
    folder = image_folder(tmp_path / "imgs", list(BAD))
    assert train(folder, "--skip-bad-images") == 0
    out, err = capsys.readouterr()
    result = json.loads(out.splitlines()[-1])
    assert result["skipped_images"] == 4 and result["epochs"] == 1
    assert "4 bad images skipped" in err
    for name in BAD:
        assert f"skipped {folder / 'a' / name}.png" in err


def test_the_datasets_hold_only_the_good_images(tmp_path):
    folder = image_folder(tmp_path / "imgs", list(BAD))
    train_set, test_set = mt.data.imagefolder(str(folder), (3, 8, 8), skip_bad=True)
    assert len(train_set) + len(test_set) == 10
    assert sorted(f.rsplit("/", 1)[-1] for f, _ in train_set.skipped) == ["bomb.png", "large.png",
                                                                          "not_an_image.png", "truncated.png"]
    x, y = train_set.take(np.arange(len(train_set)))      # every image decodes
    assert x.shape == (len(train_set), 3, 8, 8) and np.isfinite(x).all()


def test_a_stated_pixel_limit_is_applied(tmp_path):
    (tmp_path / "big.png").write_bytes(png_bytes(12, 12))
    (tmp_path / "small.png").write_bytes(png_bytes(8, 8))
    bad = mt.data.bad_images([str(tmp_path / "big.png"), str(tmp_path / "small.png")], max_pixels=100)
    assert bad == [(str(tmp_path / "big.png"), "12x12 pixels, more than the limit of 100")]


def test_skip_bad_images_applies_to_imagefolder_only(capsys):
    assert cli.main(["--no-progress", "--data", "fake", "--skip-bad-images"]) == 2
    assert "--skip-bad-images applies to --data imagefolder only" in capsys.readouterr().err
