"""Checkpoints: round trip, atomic writes, and clear errors on damaged files."""
import os

import numpy as np
import pytest

import minitorch_fft as mt
from minitorch_fft.checkpoint import CheckpointError


def small_model_and_opt(seed):
    mt.manual_seed(seed)
    m = mt.Sequential(mt.SpatialConvolution(1, 2, 3), mt.Flatten(), mt.Linear(18, 3))
    opt = mt.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    x = mt.Tensor(np.random.default_rng(seed).standard_normal((2, 1, 5, 5)))
    mt.CrossEntropyCriterion()(m(x), np.array([0, 2])).backward()
    opt.step()  # creates momentum buffers
    return m, opt


def test_round_trip(tmp_path):
    m, opt = small_model_and_opt(0)
    path = str(tmp_path / "a.ckpt")
    mt.checkpoint.save(path, m, opt, epoch=3, extra={"note": "hi"})
    m2, opt2 = small_model_and_opt(1)
    meta = mt.checkpoint.load(path, m2, opt2)
    assert meta["epoch"] == 3 and meta["extra"] == {"note": "hi"}
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert np.array_equal(a, b)
    for a, b in zip(opt.velocity, opt2.velocity):
        assert np.array_equal(a, b)


def test_a_save_replaces_a_checkpoint_and_nothing_else(tmp_path):
    """A user's file (text, or an .npz with a `__meta__` array of its own), a directory, a FIFO or a
    symbolic link at the path: ValueError, nothing touched (the save had replaced any file, and a link
    with a file); a checkpoint is replaced."""
    model, opt = small_model_and_opt(0)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    arrays = tmp_path / "mine.npz"   # a user's archive with a __meta__ array of its own: not a checkpoint
    np.savez(arrays, __meta__=np.arange(3), weights=np.ones(2))
    kept = arrays.read_bytes()
    (tmp_path / "folder").mkdir()
    link = tmp_path / "link.ckpt"
    link.symlink_to(tmp_path / "elsewhere.ckpt")
    cases = [(notes, "exists and is not a checkpoint"), (arrays, "exists and is not a checkpoint"),
             (tmp_path / "folder", "is a directory"),
             (link, "is a symbolic link")]
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        cases.append((tmp_path / "fifo", "is not a regular file"))
    for path, why in cases:
        with pytest.raises(ValueError, match=why):
            mt.checkpoint.save(str(path), model, opt, epoch=1)
    assert notes.read_text() == "mine" and link.is_symlink() and not (tmp_path / "elsewhere.ckpt").exists()
    assert arrays.read_bytes() == kept
    ckpt = tmp_path / "run.ckpt"
    mt.checkpoint.save(str(ckpt), model, opt, epoch=1)
    mt.checkpoint.save(str(ckpt), model, opt, epoch=2)                  # its own: replaced
    assert mt.checkpoint.header(str(ckpt))["epoch"] == 2


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    m, opt = small_model_and_opt(0)
    path = str(tmp_path / "a.ckpt")
    mt.checkpoint.save(path, m, opt, epoch=1)
    before = open(path, "rb").read()

    def crash(f, **arrays):
        f.write(b"partial")
        raise OSError("disk full")
    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(OSError, match="disk full"):
        mt.checkpoint.save(path, m, opt, epoch=2)
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["a.ckpt"]  # no temporary file left behind


@pytest.mark.parametrize("damage,msg", [
    (lambda b: b[: len(b) // 2], "truncated or corrupted"),
    (lambda b: b[:-200] + bytes(200), "truncated or corrupted|checksum"),
    (lambda b: b"not a zip file at all", "truncated or corrupted"),
])
def test_damaged_file_is_a_clear_error(tmp_path, damage, msg):
    m, opt = small_model_and_opt(0)
    path = str(tmp_path / "a.ckpt")
    mt.checkpoint.save(path, m, opt)
    data = open(path, "rb").read()
    open(path, "wb").write(damage(data))
    with pytest.raises(CheckpointError, match=msg):
        mt.checkpoint.load(path, m, opt)


def test_flipped_weight_byte_fails_the_checksum(tmp_path):
    m, _ = small_model_and_opt(0)
    path = str(tmp_path / "a.ckpt")
    mt.checkpoint.save(path, m)
    data = bytearray(open(path, "rb").read())
    w = m.state_dict()["0.weight"].tobytes()
    i = bytes(data).index(w)  # npz is stored uncompressed: the raw weight bytes are in the file
    data[i] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="checksum|corrupted"):
        mt.checkpoint.load(path, m)


def test_wrong_model_is_a_clear_error(tmp_path):
    m, _ = small_model_and_opt(0)
    path = str(tmp_path / "a.ckpt")
    mt.checkpoint.save(path, m)
    other = mt.Sequential(mt.SpatialConvolution(1, 4, 3), mt.Flatten(), mt.Linear(36, 3))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        mt.checkpoint.load(path, other)


# -- format 2: the header is checksummed, every field is checked, loading is all or nothing -----
def state_of(m, opt):
    return ([v.copy() for v in m.state_dict().values()],
            (opt.lr, opt.base_lr, opt.momentum, opt.weight_decay,
             [None if v is None else v.copy() for v in opt.velocity]))


def unchanged(m, opt, before):
    after = state_of(m, opt)
    return (all(np.array_equal(a, b) for a, b in zip(before[0], after[0])) and before[1][:4] == after[1][:4]
            and all((u is None and v is None) or np.array_equal(u, v) for u, v in zip(before[1][4], after[1][4])))


def rewrite(path, meta=None, arrays=None, checksum=True):
    """Rewrite a checkpoint's header (a dict) and arrays ({name: array}); with checksum, the
    __sha256__ recomputed as save() would: a hand-built file whose checksum is right."""
    import hashlib
    import json
    with np.load(path) as z:
        items = {k: z[k] for k in z.files}
    header = json.dumps(meta).encode() if meta is not None else items["__meta__"].tobytes()
    items["__meta__"] = np.frombuffer(header, np.uint8)
    if arrays is not None:
        items = {k: v for k, v in items.items() if k.startswith("__")} | arrays
    if checksum:
        h = hashlib.sha256()
        for k in sorted(k for k in items if not k.startswith("__")):
            mt.checkpoint._hash_array(h, k, items[k])
        items["__sha256__"] = np.frombuffer(mt.checkpoint._digest(header, h), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **items)


def saved(tmp_path):
    m, opt = small_model_and_opt(0)
    path = str(tmp_path / "a.ckpt")
    mt.checkpoint.save(path, m, opt, epoch=1)
    victim, victim_opt = small_model_and_opt(1)
    return path, mt.checkpoint.header(path), victim, victim_opt


def test_the_header_is_covered_by_the_checksum(tmp_path):
    """An edited header (lr: null) with the old checksum: refused, nothing touched (format 1
    assigned the weights, then failed on the header with a TypeError)."""
    path, meta, m, opt = saved(tmp_path)
    before = state_of(m, opt)
    meta["optimizer"]["lr"] = None
    rewrite(path, meta, checksum=False)
    with pytest.raises(CheckpointError, match="checksum"):
        mt.checkpoint.load(path, m, opt)
    assert unchanged(m, opt, before)


@pytest.mark.parametrize("edit,msg", [
    (lambda h: h["optimizer"].update(lr=None), "optimizer lr must be a finite number"),
    (lambda h: h["optimizer"].update(momentum=-5), "optimizer momentum must be a finite number"),
    (lambda h: h["optimizer"].update(weight_decay=float("nan")), "optimizer weight_decay"),
    (lambda h: h["optimizer"].update(velocity="yes"), "velocity must be a list"),
    (lambda h: h["optimizer"].pop("base_lr"), "optimizer must be null or an object with the fields"),
    (lambda h: h.update(optimizer=[0.1]), "optimizer must be null or an object"),
    (lambda h: h.update(epoch=-1), "epoch must be an int >= 0"),
    (lambda h: h.update(epoch="3"), "epoch must be an int >= 0"),
    (lambda h: h.update(extra=[]), "extra must be a JSON object"),
    (lambda h: h.pop("extra"), "expected the fields"),
    (lambda h: h.update(sha256="x"), "expected the fields"),
])
def test_a_hand_built_header_is_checked_field_by_field(tmp_path, edit, msg):
    """With a correct checksum (a hand-built file) each malformed field is a CheckpointError that
    names it, and neither the model nor the optimizer changes."""
    path, meta, m, opt = saved(tmp_path)
    before = state_of(m, opt)
    edit(meta)
    rewrite(path, meta)
    with pytest.raises(CheckpointError, match=msg):
        mt.checkpoint.load(path, m, opt)
    assert unchanged(m, opt, before)


@pytest.mark.parametrize("change,msg", [
    (lambda a, k: a.update({k: a[k].astype(np.complex64)}), "complex64.*imaginary"),
    (lambda a, k: a.update({k: a[k].astype(np.int32)}), "dtype int32"),
    (lambda a, k: a.update({k: a[k].astype(np.float64) * 1e300}), "beyond float32's range"),
    (lambda a, k: a.update({k: a[k][..., :1]}), "has shape"),
    (lambda a, k: a.update({k + "x": a.pop(k)}), "does not fit this model: state_dict keys do not match"),
    (lambda a, k: a.pop("optim/0"), "do not match"),
])
def test_a_bad_last_array_changes_nothing(tmp_path, change, msg):
    """The model's last parameter malformed in a file with a correct checksum: every earlier
    parameter and the optimizer keep their values."""
    path, _, m, opt = saved(tmp_path)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if not k.startswith("__")}
    last = sorted(k for k in arrays if k.startswith("model/"))[-1]
    change(arrays, last)
    rewrite(path, arrays=arrays)
    before = state_of(m, opt)
    with pytest.raises(CheckpointError, match=msg):
        mt.checkpoint.load(path, m, opt)
    assert unchanged(m, opt, before)


def test_a_float64_file_that_fits_loads_cast(tmp_path):
    """A hand-built file in float64 whose values fit float32 loads, rounded as PyTorch rounds."""
    path, _, m, opt = saved(tmp_path)
    with np.load(path) as z:
        arrays = {k: z[k].astype(np.float64) + 1e-9 for k in z.files if not k.startswith("__")}
    rewrite(path, arrays=arrays)
    mt.checkpoint.load(path, m, opt)
    for k, v in m.state_dict().items():
        assert v.dtype == np.float32 and np.array_equal(v, arrays["model/" + k].astype(np.float32))


@pytest.mark.parametrize("version,msg", [(1, "format version 1, an older minitorch-fft's"),
                                         (3, "format version 3, newer than")])
def test_older_and_newer_formats_are_refused(tmp_path, version, msg):
    path, meta, m, opt = saved(tmp_path)
    meta["format_version"] = version
    rewrite(path, meta, checksum=version != 1)
    if version == 1:                      # format 1: no __sha256__ member, the digest in the header
        with np.load(path) as z:
            items = {k: z[k] for k in z.files if k != "__sha256__"}
        np.savez(open(path, "wb"), **items)
    before = state_of(m, opt)
    for read in (mt.checkpoint.header, lambda p: mt.checkpoint.load(p, m, opt)):
        with pytest.raises(CheckpointError, match=msg):
            read(path)
    assert unchanged(m, opt, before)


def test_a_flipped_byte_in_the_zip_directory_is_a_checkpoint_error(tmp_path):
    """The central directory's compression method of the first member set to an unknown value:
    zipfile raised NotImplementedError through format 1's load."""
    path, _, m, opt = saved(tmp_path)
    data = bytearray(open(path, "rb").read())
    cd = bytes(data).index(b"PK\x01\x02")                    # the first central-directory entry
    data[cd + 10] = 0x63                                      # compression method 99
    open(path, "wb").write(bytes(data))
    before = state_of(m, opt)
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        mt.checkpoint.load(path, m, opt)
    assert unchanged(m, opt, before)


@pytest.mark.parametrize("edit", [
    lambda z: z.append(z[0]),                                                # a member twice
    lambda z: z.append(("notes.txt", b"hello")),                            # not an array
    lambda z: z.__setitem__(0, (z[0][0], z[0][1][:-4])),                    # shorter than its shape
])
def test_structural_damage_is_a_checkpoint_error(tmp_path, edit):
    import warnings
    import zipfile
    path, _, m, opt = saved(tmp_path)
    with zipfile.ZipFile(path) as z:
        items = [(i.filename, z.read(i)) for i in z.infolist()]
    edit(items)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with zipfile.ZipFile(path, "w") as z:
            for name, raw in items:
                z.writestr(name, raw)
    before = state_of(m, opt)
    with pytest.raises(CheckpointError):
        mt.checkpoint.load(path, m, opt)
    assert unchanged(m, opt, before)


# -- train.py's run state -----------------------------------------------------------------------
def run_state():
    """A run state as train.py saves it: epoch 1 of 3 done, 2 batches of 16 into the second."""
    return {"progress": {"epoch": 1, "batch": 2, "history": [{"epoch": 1, "loss": 2.1, "train_accuracy": 0.3,
                                                              "lr": 0.05}],
                         "loss_sum": 60.0, "correct": 10, "seen": 32},
            "rng": mt.random.get_state(),
            "args": {"model": "digits", "data": "digits", "epochs": 3, "batch_size": 16, "lr": 0.05,
                     "momentum": 0.9, "weight_decay": 5e-4, "seed": 0, "fake_size": 1024,
                     "num_classes": None, "backend": "auto", "device": "auto"}}


def test_a_real_train_py_run_state_passes(tmp_path):
    """What train.py writes, after an epoch, is accepted (by format version 2's rules)."""
    import train
    ckpt = str(tmp_path / "r.ckpt")
    assert train.main(["--no-progress", "--epochs", "3", "--checkpoint", ckpt, "--max-epochs-this-run", "1",
                       "--batch-size", "64"]) == 0
    extra = mt.checkpoint.header(ckpt)["extra"]
    mt.checkpoint.check_run_state(extra, n_train=len(mt.data.digits()[0]))
    mt.checkpoint.check_run_state(run_state(), n_train=100)


def _set(path, value):
    def edit(state):
        node = state
        for k in path[:-1]:
            node = node[k]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return edit


RUN_STATE_EDITS = [
    (("args", "batch_size"), 0, "args.batch_size must be an int >= 1"),
    (("args", "batch_size"), 16.0, "args.batch_size"),
    (("args", "epochs"), True, "args.epochs"),
    (("args", "lr"), float("nan"), "args.lr must be a finite number"),
    (("args", "lr"), -0.1, "args.lr"),
    (("args", "momentum"), "0.9", "args.momentum"),
    (("args", "seed"), -1, "args.seed"),
    (("args", "num_classes"), 0, "args.num_classes"),
    (("args", "model"), 5, "args.model must be a non-empty string"),
    (("args",), [], "not written by train.py"),
    (("rng",), KeyError, "not written by train.py"),
    (("progress", "epoch"), 4, "progress.epoch .4. exceeds args.epochs"),
    (("progress", "epoch"), -1, "progress.epoch must be an int >= 0"),
    (("progress", "batch"), 1.5, "progress.batch must be an int"),
    (("progress", "batch"), 3, "progress.seen .32. does not match 3 batches of 16"),
    (("progress", "seen"), 33, "does not match 2 batches"),
    (("progress", "seen"), 16, "does not match 2 batches"),
    (("progress", "correct"), 40, "exceeds progress.seen"),
    (("progress", "loss_sum"), float("inf"), "progress.loss_sum"),
    (("progress", "loss_sum"), None, "progress.loss_sum"),
    (("progress", "history"), {}, "progress.history must be a list of 1"),
    (("progress", "history"), [], "progress.history must be a list of 1"),
    (("progress", "history", 0, "loss"), float("nan"), r"history\[0\].loss"),
    (("progress", "history", 0, "loss"), "2.1", r"history\[0\].loss"),
    (("progress", "history", 0, "train_accuracy"), 1.5, r"train_accuracy must be a finite number >= 0 and <= 1"),
    (("progress", "history", 0, "epoch"), 2, r"history\[0\].epoch must be 1"),
    (("progress", "history", 0), [1, 2], r"history\[0\] must have the fields"),
    (("progress", "extra_field"), 1, "progress must have the fields"),
    (("progress", "seen"), KeyError, "progress must have the fields"),
    (("progress",), None, "progress must have the fields"),
    (("rng", "seed"), "0", "rng.seed"),
    (("rng", "gpu_masks_drawn"), {"0": -1}, "rng.gpu_masks_drawn"),
    (("rng", "gpu_masks_drawn"), {"gpu": 1}, "rng.gpu_masks_drawn"),
    (("rng", "numpy", "bit_generator"), "MT19937", "rng must be a NumPy PCG64 state"),
    (("rng", "numpy", "state", "state"), -5, "not a well-formed PCG64 state"),
    (("rng", "numpy", "state", "inc"), "1", "not a well-formed PCG64 state"),
    (("rng", "numpy", "has_uint32"), 2, "not a well-formed PCG64 state"),
    (("rng", "numpy", "uinteger"), 2**40, "not a well-formed PCG64 state"),
    (("rng", "numpy"), None, "rng must be a NumPy PCG64 state"),
    (("data",), {"images": 3}, "data must be null or"),
    (("data",), {"images": -1, "sha256": "0" * 64}, "data must be null or"),
    (("data",), {"images": 3, "sha256": "abc"}, "data must be null or"),
    (("data",), {"images": 3, "sha256": "g" * 64}, "data must be null or"),
]


@pytest.mark.parametrize("path,value,msg", RUN_STATE_EDITS, ids=[f"{'.'.join(map(str, p))}={v!r}"[:60]
                                                                  for p, v, _ in RUN_STATE_EDITS])
def test_check_run_state_refuses_each_malformed_field(path, value, msg):
    state = run_state()
    _set(path, value)(state)
    with pytest.raises(CheckpointError, match=msg):
        mt.checkpoint.check_run_state(state)


def test_check_run_state_knows_the_epochs_length():
    """With the number of training images: a batch beyond the epoch, or a count of images seen
    that the batches do not give, is refused; the state saved by a signal during an epoch's last,
    partial batch (batch = batches per epoch) is accepted."""
    state = run_state()                                      # batch 2 of 16 done, 32 seen
    mt.checkpoint.check_run_state(state, n_train=33)
    with pytest.raises(CheckpointError, match="does not fit an epoch of 2 batches of 16"):
        mt.checkpoint.check_run_state(state, n_train=20)
    state["progress"].update(seen=31)                        # would do, were batch 2 the last
    with pytest.raises(CheckpointError, match="31 images seen"):
        mt.checkpoint.check_run_state(state, n_train=40)
    mt.checkpoint.check_run_state(state, n_train=31)         # interrupted after the last batch


def test_old_bare_numpy_rng_state_is_accepted():
    state = run_state()
    state["rng"] = state["rng"]["numpy"]                 # checkpoints from before the GPU stream
    mt.checkpoint.check_run_state(state)


@pytest.mark.parametrize("edit, msg", [
    (lambda meta: meta["extra"]["args"].update(batch_size=0), "batch_size"),
    (lambda meta: meta["extra"]["progress"].update(history="not a list"), "history"),
    (lambda meta: meta["extra"]["progress"].update(seen=10**9), "seen"),   # caught once the data is known
])
def test_train_py_refuses_an_edited_run_state_before_training(tmp_path, capsys, edit, msg):
    """An edited resume header is one line and exit 2, before any training (it used to divide by
    zero, or crash after a whole epoch and lose it)."""
    import json
    import train
    ckpt = str(tmp_path / "r.ckpt")
    assert train.main(["--no-progress", "--epochs", "3", "--checkpoint", ckpt, "--max-epochs-this-run", "1",
                       "--batch-size", "64"]) == 0
    meta = mt.checkpoint.header(ckpt)
    meta = json.loads(json.dumps(meta))
    edit(meta)
    rewrite(ckpt, meta=meta)
    before = open(ckpt, "rb").read()
    capsys.readouterr()
    assert train.main(["--no-progress", "--checkpoint", ckpt, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err
    assert open(ckpt, "rb").read() == before                  # nothing trained, nothing written


def test_a_second_run_on_a_checkpoint_path_in_use_exits_2(tmp_path, capsys):
    """Two runs on one --checkpoint both exited 0 and the file held only the later run's; now the
    path is held for a run's lifetime, and a second run stops before any work, naming the holder."""
    import train
    ckpt = str(tmp_path / "r.ckpt")
    with mt.checkpoint.held(ckpt):                      # a run in progress (this process)
        capsys.readouterr()
        assert train.main(["--no-progress", "--epochs", "1", "--checkpoint", ckpt]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is in use by another run" in err[0] and f"pid {os.getpid()}" in err[0], err
        assert not os.path.exists(ckpt)
    assert train.main(["--no-progress", "--epochs", "1", "--checkpoint", ckpt]) == 0   # free again
    assert os.path.exists(ckpt)


def test_a_killed_run_leaves_no_stuck_lock(tmp_path):
    """The lock is the kernel's (flock): a holder killed with SIGKILL releases it."""
    import signal
    import subprocess
    import sys
    ckpt = str(tmp_path / "r.ckpt")
    code = ("import sys, time, minitorch_fft as mt\n"
            f"with mt.checkpoint.held({ckpt!r}):\n    print('held', flush=True)\n    time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(mt.checkpoint.CheckpointError, match=f"in use by another run \\(pid {holder.pid}"):
            with mt.checkpoint.held(ckpt):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        with mt.checkpoint.held(ckpt):                  # the stale lock file holds nothing
            pass
    finally:
        if holder.poll() is None:
            holder.kill()


def test_a_file_of_someone_elses_at_the_lock_path_is_refused_and_kept(tmp_path):
    """--checkpoint poetry locks poetry.lock: a file there that is not a lock of ours (a user's
    poetry.lock) is refused, byte for byte untouched. An empty one, or one holding a number alone (an
    older version's lock, or someone's pid file), is locked as it is: neither written nor removed.
    One holding our mark (a run of ours left it) is ours: marked with this pid, removed at the end."""
    lock = tmp_path / "poetry.lock"
    lock.write_text("[[package]]\nname = 'x'\n")
    with pytest.raises(mt.checkpoint.CheckpointError, match="is not a checkpoint lock of minitorch-fft"):
        with mt.checkpoint.held(str(tmp_path / "poetry")):
            pass
    assert lock.read_text() == "[[package]]\nname = 'x'\n"
    for old in ("", "12345\n", " 7 \n"):
        lock.write_text(old)
        with mt.checkpoint.held(str(tmp_path / "poetry")):
            with pytest.raises(mt.checkpoint.CheckpointError, match=r"in use by another run \(pid unknown"):
                with mt.checkpoint.held(str(tmp_path / "poetry")):
                    pass
        assert lock.read_text() == old
    lock.write_text(f"{mt.checkpoint.LOCK_MARK}99999999\n")
    with mt.checkpoint.held(str(tmp_path / "poetry")):
        assert lock.read_text() == f"{mt.checkpoint.LOCK_MARK}{os.getpid()}\n"
    assert not lock.exists()


def test_a_run_leaves_no_lock_file_and_no_folder_it_made_empty(tmp_path):
    """The lock file goes when the run ends; the folders held() made for it go too where the run
    wrote nothing into them, and stay where it did."""
    ckpt = tmp_path / "a" / "b" / "r.ckpt"
    with mt.checkpoint.held(str(ckpt)):
        assert (tmp_path / "a" / "b" / "r.ckpt.lock").exists()
    assert not (tmp_path / "a").exists()
    with mt.checkpoint.held(str(ckpt)):
        mt.checkpoint.save(str(ckpt), mt.nn.Linear(2, 2))
    assert ckpt.exists() and os.listdir(tmp_path / "a" / "b") == ["r.ckpt"]


def test_a_lock_file_replaced_before_it_is_held_is_opened_again(tmp_path, monkeypatch):
    """A run that opened the lock file just before its holder ended (and removed it), and a third
    run made a new one: holding the old, removed file would let two runs in; it opens the path
    again and holds the file that is there."""
    if mt.checkpoint.fcntl is None:
        pytest.skip("no fcntl here")
    ckpt, lock = str(tmp_path / "r.ckpt"), tmp_path / "r.ckpt.lock"
    real, calls = mt.checkpoint.fcntl.flock, []

    def flock(fd, op):
        calls.append(op)
        if len(calls) == 1:                      # the holder removes it, another run makes it again (and ends)
            os.remove(lock)
            lock.write_text(f"{mt.checkpoint.LOCK_MARK}424242\n")
        return real(fd, op)
    monkeypatch.setattr(mt.checkpoint.fcntl, "flock", flock)
    with mt.checkpoint.held(ckpt):
        assert len(calls) == 2 and lock.read_text() == f"{mt.checkpoint.LOCK_MARK}{os.getpid()}\n"


def test_a_folder_another_run_removed_before_the_lock_was_made_is_made_again(tmp_path, monkeypatch):
    """Two runs into one new folder: the first ends and removes the folder (empty but for its lock)
    while the second is about to make its lock there; the second makes the folder again, and it is
    the second's to remove."""
    folder, real, calls = tmp_path / "new", os.open, []
    folder.mkdir()                                    # made by the first run, not this one

    def racing_open(path, flags, *mode):
        calls.append(path)
        if len(calls) == 1:
            os.rmdir(folder)                          # the first run's end, just now
        return real(path, flags, *mode)
    monkeypatch.setattr(mt.checkpoint.os, "open", racing_open)
    with mt.checkpoint.held(str(folder / "b.ckpt")):
        monkeypatch.setattr(mt.checkpoint.os, "open", real)
        assert (folder / "b.ckpt.lock").exists() and len(calls) == 2
    assert not folder.exists()


def test_the_lock_is_never_made_through_a_link(tmp_path):
    ckpt = tmp_path / "r.ckpt"
    (tmp_path / "r.ckpt.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(mt.checkpoint.CheckpointError, match="cannot (make|open)"):
        with mt.checkpoint.held(str(ckpt)):
            pass
    assert not (tmp_path / "elsewhere").exists()


def test_a_save_over_an_unreadable_file_says_so(tmp_path, monkeypatch):
    """A file that cannot be read cannot be told to be a checkpoint: refused, saying why (not "is not
    a checkpoint"), and left as it is."""
    import zipfile
    model, opt = small_model_and_opt(0)
    path = tmp_path / "run.ckpt"
    path.write_text("unreadable")

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(zipfile, "ZipFile", denied)
    with pytest.raises(ValueError, match="exists and cannot be read"):
        mt.checkpoint.save(str(path), model, opt, epoch=1)
    assert path.read_text() == "unreadable"


def test_partial_saves_of_a_killed_run_are_found_by_name_and_only_they(tmp_path):
    """A save writes `.<name>.<hash>.partial-XXXXXXXX.tmp` beside the checkpoint; a process killed
    mid-save leaves it, and remove_partial_saves takes exactly those away: not another checkpoint's
    (one whose name starts alike included), not a link (nor what it points to), not a file of
    another shape of name. A name of 245 bytes (80 CJK characters) still saves."""
    net = mt.models.get("digits", 10)
    path = tmp_path / "run.ckpt"
    mt.checkpoint.save(str(path), net)
    assert os.listdir(tmp_path) == ["run.ckpt"]               # a finished save leaves nothing beside it
    prefix = mt.checkpoint._partial_prefix
    ours = tmp_path / (prefix(str(path)) + "0123abcd.tmp")
    ours.write_bytes(b"x" * 10)
    target = tmp_path / "keep.bin"
    target.write_bytes(b"mine")
    kept = [tmp_path / (prefix(str(tmp_path / "run.ckpt2")) + "0123abcd.tmp"),
            tmp_path / (prefix(str(tmp_path / "run.ckpt.partial-x")) + "0123abcd.tmp"),
            tmp_path / (prefix(str(path)) + "0123abcd.txt"), target]
    for f in kept[:3]:
        f.write_bytes(b"y")
    (tmp_path / (prefix(str(path)) + "link.tmp")).symlink_to(target)
    assert mt.checkpoint.remove_partial_saves(str(path)) == [(str(ours), 10)]
    assert not ours.exists() and all(f.exists() for f in kept) and target.read_bytes() == b"mine"
    assert mt.checkpoint.remove_partial_saves(str(tmp_path / "none" / "x.ckpt")) == []   # no folder: nothing
    long = tmp_path / ("\u6a21" * 80 + ".ckpt")                 # 245 bytes: within a file name's 255
    mt.checkpoint.save(str(long), net)
    assert long.exists()
