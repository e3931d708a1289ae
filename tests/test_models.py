"""The model zoo: shapes, parameter layout, and every torchvision architecture against
torchvision's own on copied weights (evaluation and training mode)."""
import numpy as np
import pytest
import torch
import torchvision

import minitorch_fft as mt
from minitorch_fft import models
from conftest import DEVICES
from reference import rel_error


def test_zoo_names_and_errors():
    assert set(models.names()) == {"digits", "alexnet", "overfeat_fast", "vgg16", "resnet18", "resnet34",
                                   "resnet50"}
    assert all(models.input_shape(n) == (3, 224, 224) for n in ("vgg16", "resnet18", "resnet34", "resnet50"))
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        models.get("resnet")
    with pytest.raises(ValueError, match="num_classes"):
        models.get("digits", num_classes=0)
    with pytest.raises(ValueError, match=r"shape \(1000000000, 4096\) needs 44.7 TiB to initialise.*more than this"):
        models.get("alexnet", num_classes=10**9)            # before any is drawn (NumPy had been asked for 30 TiB)


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


# Small inputs keep the CPU time down: 32x32 leaves VGG-16 a 1x1 map (its avgpool spreads it to
# 7x7, torchvision's general case); 64x64 leaves ResNet's last stage 2x2, so its batch norms see
# 8 values per plane (at 1x1 and batch 2 they normalise pairs, where fp32 rounding decides signs).
ZOO_CASES = [("vgg16", 32), ("resnet18", 64), ("resnet34", 64), ("resnet50", 64)]


def _copied(name, device, seed=0):
    """(torchvision's model in float64, ours with its weights and buffers), both in eval mode."""
    torch.manual_seed(seed)
    tv = getattr(torchvision.models, name)(num_classes=10)
    with torch.no_grad():   # non-trivial running statistics, so evaluation mode tests them
        for m in tv.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5), m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.5, 0.5)
    # gemm on the CPU: auto would time every backend on every geometry first, for nothing here
    ours = models.get(name, num_classes=10, backend="gemm" if device == "cpu" else "auto")
    ours.load_state_dict(tv.state_dict())       # torch's tensors, as they are
    return tv.double().eval(), ours.to(device).eval()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,hw", ZOO_CASES)
def test_zoo_matches_torchvision(name, hw, device):
    """Same state_dict keys, order, shapes and dtypes as torchvision's; with copied weights the same
    output in evaluation mode and, for ResNet-18 and -50, in training mode (batch statistics), with
    the same running statistics after the step; and ours loads back into torchvision. (ResNet-34
    is ResNet-18's blocks, more of them: evaluation only. VGG-16 has no batch norm: in training
    only its dropout differs.)"""
    tv, ours = _copied(name, device)
    theirs = tv.state_dict()
    mine = ours.state_dict()
    assert list(mine) == list(theirs)
    assert all(mine[k].shape == tuple(v.shape) for k, v in theirs.items())
    assert all(mine[k].dtype == (np.int64 if v.dtype == torch.int64 else np.float32) for k, v in theirs.items())
    x = np.random.default_rng(1).standard_normal((2, 3, hw, hw)).astype(np.float32)
    modes = [False, True] if name in ("resnet18", "resnet50") else [False]
    for training in modes:
        tv.train(training), ours.train(training)
        ref = tv(torch.tensor(x, dtype=torch.float64)).detach().numpy()
        with mt.no_grad():
            got = ours(mt.Tensor(mt.to_device(x, device))).data
        assert rel_error(got, ref) <= (1e-3 if training else 1e-4), f"training={training}"
    mine = ours.state_dict()
    theirs = tv.state_dict()
    for k, v in theirs.items():
        if "running" in k:
            assert rel_error(mine[k], v.numpy()) <= 1e-4, k
        elif "num_batches" in k:
            assert int(mine[k]) == int(v) == len(modes) - 1
    tv.float().load_state_dict({k: torch.from_numpy(v) for k, v in mine.items()})
    assert all(np.array_equal(v.numpy(), mine[k]) for k, v in tv.state_dict().items())


def test_resnet_gradients_match_torchvision(rng):
    """One training-mode backward through batch norm, residual additions, padded max pooling and
    global average pooling: the parameters' gradients as torchvision's in float64."""
    tv, ours = _copied("resnet18", "cpu")
    tv.train(), ours.train()
    x = rng.standard_normal((2, 3, 64, 64)).astype(np.float32)
    y = np.array([3, 7])
    torch.nn.functional.cross_entropy(tv(torch.tensor(x, dtype=torch.float64)), torch.tensor(y)).backward()
    mt.CrossEntropyCriterion()(ours(mt.Tensor(x)), y).backward()
    grads = dict(tv.named_parameters())
    for k, p in ours.named_parameters():
        assert rel_error(p.grad, grads[k].grad.numpy()) <= 1e-3, k


def test_each_model_has_its_own_number_of_classes_by_default():
    """digits has 10 classes, the ImageNet networks 1000, unless num_classes says otherwise."""
    assert models.get("digits").classifier[-1].weight.shape[0] == 10
    assert models.get("alexnet").classifier[-1].weight.shape[0] == 1000
    assert models.get("digits", num_classes=3).classifier[-1].weight.shape[0] == 3
