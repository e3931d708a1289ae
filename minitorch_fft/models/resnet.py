"""ResNet-18, -34 and -50 (He et al. 2016), as torchvision.models.resnet18/34/50 define them
(v1.5: a bottleneck block strides in its 3x3 convolution, not its first 1x1). Input 3x224x224.

Parameter and buffer names, order and shapes match torchvision's, so weights and running
statistics can be exchanged. Spatial sizes below are for a 224x224 input.
"""
import minitorch_fft as mt
from minitorch_fft import functional as F

INPUT_SHAPE = (3, 224, 224)


def conv(i, o, k, stride, backend):
    """A bias-free convolution with 'same' padding (k // 2), as every ResNet convolution is."""
    return mt.SpatialConvolution(i, o, k, stride=stride, padding=k // 2, bias=False, backend=backend)


class BasicBlock(mt.Module):
    """Two 3x3 convolutions and the shortcut: relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))."""
    expansion = 1

    def __init__(self, planes_in, planes, stride, backend):
        self.conv1 = conv(planes_in, planes, 3, stride, backend)
        self.bn1 = mt.SpatialBatchNormalization(planes)
        self.relu = mt.ReLU()
        self.conv2 = conv(planes, planes, 3, 1, backend)
        self.bn2 = mt.SpatialBatchNormalization(planes)
        self.downsample = downsample(planes_in, planes * self.expansion, stride, backend)

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.add_relu(y, x if self.downsample is None else self.downsample(x))   # one pass on the GPU


class Bottleneck(mt.Module):
    """1x1 down to `planes`, 3x3 (strided), 1x1 up to 4 * planes, and the shortcut."""
    expansion = 4

    def __init__(self, planes_in, planes, stride, backend):
        self.conv1 = conv(planes_in, planes, 1, 1, backend)
        self.bn1 = mt.SpatialBatchNormalization(planes)
        self.conv2 = conv(planes, planes, 3, stride, backend)
        self.bn2 = mt.SpatialBatchNormalization(planes)
        self.conv3 = conv(planes, planes * self.expansion, 1, 1, backend)
        self.bn3 = mt.SpatialBatchNormalization(planes * self.expansion)
        self.relu = mt.ReLU()
        self.downsample = downsample(planes_in, planes * self.expansion, stride, backend)

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.add_relu(y, x if self.downsample is None else self.downsample(x))   # one pass on the GPU


def downsample(planes_in, planes_out, stride, backend):
    """The projection shortcut (1x1 convolution + batch norm) where the shape changes, else None."""
    if stride == 1 and planes_in == planes_out:
        return None
    return mt.Sequential(conv(planes_in, planes_out, 1, stride, backend),
                         mt.SpatialBatchNormalization(planes_out))


class ResNet(mt.Module):
    def __init__(self, block, blocks, num_classes=1000, backend="auto"):
        self.conv1 = mt.SpatialConvolution(3, 64, 7, stride=2, padding=3, bias=False, backend=backend)
        self.bn1 = mt.SpatialBatchNormalization(64)                 # 224 -> 112
        self.relu = mt.ReLU()
        self.maxpool = mt.SpatialMaxPooling(3, 2, padding=1)        # -> 56
        planes_in, stages = 64, []
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), blocks)):
            stride = 1 if i == 0 else 2                             # 56, 28, 14, 7
            layer = []
            for j in range(n):
                layer.append(block(planes_in, planes, stride if j == 0 else 1, backend))
                planes_in = planes * block.expansion
            stages.append(mt.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = mt.SpatialAdaptiveAveragePooling(1)         # -> planes_in x 1 x 1
        self.flatten = mt.View(planes_in)
        self.fc = mt.Linear(planes_in, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.flatten(self.avgpool(x)))


def resnet18(num_classes=1000, backend="auto"):
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, backend)


def resnet34(num_classes=1000, backend="auto"):
    return ResNet(BasicBlock, (3, 4, 6, 3), num_classes, backend)


def resnet50(num_classes=1000, backend="auto"):
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, backend)
