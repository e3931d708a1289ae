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
