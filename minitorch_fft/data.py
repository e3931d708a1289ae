"""Datasets and a seeded batch iterator.

A dataset is anything with ``len()`` and ``take(indices, epoch=0) -> (x, y)`` returning
float32 NCHW images and int64 labels as NumPy arrays (`epoch` seeds any augmentation).

Image folders and CIFAR-10 are decoded by a pool of threads (Pillow releases the GIL while it
decodes and resizes), and batches() prepares the next batch while the caller trains on this
one. Their images are normalised per channel (ImageNet's or CIFAR-10's mean and deviation).
Images are resized to 8/7 of the model's input (256 for 224). Training images are cropped back
at random and half are flipped, from a generator seeded by (seed, epoch, image index): the same
run sees the same crops, whatever the number of threads, and a resumed run too. Evaluation
images are cropped at the centre.
"""
import hashlib
import math
import os
import queue
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import numpy as np

from .backends.common import check_fits

from .utils import is_int, positive_int


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

    def take(self, idx, epoch=0):
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

    def take(self, idx, epoch=0):
        rng = np.random.default_rng([self.seed, int(idx[0]) if len(idx) else 0, len(idx)])
        x = rng.standard_normal((len(idx),) + self.input_shape, dtype=np.float32)
        return x, rng.integers(0, self.num_classes, len(idx))


# Per-channel mean and standard deviation of the pixels in [0, 1].
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
# Training images are resized to 8/7 of the input (256 for 224) and cropped back at random.
CROP_MARGIN = 8 / 7


class TorchvisionDataset:
    """A torchvision dataset read lazily from local files (never downloaded).

    Its transform must give float tensors in [0, 1] of shape (c, H, W) with H, W >= the
    input size; take() crops them (at random where `augment`, else centred), flips half the
    training images, and normalises by `stats` ((mean, std) per channel)."""

    def __init__(self, ds, input_shape, stats=None, augment=False, seed=0, workers=None):
        self.ds, self.input_shape, self.augment, self.seed = ds, tuple(input_shape), augment, seed
        c = self.input_shape[0]
        if stats is None:
            self.mean = self.std = None
        else:
            mean, std = (np.asarray(v, np.float32) for v in stats)
            if c == 1:                      # grayscale: the channels' average
                mean, std = mean.mean(keepdims=True), std.mean(keepdims=True)
            self.mean, self.std = mean.reshape(c, 1, 1), std.reshape(c, 1, 1)
        self.workers = workers or min(8, os.cpu_count() or 1)
        self._pool = None

    def __len__(self):
        return len(self.ds)

    def take(self, idx, epoch=0):
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="minitorch-data")
        items = list(self._pool.map(lambda i: self._item(int(i), epoch), idx))   # order kept
        return np.stack([x for x, _ in items]), np.asarray([t for _, t in items], dtype=np.int64)

    def _item(self, i, epoch):
        img, target = self.ds[i]
        x = np.asarray(img, dtype=np.float32)
        _, h, w = self.input_shape
        H, W = x.shape[1:]
        if self.augment:
            rng = np.random.default_rng([self.seed, epoch, i])
            top, left = rng.integers(0, H - h + 1), rng.integers(0, W - w + 1)
            x = x[:, top:top + h, left:left + w]
            if rng.random() < 0.5:
                x = x[:, :, ::-1]
        else:
            top, left = (H - h) // 2, (W - w) // 2
            x = x[:, top:top + h, left:left + w]
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return np.ascontiguousarray(x, dtype=np.float32), target


def digits(test_fraction=0.2, seed=0):
    """The 8x8 handwritten digits (1,797 images, 10 classes), bundled as digits.npz.

    Returns (train, test) ArrayDatasets of (N, 1, 8, 8) images scaled to [0, 1], split with
    stratification by `seed` exactly as scikit-learn's train_test_split(..., stratify=target,
    random_state=seed) splits them (stratified_split), without needing scikit-learn.

    The file holds scikit-learn's copy of the UCI test set (E. Alpaydin, C. Kaynak, 1998; CC BY
    4.0) as uint8 pixels 0..16; it was written once by
      python -c "import numpy as np, sklearn.datasets as sd; d = sd.load_digits(); np.savez_compressed(
      'minitorch_fft/digits.npz', images=d.images.astype(np.uint8), target=d.target.astype(np.uint8))"
    and tests/test_data.py checks it against load_digits() where scikit-learn is installed.
    """
    with resources.files(__package__).joinpath("digits.npz").open("rb") as f:
        bundled = np.load(f)
        images, target = bundled["images"], bundled["target"].astype(np.int64)
    x = (images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    train, test = stratified_split(target, test_fraction, seed)
    return ArrayDataset(x[train], target[train]), ArrayDataset(x[test], target[test])


def stratified_split(y, test_fraction, seed):
    """(train, test) indices of a stratified shuffle split of labels `y`: the same indices as
    scikit-learn's StratifiedShuffleSplit (so train_test_split with `stratify`) at random_state=seed,
    drawn from the same legacy RandomState stream in the same order."""
    rng = np.random.RandomState(seed)
    n_test = int(np.ceil(test_fraction * len(y)))
    _, y_indices, counts = np.unique(y, return_inverse=True, return_counts=True)
    by_class = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(counts)[:-1])
    n_train_i = _approximate_mode(counts, len(y) - n_test, rng)
    n_test_i = _approximate_mode(counts - n_train_i, n_test, rng)
    train, test = [], []
    for members, n_tr, n_te in zip(by_class, n_train_i, n_test_i):
        shuffled = members[rng.permutation(len(members))]
        train.extend(shuffled[:n_tr])
        test.extend(shuffled[n_tr:n_tr + n_te])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(counts, n_draws, rng):
    """How many of n_draws to take from each class: the floor of its share, then one more for the
    largest remainders, ties broken at random (scikit-learn's utils.extmath._approximate_mode)."""
    share = counts / counts.sum() * n_draws
    taken = np.floor(share)
    need = int(n_draws - taken.sum())
    remainder = share - taken
    for value in np.sort(np.unique(remainder))[::-1]:
        if need <= 0:
            break
        (tied,) = np.where(remainder == value)
        chosen = rng.choice(tied, size=min(len(tied), need), replace=False)
        taken[chosen] += 1
        need -= len(chosen)
    return taken.astype(int)


def _torchvision():
    try:
        import torchvision
        import torchvision.transforms as T
    except ImportError:
        raise ValueError("this --data source needs torchvision: pip install 'minitorch-fft[data]'") from None
    return torchvision, T


def _resize(T, input_shape):
    """Resize to CROP_MARGIN times the input; take() crops back (at random for training, the
    centre for evaluation, so both see objects at one scale)."""
    c, h, w = input_shape
    size = (round(h * CROP_MARGIN), round(w * CROP_MARGIN))
    return T.Compose([T.Resize(size), T.Grayscale(c) if c == 1 else T.Lambda(lambda im: im.convert("RGB")),
                      T.ToTensor()])


def imagefolder(path, input_shape, test_fraction=0.1, seed=0, workers=None, skip_bad=False, max_pixels=None):
    """An ImageFolder tree (one subfolder per class): (train, test) at the model's input size,
    normalised by ImageNet's statistics, the training part augmented (module docstring).

    Every image is checked first (bad_images): the first bad one is a ValueError naming it, or,
    with skip_bad, the bad ones are left out and listed in both datasets' `skipped`."""
    if not os.path.isdir(path):
        raise ValueError(f"imagefolder path {path!r} is not a directory")
    tv, T = _torchvision()
    full = tv.datasets.ImageFolder(path, transform=_resize(T, input_shape))
    bad = bad_images([file for file, _ in full.samples], max_pixels, workers)
    if bad and not skip_bad:
        file, reason = bad[0]
        raise ValueError(f"imagefolder {path!r}: {file}: {reason} ({len(bad)} bad image"
                         f"{'' if len(bad) == 1 else 's'} in all; --skip-bad-images leaves them out)")
    if bad:
        left_out = {file for file, _ in bad}
        full.samples = full.imgs = [s for s in full.samples if s[0] not in left_out]
        full.targets = [t for _, t in full.samples]
    if len(full) < 2:
        raise ValueError(f"imagefolder {path!r} holds {len(full)} image{'s' if len(full) != 1 else ''}; need at least 2")
    perm = np.random.default_rng(seed).permutation(len(full))
    n_test = max(1, int(len(full) * test_fraction))
    import torch.utils.data as tud
    common = dict(input_shape=input_shape, stats=IMAGENET_STATS, seed=seed, workers=workers)
    train, test = (TorchvisionDataset(tud.Subset(full, perm[n_test:].tolist()), augment=True, **common),
                   TorchvisionDataset(tud.Subset(full, perm[:n_test].tolist()), augment=False, **common))
    train.skipped = test.skipped = bad
    train.fingerprint = test.fingerprint = fingerprint(path, full.samples)
    return train, test


def fingerprint(root, samples):
    """{"images": how many, "sha256": of their paths under `root` and classes, in order}: what a
    checkpoint keeps of an image folder, so that a run resumed on a folder whose files were added,
    removed or renamed since is refused (its split and batches would no longer be the run's). The
    files' contents are not read: an image rewritten in place under its name is not seen."""
    h = hashlib.sha256()
    for file, target in samples:
        h.update(f"{os.path.relpath(file, root)}\0{target}\n".encode("utf-8", "surrogateescape"))
    return {"images": len(samples), "sha256": h.hexdigest()}


def bad_images(files, max_pixels=None, workers=None):
    """[(file, reason)] for the files that are not images Pillow decodes whole within max_pixels
    (default: Pillow's MAX_IMAGE_PIXELS; Pillow itself refuses twice that), in the order given. Each header is read first, so a
    decompression bomb (a 27 KB PNG of 15000 x 15000 pixels) is refused before it is decoded; the
    rest are decoded once, so a truncated or corrupt file is found here, not mid-epoch."""
    from PIL import Image
    limit = max_pixels or Image.MAX_IMAGE_PIXELS

    def check(file):
        if not os.path.isfile(file):   # a FIFO would block Image.open for ever; a socket or device is no image either
            return "not a regular file (a FIFO, socket or device)"
        try:
            with Image.open(file) as im:
                w, h = im.size
                if w * h > limit:
                    return f"{w}x{h} pixels, more than the limit of {limit:,}"
                im.load()
        except Image.DecompressionBombError as e:   # twice MAX_IMAGE_PIXELS: Pillow refuses to open it
            return f"over the pixel limit ({e})"
        except (OSError, ValueError, SyntaxError, EOFError) as e:   # what Pillow raises on bad data
            return f"not an image Pillow can decode ({type(e).__name__}: {e})"
        return None

    # Pillow warns above MAX_IMAGE_PIXELS (and refuses above twice that): the limit is ours. The
    # filter is set here, once: catch_warnings() changes process-wide state, unsafe in the threads.
    with warnings.catch_warnings(), ThreadPoolExecutor(workers or min(8, os.cpu_count() or 1)) as pool:
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        reasons = list(pool.map(check, files))
    return [(file, reason) for file, reason in zip(files, reasons) if reason is not None]


def cifar10(path, input_shape, seed=0, workers=None):
    """CIFAR-10 in torchvision's layout under `path` (cifar-10-batches-py), resized to the model,
    normalised by CIFAR-10's statistics, the training set augmented (module docstring)."""
    if not os.path.isdir(path):
        raise ValueError(f"cifar10 path {path!r} is not a directory")
    tv, T = _torchvision()
    c, h, w = input_shape
    if c != 3:
        raise ValueError(f"cifar10 images have 3 channels; this model expects {c}")
    try:
        train = tv.datasets.CIFAR10(path, train=True, transform=_resize(T, input_shape), download=False)
        test = tv.datasets.CIFAR10(path, train=False, transform=_resize(T, input_shape), download=False)
    except RuntimeError:
        # torchvision's message suggests download=True, which train.py never does: name the files instead
        raise ValueError(f"no CIFAR-10 found under {path!r}: it needs torchvision's cifar-10-batches-py folder "
                         "there (data_batch_1..5 and test_batch from the CIFAR-10 python archive), each file "
                         "passing torchvision's checksum") from None
    common = dict(input_shape=input_shape, stats=CIFAR10_STATS, seed=seed, workers=workers)
    return TorchvisionDataset(train, augment=True, **common), TorchvisionDataset(test, augment=False, **common)


def batches(dataset, batch_size, shuffle=True, seed=0, epoch=0, start=0, prefetch=1, rank=0, world_size=1):
    """Yield (x, y) NumPy batches. The order depends only on (seed, epoch), so a run
    resumed at batch `start` sees exactly the batches it would have seen.

    rank, world_size: data-parallel sharding (minitorch_fft.distributed). Step b's global batch
    is order[b*B*W : (b+1)*B*W] (B = batch_size per rank, W = world_size); this rank takes its
    rank-th slice of B images: the ranks' parts are disjoint and together cover the epoch's
    order. With several ranks only full global batches are used (num_batches), as PyTorch's
    DistributedSampler(drop_last=True) does; with one, the last batch may be partial.

    prefetch: how many batches a background thread prepares ahead (0: none, each batch is
    made when asked for). A batch that fails to load raises here, in the caller's thread."""
    batch_size = positive_int(batch_size, "batch_size")   # NumPy integers too; not bools
    if not (is_int(rank) and is_int(world_size) and 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in 0 .. world_size-1, got rank {rank!r} of world_size {world_size!r}")
    n = len(dataset)
    check_fits(n * 8, np, f"the order of {n:,} images (8 bytes each)")
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    made = (dataset.take(order[(b * world_size + rank) * batch_size:(b * world_size + rank + 1) * batch_size],
                         epoch=epoch)
            for b in range(start, num_batches(n, batch_size, world_size)))
    yield from (_ahead(made, prefetch) if prefetch > 0 else made)


_END = object()


def _ahead(items, depth):
    """items, produced by a daemon thread up to `depth` ahead; its exception is re-raised here."""
    q = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce():
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put((item, None))
            q.put((_END, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((_END, e))

    threading.Thread(target=produce, daemon=True, name="minitorch-prefetch").start()
    try:
        while True:
            item, error = q.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        stop.set()                       # the consumer stopped early: let the producer end
        while not q.empty():
            q.get_nowait()


def check_memory(dataset, batch_size, input_shape, xp=np):
    """ValueError, before any training, where an epoch's order (8 bytes an image) or one batch of
    float32 images cannot fit in the host's memory, or the batch in the GPU's (xp = cupy)."""
    n = len(dataset)
    check_fits(n * 8, np, f"the order of an epoch of {n:,} images (8 bytes each)")
    images = min(positive_int(batch_size, "batch_size"), n)
    what = f"a batch of {images:,} images of {tuple(input_shape)} float32"
    check_fits(images * math.prod(input_shape) * 4, np, what)
    if xp is not np:
        check_fits(images * math.prod(input_shape) * 4, xp, what + " on the GPU")


def num_batches(n, batch_size, world_size=1):
    """Batches of `batch_size` (the last one possibly partial) that hold n images; with
    world_size > 1 ranks, the full global batches of batch_size * world_size (batches())."""
    batch_size = positive_int(batch_size, "batch_size")
    world_size = positive_int(world_size, "world_size")
    if not is_int(n) or n < 0:
        raise ValueError(f"the number of images must be an int >= 0, got {n!r}")
    if world_size > 1:
        return int(n) // (batch_size * world_size)
    return (int(n) + batch_size - 1) // batch_size
