"""Checkpoints: model + optimiser + progress in one file, written atomically.

The file is an uncompressed .npz (no pickle) holding every array plus a JSON
header with a format version, the shapes and a SHA-256 of the array bytes. It
is written to a temporary file in the same folder, flushed to disk and renamed
over the target, so a crash mid-write never leaves a half-written checkpoint
where the last good one was.
"""
import hashlib
import json
import os
import zipfile

import numpy as np

from .utils import atomic_file

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated, corrupted or mismatched."""


def _digest(arrays):
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(k.encode())
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save(path, model, optimizer=None, epoch=0, extra=None):
    """Write the checkpoint atomically. `extra` is any JSON-serialisable dict."""
    arrays = {f"model/{k}": v for k, v in model.state_dict().items()}
    opt_meta = None
    if optimizer is not None:
        st = optimizer.state_dict()
        vel = st.pop("velocity")
        opt_meta = dict(st, velocity=[v is not None for v in vel])
        arrays.update({f"optim/{i}": v for i, v in enumerate(vel) if v is not None})
    meta = {"format_version": FORMAT_VERSION, "epoch": int(epoch), "optimizer": opt_meta,
            "extra": extra or {}, "sha256": _digest(arrays)}
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_file(path, "wb", prefix=".ckpt-") as f:
        np.savez(f, **arrays)
    return path


def header(path):
    """The header (epoch, optimizer settings, `extra`) of a checkpoint, without its arrays:
    what a caller needs before it can build the model to load() into. load() validates the rest."""
    return _read(path, only=("__meta__",))[0]


def _read(path, only=None):
    """(header, {name: array}) of a checkpoint file, the arrays limited to `only` if given."""
    _check_file(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files if only is None or k in only}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"checkpoint {path!r} is truncated or corrupted ({type(e).__name__}: {e})") from None
    if "__meta__" not in arrays:
        raise CheckpointError(f"checkpoint {path!r} has no header: not a minitorch-fft checkpoint")
    return _parse_header(path, arrays.pop("__meta__")), arrays


def _check_file(path):
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"checkpoint {path!r} is truncated or corrupted, or not a minitorch-fft "
                              "checkpoint at all: it is not a complete .npz archive")


def _parse_header(path, raw):
    try:
        meta = json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path!r} has a corrupted header ({e})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(f"checkpoint {path!r} has format version {version!r}; "
                              f"this version reads {FORMAT_VERSION}")
    return meta


def load(path, model, optimizer=None):
    """Validate and restore a checkpoint into `model` (and `optimizer`). Returns its header."""
    meta, arrays = _read(path)
    if _digest(arrays) != meta.get("sha256"):
        raise CheckpointError(f"checkpoint {path!r} failed its checksum: the data is corrupted")

    state = {k[len("model/"):]: v for k, v in arrays.items() if k.startswith("model/")}
    if optimizer is not None:  # checked before anything is loaded: a failed load changes nothing
        om = meta.get("optimizer")
        if om is None:
            raise CheckpointError(f"checkpoint {path!r} holds no optimizer state")
        vel = [arrays[f"optim/{i}"] if present else None for i, present in enumerate(om.pop("velocity"))]
        if len(vel) != len(optimizer.params) or any(
                v is not None and tuple(v.shape) != tuple(p.shape) for v, p in zip(vel, optimizer.params)):
            shapes = [None if v is None else tuple(v.shape) for v in vel]
            raise CheckpointError(f"checkpoint {path!r} optimizer state does not fit: buffers {shapes} "
                                  f"for parameters {[tuple(p.shape) for p in optimizer.params]}")
    try:
        model.load_state_dict(state)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path!r} does not fit this model: {e}") from None
    if optimizer is not None:
        try:
            optimizer.load_state_dict(dict(om, velocity=vel))
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path!r} optimizer state does not fit: {e}") from None
    return meta
