"""Shared fixtures: the `gpu` marker skips cleanly where CuPy or a GPU is missing."""
import numpy as np
import pytest

from minitorch_fft.device import gpu_available


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Backend/model tests run once per device; the cuda variant carries the gpu marker.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
