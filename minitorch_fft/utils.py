"""Small argument helpers shared by the core and the backends."""
import numpy as np


def is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def pair(v, name):
    """int or (h, w) -> (h, w) of ints; TypeError naming `name` otherwise."""
    if is_int(v):
        return (int(v), int(v))
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(is_int(e) for e in v):
        return (int(v[0]), int(v[1]))
    raise TypeError(f"{name} must be an int or a pair (h, w) of ints, got {v!r}")


def positive_int(v, name):
    """v as an int >= 1; ValueError naming `name` otherwise."""
    if not is_int(v) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)
