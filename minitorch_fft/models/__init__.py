"""The model zoo. Each file holds one architecture; the backend comes from configuration."""
from . import alexnet, digits_net, overfeat, resnet, vgg
from minitorch_fft.utils import positive_int

# name -> (class or constructor, input shape (C, H, W))
_ZOO = {
    "digits": (digits_net.DigitsNet, digits_net.INPUT_SHAPE),
    "alexnet": (alexnet.AlexNet, alexnet.INPUT_SHAPE),
    "overfeat_fast": (overfeat.OverFeatFast, overfeat.INPUT_SHAPE),
    "vgg16": (vgg.VGG16, vgg.INPUT_SHAPE),
    "resnet18": (resnet.resnet18, resnet.INPUT_SHAPE),
    "resnet34": (resnet.resnet34, resnet.INPUT_SHAPE),
    "resnet50": (resnet.resnet50, resnet.INPUT_SHAPE),
}


def names():
    return list(_ZOO)


def _entry(name):
    if name not in _ZOO:
        raise ValueError(f"unknown model {name!r}; available: {names()}")
    return _ZOO[name]


def get(name, num_classes=None, backend="auto"):
    """A freshly initialised model (parameters drawn from minitorch_fft.random). num_classes None:
    the model's own (digits 10, the ImageNet networks 1000)."""
    cls, _ = _entry(name)
    if num_classes is None:
        return cls(backend=backend)
    return cls(num_classes=positive_int(num_classes, "num_classes"), backend=backend)


def input_shape(name):
    """(C, H, W) the model expects."""
    return _entry(name)[1]
