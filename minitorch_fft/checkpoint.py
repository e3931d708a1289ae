"""Checkpoints: model + optimiser + progress in one file, written atomically, loaded all or nothing.

The file is an uncompressed .npz (no pickle): `model/<name>` for each parameter and buffer
(BatchNorm's running statistics), `optim/<i>` for each momentum buffer, `__meta__` a JSON header
(format version, epoch, optimiser settings, `extra`), and `__sha256__` a SHA-256 over the header's
bytes and every array's name, dtype, shape and bytes. It is written to a temporary file in the same
folder, flushed to disk and renamed over the target, so a crash mid-write never leaves a
half-written checkpoint where the last good one was.

load() parses and checks everything first (the zip, each array's size against its header, the
version, the checksum, every header field's type and range, every array against the model and
the optimiser), then assigns the model and the optimiser together: both are updated, or, with a
CheckpointError naming the problem, neither is touched. check_run_state() does the same for the
run state that train.py keeps in `extra`.
"""
import contextlib
import hashlib
import json
import math
import os
import zipfile

try:
    import fcntl
except ImportError:  # not POSIX: held() cannot keep a second run off a checkpoint path
    fcntl = None

import numpy as np

from . import random as _random
from .device import to_device
from .tensor import cast_float32, overflow_value
from .utils import atomic_file, is_int, is_number, open_lock_file

# 2: the checksum covers the header too, and sits in its own member (1 hashed the arrays only).
FORMAT_VERSION = 2
HEADER, CHECKSUM = "__meta__", "__sha256__"
HEADER_KEYS = ("format_version", "epoch", "optimizer", "extra")
OPTIMIZER_KEYS = ("lr", "base_lr", "momentum", "weight_decay", "velocity")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated, corrupted, malformed or mismatched."""


def state_array(value, shape, what):
    """`value` as a new C-contiguous float32 NumPy array of `shape`, cast as PyTorch's copy_ into
    a float32 parameter casts it: float16/32/64 only (a float64 rounded to nearest), NaN and inf
    kept. CheckpointError, naming `what`, for another shape, a non-float dtype (complex, integer,
    bool, text) or a finite value beyond float32's range (it would become inf)."""
    try:
        a = np.asarray(to_device(value, "cpu"))
    except Exception as e:  # noqa: BLE001 - whatever it is, it is not an array
        raise CheckpointError(f"{what} is not an array ({type(e).__name__}: {e})") from None
    if a.dtype.kind != "f":
        why = ": the imaginary parts would be lost" if a.dtype.kind == "c" else ""
        raise CheckpointError(f"{what} has dtype {a.dtype}; parameters take real floating-point "
                              f"values (float16, float32 or float64){why}")
    if tuple(a.shape) != tuple(shape):
        raise CheckpointError(f"{what} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    out = cast_float32(a)
    v = overflow_value(a, out)
    if v is not None:
        raise CheckpointError(f"{what} holds {v!r}, beyond float32's range (largest "
                              f"{float(np.finfo(np.float32).max)!r}): it would become inf")
    return np.array(out, order="C", copy=True)


def buffer_array(value, shape, dtype, what):
    """`value` for a module's buffer of `shape` and `dtype`, as a new C-contiguous NumPy array: a
    float buffer as state_array() takes a parameter; an integer buffer (num_batches_tracked)
    takes integer values only, each within `dtype`'s range. CheckpointError, naming `what`."""
    if np.dtype(dtype).kind == "f":
        return state_array(value, shape, what)
    try:
        a = np.asarray(to_device(value, "cpu"))
    except Exception as e:  # noqa: BLE001 - whatever it is, it is not an array
        raise CheckpointError(f"{what} is not an array ({type(e).__name__}: {e})") from None
    if a.dtype.kind not in "iu":
        raise CheckpointError(f"{what} has dtype {a.dtype}; this buffer holds integers ({dtype})")
    if tuple(a.shape) != tuple(shape):
        raise CheckpointError(f"{what} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    info = np.iinfo(dtype)
    if a.size and (int(a.min()) < info.min or int(a.max()) > info.max):
        raise CheckpointError(f"{what} holds values outside {dtype}'s range [{info.min}, {info.max}]")
    return np.array(a, dtype=dtype, order="C", copy=True)


def _hash_array(h, name, a):
    h.update(name.encode() + b"\0" + str(a.dtype).encode() + str(a.shape).encode() + b"\0")
    h.update(np.ascontiguousarray(a).tobytes())


def _digest(header_bytes, array_hash):
    """The checksum: the header's bytes, then the hash of the arrays in name order."""
    h = hashlib.sha256(b"minitorch-fft checkpoint %d\0" % FORMAT_VERSION)
    h.update(len(header_bytes).to_bytes(8, "little") + header_bytes)
    h.update(array_hash.digest())
    return h.digest()


def save(path, model, optimizer=None, epoch=0, extra=None):
    """Write the checkpoint atomically. `extra` is any JSON-serialisable dict. It replaces a
    checkpoint (a zip archive with the header entry, its checksum not read) and nothing else:
    ValueError, before any work, for a file that is not one, a directory, a FIFO or a symbolic
    link (which the save would replace with a file)."""
    _check_replaceable(path)
    arrays = {f"model/{k}": v for k, v in model.state_dict().items()}
    opt_meta = None
    if optimizer is not None:
        st = optimizer.state_dict()
        vel = st.pop("velocity")
        opt_meta = dict(st, velocity=[v is not None for v in vel])
        arrays.update({f"optim/{i}": v for i, v in enumerate(vel) if v is not None})
    meta = {"format_version": FORMAT_VERSION, "epoch": int(epoch) if is_int(epoch) else epoch, "optimizer": opt_meta, "extra": extra or {}}
    header_bytes = json.dumps(meta).encode()
    _check_header(f"the checkpoint for {path!r}", json.loads(header_bytes), set(arrays))  # never write
    array_hash = hashlib.sha256()                                                   # what load refuses
    for k in sorted(arrays):
        _hash_array(array_hash, k, arrays[k])
    arrays[HEADER] = np.frombuffer(header_bytes, dtype=np.uint8)
    arrays[CHECKSUM] = np.frombuffer(_digest(header_bytes, array_hash), dtype=np.uint8)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_file(path, "wb", prefix=_partial_prefix(path)) as f:
        np.savez(f, **arrays)
    return path


def _partial_prefix(path):
    """How the temporary file of a save of `path` is named, beside it: `.<name>.<hash>.partial-XXXXXXXX.tmp`,
    the name cut to 100 bytes (a file name takes 255) and the hash (12 hex digits of the whole name's
    sha256) telling apart two checkpoints whose names start alike (`a` and `a.partial-x` too). A save
    that fails or is interrupted removes it; a process killed outright (SIGKILL, a power cut) leaves
    it: remove_partial_saves()."""
    name = os.fsencode(os.path.basename(path))   # bytes: the limit is the file system's, in bytes
    return f".{os.fsdecode(name[:100])}.{hashlib.sha256(name).hexdigest()[:12]}.partial-"


def remove_partial_saves(path):
    """Remove the temporary files that saves of checkpoint `path` left when their process was killed
    mid-save (a 200 MB model leaves 200 MB): regular files beside it named by _partial_prefix, and
    nothing else. Call it only while holding the path (held()), when no save of it can be running.
    Returns [(file, bytes)] removed."""
    folder, prefix = os.path.dirname(os.path.abspath(path)), _partial_prefix(path)
    try:
        names = sorted(os.listdir(folder))
    except OSError:   # no folder yet: nothing was saved there
        return []
    removed = []
    for name in names:
        file = os.path.join(folder, name)
        if name.startswith(prefix) and name.endswith(".tmp") and os.path.isfile(file) and not os.path.islink(file):
            size = os.path.getsize(file)
            with contextlib.suppress(FileNotFoundError):
                os.remove(file)
                removed.append((file, size))
    return removed


def check_file_path(path, what="checkpoint"):
    """ValueError (naming the path as `what`) where `path` is a symbolic link (a save replaces the
    file at the path given: the link would become a file), a directory, or anything but a regular
    file; a free path passes. train.py asks before training, save() before writing."""
    if os.path.islink(path):
        raise ValueError(f"{what} {str(path)!r} is a symbolic link; give the path it points to "
                         f"({os.path.realpath(path)!r}): a save replaces the file at the path given, which would "
                         "replace the link")
    if os.path.isdir(path):
        raise ValueError(f"{what} {str(path)!r} is a directory; give a file path")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise ValueError(f"{what} {str(path)!r} is not a regular file (a FIFO, socket or device); give a file path")


def _check_replaceable(path):
    """ValueError unless `path` is free or holds a checkpoint (save): an archive of .npy members only,
    the header and the checksum among them (a user's own .npz holding a `__meta__` array is not
    one: session 59's review). Its contents are not checked: a damaged checkpoint may be replaced."""
    check_file_path(path)
    if not os.path.lexists(path):
        return
    try:   # a regular file (check_file_path): no FIFO to block the read
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
        ours = ({f"{HEADER}.npy", f"{CHECKSUM}.npy"} <= set(names)
                and all(n.endswith(".npy") for n in names))
    except PermissionError as e:
        raise ValueError(f"{str(path)!r} exists and cannot be read ({e}), so it cannot be told to be a checkpoint; "
                         "a save never replaces another file") from None
    except (OSError, zipfile.BadZipFile, ValueError):
        ours = False
    if not ours:
        raise ValueError(f"{str(path)!r} exists and is not a checkpoint (of format {FORMAT_VERSION}, this version's); "
                         "a save never replaces another file: remove it or choose another path")


def header(path):
    """The header (epoch, optimizer settings, `extra`) of a checkpoint, without its arrays: what a
    caller needs before it can build the model to load() into. The whole file is checked (its
    checksum covers the arrays too), so a header returned here belongs to a sound file."""
    return _read(path, keep_arrays=False)[0]


def _read(path, keep_arrays=True):
    """(header, {name: array}) of a checked checkpoint file; CheckpointError for anything wrong."""
    name = f"checkpoint {path!r}"
    if not os.path.isfile(path):
        raise CheckpointError(f"{name} is a directory; give the checkpoint's file path" if os.path.isdir(path)
                              else f"{name} does not exist" if not os.path.lexists(path)
                              else f"{name} is not a regular file")
    raw, digest, arrays, array_hash = None, None, {}, hashlib.sha256()
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            names = [i.filename for i in infos]
            if len(set(names)) != len(names):
                raise CheckpointError(f"{name} is corrupted: its archive lists a member twice")
            for info in sorted(infos, key=lambda i: i.filename):
                if not info.filename.endswith(".npy"):
                    raise CheckpointError(f"{name} holds an unexpected member {info.filename!r}")
                key, a = info.filename[:-4], _read_member(zf, info)
                if key == HEADER:
                    raw = a
                elif key == CHECKSUM:
                    digest = a
                else:
                    _hash_array(array_hash, key, a)
                    if keep_arrays:
                        arrays[key] = a
    except (CheckpointError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - zipfile and numpy's parsers fail in many ways on bad bytes
        raise CheckpointError(f"{name} is truncated or corrupted, or not a minitorch-fft checkpoint "
                              f"({type(e).__name__}: {e})") from None
    if raw is None:
        raise CheckpointError(f"{name} has no header: not a minitorch-fft checkpoint")
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise CheckpointError(f"{name} has a corrupted header (a {raw.dtype} array of shape {raw.shape})")
    header_bytes = raw.tobytes()
    try:
        meta = json.loads(header_bytes.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        meta = None                      # a damaged header: the checksum below says so
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if is_int(version) and version != FORMAT_VERSION:
        if version < FORMAT_VERSION:
            raise CheckpointError(f"{name} has format version {version}, an older minitorch-fft's whose "
                                  f"checksum did not cover the header; this version reads format "
                                  f"{FORMAT_VERSION} only and does not convert older files")
        raise CheckpointError(f"{name} has format version {version}, newer than this minitorch-fft's "
                              f"{FORMAT_VERSION} (or its header is damaged)")
    if digest is None:
        raise CheckpointError(f"{name} has no checksum: not a minitorch-fft checkpoint of format "
                              f"{FORMAT_VERSION}")
    if digest.dtype != np.uint8 or digest.tobytes() != _digest(header_bytes, array_hash):
        raise CheckpointError(f"{name} failed its checksum: the data is corrupted")
    if meta is None:
        raise CheckpointError(f"{name} has a header that is not JSON")
    _check_header(name, meta, set(arrays) if keep_arrays else None)
    return meta, arrays


def _read_member(zf, info):
    """One .npy member as a read-only array. Its size is checked against its header before
    anything is allocated, so a damaged shape cannot ask for terabytes."""
    with zf.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"member {info.filename!r} has .npy format {version}; expected 1.0 or 2.0")
        if dtype.hasobject or dtype.kind not in "biufc":
            raise ValueError(f"member {info.filename!r} holds {dtype}, not numbers")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes != info.file_size - f.tell():
            raise ValueError(f"member {info.filename!r}: {shape} of {dtype} needs {nbytes} bytes, "
                             f"it holds {info.file_size - f.tell()}")
        data = f.read(nbytes)
        if len(data) != nbytes or f.read(1):   # reading to the end checks the zip's CRC-32 too
            raise ValueError(f"member {info.filename!r} ends early")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")


def finite_number(v):
    """A finite real number (NumPy's too, not a bool); an int too large for a float is not."""
    try:
        return is_number(v) and math.isfinite(v)
    except OverflowError:
        return False


def _nonneg_number(v):
    return finite_number(v) and v >= 0


def _check_header(name, meta, array_names):
    """Every header field's type and range, and (given the names of the arrays) that the arrays
    are exactly the model's and the buffers the header lists."""
    def bad(what):
        raise CheckpointError(f"{name} has a malformed header: {what}")

    if not isinstance(meta, dict) or set(meta) != set(HEADER_KEYS):
        bad(f"expected the fields {list(HEADER_KEYS)}, got "
            f"{sorted(meta) if isinstance(meta, dict) else type(meta).__name__}")
    if not is_int(meta["epoch"]) or meta["epoch"] < 0:
        bad(f"epoch must be an int >= 0, got {meta['epoch']!r}")
    if not isinstance(meta["extra"], dict):
        bad(f"extra must be a JSON object, got {type(meta['extra']).__name__}")
    om = meta["optimizer"]
    buffers = set()
    if om is not None:
        if not isinstance(om, dict) or set(om) != set(OPTIMIZER_KEYS):
            bad(f"optimizer must be null or an object with the fields {list(OPTIMIZER_KEYS)}, got "
                f"{sorted(om) if isinstance(om, dict) else type(om).__name__}")
        for k in OPTIMIZER_KEYS[:4]:
            if not _nonneg_number(om[k]):
                bad(f"optimizer {k} must be a finite number >= 0, got {om[k]!r}")
        vel = om["velocity"]
        if not isinstance(vel, list) or not all(isinstance(v, bool) for v in vel):
            bad(f"optimizer velocity must be a list of true/false, got {vel!r}")
        buffers = {f"optim/{i}" for i, present in enumerate(vel) if present}
    if array_names is None:
        return
    model_names = {k for k in array_names if k.startswith("model/") and len(k) > len("model/")}
    if array_names - model_names != buffers:
        odd = sorted((array_names - model_names) ^ buffers)
        bad(f"the arrays {odd} do not match the model's parameters and the optimizer buffers listed")


def load(path, model, optimizer=None):
    """Validate and restore a checkpoint into `model` (and `optimizer`), all or nothing: on a
    CheckpointError neither has changed. Returns the header."""
    meta, arrays = _read(path)
    state = {k[len("model/"):]: v for k, v in arrays.items() if k.startswith("model/")}
    try:
        new_params = model.checked_state(state)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path!r} does not fit this model: {e}") from None
    if optimizer is not None:
        om = meta["optimizer"]
        if om is None:
            raise CheckpointError(f"checkpoint {path!r} holds no optimizer state")
        vel = [arrays[f"optim/{i}"] if present else None for i, present in enumerate(om["velocity"])]
        try:
            new_opt = optimizer.checked_state(dict(om, velocity=vel))
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path!r} optimizer state does not fit: {e}") from None
    model.assign_state(new_params)          # from here on only attributes are rebound
    if optimizer is not None:
        optimizer.assign_state(new_opt)
    return meta


# -- train.py's run state (`extra`) ---------------------------------------------------------------
PROGRESS_KEYS = ("epoch", "batch", "history", "loss_sum", "correct", "seen")
HISTORY_KEYS = ("epoch", "loss", "train_accuracy", "lr")
RNG_KEYS = ("bit_generator", "state", "has_uint32", "uinteger")


def check_run_state(extra, n_train=None):
    """CheckpointError unless `extra` is a run state train.py can resume: {"progress", "rng",
    "args"} and, for an image folder, "data" (its fingerprint), every field it reads type- and range-checked. `n_train` (the number of training
    images, once the data is loaded) adds the check that the saved batch lies within an epoch.

    progress: epoch 0..args.epochs, one history entry per finished epoch ({epoch: its number,
    loss >= 0, train_accuracy in [0, 1], lr >= 0}, finite), the epoch in flight's counters (batch,
    seen, correct ints with correct <= seen, seen matching batch full batches, the last of an
    epoch possibly partial; loss_sum finite >= 0; all 0 once epoch = epochs). rng: what
    minitorch_fft.random.get_state() gives (or an older file's bare NumPy generator state). args:
    the flags train.py takes back (epochs, batch_size, fake_size >= 1; seed >= 0; num_classes
    null or >= 1; lr, momentum, weight_decay finite >= 0; model, data, backend strings)."""
    def bad(field, what):
        raise CheckpointError(f"the checkpoint's run state is malformed: {field} {what}")

    if not isinstance(extra, dict) or not isinstance(extra.get("args"), dict) or not {"progress", "rng"} <= set(extra):
        raise CheckpointError("the checkpoint holds no run state (progress, rng, args): it was not "
                              "written by train.py")
    args = extra["args"]
    for k in ("epochs", "batch_size", "fake_size"):
        if k in args and (not is_int(args[k]) or args[k] < 1):
            bad(f"args.{k}", f"must be an int >= 1, got {args[k]!r}")
    if "seed" in args and (not is_int(args["seed"]) or not 0 <= args["seed"] < 2**64):
        bad("args.seed", f"must be an int in [0, 2**64), got {args['seed']!r}")
    if args.get("num_classes") is not None and (not is_int(args["num_classes"]) or args["num_classes"] < 1):
        bad("args.num_classes", f"must be null or an int >= 1, got {args['num_classes']!r}")
    for k in ("lr", "momentum", "weight_decay"):
        if k in args and not _nonneg_number(args[k]):
            bad(f"args.{k}", f"must be a finite number >= 0, got {args[k]!r}")
    if "skip_bad_images" in args and not isinstance(args["skip_bad_images"], bool):
        bad("args.skip_bad_images", f"must be true or false, got {args['skip_bad_images']!r}")
    for k in ("model", "data", "backend"):
        if k in args and not (isinstance(args[k], str) and args[k] or k == "backend" and args[k] is None):
            bad(f"args.{k}", f"must be a non-empty string, got {args[k]!r}")

    p = extra["progress"]
    if not isinstance(p, dict) or set(p) != set(PROGRESS_KEYS):
        bad("progress", f"must have the fields {list(PROGRESS_KEYS)}, got "
            f"{sorted(p) if isinstance(p, dict) else type(p).__name__}")
    for k in ("epoch", "batch", "correct", "seen"):
        if not is_int(p[k]) or p[k] < 0:
            bad(f"progress.{k}", f"must be an int >= 0, got {p[k]!r}")
    if not _nonneg_number(p["loss_sum"]):
        bad("progress.loss_sum", f"must be a finite number >= 0, got {p['loss_sum']!r}")
    if p["correct"] > p["seen"]:
        bad("progress.correct", f"({p['correct']}) exceeds progress.seen ({p['seen']})")
    epochs, bs = args.get("epochs"), args.get("batch_size")
    if epochs is not None and p["epoch"] > epochs:
        bad("progress.epoch", f"({p['epoch']}) exceeds args.epochs ({epochs})")
    if epochs is not None and p["epoch"] == epochs and (p["batch"] or p["seen"] or p["loss_sum"]):
        bad("progress", f"counts batches of epoch {p['epoch'] + 1}, beyond the run's {epochs}")
    if bs is not None and not (p["batch"] - 1) * bs < p["seen"] <= p["batch"] * bs and (p["batch"] or p["seen"]):
        bad("progress.seen", f"({p['seen']}) does not match {p['batch']} batches of {bs}")
    if n_train is not None and bs is not None:
        if not is_int(n_train) or n_train < 0:
            raise ValueError(f"n_train must be an int >= 0, got {n_train!r}")
        n_batches = -(-n_train // bs)
        if p["batch"] > n_batches or p["seen"] != min(p["batch"] * bs, n_train):
            bad("progress.batch", f"({p['batch']} batches, {p['seen']} images seen) does not fit an "
                f"epoch of {n_batches} batches of {bs} ({n_train} images)")
    history = p["history"]
    if not isinstance(history, list) or len(history) != p["epoch"]:
        bad("progress.history", f"must be a list of {p['epoch']} entries (one per finished epoch), got "
            f"{len(history) if isinstance(history, list) else type(history).__name__}")
    for i, h in enumerate(history):
        if not isinstance(h, dict) or set(h) != set(HISTORY_KEYS):
            bad(f"progress.history[{i}]", f"must have the fields {list(HISTORY_KEYS)}, got {h!r}")
        if h["epoch"] != i + 1 or not is_int(h["epoch"]):
            bad(f"progress.history[{i}].epoch", f"must be {i + 1}, got {h['epoch']!r}")
        for k in ("loss", "train_accuracy", "lr"):
            if not _nonneg_number(h[k]) or k == "train_accuracy" and h[k] > 1:
                bad(f"progress.history[{i}].{k}", f"must be a finite number >= 0"
                    f"{' and <= 1' if k == 'train_accuracy' else ''}, got {h[k]!r}")
    _check_rng_state(extra["rng"], bad)
    data = extra.get("data")   # an image folder's fingerprint (data.imagefolder); absent in older files
    if data is not None and not (isinstance(data, dict) and set(data) == {"images", "sha256"}
                                 and is_int(data["images"]) and data["images"] >= 0
                                 and isinstance(data["sha256"], str) and len(data["sha256"]) == 64
                                 and set(data["sha256"]) <= set("0123456789abcdef")):
        bad("data", f"must be null or {{images: an int >= 0, sha256: 64 hex digits}}, got {data!r}")


def _check_rng_state(rng, bad):
    """random.get_state()'s snapshot: the NumPy generator's state, the GPU dropout seed and the
    masks each device has drawn; or, from older files, the bare generator state."""
    if isinstance(rng, dict) and "numpy" in rng:
        if not set(rng) <= {"numpy", "seed", "gpu_masks_drawn"} or "seed" not in rng:
            bad("rng", f"must have the fields numpy, seed and gpu_masks_drawn, got {sorted(rng)}")
        if not is_int(rng["seed"]) or not 0 <= rng["seed"] < 2**64:
            bad("rng.seed", f"must be an int in [0, 2**64), got {rng['seed']!r}")
        drawn = rng.get("gpu_masks_drawn", {})
        if not isinstance(drawn, dict) or not all(
                isinstance(d, str) and d.isdigit() and d.isascii() and is_int(n) and 0 <= n < 2**64
                for d, n in drawn.items()):
            bad("rng.gpu_masks_drawn", f"must map device numbers to mask counts, got {drawn!r}")
        rng = rng["numpy"]
    kind = type(_random.generator().bit_generator).__name__
    if not isinstance(rng, dict) or set(rng) != set(RNG_KEYS) or rng["bit_generator"] != kind:
        bad("rng", f"must be a NumPy {kind} state {{{', '.join(RNG_KEYS)}}}, got {rng!r}"[:300])
    s = rng["state"]
    if (not isinstance(s, dict) or set(s) != {"state", "inc"}
            or not all(is_int(v) and 0 <= v < 2**128 for v in s.values())
            or rng["has_uint32"] not in (0, 1) or not is_int(rng["has_uint32"])
            or not is_int(rng["uinteger"]) or not 0 <= rng["uinteger"] < 2**32):
        bad("rng", f"is not a well-formed {kind} state: {rng!r}"[:300])
    try:   # the generator's own check, on a throwaway generator
        getattr(np.random, kind)().state = rng
    except (TypeError, ValueError, KeyError, OverflowError) as e:
        bad("rng", f"is refused by NumPy's {kind}: {e}")


LOCK_MARK = "minitorch-fft checkpoint lock, pid "   # what a lock file of ours holds


def lock_path(path):
    """The lock file that held() keeps beside checkpoint `path`."""
    return os.path.abspath(path) + ".lock"


@contextlib.contextmanager
def held(path):
    """Hold checkpoint `path` for one run: an exclusive lock on <path>.lock (lock_path), kept while
    the block runs. A second run on the same path gets a CheckpointError naming it and the holder's
    pid (two runs on one path would otherwise both write it, and the later would silently win).
    The lock is fcntl.flock's: the kernel drops it when its process ends, so a run that crashed or
    was killed may leave the lock file but never a stuck lock.

    The lock file is opened non-blocking, never through a link, and only if it is a regular file.
    One this run makes, or one that holds LOCK_MARK (a lock of ours a run left), gets LOCK_MARK and
    the pid, and is removed when the block ends. A file already there that is empty or holds a
    number alone (an older version's lock, or someone's pid file) is locked as it is: neither
    written nor removed. Anything else there (someone's poetry.lock beside --checkpoint poetry) is
    refused, untouched. The folders the path needs are made here, and those the run made and left
    empty are removed when the block ends. A run that opened the lock file before its holder
    removed it finds, once it holds the lock, that the path names another file (or none), and
    opens it again: two runs never hold two different files."""
    lock, made = lock_path(path), []
    try:
        fd, ours = _open_lock(lock, path, made)
        try:
            yield
        finally:
            if ours and fcntl is not None:
                with contextlib.suppress(OSError):
                    os.remove(lock)    # while still held: a run that opened it will see it gone
            os.close(fd)               # releases the lock
    finally:
        for folder in reversed(made):  # deepest first; a folder the run wrote into (or another run's) stays
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def _make_folders(folder, made):
    """Make `folder` and its missing parents, appending each one this call made to `made` (parents
    first); one another run made meanwhile is not ours. CheckpointError where one cannot be made."""
    missing = []
    while not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    for f in reversed(missing):
        try:
            os.mkdir(f)
        except FileExistsError:
            continue
        except OSError as e:
            raise CheckpointError(f"cannot make the folder {f!r} for the checkpoint ({e.strerror})") from None
        made.append(f)


def _open_lock(lock, path, made):
    """(file descriptor holding the lock at `lock`, whether the file is ours to write and remove),
    by held()'s rules; the folders it makes are appended to `made`."""
    nofollow, nonblock = getattr(os, "O_NOFOLLOW", 0), getattr(os, "O_NONBLOCK", 0)
    for _ in range(100):
        _make_folders(os.path.dirname(lock), made)   # again after a run that ended took an empty one away
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | nofollow | nonblock, 0o666)
            created = True
        except FileExistsError:
            created = False
            try:
                fd = open_lock_file(lock, os.O_RDWR)
            except FileNotFoundError:
                continue                                # removed since: make it
            except OSError as e:
                raise CheckpointError(f"cannot open {lock!r}, the lock that keeps other runs off checkpoint "
                                      f"{path!r} ({e})") from None
        except FileNotFoundError:
            continue                                    # its folder went: make it again
        except OSError as e:
            raise CheckpointError(f"cannot make {lock!r}, the lock that keeps other runs off checkpoint "
                                  f"{path!r} ({e})") from None
        try:
            text = "" if created else os.read(fd, 256).decode("utf-8", "replace")
            marked = text.startswith(LOCK_MARK)
            if text.strip() and not (marked or text.strip().isdigit()):
                raise CheckpointError(f"{lock!r} is not a checkpoint lock of minitorch-fft (it holds other data), "
                                      f"and the run would need that path to lock checkpoint {path!r}; move that file, "
                                      "or choose another --checkpoint")
            if fcntl is None:
                return fd, False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = text[len(LOCK_MARK):].strip() if marked else "unknown"
                raise CheckpointError(f"checkpoint {path!r} is in use by another run (pid {holder or 'unknown'}, "
                                      f"holding {lock!r}); wait for it to end, or choose another --checkpoint") from None
            try:
                same = os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                ours = created or marked
                if ours:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{LOCK_MARK}{os.getpid()}\n".encode(), 0)
                return fd, ours
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)                   # the holder before us removed it: open the path again
    raise CheckpointError(f"could not hold {lock!r}: it was replaced 100 times while this run opened it")
