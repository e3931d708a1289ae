"""The model zoo: shapes, parameter layout, and AlexNet against torchvision's."""
import numpy as np
import pytest
import torch
import torchvision

import minitorch_fft as mt
import models
from conftest import DEVICES
from reference import rel_error


def test_zoo_names_and_errors():
    assert set(models.names()) == {"digits", "alexnet", "overfeat_fast"}
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        models.get("resnet")
    with pytest.raises(ValueError, match="num_classes"):
        models.get("digits", num_classes=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,classes", [("digits", 10), ("alexnet", 7), ("overfeat_fast", 5)])
def test_output_shapes(name, classes, device):
    mt.manual_seed(0)
    m = models.get(name, num_classes=classes).to(device).eval()
    x = np.random.default_rng(0).standard_normal((2,) + models.input_shape(name)).astype(np.float32)
    with mt.no_grad():
        y = m(mt.Tensor(mt.to_device(x, device)))
    assert y.shape == (2, classes) and np.all(np.isfinite(y.numpy()))


def test_overfeat_parameter_shapes():
    shapes = {k: v.shape for k, v in models.get("overfeat_fast", num_classes=1000).state_dict().items()}
    assert shapes["features.0.weight"] == (96, 3, 11, 11)
    assert shapes["features.3.weight"] == (256, 96, 5, 5)
    assert shapes["features.10.weight"] == (1024, 1024, 3, 3)
    assert shapes["classifier.1.weight"] == (3072, 36864)
    assert shapes["classifier.6.weight"] == (1000, 4096)


@pytest.mark.parametrize("device", DEVICES)
def test_alexnet_matches_torchvision(device):
    """Same keys, order and shapes; with copied weights, the same output (eval mode)."""
    torch.manual_seed(0)
    tv = torchvision.models.alexnet(num_classes=10).eval()
    ours = models.get("alexnet", num_classes=10)
    theirs = {k: v.numpy() for k, v in tv.state_dict().items()}
    assert list(ours.state_dict()) == list(theirs)
    ours.load_state_dict(theirs)
    ours.to(device).eval()
    x = np.random.default_rng(1).standard_normal((2, 3, 224, 224)).astype(np.float32)
    with torch.no_grad():
        ref = tv.double()(torch.tensor(x, dtype=torch.float64)).numpy()
    with mt.no_grad():
        got = ours(mt.Tensor(mt.to_device(x, device))).data
    assert rel_error(got, ref) <= 1e-4
