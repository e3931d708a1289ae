"""minitorch-fft: a small Torch-style CNN framework with pluggable convolution backends."""
__version__ = "0.1.0"   # first: the submodules below may read it while the package initialises

from . import checkpoint, data, functional, graphs, nn, optim, random
from .device import get_array_module, gpu_available, normalize_device, synchronize, to_device
from .nn import (Buffer, ClassNLLCriterion, CrossEntropyCriterion, Dropout, Flatten, Linear, LogSoftMax,
                 Module, ReLU, Sequential, SpatialAdaptiveAveragePooling, SpatialAveragePooling,
                 SpatialBatchNormalization, SpatialConvolution, SpatialMaxPooling, View)
from .random import manual_seed
from .tensor import Function, Parameter, Tensor, enable_grad, is_grad_enabled, no_grad
from .training import train_step
from . import backends, models   # mt.backends (the ground floor) and mt.models (the zoo), as submodules

