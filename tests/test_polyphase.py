"""The polyphase backend (strided layers as stride-1 FFT convolutions) against PyTorch float64."""
import numpy as np
import pytest

import backends
from backends import cufft, fbfft, polyphase
from conftest import DEVICES
from reference import check_backend

CASES = [  # (S, f, f', h, w, kh, kw, stride, padding)
    (2, 3, 4, 23, 23, 11, 11, (4, 4), (2, 2)),   # AlexNet conv1's shape, scaled down
    (2, 3, 4, 27, 27, 11, 11, (4, 4), (0, 0)),   # OverFeat conv1's: 27 - 11 = 16, divisible by 4
    (2, 3, 2, 26, 25, 11, 11, (4, 4), (0, 0)),   # input rows past the last window (gradient 0)
    (3, 2, 5, 13, 12, 4, 3, (2, 3), (1, 2)),     # rectangular stride and padding
    (2, 2, 3, 9, 9, 3, 3, (2, 1), (1, 1)),       # stride in one direction only
    (1, 1, 1, 7, 7, 2, 2, (2, 2), (3, 3)),       # padding larger than the kernel
    (2, 2, 2, 5, 5, 5, 5, (3, 3), (0, 0)),       # one output: kernel = input
    (2, 2, 2, 8, 8, 1, 1, (2, 2), (0, 0)),       # 1 x 1 kernel: one phase carries every tap
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_three_passes_match_the_reference(device, case, rng):
    S, f, fo, h, w, kh, kw, stride, pad = case
    x = rng.standard_normal((S, f, h, w)).astype(np.float32)
    wt = rng.standard_normal((fo, f, kh, kw)).astype(np.float32)
    check_backend(polyphase, x, wt, stride, pad, device=device, rng=rng)


def test_phase_geometry_of_the_networks_first_layers():
    g = backends.geometry((128, 3, 224, 224), (64, 3, 11, 11), 4, 2)            # AlexNet conv1
    assert polyphase.inner_shapes(g) == ((128, 48, 57, 57), (64, 48, 3, 3))
    assert polyphase._inner(g) is fbfft
    g = backends.geometry((128, 3, 231, 231), (96, 3, 11, 11), 4, 0)            # OverFeat-fast conv1
    assert polyphase.inner_shapes(g) == ((128, 48, 58, 58), (96, 48, 3, 3))
    assert polyphase.supports((128, 3, 231, 231), (96, 3, 11, 11), (4, 4), (0, 0))


def test_supports_and_errors():
    assert not polyphase.supports((1, 1, 13, 13), (1, 1, 3, 3), (1, 1), (1, 1))   # stride 1: not for it
    assert not polyphase.supports((1, 1, 13, 13), (1, 1, 3, 3), (2, 2), (-1, 0))  # invalid geometry
    # phase images beyond fbfft's 128 basis go to cufft
    g = backends.geometry((1, 1, 600, 600), (1, 1, 4, 4), 2, 0)
    assert polyphase._inner(g) is cufft
    with pytest.raises(ValueError, match="for strided convolutions"):
        polyphase.fprop(np.ones((1, 1, 9, 9), np.float32), np.ones((1, 1, 3, 3), np.float32))
    with pytest.raises(ValueError, match="channel mismatch"):
        polyphase.fprop(np.ones((1, 2, 9, 9), np.float32), np.ones((1, 1, 3, 3), np.float32), stride=2)
    assert "polyphase" in backends.names()


def test_spectra_and_phase_images_are_shared_across_a_step(rng):
    """Within reuse_spectra() the phase images of x and w are built once, so the inner backend's
    spectra of them are found again by bprop and accGrad (3 of the 6 forward FFTs saved)."""
    x = rng.standard_normal((2, 3, 23, 23)).astype(np.float32)
    w = rng.standard_normal((4, 3, 11, 11)).astype(np.float32)
    gy = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)
    with backends.reuse_spectra() as cache:
        polyphase.fprop(x, w, stride=4, padding=2)
        polyphase.bprop(gy, w, x.shape, stride=4, padding=2)
        polyphase.accgrad(gy, x, w.shape, stride=4, padding=2)
    roles = sorted((k.backend, k.role) for k in cache.hit_keys)
    assert roles == [("fbfft", "gy"), ("fbfft", "w"), ("fbfft", "x"), ("polyphase", "w"), ("polyphase", "x")]


@pytest.mark.gpu
def test_network_first_layers_gpu(rng):
    """AlexNet's and OverFeat-fast's conv1 at batch 16 on the GPU (fbfft inside, basis 64)."""
    for x_shape, w_shape, pad in [((16, 3, 224, 224), (64, 3, 11, 11), 2), ((16, 3, 231, 231), (96, 3, 11, 11), 0)]:
        x = rng.standard_normal(x_shape).astype(np.float32)
        wt = rng.standard_normal(w_shape).astype(np.float32)
        check_backend(polyphase, x, wt, (4, 4), (pad, pad), device="cuda", rng=rng)
