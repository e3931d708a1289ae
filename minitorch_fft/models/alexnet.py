"""AlexNet, the "one weird trick" single-GPU variant (Krizhevsky 2014) that
torchvision and convnet-benchmarks use. Input 3x224x224.

Parameter names, order and shapes match ``torchvision.models.alexnet``, so
weights can be exchanged (its AdaptiveAvgPool2d is the identity at 224x224).
"""
import minitorch_fft as mt

from .shapes import check_features

INPUT_SHAPE = (3, 224, 224)


class AlexNet(mt.Module):
    INPUT_SHAPE = INPUT_SHAPE

    def __init__(self, num_classes=1000, backend="auto"):
        conv = lambda i, o, k, **kw: mt.SpatialConvolution(i, o, k, backend=backend, **kw)  # noqa: E731
        self.features = mt.Sequential(
            conv(3, 64, 11, stride=4, padding=2), mt.ReLU(),    # 224 -> 55
            mt.SpatialMaxPooling(3, 2),                         # -> 27
            conv(64, 192, 5, padding=2), mt.ReLU(),             # 27
            mt.SpatialMaxPooling(3, 2),                         # -> 13
            conv(192, 384, 3, padding=1), mt.ReLU(),            # 13
            conv(384, 256, 3, padding=1), mt.ReLU(),            # 13
            conv(256, 256, 3, padding=1), mt.ReLU(),            # 13
            mt.SpatialMaxPooling(3, 2),                         # -> 6
        )
        self.flatten = mt.View(256 * 6 * 6)
        self.classifier = mt.Sequential(
            mt.Dropout(0.5), mt.Linear(256 * 6 * 6, 4096), mt.ReLU(),
            mt.Dropout(0.5), mt.Linear(4096, 4096), mt.ReLU(),
            mt.Linear(4096, num_classes),
        )

    def forward(self, x):
        features = self.features(x)
        check_features(self, features, (256, 6, 6), x)
        return self.classifier(self.flatten(features))
