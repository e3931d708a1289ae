"""The data pipeline: seeded order, threaded decoding, augmentation, normalisation, prefetch."""
import threading

import numpy as np
import pytest

import minitorch_fft as mt
from minitorch_fft import data


@pytest.fixture
def folder(tmp_path):
    """Two classes of six 20x20 RGB images, distinct in every pixel."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for cls in ("cats", "dogs"):
        (tmp_path / cls).mkdir()
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    return tmp_path


def all_batches(ds, epoch=0, **kw):
    return [b for b in data.batches(ds, 4, seed=3, epoch=epoch, **kw)]


def test_augmentation_depends_on_seed_and_epoch_not_on_threads(folder):
    one = data.imagefolder(str(folder), (3, 14, 14), seed=1, workers=1)[0]
    many = data.imagefolder(str(folder), (3, 14, 14), seed=1, workers=4)[0]
    a, b = all_batches(one), all_batches(many)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    assert a[0][0].shape == (4, 3, 14, 14) and a[0][0].dtype == np.float32
    idx = np.arange(len(one))
    np.testing.assert_array_equal(one.take(idx, epoch=0)[0], many.take(idx, epoch=0)[0])
    changed = [not np.array_equal(one.take(idx[i:i + 1], epoch=0)[0], one.take(idx[i:i + 1], epoch=1)[0])
               for i in idx]
    assert sum(changed) >= len(idx) // 2          # another epoch, other crops (18 choices each)


def test_training_crops_and_flips_evaluation_centres(folder):
    """The crop of a training image lies inside its 16x16 resize (8/7 of 14) at some offset,
    possibly flipped; the test image is the centre crop of its resize, unflipped. Checked
    against the raw resized pixels, normalised here with ImageNet's statistics."""
    train, test = data.imagefolder(str(folder), (3, 14, 14), seed=1, workers=2)
    mean, std = (np.asarray(v, np.float32).reshape(3, 1, 1) for v in data.IMAGENET_STATS)
    flips = 0
    for i in range(len(train)):
        raw = np.asarray(train.ds[i][0], dtype=np.float32)                       # (3, 16, 16) in [0, 1]
        assert raw.shape == (3, 16, 16)
        got = train.take(np.array([i]), epoch=5)[0][0] * std + mean
        windows = [(raw[:, t:t + 14, l:l + 14], flip) for t in range(3) for l in range(3) for flip in (0, 1)]
        matches = [flip for w, flip in windows if np.allclose(got, w[:, :, ::-1] if flip else w, atol=1e-5)]
        assert matches, f"image {i}: not a 14x14 window of its resize"
        flips += matches[0]
    assert 0 < flips < len(train)                                                 # some flipped, not all
    raw = np.asarray(test.ds[0][0], dtype=np.float32)
    assert raw.shape == (3, 16, 16)                                              # the same scale
    np.testing.assert_allclose(test.take(np.array([0]), epoch=5)[0][0], (raw[:, 1:15, 1:15] - mean) / std,
                               atol=1e-5)


def test_prefetch_gives_the_same_batches_and_raises_in_the_caller():
    ds = mt.data.ArrayDataset(np.arange(40, dtype=np.float32).reshape(10, 1, 2, 2), np.arange(10) % 3)
    plain = list(data.batches(ds, 3, seed=2, prefetch=0))
    ahead = list(data.batches(ds, 3, seed=2, prefetch=2))
    for (xa, ya), (xb, yb) in zip(plain, ahead, strict=True):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)

    class Broken(mt.data.ArrayDataset):
        def take(self, idx, epoch=0):
            if 7 in idx:
                raise OSError("truncated image file")
            return super().take(idx, epoch)

    broken = Broken(ds.x, ds.y)
    with pytest.raises(OSError, match="truncated image file"):
        list(data.batches(broken, 1, shuffle=False))


def test_stopping_early_ends_the_prefetch_thread():
    ds = mt.data.ArrayDataset(np.zeros((50, 1, 2, 2), np.float32), np.zeros(50, np.int64))
    before = threading.active_count()
    it = data.batches(ds, 1, prefetch=2)
    next(it)
    it.close()                                  # what a `break` out of the training loop does
    for t in threading.enumerate():
        if t.name == "minitorch-prefetch":
            t.join(timeout=5)
    assert threading.active_count() <= before


def test_the_bundled_digits_are_scikit_learns_split_the_same_way():
    """digits.npz holds load_digits() exactly, and stratified_split gives train_test_split's
    indices (stratified, random_state=seed), so runs match those made when the digits came from
    scikit-learn; the runtime itself needs no scikit-learn (tests/test_packaging.py)."""
    sk_datasets = pytest.importorskip("sklearn.datasets")
    from sklearn.model_selection import train_test_split
    d = sk_datasets.load_digits()
    train, test = data.digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=0.2, random_state=0, stratify=d.target)
    for got, want in ((train.x, xtr), (test.x, xte), (train.y, ytr), (test.y, yte)):
        np.testing.assert_array_equal(got, want)
    index = np.arange(len(d.target))
    for seed in (0, 1, 7, 12345):
        for fraction in (0.2, 0.1, 0.33):
            want = train_test_split(index, test_size=fraction, random_state=seed, stratify=d.target)
            for got, w in zip(data.stratified_split(d.target, fraction, seed), want, strict=True):
                np.testing.assert_array_equal(got, w)
