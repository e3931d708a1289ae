"""Datasets and a seeded batch iterator.

A dataset is anything with ``len()`` and ``take(indices) -> (x, y)`` returning
float32 NCHW images and int64 labels as NumPy arrays.
"""
import os

import numpy as np


class ArrayDataset:
    def __init__(self, x, y):
        if len(x) != len(y):
            raise ValueError(f"images and labels differ in count: {len(x)} vs {len(y)}")
        labels = np.asarray(y)
        if labels.size and (labels.dtype.kind not in "iuf" or labels.dtype.kind == "f"
                            and not np.array_equal(labels, np.round(labels))):
            raise TypeError(f"labels must be integer class indices, got dtype {labels.dtype}"
                            f"{' with fractional values' if labels.dtype.kind == 'f' else ''}")
        self.x, self.y = np.ascontiguousarray(x, dtype=np.float32), labels.astype(np.int64)

    def __len__(self):
        return len(self.y)

    def take(self, idx):
        return self.x[idx], self.y[idx]

    @property
    def input_shape(self):
        return tuple(self.x.shape[1:])


class FakeDataset:
    """Random images at a model's input size, generated per index (no memory held)."""

    def __init__(self, n, input_shape, num_classes, seed=0):
        self.n, self.input_shape, self.num_classes, self.seed = n, tuple(input_shape), num_classes, seed

    def __len__(self):
        return self.n

    def take(self, idx):
        rng = np.random.default_rng([self.seed, int(idx[0]) if len(idx) else 0, len(idx)])
        x = rng.standard_normal((len(idx),) + self.input_shape, dtype=np.float32)
        return x, rng.integers(0, self.num_classes, len(idx))


class TorchvisionDataset:
    """A torchvision dataset read lazily from local files (never downloaded)."""

    def __init__(self, ds, input_shape):
        self.ds, self.input_shape = ds, tuple(input_shape)

    def __len__(self):
        return len(self.ds)

    def take(self, idx):
        items = [self.ds[int(i)] for i in idx]
        x = np.stack([np.asarray(img, dtype=np.float32) for img, _ in items])
        return x, np.asarray([t for _, t in items], dtype=np.int64)


def digits(test_fraction=0.2, seed=0):
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes).

    Returns (train, test) ArrayDatasets of (N, 1, 8, 8) images scaled to [0, 1],
    split with stratification by a fixed seed.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    xtr, xte, ytr, yte = train_test_split(x, d.target, test_size=test_fraction,
                                          random_state=seed, stratify=d.target)
    return ArrayDataset(xtr, ytr), ArrayDataset(xte, yte)


def _torchvision():
    try:
        import torchvision
        import torchvision.transforms as T
    except ImportError:
        raise ValueError("this --data source needs torchvision: pip install 'minitorch-fft[data]'") from None
    return torchvision, T


def imagefolder(path, input_shape, test_fraction=0.1, seed=0):
    """An ImageFolder tree (one subfolder per class) resized to the model's input."""
    if not os.path.isdir(path):
        raise ValueError(f"imagefolder path {path!r} is not a directory")
    tv, T = _torchvision()
    c, h, w = input_shape
    tf = T.Compose([T.Resize((h, w)), T.Grayscale(c) if c == 1 else T.Lambda(lambda im: im.convert("RGB")),
                    T.ToTensor()])
    full = tv.datasets.ImageFolder(path, transform=tf)
    if len(full) < 2:
        raise ValueError(f"imagefolder {path!r} holds {len(full)} images; need at least 2")
    perm = np.random.default_rng(seed).permutation(len(full))
    n_test = max(1, int(len(full) * test_fraction))
    import torch.utils.data as tud
    return (TorchvisionDataset(tud.Subset(full, perm[n_test:].tolist()), input_shape),
            TorchvisionDataset(tud.Subset(full, perm[:n_test].tolist()), input_shape))


def cifar10(path, input_shape):
    """CIFAR-10 in torchvision's layout under `path` (cifar-10-batches-py), resized to the model."""
    if not os.path.isdir(path):
        raise ValueError(f"cifar10 path {path!r} is not a directory")
    tv, T = _torchvision()
    c, h, w = input_shape
    if c != 3:
        raise ValueError(f"cifar10 images have 3 channels; this model expects {c}")
    tf = T.Compose([T.Resize((h, w)), T.ToTensor()])
    try:
        train = tv.datasets.CIFAR10(path, train=True, transform=tf, download=False)
        test = tv.datasets.CIFAR10(path, train=False, transform=tf, download=False)
    except RuntimeError as e:
        raise ValueError(f"no CIFAR-10 found under {path!r} ({e})") from None
    return TorchvisionDataset(train, input_shape), TorchvisionDataset(test, input_shape)


def batches(dataset, batch_size, shuffle=True, seed=0, epoch=0, start=0):
    """Yield (x, y) NumPy batches. The order depends only on (seed, epoch), so a run
    resumed at batch `start` sees exactly the batches it would have seen."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    n = len(dataset)
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    for b in range(start, num_batches(n, batch_size)):
        yield dataset.take(order[b * batch_size:(b + 1) * batch_size])


def num_batches(n, batch_size):
    return (n + batch_size - 1) // batch_size
