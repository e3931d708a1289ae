"""Damaged and hand-edited checkpoints: each one loads data identical to what it claims, or raises
CheckpointError with the model and the optimizer untouched. Never another exception, never half
a load.

One real checkpoint of a small CNN with SGD momentum (so momentum buffers exist) and a train.py
run state in `extra` goes through random byte flips, truncations, and structural edits: zip
members removed, renamed, duplicated or added; header JSON fields deleted, retyped or put out of
range; arrays of another dtype or shape. The structural edits are made twice: with the checksum
left as it was (the file must be refused) and recomputed (a hand-built file: the checks behind
the checksum must refuse it, or it loads exactly what it holds). A header that loads is also
given to check_run_state, which must accept it or raise CheckpointError. The seed is new each
run and printed in the report (conftest's fresh_rng).
"""
import copy
import hashlib
import io
import json
import time
import warnings
import zipfile

import numpy as np

import minitorch_fft as mt
from minitorch_fft import checkpoint as ckpt
from minitorch_fft.checkpoint import CheckpointError

N_FLIPS, N_TRUNCATIONS, N_CASES = 800, 200, 2000   # the rest structural: about 5 s on one core
N_TRAIN = 40                                          # images per epoch in the run state below


def small_model(seed):
    mt.manual_seed(seed)
    return mt.Sequential(mt.SpatialConvolution(1, 2, 3), mt.ReLU(), mt.Flatten(), mt.Linear(18, 3))


def trained(seed):
    m = small_model(seed)
    opt = mt.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = mt.Tensor(np.random.default_rng(seed).standard_normal((4, 1, 5, 5)))
    mt.train_step(m, mt.CrossEntropyCriterion(), opt, x, np.array([0, 1, 2, 0]))
    opt.velocity[1] = None                 # one parameter without a buffer: both cases in the file
    return m, opt


def run_state():
    """What train.py keeps in `extra`: one epoch of 4 done at batch size 16, 2 batches into the next."""
    return {"progress": {"epoch": 1, "batch": 2, "loss_sum": 35.5, "correct": 12, "seen": 32,
                         "history": [{"epoch": 1, "loss": 1.1, "train_accuracy": 0.5, "lr": 0.1}]},
            "rng": mt.random.get_state(),
            "args": {"model": "digits", "data": "fake", "epochs": 4, "batch_size": 16, "lr": 0.1,
                     "momentum": 0.9, "weight_decay": 1e-4, "seed": 0, "fake_size": N_TRAIN,
                     "num_classes": None, "backend": "auto"}}


def snapshot(m, opt):
    return ({k: v.copy() for k, v in m.state_dict().items()},
            (opt.lr, opt.base_lr, opt.momentum, opt.weight_decay,
             [None if v is None else v.copy() for v in opt.velocity]))


def same(a, b):
    (pa, oa), (pb, ob) = a, b
    return (pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k], equal_nan=True) and
                                          pa[k].dtype == pb[k].dtype for k in pa)
            and oa[:4] == ob[:4] and len(oa[4]) == len(ob[4])
            and all((u is None) == (v is None) and (u is None or np.array_equal(u, v))
                    for u, v in zip(oa[4], ob[4])))


def members(data):
    """[(name, raw bytes)] of a zip, in order."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def zipped(items):
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # zipfile warns about duplicate names
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            for name, raw in items:
                z.writestr(name, raw)
    return buf.getvalue()


def npy(a):
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asarray(a), allow_pickle=False)
    return buf.getvalue()


def unnpy(raw):
    return np.lib.format.read_array(io.BytesIO(raw), allow_pickle=False)


def with_checksum(items):
    """items with __sha256__ recomputed the way save() computes it (a hand-built file)."""
    arrays = {n[:-4]: unnpy(r) for n, r in items if n not in ("__meta__.npy", "__sha256__.npy")}
    header = next((unnpy(r).tobytes() for n, r in items if n == "__meta__.npy"), b"")
    h = hashlib.sha256()
    for k in sorted(arrays):
        ckpt._hash_array(h, k, arrays[k])
    digest = np.frombuffer(ckpt._digest(header, h), np.uint8)
    return [(n, npy(digest) if n == "__sha256__.npy" else r) for n, r in items]


# -- the edits: each returns (items, expected): expected is the state a load must give, or None
#    when the file must be refused --------------------------------------------------------------
def header_of(items):
    return json.loads(unnpy(dict(items)["__meta__.npy"]).tobytes())


def set_header(items, meta):
    raw = npy(np.frombuffer(json.dumps(meta).encode(), np.uint8))
    return [(n, raw if n == "__meta__.npy" else r) for n, r in items]


BAD_VALUES = [None, "1", [], {}, True, -1, -0.5, float("nan"), float("inf"), 1.5, 2**70, "", [1]]
# Not valid optimizer settings, so an edit that sets one must be refused (1.5 would be valid).
BAD_NUMBERS = [v for v in BAD_VALUES if isinstance(v, bool) or not isinstance(v, (int, float))
               or not (v >= 0 and v < float("inf"))]


def header_edit(rng, items):
    meta = header_of(items)
    paths = [("format_version",), ("epoch",), ("optimizer",), ("extra",)]
    paths += [("optimizer", k) for k in ckpt.OPTIMIZER_KEYS]
    paths += [("optimizer", "velocity", i) for i in range(len(meta["optimizer"]["velocity"]))]
    path = paths[rng.integers(len(paths))]
    parent = meta
    for k in path[:-1]:
        parent = parent[k]
    how = rng.integers(3)
    bad = BAD_NUMBERS if path[0] == "optimizer" and len(path) == 2 else BAD_VALUES
    if how == 0 and not isinstance(parent, list):
        del parent[path[-1]]
    elif how == 1:
        parent[path[-1]] = bad[rng.integers(len(bad))]
    else:
        meta["unexpected" if rng.integers(2) else path[0]] = BAD_VALUES[rng.integers(len(BAD_VALUES))]
    return set_header(items, meta), None       # loads only if the edit happened to change nothing


def extra_edit(rng, items):
    """A run-state field retyped or out of range: load() takes any JSON object as `extra`, so it
    loads; check_run_state must then refuse it or accept it, and nothing else."""
    meta = header_of(items)
    parent, key = meta, "extra"
    for _ in range(rng.integers(1, 5)):          # walk down 1 to 4 levels
        node = parent[key]
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys:
            break
        parent, key = node, keys[rng.integers(len(keys))]
    if isinstance(parent, dict) and rng.integers(4) == 0:
        del parent[key]
    else:
        parent[key] = BAD_VALUES[rng.integers(len(BAD_VALUES))]
    return set_header(items, meta), "original"


def array_edit(rng, items):
    """A parameter or buffer replaced by another dtype or shape."""
    names = [n for n, _ in items if n.startswith(("model/", "optim/"))]
    name = names[rng.integers(len(names))]
    a = unnpy(dict(items)[name]).copy()
    kind = rng.integers(8)
    expected = None
    if kind == 0:
        b, expected = a.astype(np.float64), "original"           # exact: loads the same
    elif kind == 1:
        b = a.astype(np.float16)                                   # lossy but allowed: what it holds
        expected = "float16:" + name
    elif kind == 2:
        b = a.astype(np.complex64) + 1j
    elif kind == 3:
        b = (a * 100).astype(np.int32)
    elif kind == 4:
        b = a.astype(np.float64)
        b.reshape(-1)[rng.integers(b.size)] = 1e300
    elif kind == 5:
        b = a.reshape(-1)
        if b.shape == a.shape:
            b = b[:-1]
    elif kind == 6:
        b = np.concatenate([a.reshape(-1), a.reshape(-1)[:1]])
    else:
        b = a > 0
    return [(n, npy(b) if n == name else r) for n, r in items], expected


def structural_edit(rng, items):
    items = list(items)
    i = rng.integers(len(items))
    kind = rng.integers(5)
    if kind == 0:
        del items[i]
    elif kind == 1:
        name = items[i][0]
        new = rng.choice([name[:-4], name.replace("model/", "optim/"), name.upper(),
                          "model/extra.npy", name.replace(".npy", "x.npy"), "optim/99.npy"])
        items[i] = (str(new), items[i][1])
    elif kind == 2:
        items.append(items[i] if rng.integers(2) else (items[i][0], items[(i + 1) % len(items)][1]))
    elif kind == 3:
        items.append(("model/extra.npy", npy(np.ones(3, np.float32))))
    else:
        items.insert(0, items.pop(i))                       # another order: harmless
        return items, "original"
    return items, None


def test_damaged_checkpoints_load_exactly_or_change_nothing(tmp_path, fresh_rng):
    rng = fresh_rng
    t0 = time.perf_counter()
    src, src_opt = trained(0)
    path = str(tmp_path / "c.ckpt")
    ckpt.save(path, src, src_opt, epoch=1, extra=run_state())
    original_bytes = open(path, "rb").read()
    original_items = members(original_bytes)
    original = snapshot(src, src_opt)
    victim, victim_opt = trained(1)
    victim_opt.lr = 0.05                       # every field differs from the file's
    before = snapshot(victim, victim_opt)
    victim_state = copy.deepcopy(before)

    def restore():
        victim.load_state_dict(victim_state[0])
        victim_opt.lr, victim_opt.base_lr, victim_opt.momentum, victim_opt.weight_decay = victim_state[1][:4]
        victim_opt.velocity = [None if v is None else v.copy() for v in victim_state[1][4]]

    def expected_state(tag):
        if tag == "original":
            return original
        name = tag.split(":", 1)[1][:-4]                # float16:<member>
        params, opt = copy.deepcopy(original)
        if name.startswith("model/"):
            k = name[len("model/"):]
            params[k] = params[k].astype(np.float16).astype(np.float32)
        else:
            i = int(name[len("optim/"):])
            opt[4][i] = opt[4][i].astype(np.float16).astype(np.float32)
        return params, opt

    cases = []
    for _ in range(N_FLIPS):
        b = bytearray(original_bytes)
        for _ in range(rng.integers(1, 4)):
            b[rng.integers(len(b))] ^= int(rng.integers(1, 256))
        cases.append(("flip", bytes(b), None))
    for _ in range(N_TRUNCATIONS):
        n = int(rng.integers(len(original_bytes)))
        tail = bytes(rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8)) if rng.integers(2) else b""
        cases.append(("truncate", original_bytes[:n] + tail, None))
    while len(cases) < N_CASES:
        kind = rng.integers(4)
        if kind == 0:
            items, expected = structural_edit(rng, original_items)
        elif kind == 1:
            items, expected = header_edit(rng, original_items)
        elif kind == 2:
            items, expected = extra_edit(rng, original_items)
        else:
            items, expected = array_edit(rng, original_items)
        name = ["zip member", "header", "run state", "array"][kind]
        # as edited (the checksum no longer matches: refused, unless the edit changed nothing) ...
        cases.append((name + " (old checksum)", zipped(items), None))
        # ... and hand-built, the checksum recomputed: the checks behind it must hold
        if all(n.endswith(".npy") for n, _ in items) and sum(n == "__meta__.npy" for n, _ in items) <= 1:
            try:
                rebuilt = with_checksum(items)
            except Exception:      # noqa: BLE001 - an edit the helper itself cannot hash
                continue
            cases.append((name + " (checksum recomputed)", zipped(rebuilt), expected))

    tried = {"loaded": 0, "refused": 0}
    for i, (what, data, expected) in enumerate(cases):
        with open(path, "r+b") as f:     # rewritten in place: truncating to 0 first is slow on ext4
            f.write(data)
            f.truncate()
        try:
            meta = ckpt.load(path, victim, victim_opt)
        except CheckpointError:
            assert same(snapshot(victim, victim_opt), before), f"case {i} ({what}): refused but changed state"
            tried["refused"] += 1
            continue
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"case {i} ({what}): {type(e).__name__}: {e}") from e
        got = snapshot(victim, victim_opt)
        if expected is None:     # a flip that changed nothing meaningful (e.g. a zip comment)
            expected = "original"
        assert same(got, expected_state(expected)), f"case {i} ({what}): loaded data that differs"
        try:
            mt.checkpoint.check_run_state(meta["extra"], n_train=N_TRAIN)
        except CheckpointError:
            pass
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"case {i} ({what}): check_run_state: {type(e).__name__}: {e}") from e
        tried["loaded"] += 1
        restore()
        assert same(snapshot(victim, victim_opt), before)
    assert len(cases) >= 1000
    assert tried["refused"] > 0.7 * len(cases)
    print(f"{len(cases)} cases: {tried['loaded']} loaded exactly, {tried['refused']} refused, "
          f"{time.perf_counter() - t0:.1f} s")


def test_the_fuzzers_run_state_is_valid():
    """The run state the fuzzer edits passes check_run_state (else extra_edit would test little)."""
    mt.checkpoint.check_run_state(json.loads(json.dumps(run_state())), n_train=N_TRAIN)
