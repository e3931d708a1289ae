"""backends.layout: NCHW <-> NHWC copies (the tiled transpose kernel on the GPU), against NumPy's."""
import numpy as np
import pytest

from minitorch_fft.backends import layout
from conftest import DEVICES

SHAPES = [(2, 3, 5, 7), (3, 64, 9, 33), (1, 40, 32, 32), (2, 1, 1, 1), (0, 3, 4, 4),
          (70000, 2, 1, 3),          # more images than the grid's z (65535): the kernel's image loop
          (1, 2, 1500, 1500)]        # over 2^21 pixels a plane: past the grid's y, CuPy's copy


def arrays(device, shape):
    a = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    if device == "cuda":
        import cupy
        return a, cupy.asarray(a)
    return a, a.copy()


def host(a):
    return a.get() if hasattr(a, "get") else a


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_copies_keep_the_values_and_give_the_layout(device, shape):
    ref, a = arrays(device, shape)
    nhwc = layout.to_nhwc(a)
    assert nhwc.shape == shape and nhwc.transpose(0, 2, 3, 1).flags.c_contiguous
    np.testing.assert_array_equal(host(nhwc), ref)
    back = layout.to_nchw(nhwc)
    assert back.shape == shape and back.flags.c_contiguous
    np.testing.assert_array_equal(host(back), ref)
    assert layout.to_nchw(back) is back and layout.to_nhwc(nhwc) is nhwc   # already laid out: no copy


@pytest.mark.parametrize("device", DEVICES)
def test_other_strides_are_copied_plainly(device):
    ref, a = arrays(device, (2, 4, 6, 8))
    odd = a[:, :, ::2]                                   # neither layout
    np.testing.assert_array_equal(host(layout.to_nchw(odd)), ref[:, :, ::2])
    np.testing.assert_array_equal(host(layout.to_nhwc(odd)), ref[:, :, ::2])
    assert layout.to_nhwc(odd).transpose(0, 2, 3, 1).flags.c_contiguous


@pytest.mark.parametrize("bad", [np.zeros((2, 3, 4), np.float32), np.zeros((1, 2, 3, 4), np.float64)])
def test_bad_arrays_are_refused_before_work(bad):
    with pytest.raises(ValueError, match="4-d float32"):
        layout.to_nchw(bad)


@pytest.mark.gpu
def test_an_image_past_the_kernels_offsets_takes_the_plain_copy(monkeypatch):
    """On the GPU an image of IMAGE_MAX floats or more (2^31: the kernel's offsets) is copied by CuPy's
    strided copy, not refused; here IMAGE_MAX lowered to one image's size. (The CPU has no kernel.)"""
    ref, a = arrays("cuda", (3, 4, 5, 6))
    monkeypatch.setattr(layout, "IMAGE_MAX", 4 * 5 * 6)
    monkeypatch.setattr(layout, "_transpose", lambda *args: pytest.fail("the kernel ran"))
    nhwc = layout.to_nhwc(a)
    assert nhwc.transpose(0, 2, 3, 1).flags.c_contiguous
    back = layout.to_nchw(nhwc)
    assert back.flags.c_contiguous
    np.testing.assert_array_equal(host(nhwc), ref)
    np.testing.assert_array_equal(host(back), ref)
