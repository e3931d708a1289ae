"""The training command line end to end (train.py, python -m minitorch_fft, minitorch_fft.cli):
the default run, its output, --help, checkpoints, resume, and bad input."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minitorch_fft import backends
import minitorch_fft as mt
from minitorch_fft import models
from minitorch_fft import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(*args, check=True):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--no-progress", *args],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_default_run_learns_the_digits():
    """`python train.py` with no arguments: the bundled digits, held-out accuracy >= 95%."""
    p = run_train()
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert {"test_accuracy", "epochs", "model", "backend", "device", "seconds"} <= set(result)
    assert result["model"] == "digits" and result["epochs"] == cli.DEFAULTS["epochs"]
    assert result["test_accuracy"] >= 0.95
    assert len(p.stdout.splitlines()) == 1                       # stdout is the JSON line alone
    assert p.stderr.splitlines()[-1].startswith("digits on ")    # the summary, for a person


def test_python_m_minitorch_fft_prints_the_summary_before_the_json():
    """`python -m minitorch_fft` runs the same command line; with stderr and stdout in one
    stream, the human summary line comes right before the JSON line, which is last."""
    p = subprocess.run([sys.executable, "-m", "minitorch_fft", "--no-progress", "--data", "fake", "--epochs", "1",
                        "--fake-size", "40", "--batch-size", "16", "--device", "cpu"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stdout
    *_, line, last = p.stdout.splitlines()
    result = json.loads(last)
    assert line == cli.summary(result, "cpu")
    assert line.startswith("digits on cpu: test accuracy ") and " after 1 epoch in " in line
    assert line.endswith(" images/s)")


def help_entries(*command):
    """--help's flags, each with its help text (joined across wrapped lines)."""
    p = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env={**os.environ, "COLUMNS": "100"})
    assert p.returncode == 0, p.stderr
    options = p.stdout.split("\noptions:\n")[1].split("\n\n")[0]
    entries, flag = {}, None
    for line in options.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line
        else:
            entries[flag] += " " + line.strip()
    return p.stdout, entries


def test_help_shows_every_flag_with_its_default_in_both_entry_points():
    text, entries = help_entries(os.path.join(ROOT, "train.py"))
    _, via_module = help_entries("-m", "minitorch_fft")
    assert sorted(entries) == sorted(via_module)
    parser_flags = {a.option_strings[0] for a in cli._parser()._actions}
    assert set(entries) == parser_flags and len(entries) > 20
    for flag, entry in entries.items():
        if flag != "-h":
            assert "(default" in entry, f"--help gives no default for {flag}: {entry}"
    assert "(default: 10)" in entries["--epochs"] and "(default: auto)" in entries["--backend"]
    assert "Exit codes" in text                            # the epilog: outputs and exit codes


def test_fake_data_smoke():
    result = json.loads(run_train("--data", "fake", "--epochs", "1", "--fake-size", "40",
                                  "--batch-size", "16", "--device", "cpu").stdout.splitlines()[-1])
    assert result["epochs"] == 1 and 0.0 <= result["test_accuracy"] <= 1.0


def test_resnet_trains_and_its_checkpoint_keeps_the_running_statistics(tmp_path, capsys):
    """--model resnet18 on fake 224x224 images: one step, then the checkpoint holds the batch
    norms' running statistics and batch counts beside the weights, and loads into a fresh model
    exactly (buffers included)."""
    ckpt = str(tmp_path / "r18.npz")
    assert cli.main(["--no-progress", "--model", "resnet18", "--backend", "gemm", "--data", "fake",
                     "--fake-size", "2", "--batch-size", "2", "--num-classes", "5", "--epochs", "1",
                     "--device", "cpu", "--checkpoint", ckpt]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["model"] == "resnet18"
    fresh = models.get("resnet18", num_classes=5)
    before = fresh.state_dict()
    mt.checkpoint.load(ckpt, fresh)
    state = fresh.state_dict()
    assert list(state) == list(before)
    assert int(state["layer4.1.bn2.num_batches_tracked"]) == 1 and state["bn1.num_batches_tracked"].dtype == np.int64
    assert not np.array_equal(state["layer1.0.bn1.running_mean"], before["layer1.0.bn1.running_mean"])
    with np.load(ckpt) as f:
        assert all(np.array_equal(f[f"model/{k}"], v) for k, v in state.items())


def test_resume_continues_the_same_run(tmp_path):
    """Two epochs, then two more from the checkpoint == four epochs straight (bit for bit)."""
    straight = train_history(4)
    ckpt = str(tmp_path / "run.ckpt")
    assert cli.main(["--no-progress", "--epochs", "4", "--checkpoint", ckpt, "--max-epochs-this-run", "2"]) == 0
    assert mt.checkpoint.load(ckpt, models.get("digits", 10))["epoch"] == 2
    assert cli.main(["--no-progress", "--epochs", "4", "--checkpoint", ckpt, "--resume"]) == 0
    meta = mt.checkpoint.load(ckpt, models.get("digits", 10))
    assert meta["epoch"] == 4
    assert meta["extra"]["progress"]["history"] == straight


def train_history(epochs):
    import io
    from contextlib import redirect_stdout
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli.main(["--no-progress", "--epochs", str(epochs)]) == 0
    return json.loads(buf.getvalue().splitlines()[-1])["history"]


@pytest.mark.parametrize("args,msg", [
    (["--data", "bogus"], "bad --data"),
    (["--data", "imagefolder:/no/such/dir"], "is not a directory"),
    (["--model", "alexnet"], "expects input"),
    (["--epochs", "0"], "positive integer"),
    (["--lr", "abc"], "expected a number"),
    (["--resume", "--checkpoint", "/no/such.ckpt"], "does not exist"),
    (["--device", "tpu"], "unknown device"),
    (["--seed", "-1"], "--seed: expected an integer >= 0"),
    (["--seed", "4294967296"], "seeds go up to 2**32 - 1; got --seed 4294967296"),
    (["--momentum", "1"], "--momentum: expected a number in [0, 1)"),
    (["--max-epochs-this-run", "1"], "--max-epochs-this-run needs --checkpoint"),
    (["--fake-size", "10"], "--fake-size applies to --data fake only"),
    (["--backend", "gemm", "--tune-report", "r.json"], "needs --backend auto"),
    (["--checkpoint", "tests"], "is a directory"),
    (["--tune-report", "README.md/r.json"], "cannot create its folder"),
    (["--tune-report", "README.md"], "already exists; a report never replaces a file"),
    (["--resume", "--checkpoint", "tests"], "is a directory"),
    (["--model", "resnet50", "--data", "fake", "--num-classes", "100000000"], "more than the"),
    (["--seed", str(2**64)], "--seed: expected an integer in [0, 2**64)"),   # a checkpoint keeps [0, 2**64)
    (["--workers", "4"], "--workers applies to --data imagefolder or cifar10 only"),
    (["--checkpoint", ""], "--checkpoint is an empty path"),
])
def test_bad_input_is_one_line_and_nonzero(args, msg):
    p = run_train(*args, check=False)
    assert p.returncode != 0
    assert msg in p.stderr and "Traceback" not in p.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize("flag", ["--tune-report", "--checkpoint"])
def test_a_folder_that_takes_no_file_is_refused_before_training(flag, capsys):
    """Writable is tried, not read from the mode bits: /proc passes os.access for root, and a run
    told to write there was refused only at its end (the report) or by a misleading lock message."""
    assert cli.main(["--no-progress", "--epochs", "1", flag, "/proc/minitorch_fft_x.json"]) == 2
    err = capsys.readouterr().err
    assert "its folder '/proc' is not writable" in err and "epoch 1/1" not in err


def test_outputs_never_replace_or_leave_what_the_run_did_not_make(tmp_path, capsys):
    """--tune-report never replaces a file (nor the run's own checkpoint); a run refused on its
    input makes no folder for its checkpoint; a finished run leaves its checkpoint and report, no
    lock file."""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert cli.main(["--no-progress", "--epochs", "1", "--tune-report", str(notes)]) == 2
    assert notes.read_text() == "mine"
    same = str(tmp_path / "same.ckpt")
    assert cli.main(["--no-progress", "--epochs", "1", "--checkpoint", same, "--tune-report", same]) == 2
    assert "is the --checkpoint path" in capsys.readouterr().err and not os.path.exists(same)
    lock = mt.checkpoint.lock_path(same)
    assert cli.main(["--no-progress", "--epochs", "1", "--checkpoint", same, "--tune-report", lock]) == 2
    assert "the checkpoint's lock file" in capsys.readouterr().err
    assert cli.main(["--no-progress", "--model", "alexnet", "--checkpoint", str(tmp_path / "new" / "x.ckpt")]) == 2
    assert not (tmp_path / "new").exists()
    ckpt, report = tmp_path / "run" / "r.ckpt", tmp_path / "reports" / "t.json"
    assert cli.main(["--no-progress", "--epochs", "1", "--checkpoint", str(ckpt), "--tune-report", str(report)]) == 0
    assert os.listdir(ckpt.parent) == ["r.ckpt"] and json.loads(report.read_text())


def test_paths_that_would_fail_or_replace_after_training_are_refused_before_it(tmp_path, capsys):
    """A path ending with a separator names a folder: refused before training (the save at the end of
    epoch 1 failed, the epoch lost; a report after the whole run). A symbolic link at --checkpoint is
    refused, the link left as it was (a save replaces the file at the path given: the link became a
    plain file)."""
    for flag in ("--checkpoint", "--tune-report"):
        assert cli.main(["--no-progress", "--epochs", "1", flag, str(tmp_path / "new") + os.sep]) == 2
        err = capsys.readouterr().err
        assert "ends with a path separator" in err and "epoch 1/1" not in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    link = tmp_path / "d.ckpt"
    link.symlink_to(tmp_path / "elsewhere" / "t.ckpt")
    assert cli.main(["--no-progress", "--epochs", "1", "--checkpoint", str(link)]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert link.is_symlink() and not (tmp_path / "elsewhere").exists()
    real = tmp_path / "real.ckpt"                                   # --resume through a link to a checkpoint
    assert cli.main(["--no-progress", "--epochs", "2", "--max-epochs-this-run", "1", "--checkpoint", str(real)]) == 0
    saved = real.read_bytes()
    link.unlink()
    link.symlink_to(real)
    assert cli.main(["--no-progress", "--epochs", "2", "--checkpoint", str(link), "--resume"]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert link.is_symlink() and real.read_bytes() == saved


def test_ctrl_c_before_training_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C while the model is built or the data read (the training loop saves and returns 130 itself)."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "load_data", interrupted)
    assert cli.main(["--no-progress", "--epochs", "1"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "train.py: interrupted (Ctrl-C)"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_an_image_folder_is_a_bad_image_not_a_hang(tmp_path, capsys):
    """Opening a FIFO blocks until a writer comes: the image check refuses anything but a regular file."""
    pytest.importorskip("torchvision")
    from PIL import Image
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    os.mkfifo(tmp_path / "a" / "x.png")
    assert cli.main(["--no-progress", "--model", "digits", "--data", f"imagefolder:{tmp_path}", "--epochs", "1"]) == 2
    assert "x.png: not a regular file (a FIFO, socket or device)" in capsys.readouterr().err


def test_a_run_resumed_in_chunks_replaces_its_own_report(tmp_path):
    """--max-epochs-this-run with --tune-report: each chunk, the same command with --resume, writes
    the report again over its own (a report at another path is still never replaced)."""
    ckpt, report = str(tmp_path / "c.ckpt"), tmp_path / "r.json"
    args = ["--no-progress", "--epochs", "2", "--max-epochs-this-run", "1", "--checkpoint", ckpt,
            "--tune-report", str(report)]
    assert cli.main(args) == 0 and json.loads(report.read_text())
    report.write_text("[]")
    assert cli.main(args + ["--resume"]) == 0 and json.loads(report.read_text()) != []
    other = tmp_path / "other.json"
    other.write_text("mine")
    assert cli.main(args[:-1] + [str(other), "--resume"]) == 2 and other.read_text() == "mine"


def test_a_large_seed_trains_where_the_data_takes_it_and_sizing_draws_nothing():
    """--seed beyond 2**32 - 1 is refused only where the data needs NumPy's legacy seeds (the digits'
    split): fake data takes it. Sizing a model of many classes leaves the random state as it was."""
    assert cli.main(["--no-progress", "--data", "fake", "--fake-size", "16", "--batch-size", "8", "--epochs", "1",
                     "--seed", str(2**40)]) == 0
    mt.manual_seed(0)
    before = json.dumps(mt.random.get_state(), sort_keys=True, default=str)
    cli.check_model_fits("digits", cli.BIG_HEAD + 1, "cpu")
    assert json.dumps(mt.random.get_state(), sort_keys=True, default=str) == before


def test_a_report_written_over_a_file_made_meanwhile_is_refused(tmp_path):
    """atomic_file(replace=False): where something appeared at the path while the run went on, it
    stays as it is, and no temporary file is left."""
    from minitorch_fft.utils import atomic_file
    path = tmp_path / "r.json"
    with atomic_file(str(path), replace=False) as f:
        f.write("new")
    assert path.read_text() == "new"
    with pytest.raises(FileExistsError, match="appeared while it was being written"):
        with atomic_file(str(path), replace=False) as f:
            f.write("newer")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["r.json"]


def test_imagefolder_and_cifar10_read_local_files(tmp_path, capsys):
    """A tiny ImageFolder tree (two classes of 12x12 RGB images) trains end to end; a folder
    without CIFAR-10 in it is a one-line error, never a download."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for cls in ("cats", "dogs"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(tmp_path / "imgs" / cls / f"{i}.png")
    assert cli.main(["--no-progress", "--data", f"imagefolder:{tmp_path / 'imgs'}", "--epochs", "1",
                       "--batch-size", "4"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["data"].startswith("imagefolder:") and 0.0 <= result["test_accuracy"] <= 1.0
    (tmp_path / "empty").mkdir()
    p = run_train("--data", f"cifar10:{tmp_path / 'empty'}", "--model", "alexnet", check=False)
    assert p.returncode == 2 and "no CIFAR-10 found" in p.stderr and "Traceback" not in p.stderr
    assert "cifar-10-batches-py" in p.stderr and "download" not in p.stderr   # train.py never downloads


def test_a_resnet_trains_on_an_imagefolder(tmp_path, capsys):
    """--model resnet18 --data imagefolder:PATH: small RGB images resized to 224x224, one epoch."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for cls in ("cats", "dogs"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    assert cli.main(["--no-progress", "--model", "resnet18", "--backend", "gemm", "--device", "cpu",
                     "--data", f"imagefolder:{tmp_path}", "--epochs", "1", "--batch-size", "8"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["model"] == "resnet18" and 0.0 <= result["test_accuracy"] <= 1.0


@pytest.mark.parametrize("backend", ["cufft", "fbfft"])
def test_steps_share_spectra_by_default_and_it_changes_nothing(backend, monkeypatch, capsys):
    """Every step runs in its own reuse_spectra() block, where the digits net's two conv layers
    save 3 FFTs (conv2: x, gy; conv1, whose image wants no gradient: x; weight spectra are not
    kept by default), and the run equals one with --no-reuse-spectra bit for bit."""
    caches, real = [], backends.reuse_spectra

    @contextlib.contextmanager
    def recording():
        with real() as cache:
            yield cache
        caches.append(cache)

    def run(*extra):
        assert cli.main(["--no-progress", "--backend", backend, "--data", "fake", "--fake-size", "48",
                           "--batch-size", "16", "--epochs", "2", *extra]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[-1])

    monkeypatch.setattr(backends, "reuse_spectra", recording)
    shared = run()
    assert shared["reuse_spectra"] and len(caches) == 2 * 3                       # 2 epochs x 3 batches
    assert [c.hits for c in caches] == [3] * 6
    plain = run("--no-reuse-spectra")
    assert not plain["reuse_spectra"] and len(caches) == 6                        # no block this time
    assert shared["history"] == plain["history"]


def test_resume_takes_the_runs_flags_from_the_checkpoint(tmp_path, capsys):
    """--resume alone continues a run started with other flags; a flag given again with another
    value is refused (it would change the data order or the schedule); a checkpoint already on
    disk is never overwritten by a new run."""
    ckpt = str(tmp_path / "run.ckpt")
    run = ["--no-progress", "--checkpoint", ckpt]
    assert cli.main(run + ["--backend", "gemm", "--epochs", "3", "--batch-size", "64", "--lr", "0.1",
                             "--max-epochs-this-run", "1"]) == 0
    capsys.readouterr()
    assert cli.main(run + ["--resume", "--batch-size", "32"]) == 2
    assert "--batch-size 32 differs from the checkpoint's 64" in capsys.readouterr().err
    with pytest.raises(ValueError, match="already exists; --resume continues"):
        cli.run(run)                                       # without main's one-line handling
    assert cli.main(run + ["--resume"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["epochs"] == 3 and result["backend"] == "gemm"
    saved = mt.checkpoint.header(ckpt)["extra"]["args"]
    assert (saved["batch_size"], saved["lr"], saved["epochs"]) == (64, 0.1, 3)
    assert [h["lr"] for h in result["history"]] == pytest.approx([0.1, 0.075, 0.025])   # cosine over 3


def test_resume_accepts_the_fake_data_flags_it_was_started_with(tmp_path, capsys):
    ckpt = str(tmp_path / "fake.ckpt")
    run = ["--no-progress", "--checkpoint", ckpt, "--data", "fake", "--fake-size", "32", "--backend", "gemm"]
    assert cli.main(run + ["--epochs", "2", "--max-epochs-this-run", "1"]) == 0
    capsys.readouterr()
    assert cli.main(["--no-progress", "--checkpoint", ckpt, "--resume", "--fake-size", "32"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["epochs"] == 2
    assert cli.main(["--no-progress", "--checkpoint", ckpt, "--resume", "--fake-size", "16"]) == 2
    assert "--fake-size 16 differs from the checkpoint's 32" in capsys.readouterr().err


def test_a_checkpoint_not_written_by_train_py_cannot_be_resumed(tmp_path):
    ckpt = str(tmp_path / "lib.ckpt")
    net = models.get("digits", 10)
    mt.checkpoint.save(ckpt, net, mt.optim.SGD(net.parameters(), lr=0.1))
    p = run_train("--checkpoint", ckpt, "--resume", check=False)
    assert p.returncode == 2 and "not written by train.py" in p.stderr and "Traceback" not in p.stderr


def test_a_diverging_run_stops_without_saving(tmp_path):
    """A loss of NaN/inf stops the run with exit code 3: no NaN weights saved, no JSON with NaN."""
    ckpt = tmp_path / "run.ckpt"
    p = run_train("--backend", "gemm", "--lr", "1e6", "--epochs", "2", "--checkpoint", str(ckpt), check=False)
    assert p.returncode == cli.EXIT_DIVERGED, p.stderr
    assert "the loss became" in p.stderr and "Traceback" not in p.stderr and "Warning" not in p.stderr
    assert "no epoch had finished, so there is no checkpoint" in p.stderr   # not "keeps the last good epoch"
    assert p.stdout.strip() == "" and not ckpt.exists()


def test_a_batch_whose_saved_activations_cannot_fit_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """Where the kernel overcommits, a batch too large for the host ran until the OOM killer ended it
    (exit 137, no message): what a step keeps for backward is sized first, and the batch that fits named."""
    per_image = mt.training.saved_bytes_per_image(models.get("digits"), models.input_shape("digits"))
    assert per_image > 0
    limit = 10 * per_image + per_image // 2                 # ten images fit, the default 32 do not
    monkeypatch.setattr(cli, "available_bytes", lambda xp: (limit, "of memory available on the host (MemAvailable)"))
    ckpt = tmp_path / "run.ckpt"
    rc = cli.main(["--no-progress", "--epochs", "1", "--checkpoint", str(ckpt)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "a training step on a batch of 32 images of (1, 8, 8) keeps at least" in err, err
    assert "the host (MemAvailable); --batch-size 10 is the most that could fit" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
    assert cli.main(["--no-progress", "--epochs", "1", "--batch-size", "10"]) == 0, capsys.readouterr().err


def test_the_saved_activations_bound_a_step_from_below_and_change_nothing():
    """saved_bytes_per_image against NumPy's own count of a real step's allocations (tracemalloc): at most
    what the step takes, and not vacuous. The model comes back as it was: backends, mode, weights, statistics."""
    import tracemalloc
    mt.manual_seed(0)
    net = models.get("resnet18", num_classes=10, backend="direct")
    frozen = net.bn1.eval()                                # a frozen batch norm stays frozen
    before = {k: v.copy() for k, v in net.state_dict().items()}
    rng = mt.random.get_state()
    per_image = mt.training.saved_bytes_per_image(net, models.input_shape("resnet18"))
    assert [m.backend for m in net.modules() if isinstance(m, mt.nn.SpatialConvolution)] == ["direct"] * 20
    assert net.training and not frozen.training and mt.random.get_state() == rng
    assert all(m.training for m in net.modules() if m is not frozen)
    assert all(np.array_equal(v, before[k]) for k, v in net.state_dict().items())
    # on the GPU a ReLU's mask is a bit a value (fused.relu), not a byte: less, by at most a mask's 7/8
    on_gpu = mt.training.saved_bytes_per_image(net, models.input_shape("resnet18"), "cuda")
    assert 0.75 * per_image < on_gpu < per_image
    frozen.train()
    for m in net.modules():
        if isinstance(m, mt.nn.SpatialConvolution):
            m.backend = "gemm"
    opt, crit = mt.optim.SGD(net.parameters(), lr=0.01, momentum=0.9), mt.CrossEntropyCriterion()
    x, y = mt.Tensor(np.random.default_rng(0).random((4, 3, 224, 224), np.float32)), np.arange(4)
    mt.train_step(net, crit, opt, x, y)                    # gradients and momentum made: not the step's
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        mt.train_step(net, crit, opt, x, y)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert 0.3 * peak <= 4 * per_image <= peak, (4 * per_image, peak)


def test_out_of_memory_while_training_is_one_line_and_exit_5(tmp_path, monkeypatch, capsys):
    """What a step keeps for backward is a lower bound of what it takes: NumPy's (or CuPy's) MemoryError
    in a step is one line and its own exit code, the checkpoint's lock released."""
    ckpt = tmp_path / "run.ckpt"

    def no_memory(*args, **kwargs):
        return np.empty(1 << 55, np.float32)            # 128 PiB: NumPy's own MemoryError
    monkeypatch.setattr(mt, "train_step", no_memory)
    rc = cli.main(["--no-progress", "--epochs", "1", "--checkpoint", str(ckpt)])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_OUT_OF_MEMORY == 5, err
    assert "out of memory at the start of epoch 1 (Unable to allocate" in err and "--batch-size" in err
    assert "no epoch had finished, so there is no checkpoint" in err
    assert "Traceback" not in err and not ckpt.exists()
    assert list(tmp_path.iterdir()) == []                  # no lock or folder left behind


def test_out_of_memory_before_training_is_bad_inputs_exit_2(monkeypatch, capsys):
    """Reading the data or a checkpoint: what the README counts as bad input (exit 2), not exit 5."""
    def no_memory(*args, **kwargs):
        return np.empty(1 << 55, np.float32)
    monkeypatch.setattr(cli, "load_data", no_memory)
    assert cli.main(["--no-progress", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: out of memory before training (Unable to allocate" in err and "Traceback" not in err


def test_sigterm_saves_like_ctrl_c(tmp_path):
    ckpt = str(tmp_path / "run.ckpt")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--no-progress", "--epochs", "50",
                             "--checkpoint", ckpt], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while not os.path.exists(ckpt) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)                       # the first epoch's checkpoint: training is under way
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM: interrupted in epoch" in err and "Traceback" not in err
    assert 1 <= mt.checkpoint.load(ckpt, models.get("digits", 10))["epoch"] < 50


def test_a_backend_that_does_not_run_on_the_device_is_refused_before_training(monkeypatch, capsys):
    """cudnn runs on the GPU only: with --device cpu it is one line and exit 2, before the data or
    the model."""
    monkeypatch.setattr(cli, "load_data", lambda *a, **k: pytest.fail("the data was loaded"))
    assert cli.main(["--backend", "cudnn", "--device", "cpu", "--epochs", "1", "--no-progress"]) == 2
    assert "--backend cudnn does not run on the CPU (it runs on: cuda)" in capsys.readouterr().err


def test_a_runs_place_is_counted_as_the_progress_bars_count():
    assert cli._place(2, 25, 40) == "in epoch 3 after batch 25"
    assert cli._place(1, 0, 3) == "at the start of epoch 2"
    assert cli._place(1, 0, 1) == "after its last epoch (1 of 1)"   # a finished run resumed: no epoch 2


# -- what a user meets when something goes wrong (a CPU audit of the command line, session 69) --------------

def test_argparse_errors_are_one_line_too():
    """The README promises one line for bad input: argparse printed its usage block first."""
    for args in (["--batch-size", "0"], ["--model", "foo"], ["--resume"]):
        p = run_train(*args, check=False)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert p.stderr.startswith("train.py: error: ") and "usage:" not in p.stderr


def test_a_misspelt_setting_is_refused_by_name(monkeypatch, capsys):
    monkeypatch.setenv("MINITORCH_CGEM_TF32", "1")
    with pytest.raises(SystemExit) as help_exit:        # --help answers whatever the environment holds
        cli.main(["--help"])
    assert help_exit.value.code == 0 and "--max-epochs-this-run" in capsys.readouterr().out
    monkeypatch.setattr(cli, "load_data", lambda *a, **k: pytest.fail("the data was loaded"))
    assert cli.main(["--no-progress", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "MINITORCH_CGEM_TF32 is not a setting of minitorch-fft (did you mean MINITORCH_CGEMM_TF32?)" in err
    assert backends.config.unknown_variables({"MINITORCH_DEBUG": "1", "PATH": "/bin"}) == []


def test_a_tune_cache_that_cannot_serve_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """MINITORCH_TUNE_CACHE at a folder, at a file that is not a tuning cache (left as it is), or at a
    new file whose folder cannot be written: one line before any work, not warnings mid-run."""
    monkeypatch.setattr(cli, "load_data", lambda *a, **k: pytest.fail("the data was loaded"))
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": 1}')
    cases = [(tmp_path, "is a directory"), (mine, "it is not a tuning cache this code wrote")]
    if os.path.isdir("/proc/self"):
        cases.append(("/proc/minitorch_fft_x.json", "its folder '/proc' is not writable"))
    for path, msg in cases:
        with backends.config.override(tune_cache=str(path)):
            assert cli.main(["--no-progress", "--epochs", "1"]) == 2
        err = capsys.readouterr().err
        assert msg in err and "MINITORCH_TUNE_CACHE" in err and len(err.strip().splitlines()) == 1, err
    assert mine.read_text() == '{"mine": 1}'
    # and what can serve passes: a cache of its own (read-only too), a link to one, a new file in a
    # folder to be made, a relative path
    own = tmp_path / "own.json"
    backends.tuning.TuneCache(own).put(backends.tuning.key(np, np.float32, (1, 2, 3), "fprop", "auto"), "gemm")
    link = tmp_path / "link.json"
    link.symlink_to(own)
    frozen = tmp_path / "frozen.json"
    frozen.write_text(own.read_text())
    frozen.chmod(0o444)
    monkeypatch.chdir(tmp_path)
    for path in (own, link, frozen, tmp_path / "new" / "sub" / "c.json", "rel.json"):
        with backends.config.override(tune_cache=str(path)):
            cli.check_tune_cache()
    assert not (tmp_path / "new").exists()             # nothing made by the check


def test_the_librarys_warnings_are_one_line_each(monkeypatch, capsys):
    import warnings

    def warn_once():
        warnings.warn("cannot write autotune cache x (read-only); keeping choices in memory only")
    monkeypatch.setattr(cli, "check_tune_cache", warn_once)
    assert cli.main(["--no-progress", "--epochs", "1"]) == 0
    err = capsys.readouterr().err
    assert "train.py: warning: cannot write autotune cache x (read-only)" in err and "UserWarning" not in err


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_exit_6(tmp_path, monkeypatch, capsys):
    """A full disk while training: which file, where the run stood, what stays; not exit 2 (bad input)."""
    ckpt, real_save, calls = tmp_path / "run.ckpt", mt.checkpoint.save, []

    def full_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(*args, **kwargs)
    monkeypatch.setattr(mt.checkpoint, "save", full_on_the_second)
    assert cli.main(["--no-progress", "--epochs", "3", "--checkpoint", str(ckpt)]) == cli.EXIT_WRITE_FAILED == 6
    err = capsys.readouterr().err
    assert (f"could not save --checkpoint {str(ckpt)!r} at the start of epoch 3 (No space left on device); "
            f"{ckpt} keeps the run as last saved") in err
    assert mt.checkpoint.header(str(ckpt))["epoch"] == 1
    calls.clear()
    calls.append(1)                                      # the first save fails: nothing on disk
    other = tmp_path / "other.ckpt"
    assert cli.main(["--no-progress", "--epochs", "1", "--checkpoint", str(other)]) == 6
    assert "no save of the run succeeded, so there is no checkpoint" in capsys.readouterr().err


def test_a_checkpoint_path_made_a_folder_mid_run_is_exit_6(tmp_path, monkeypatch, capsys):
    """save() refuses to replace what is not a checkpoint (ValueError): after training has started that
    is a write that failed, exit 6, not bad input's 2."""
    ckpt, real_save, calls = tmp_path / "run.ckpt", mt.checkpoint.save, []

    def made_a_folder(path, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.remove(path)
            os.mkdir(path)
        return real_save(path, *args, **kwargs)
    monkeypatch.setattr(mt.checkpoint, "save", made_a_folder)
    assert cli.main(["--no-progress", "--epochs", "3", "--checkpoint", str(ckpt)]) == 6
    err = capsys.readouterr().err
    assert f"could not save --checkpoint {str(ckpt)!r} at the start of epoch 3" in err and "is a directory" in err


def test_a_report_that_cannot_be_written_keeps_the_result_and_exits_6(tmp_path, monkeypatch, capsys):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(cli, "write_report", full)
    report = tmp_path / "r.json"
    assert cli.main(["--no-progress", "--epochs", "1", "--tune-report", str(report)]) == 6
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[-1])["epochs"] == 1
    assert f"could not write --tune-report {str(report)!r} (No space left on device); the run's result is the JSON" in err


def test_a_second_signal_stops_at_once_and_leaves_no_partial_save(tmp_path, monkeypatch, capsys):
    """SIGTERM, then SIGTERM again while the checkpoint is being written (schedulers send a second
    one): the save is abandoned, its temporary file removed; it used to be killed there, leaving
    the partial file (hundreds of MB for AlexNet) beside the checkpoint for good."""
    import functools
    ckpt = tmp_path / "run.ckpt"

    def savez(file, **arrays):
        file.write(b"half a checkpoint")
        os.kill(os.getpid(), signal.SIGTERM)            # the second, mid-save
        time.sleep(1)
        pytest.fail("the second signal did not stop the save")
    monkeypatch.setattr(mt, "train_step", functools.partial(_first_then, mt.train_step, []))   # the first
    monkeypatch.setattr(mt.checkpoint.np, "savez", savez)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["--no-progress", "--epochs", "1", "--checkpoint", str(ckpt)]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert ("SIGTERM again: stopped at once in epoch 1 after batch 1; no epoch had finished, so there is no "
            "checkpoint") in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []               # no partial save, no lock
    assert signal.getsignal(signal.SIGTERM) is before   # the handlers before the run are back


def test_a_second_signal_after_the_saves_rename_says_the_checkpoint_is_there(tmp_path, monkeypatch, capsys):
    """The save had renamed its file into place (its folder's fsync still to come) when the second signal
    came: the message says the checkpoint holds the run, as it does."""
    import functools
    from minitorch_fft.backends import utils as backend_utils
    ckpt = tmp_path / "run.ckpt"

    def fsync_dir(folder):
        os.kill(os.getpid(), signal.SIGTERM)            # the second, after os.replace
        time.sleep(1)
        pytest.fail("the second signal did not stop the run")
    monkeypatch.setattr(mt, "train_step", functools.partial(_first_then, mt.train_step, []))
    monkeypatch.setattr(backend_utils, "_fsync_dir", fsync_dir)
    assert cli.main(["--no-progress", "--epochs", "1", "--checkpoint", str(ckpt)]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert f"SIGTERM again: stopped at once in epoch 1 after batch 1; {ckpt} keeps the run as last saved" in err
    assert mt.checkpoint.header(str(ckpt))["extra"]["progress"]["batch"] == 1


def _first_then(real_step, sent, *args, **kwargs):
    """A training step that sends this process SIGTERM after its first call (the first signal: the step
    finishes, the run saves and stops)."""
    out = real_step(*args, **kwargs)
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
    return out


def test_a_second_signal_outside_the_loop_is_one_line(monkeypatch, capsys):
    def stop(*args, **kwargs):
        raise cli._StopNow(signal.SIGTERM)
    monkeypatch.setattr(cli, "run", stop)
    assert cli.main([]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == "train.py: SIGTERM again: stopped at once"


def test_partial_saves_a_killed_run_left_are_removed_by_the_next(tmp_path, capsys):
    ckpt = tmp_path / "run.ckpt"
    left = tmp_path / (mt.checkpoint._partial_prefix(str(ckpt)) + "abcd1234.tmp")
    left.write_bytes(b"x" * 1000)
    others = [tmp_path / (mt.checkpoint._partial_prefix(str(tmp_path / "other.ckpt")) + "abcd1234.tmp"),
              tmp_path / ".ckpt-abcd1234.tmp", tmp_path / (mt.checkpoint._partial_prefix(str(ckpt)) + "notes.txt")]
    for f in others:
        f.write_text("not this run's")
    assert cli.main(["--no-progress", "--epochs", "1", "--checkpoint", str(ckpt)]) == 0
    assert f"removed {left} (1000 B), what was written of a save before its run was killed" in capsys.readouterr().err
    assert not left.exists() and all(f.read_text() == "not this run's" for f in others)


def test_ctrl_c_while_the_package_loads_is_one_line():
    code = ("import builtins, runpy, sys\n"
            "real = builtins.__import__\n"
            "def interrupted(name, *args, **kwargs):\n"
            "    if name == 'minitorch_fft.cli':\n"
            "        raise KeyboardInterrupt\n"
            "    return real(name, *args, **kwargs)\n"
            "builtins.__import__ = interrupted\n"
            "sys.argv = ['train.py']\n"
            "runpy.run_path('train.py', run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 130 and p.stderr.strip() == "train.py: interrupted (Ctrl-C)", p.stderr


def test_a_run_stopped_by_max_epochs_this_run_says_so(tmp_path, capsys):
    ckpt = str(tmp_path / "c.ckpt")
    assert cli.main(["--no-progress", "--epochs", "3", "--max-epochs-this-run", "1", "--checkpoint", ckpt]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out.splitlines()[-1])
    assert (result["epochs"], result["epochs_planned"], result["finished"]) == (1, 3, False)
    assert "after 1 of 3 epochs (stopped by --max-epochs-this-run; --resume continues)" in err
    assert cli.main(["--no-progress", "--checkpoint", ckpt, "--resume"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (result["epochs"], result["finished"]) == (3, True)


def test_resume_compares_flags_as_the_run_used_them(tmp_path, capsys):
    """A fake digits run's --num-classes default is 10: --num-classes 10 on --resume is the same run.
    A flag of another data source gets a new run's message, not a comparison with a stored value."""
    fake, digits = str(tmp_path / "f.ckpt"), str(tmp_path / "d.ckpt")
    assert cli.main(["--no-progress", "--data", "fake", "--fake-size", "32", "--epochs", "2",
                     "--max-epochs-this-run", "1", "--checkpoint", fake]) == 0
    assert cli.main(["--no-progress", "--epochs", "2", "--max-epochs-this-run", "1", "--checkpoint", digits]) == 0
    capsys.readouterr()
    assert cli.main(["--no-progress", "--checkpoint", fake, "--resume", "--num-classes", "20"]) == 2
    assert "--num-classes 20 differs from the checkpoint's 10" in capsys.readouterr().err
    assert cli.main(["--no-progress", "--checkpoint", digits, "--resume", "--fake-size", "5"]) == 2
    assert "--fake-size applies to --data fake only (got --data digits)" in capsys.readouterr().err
    assert cli.main(["--no-progress", "--checkpoint", fake, "--resume", "--num-classes", "10"]) == 0


def test_a_resumed_run_refuses_an_image_folder_changed_since(tmp_path, monkeypatch, capsys):
    """Images added or renamed between the chunks of a run: the split and the batches would not be
    the run's. `~` in --data is the home folder (the shell does not expand it after `imagefolder:`)."""
    pytest.importorskip("torchvision")
    from PIL import Image
    monkeypatch.setenv("HOME", str(tmp_path))
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "imgs" / cls / f"{i}.png")
    ckpt = str(tmp_path / "run.ckpt")
    run = ["--no-progress", "--checkpoint", ckpt, "--batch-size", "2"]
    assert cli.main(run + ["--data", "imagefolder:~/imgs", "--epochs", "3", "--max-epochs-this-run", "1"]) == 0
    assert mt.checkpoint.header(ckpt)["extra"]["data"]["images"] == 8
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "imgs" / "a" / "4.png")
    capsys.readouterr()
    assert cli.main(run + ["--resume"]) == 2
    assert "--data imagefolder:~/imgs now holds 9 images where the checkpoint's run read 8" in capsys.readouterr().err
    os.rename(tmp_path / "imgs" / "a" / "4.png", tmp_path / "imgs" / "b" / "9.png")
    os.remove(tmp_path / "imgs" / "b" / "0.png")
    assert cli.main(run + ["--resume"]) == 2
    assert "8 images, as the checkpoint's run did, but not the same files" in capsys.readouterr().err
    os.rename(tmp_path / "imgs" / "b" / "9.png", tmp_path / "imgs" / "b" / "0.png")   # back as it was
    assert cli.main(run + ["--resume", "--max-epochs-this-run", "1"]) == 0


def test_resume_while_another_run_holds_the_path_says_so(tmp_path, capsys):
    """Before its first save a run holds the lock but no file: 'in use by another run', not 'does not exist'."""
    ckpt = str(tmp_path / "run.ckpt")
    with mt.checkpoint.held(ckpt):
        assert cli.main(["--no-progress", "--checkpoint", ckpt, "--resume"]) == 2
    assert f"checkpoint {ckpt!r} is in use by another run (pid {os.getpid()}" in capsys.readouterr().err


def test_slow_rates_keep_their_digits():
    assert (cli.rate(0.41), cli.rate(9.96), cli.rate(12.4), cli.rate(12345.2)) == ("0.41", "10", "12", "12,345")
