"""The one check the fixed-size zoo models (digits, AlexNet, OverFeat-fast) share: their classifier
takes features of one shape, which only some input sizes give."""


def check_features(model, features, want, x):
    """ValueError naming the model's input size where `features` (its conv stack's output on input
    `x`) is not `want` (C, H, W) a sample: what View would otherwise refuse as an unexplained
    reshape."""
    if tuple(features.shape[1:]) != tuple(want):
        shape = type(model).INPUT_SHAPE
        raise ValueError(f"{type(model).__name__} takes {shape[0]}x{shape[1]}x{shape[2]} images (input (S, "
                         f"{', '.join(map(str, shape))})): its classifier takes {'x'.join(map(str, want))} "
                         f"features, and input {tuple(x.shape)} gives {'x'.join(map(str, features.shape[1:]))}")
