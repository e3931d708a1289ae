"""VGG-16 (Simonyan & Zisserman 2015, configuration D), as torchvision.models.vgg16 defines it.
Input 3x224x224.

Parameter names, order and shapes match torchvision's, so weights can be exchanged. Its
adaptive average pooling to 7x7 is the identity at 224x224; on smaller inputs it spreads the
last feature map over 7x7 as torchvision's does.
"""
import minitorch_fft as mt

INPUT_SHAPE = (3, 224, 224)

# output planes of each 3x3 convolution (padding 1, stride 1), "M" a 2x2 max pooling
CONFIG_D = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(mt.Module):
    def __init__(self, num_classes=1000, backend="auto"):
        layers, planes = [], 3
        for v in CONFIG_D:                                       # 224 -> 112 -> 56 -> 28 -> 14 -> 7
            if v == "M":
                layers.append(mt.SpatialMaxPooling(2, 2))
            else:
                layers += [mt.SpatialConvolution(planes, v, 3, padding=1, backend=backend), mt.ReLU()]
                planes = v
        self.features = mt.Sequential(*layers)
        self.avgpool = mt.SpatialAdaptiveAveragePooling(7)    # -> 512 x 7 x 7
        self.flatten = mt.View(512 * 7 * 7)
        self.classifier = mt.Sequential(
            mt.Linear(512 * 7 * 7, 4096), mt.ReLU(), mt.Dropout(0.5),
            mt.Linear(4096, 4096), mt.ReLU(), mt.Dropout(0.5),
            mt.Linear(4096, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.flatten(self.avgpool(self.features(x))))
