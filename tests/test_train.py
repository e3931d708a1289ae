"""train.py end to end: the default run, checkpoints, resume, and bad input."""
import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import backends
import minitorch_fft as mt
import models
import train

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
    assert result["model"] == "digits" and result["epochs"] == train.DEFAULTS["epochs"]
    assert result["test_accuracy"] >= 0.95


def test_fake_data_smoke():
    result = json.loads(run_train("--data", "fake", "--epochs", "1", "--fake-size", "40",
                                  "--batch-size", "16", "--device", "cpu").stdout.splitlines()[-1])
    assert result["epochs"] == 1 and 0.0 <= result["test_accuracy"] <= 1.0


def test_resume_continues_the_same_run(tmp_path):
    """Two epochs, then two more from the checkpoint == four epochs straight (bit for bit)."""
    straight = train_history(4)
    ckpt = str(tmp_path / "run.ckpt")
    assert train.main(["--no-progress", "--epochs", "4", "--checkpoint", ckpt, "--max-epochs-this-run", "2"]) == 0
    assert mt.checkpoint.load(ckpt, models.get("digits", 10))["epoch"] == 2
    assert train.main(["--no-progress", "--epochs", "4", "--checkpoint", ckpt, "--resume"]) == 0
    meta = mt.checkpoint.load(ckpt, models.get("digits", 10))
    assert meta["epoch"] == 4
    assert meta["extra"]["progress"]["history"] == straight


def train_history(epochs):
    import io
    from contextlib import redirect_stdout
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert train.main(["--no-progress", "--epochs", str(epochs)]) == 0
    return json.loads(buf.getvalue().splitlines()[-1])["history"]


@pytest.mark.parametrize("args,msg", [
    (["--data", "bogus"], "bad --data"),
    (["--data", "imagefolder:/no/such/dir"], "is not a directory"),
    (["--model", "alexnet"], "expects input"),
    (["--epochs", "0"], "positive integer"),
    (["--lr", "abc"], "expected a number"),
    (["--resume", "--checkpoint", "/no/such.ckpt"], "does not exist"),
    (["--device", "tpu"], "unknown device"),
])
def test_bad_input_is_one_line_and_nonzero(args, msg):
    p = run_train(*args, check=False)
    assert p.returncode != 0
    assert msg in p.stderr and "Traceback" not in p.stderr


def test_imagefolder_and_cifar10_read_local_files(tmp_path, capsys):
    """A tiny ImageFolder tree (two classes of 12x12 RGB images) trains end to end; a folder
    without CIFAR-10 in it is a one-line error, never a download."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for cls in ("cats", "dogs"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(tmp_path / "imgs" / cls / f"{i}.png")
    assert train.main(["--no-progress", "--data", f"imagefolder:{tmp_path / 'imgs'}", "--epochs", "1",
                       "--batch-size", "4"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["data"].startswith("imagefolder:") and 0.0 <= result["test_accuracy"] <= 1.0
    (tmp_path / "empty").mkdir()
    p = run_train("--data", f"cifar10:{tmp_path / 'empty'}", "--model", "alexnet", check=False)
    assert p.returncode == 2 and "no CIFAR-10 found" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("backend", ["cufft", "fbfft"])
def test_steps_share_spectra_by_default_and_it_changes_nothing(backend, monkeypatch, capsys):
    """Every step runs in its own reuse_spectra() block, where the digits net's two conv layers
    save 4 FFTs (conv2: w, x, gy; conv1, whose image wants no gradient: x), and the run equals
    one with --no-reuse-spectra bit for bit."""
    caches, real = [], backends.reuse_spectra

    @contextlib.contextmanager
    def recording():
        with real() as cache:
            yield cache
        caches.append(cache)

    def run(*extra):
        assert train.main(["--no-progress", "--backend", backend, "--data", "fake", "--fake-size", "48",
                           "--batch-size", "16", "--epochs", "2", *extra]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[-1])

    monkeypatch.setattr(backends, "reuse_spectra", recording)
    shared = run()
    assert shared["reuse_spectra"] and len(caches) == 2 * 3                       # 2 epochs x 3 batches
    assert [c.hits for c in caches] == [4] * 6
    plain = run("--no-reuse-spectra")
    assert not plain["reuse_spectra"] and len(caches) == 6                        # no block this time
    assert shared["history"] == plain["history"]
