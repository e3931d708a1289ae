"""A small CNN for scikit-learn's bundled 8x8 digits: trains on a 2-core CPU in seconds."""
import minitorch_fft as mt

from .shapes import check_features

INPUT_SHAPE = (1, 8, 8)


class DigitsNet(mt.Module):
    INPUT_SHAPE = INPUT_SHAPE

    def __init__(self, num_classes=10, backend="auto"):
        self.features = mt.Sequential(
            mt.SpatialConvolution(1, 16, 3, padding=1, backend=backend), mt.ReLU(),   # 8x8
            mt.SpatialConvolution(16, 32, 3, padding=1, backend=backend), mt.ReLU(),  # 8x8
            mt.SpatialMaxPooling(2, 2),                                               # -> 4x4
        )
        self.flatten = mt.View(32 * 4 * 4)
        self.classifier = mt.Sequential(
            mt.Linear(32 * 4 * 4, 64), mt.ReLU(), mt.Dropout(0.2),
            mt.Linear(64, num_classes),
        )

    def forward(self, x):
        features = self.features(x)
        check_features(self, features, (32, 4, 4), x)
        return self.classifier(self.flatten(features))
