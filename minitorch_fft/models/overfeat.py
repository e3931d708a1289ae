"""OverFeat "fast" (Sermanet et al. 2014), as convnet-benchmarks and the fbfft
paper's Table 3 time it. Input 3x231x231."""
import minitorch_fft as mt

from .shapes import check_features

INPUT_SHAPE = (3, 231, 231)


class OverFeatFast(mt.Module):
    INPUT_SHAPE = INPUT_SHAPE

    def __init__(self, num_classes=1000, backend="auto"):
        conv = lambda i, o, k, **kw: mt.SpatialConvolution(i, o, k, backend=backend, **kw)  # noqa: E731
        self.features = mt.Sequential(
            conv(3, 96, 11, stride=4), mt.ReLU(),               # 231 -> 56
            mt.SpatialMaxPooling(2, 2),                         # -> 28
            conv(96, 256, 5), mt.ReLU(),                        # -> 24
            mt.SpatialMaxPooling(2, 2),                         # -> 12
            conv(256, 512, 3, padding=1), mt.ReLU(),            # 12
            conv(512, 1024, 3, padding=1), mt.ReLU(),           # 12
            conv(1024, 1024, 3, padding=1), mt.ReLU(),          # 12
            mt.SpatialMaxPooling(2, 2),                         # -> 6
        )
        self.flatten = mt.View(1024 * 6 * 6)
        self.classifier = mt.Sequential(
            mt.Dropout(0.5), mt.Linear(1024 * 6 * 6, 3072), mt.ReLU(),
            mt.Dropout(0.5), mt.Linear(3072, 4096), mt.ReLU(),
            mt.Linear(4096, num_classes),
        )

    def forward(self, x):
        features = self.features(x)
        check_features(self, features, (1024, 6, 6), x)
        return self.classifier(self.flatten(features))
