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
import tempfile
import zipfile

import numpy as np

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

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def load(path, model, optimizer=None):
    """Validate and restore a checkpoint into `model` (and `optimizer`). Returns its header."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"checkpoint {path!r} is truncated or corrupted ({type(e).__name__}: {e})") from None
    if "__meta__" not in arrays:
        raise CheckpointError(f"checkpoint {path!r} has no header: not a minitorch-fft checkpoint")
    try:
        meta = json.loads(arrays.pop("__meta__").tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path!r} has a corrupted header ({e})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path!r} has format version {meta.get('format_version')!r}; "
                              f"this version reads {FORMAT_VERSION}")
    if _digest(arrays) != meta.get("sha256"):
        raise CheckpointError(f"checkpoint {path!r} failed its checksum: the data is corrupted")

    state = {k[len("model/"):]: v for k, v in arrays.items() if k.startswith("model/")}
    try:
        model.load_state_dict(state)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path!r} does not fit this model: {e}") from None
    if optimizer is not None:
        om = meta.get("optimizer")
        if om is None:
            raise CheckpointError(f"checkpoint {path!r} holds no optimizer state")
        vel = [arrays[f"optim/{i}"] if present else None for i, present in enumerate(om.pop("velocity"))]
        try:
            optimizer.load_state_dict(dict(om, velocity=vel))
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path!r} optimizer state does not fit: {e}") from None
    return meta
