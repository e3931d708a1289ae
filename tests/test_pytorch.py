"""minitorch_fft.pytorch: the custom operator, Conv2d and convert() against PyTorch's own
convolution in float64 (the independent reference), through opcheck, torch.compile and, on the
GPU, CUDA graphs and the profiler. Both ways in: the eager path (conv2d's EagerConv2d) and the
operator (torch.ops.minitorch_fft.conv2d, what tracing and torch.compile see)."""
import contextlib
import copy
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from minitorch_fft import backends
from conftest import DEVICES
from minitorch_fft import pytorch as pt
from minitorch_fft.pytorch import Conv2d, conv2d, convert, reuse_spectra, unsupported
from reference import Kinks, rel_error

PATHS = ["eager", "operator"]

CASES = [  # (S, f, f', h, w, kh, kw, stride, padding)
    (2, 3, 4, 9, 9, 3, 3, (1, 1), (1, 1)),
    (1, 2, 3, 8, 7, 2, 3, (2, 1), (0, 1)),
    (2, 4, 5, 11, 10, 5, 5, (1, 1), (2, 2)),
    (2, 3, 2, 23, 23, 11, 11, (4, 4), (2, 2)),
]
STRIDE1 = [c for c in CASES if c[7] == (1, 1)]


def operands(case, device, seed=0):
    S, f, fo, h, w, kh, kw, stride, padding = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, f, h, w, generator=g)
    wt = torch.randn(fo, f, kh, kw, generator=g)
    return x.to(device), wt.to(device), stride, padding


def call(path, x, w, stride, padding, backend="auto", bias=None):
    """conv2d's eager path, or the registered operator called directly."""
    if path == "eager":
        return conv2d(x, w, stride, padding, backend, bias)
    return torch.ops.minitorch_fft.conv2d(x, w, list(stride), list(padding), backend, bias)


def check_against_float64(case, backend, device, path="eager", tol=1e-5):
    """The forward and both gradients against F.conv2d in float64, through `path`."""
    x, w, stride, padding = operands(case, device)
    x.requires_grad_(), w.requires_grad_()
    y = call(path, x, w, stride, padding, backend)
    assert (y.grad_fn.name() == "EagerConv2dBackward") == (path == "eager")
    x64, w64 = (t.detach().double().cpu().requires_grad_() for t in (x, w))
    y64 = TF.conv2d(x64, w64, stride=stride, padding=padding)
    gy = torch.randn(y64.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y.backward(gy.float().to(device))
    y64.backward(gy)
    for got, ref in ((y, y64), (x.grad, x64.grad), (w.grad, w64.grad)):
        assert got.dtype == torch.float32 and got.device == x.device
        assert rel_error(got.detach().cpu().numpy(), ref.detach().numpy()) <= tol


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_operator_matches_float64(case, device, path):
    check_against_float64(case, "auto", device, path)
    check_against_float64(case, "gemm", device, path)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", STRIDE1)
def test_fft_backend_matches_float64(case, device):
    check_against_float64(case, "cufft", device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_opcheck(case, device):
    x, w, stride, padding = operands(case, device)
    torch.library.opcheck(torch.ops.minitorch_fft.conv2d, (x.requires_grad_(), w.requires_grad_(),
                                                            list(stride), list(padding), "auto"))
    y = conv2d(x.detach(), w.detach(), stride, padding)
    gy = torch.randn_like(y)
    torch.library.opcheck(torch.ops.minitorch_fft.conv2d_bprop,
                          (gy, w.detach(), list(x.shape), list(stride), list(padding), "auto"))
    torch.library.opcheck(torch.ops.minitorch_fft.conv2d_accgrad,
                          (gy, x.detach(), list(w.shape), list(stride), list(padding), "auto"))
    for mask in ([True, True, True], [True, False, False], [False, True, True], [False, False, True]):
        torch.library.opcheck(torch.ops.minitorch_fft.conv2d_grads,
                              (gy, x.detach(), w.detach(), list(stride), list(padding), "auto", mask))
    bias = torch.randn(w.shape[0], device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.minitorch_fft.conv2d, (x.detach().requires_grad_(), w.detach(),
                                                            list(stride), list(padding), "auto", bias))


def channels_last(*tensors):
    return [t.contiguous(memory_format=torch.channels_last) for t in tensors]


def float64_layer(x, w, bias, stride, padding):
    """A layer's float64 reference on the CPU: a seeded float64 gradOutput of its output's shape, and
    (y, gx, gw, gb), the output and the gradients that gradOutput gives."""
    x64, w64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, w, bias))
    y64 = TF.conv2d(x64, w64, b64, stride=stride, padding=padding)
    gy = torch.randn(y64.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y64.backward(gy)
    return gy, (y64, x64.grad, w64.grad, b64.grad)


def assert_matches(got, refs, tol=1e-5):
    """Each tensor of `got` within tol of its float64 reference in `refs` (relative error)."""
    for t, ref in zip(got, refs, strict=True):
        assert rel_error(t.detach().cpu().numpy(), ref.detach().numpy()) <= tol


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_channels_last_in_channels_last_out(case, device, path, strict_fp32):
    """A channels-last layer (model.to(memory_format=torch.channels_last)) gives channels-last
    results, forward and backward, equal to the float64 reference (on the GPU: cuDNN's NHWC plans,
    searched under their own key; on the CPU: the NCHW passes, their results laid out again). The
    backward's layout is read from the backward operator's own results: autograd lays a leaf's
    .grad out as the leaf whatever the operator gave."""
    x, w, stride, padding = operands(case, device)
    x, w = (t.requires_grad_() for t in channels_last(x, w))
    y = call(path, x, w, stride, padding)
    x64, w64 = (t.detach().double().cpu().requires_grad_() for t in (x, w))
    y64 = TF.conv2d(x64, w64, stride=stride, padding=padding)
    gy = torch.randn(y64.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gy32 = gy.float().to(device).contiguous(memory_format=torch.channels_last)
    y.backward(gy32)
    y64.backward(gy)
    if path == "eager":
        gx, gw, _ = pt._grads(gy32, x.detach(), w.detach(), stride, padding, "auto", True, True, False)
    else:
        gx, gw, _ = torch.ops.minitorch_fft.conv2d_grads(gy32, x.detach(), w.detach(), list(stride), list(padding),
                                                          "auto", [True, True, False])
    assert all(t.is_contiguous(memory_format=torch.channels_last) for t in (y, gx, gw))
    for got, ref in ((y, y64), (x.grad, x64.grad), (w.grad, w64.grad), (gx, x64.grad), (gw, w64.grad)):
        assert rel_error(got.detach().cpu().numpy(), ref.detach().numpy()) <= 1e-5
    if device == "cuda" and backends.get("cudnn").available():
        # each pass that auto routes to cuDNN's NHWC plans built one (a route another test's worker timed
        # first may be "nchw" for this small geometry, read from the shared tuning cache: session 52)
        import cupy
        g = backends.geometry(tuple(x.shape), tuple(w.shape), stride, padding)
        routes = {p: backends.nhwc_route(p, tuple(x.shape), tuple(w.shape), tuple(stride), tuple(padding), cupy)
                  for p in ("fprop", "bprop", "accgrad")}
        laid = {k[1] for k in backends.get("cudnn").built() if k[2] == g and k[-1] == "nhwc"}
        assert {p for p, r in routes.items() if r == "cudnn"} <= laid, (laid, routes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_opcheck_channels_last(case, device):
    """The fake implementations give the real results' strides for channels-last operands."""
    x, w, stride, padding = operands(case, device)
    x, w = channels_last(x, w)
    torch.library.opcheck(torch.ops.minitorch_fft.conv2d, (x.requires_grad_(), w.requires_grad_(),
                                                            list(stride), list(padding), "auto"))
    y = conv2d(x.detach(), w.detach(), stride, padding)
    gy = channels_last(torch.randn_like(y))[0]
    torch.library.opcheck(torch.ops.minitorch_fft.conv2d_bprop,
                          (gy, w.detach(), list(x.shape), list(stride), list(padding), "auto"))
    torch.library.opcheck(torch.ops.minitorch_fft.conv2d_accgrad,
                          (gy, x.detach(), list(w.shape), list(stride), list(padding), "auto"))
    for mask in ([True, True, True], [False, True, False]):
        torch.library.opcheck(torch.ops.minitorch_fft.conv2d_grads,
                              (gy, x.detach(), w.detach(), list(stride), list(padding), "auto", mask))
    bias = torch.randn(w.shape[0], device=device, requires_grad=True)   # into cuDNN's fprop on the GPU
    torch.library.opcheck(torch.ops.minitorch_fft.conv2d, (x.detach().requires_grad_(), w.detach(),
                                                            list(stride), list(padding), "auto", bias))


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("device", DEVICES)
def test_a_layers_bias_and_its_gradient_against_float64(device, path, layout):
    """A layer with a bias, NCHW and channels-last: its output (on the GPU channels-last: the bias in
    cuDNN's fprop, fused or not) and the bias's gradient (on the GPU: one GEMV of gy) against
    float64. cuBLAS's TF32 is on throughout, as a TF32 user's would be, and the bias's gradient
    must still be fp32's (the GEMV takes no tensor cores; a TF32 sum of 1024 rows is off by ~3e-4).
    The conv passes are strict fp32 (the framework's own switch, off)."""
    x, w, stride, padding = operands((4, 6, 8, 16, 16, 3, 3, (1, 1), (1, 1)), device, seed=5)
    bias = (torch.randn(w.shape[0], generator=torch.Generator().manual_seed(6)) * 4).to(device)
    if layout == "channels_last":
        x, w = channels_last(x, w)
    x, w, bias = (t.requires_grad_() for t in (x, w, bias))
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        y = call(path, x, w, stride, padding, bias=bias)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64) + 0.5
        gy32 = gy.float().to(device)
        if layout == "channels_last":
            gy32 = channels_last(gy32)[0]
        y.backward(gy32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    x64, w64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, w, bias))
    y64 = TF.conv2d(x64, w64, b64, stride=stride, padding=padding)
    y64.backward(gy)
    assert y.is_contiguous(memory_format=torch.channels_last) == (layout == "channels_last")
    for name, got, ref in (("y", y, y64), ("gx", x.grad, x64.grad), ("gw", w.grad, w64.grad),
                           ("gb", bias.grad, b64.grad)):
        assert rel_error(got.detach().cpu().numpy(), ref.detach().numpy()) <= 1e-5, (name, rel_error(
            got.detach().cpu().numpy(), ref.detach().numpy()))


@pytest.mark.gpu
def test_the_bias_gradient_of_any_layout():
    """_bias_grad on the GPU: gy summed over batch and space for dense NCHW and channels-last (the
    GEMV), other strides (an expanded gradient, a sliced one: the sum) and none, as gy.sum((0, 2,
    3)) in float64; nothing of it stays allocated (the step's peak: session 43); under autocast
    and deterministic algorithms, the sum."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = "cuda"
    g = torch.Generator().manual_seed(8)
    # cuBLAS's first call on a stream allocates PyTorch's workspace for it (32 MiB), kept
    torch.mv(torch.ones(2, 2, device=device), torch.ones(2, device=device))
    base, large = torch.randn(3, 5, 6, 7, generator=g).to(device), torch.randn(4, 5, 9, 9, generator=g).to(device)
    for gy in (base, base.contiguous(memory_format=torch.channels_last), base[:, :, ::2],
               torch.randn(1, 5, 1, 1, generator=g).to(device).expand(3, 5, 6, 7), base[:0], large,
               large.contiguous(memory_format=torch.channels_last), base):
        want = gy.double().sum((0, 2, 3))
        before = torch.cuda.memory_allocated()
        got = pt._bias_grad(gy)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), gy.stride()
        assert torch.cuda.memory_allocated() - before <= 512   # the result's block alone (512-byte rounding)
        got = None
    gy = base.contiguous(memory_format=torch.channels_last)
    with torch.autocast("cuda"):
        assert pt._bias_grad(gy).dtype == torch.float32
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.allclose(pt._bias_grad(gy).double(), gy.double().sum((0, 2, 3)), rtol=1e-5, atol=1e-5)
    finally:
        torch.use_deterministic_algorithms(saved)


@pytest.mark.gpu
def test_channels_last_without_cudnn_among_autos_candidates(settings):
    """auto_backends=ours leaves cuDNN out of auto's choices: a channels-last layer then runs our
    NCHW passes on copies (still channels-last out), and builds no NHWC plan."""
    if not backends.get("cudnn").available():
        pytest.skip("cuDNN's frontend is not installed")
    settings(auto_backends="ours")
    x, w, stride, padding = operands((2, 5, 6, 10, 10, 3, 3, (1, 1), (1, 1)), "cuda")   # a geometry of its own
    x, w = channels_last(x, w)
    y = conv2d(x, w, stride, padding)
    assert y.is_contiguous(memory_format=torch.channels_last)
    ref = TF.conv2d(x.double().cpu(), w.double().cpu(), stride=stride, padding=padding)
    assert rel_error(y.cpu().numpy(), ref.numpy()) <= 1e-5
    g = backends.geometry(tuple(x.shape), tuple(w.shape), stride, padding)
    assert not [k for k in backends.get("cudnn").built() if k[2] == g and k[-1] == "nhwc"]


@pytest.mark.gpu
def test_channels_last_routes_count_their_memory(settings, tmp_path, monkeypatch):
    """The adapter counts a route's runs while auto times a channels-last layer's routes
    (pytorch._counted): every timed route's peak is in the record's "bytes", each at least the
    pass's result, the "nchw" route's at least the NCHW copies of its two operands too; under
    nhwc_route_mb (1 MiB) the route taken peaks within the bound of the leanest, and the copies'
    route (over 3 MiB more here) never wins."""
    if not backends.get("cudnn").available():
        pytest.skip("cuDNN's frontend is not installed")
    settings(tf32=False, tune_cache=str(tmp_path / "tune.json"), nhwc_route_mb=1)
    monkeypatch.setattr(backends.auto, "_routes", {})
    monkeypatch.setattr(backends.auto, "_route_records", {})
    x, w, stride, padding = operands((8, 40, 36, 36, 36, 3, 3, (1, 1), (1, 1)), "cuda")   # a geometry of its own
    x, w = (t.requires_grad_() for t in channels_last(x, w))
    y = conv2d(x, w, stride, padding)
    y.backward(channels_last(torch.randn_like(y))[0])
    g = backends.auto._geometry_key(tuple(x.shape), tuple(w.shape), stride, padding)
    rows = {r["pass"]: r for r in backends.auto.route_choices() if tuple(r["geometry"]) == g}
    assert set(rows) == {"fprop", "bprop", "accgrad"}
    size = {"x": 4 * x.numel(), "w": 4 * w.numel(), "y": 4 * y.numel()}
    operands_of = {"fprop": ("x", "w", "y"), "bprop": ("y", "w", "x"), "accgrad": ("y", "x", "w")}
    for pass_name, r in rows.items():
        a, b, result = operands_of[pass_name]
        assert set(r["bytes"]) == set(r["ms"]) == {"cudnn", "nchw"}, r
        assert min(r["bytes"].values()) >= size[result], r
        assert r["bytes"]["nchw"] >= size[a] + size[b] + size[result], r
        assert r["bytes"][r["route"]] <= min(r["bytes"].values()) + 2**20, r
        assert r["route"] == "cudnn" or r["bytes"]["nchw"] <= r["bytes"]["cudnn"] + 2**20, r
    assert any(r["bytes"]["nchw"] > r["bytes"]["cudnn"] + 2**20 for r in rows.values())   # the bound had work to do


@pytest.mark.gpu
@pytest.mark.parametrize("gy_layout", ["channels_last", "nchw"])
@pytest.mark.parametrize("routes", [("nchw", "nchw", "nchw"), ("nchw", "cudnn", "nchw"), ("cudnn", "nchw", "cudnn")],
                         ids=["all_nchw", "mixed", "mixed_other"])
def test_channels_last_routes_mixed_per_pass(monkeypatch, settings, routes, gy_layout):
    """auto's channels-last routes (backends.nhwc_route) taken per pass, here forced: fprop, accGrad and
    bprop each on cuDNN's NHWC plans or on NCHW copies, the bias with fprop. Every result, the backward
    operator's own included, is channels-last and equal to float64; the backward copies a channels-last
    gradOutput at most once (for both NCHW passes), and where both run NCHW bprop gets accGrad's very
    gradOutput array (reuse.py finds a spectrum by the array's identity); inside reuse_spectra() no view
    outlives the backward (a pass on cuDNN's plans takes none an NCHW pass kept: with an NCHW gradOutput,
    the one operand viewed as it is, a view kept for such a pass would be left over)."""
    if not backends.get("cudnn").available():
        pytest.skip("cuDNN's frontend is not installed")
    settings(tf32=False)
    chosen = dict(zip(("fprop", "accgrad", "bprop"), routes))
    asked, nchw_ran, copied, first = [], [], [], {}
    monkeypatch.setattr(backends, "nhwc_route", lambda p, *a, **k: asked.append(p) or chosen[p])
    real_run, real_copy = backends.run_pass, backends.layout.to_nchw

    def run_pass(name, p, *a, **k):
        nchw_ran.append((p, k["later"]))
        first[p] = a[0]   # accGrad's and bprop's: gradOutput as the pass got it
        return real_run(name, p, *a, **k)
    monkeypatch.setattr(backends, "run_pass", run_pass)
    monkeypatch.setattr(backends.layout, "to_nchw", lambda a: copied.append(tuple(a.shape)) or real_copy(a))
    x, w, stride, padding = operands((4, 6, 8, 13, 11, 3, 3, (1, 1), (1, 1)), "cuda", seed=5)
    bias = torch.randn(8, generator=torch.Generator().manual_seed(2)).cuda().requires_grad_()
    x, w = (t.requires_grad_() for t in channels_last(x, w))
    gy, refs = float64_layer(x, w, bias, stride, padding)
    gy32 = gy.float().cuda().contiguous(
        memory_format=torch.channels_last if gy_layout == "channels_last" else torch.contiguous_format)
    with reuse_spectra():
        y = conv2d(x, w, stride, padding, bias=bias)
        y.backward(gy32)
        assert not pt._views
    assert sorted(asked) == ["accgrad", "bprop", "fprop"]
    assert sorted(p for p, _ in nchw_ran) == sorted(p for p, r in chosen.items() if r == "nchw")
    # an NCHW accGrad keeps gradOutput's copy (and its spectrum) for bprop only where bprop runs NCHW too
    laters = dict(nchw_ran)
    if chosen["accgrad"] == "nchw":
        assert laters["accgrad"] == (("bprop",) if chosen["bprop"] == "nchw" else ())
    assert laters.get("fprop", ()) == () and laters.get("bprop", ()) == ()
    if chosen["accgrad"] == chosen["bprop"] == "nchw":
        assert first["accgrad"] is first["bprop"]
    backward_nchw = chosen["accgrad"] == "nchw" or chosen["bprop"] == "nchw"
    assert copied.count(tuple(y.shape)) == int(backward_nchw and gy_layout == "channels_last")
    gx, gw, gb = pt._grads(gy32, x.detach(), w.detach(), stride, padding, "auto", True, True, True)
    assert all(t.is_contiguous(memory_format=torch.channels_last) for t in (y, gx, gw))
    assert_matches((y, x.grad, w.grad, bias.grad, gx, gw, gb), refs + refs[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("stride", [(1, 1), (2, 2)], ids=["s1", "s2"])
@pytest.mark.parametrize("routes", [("gemm", "gemm", "gemm"), ("gemm", "nchw", "gemm"), ("cudnn", "gemm", "nchw")],
                         ids=["all_gemm", "mixed", "mixed_other"])
def test_channels_last_pointwise_gemm_route(monkeypatch, settings, routes, stride):
    """A channels-last 1x1 layer's "gemm" route (one GEMM on the tensors as they are), forced per pass and
    mixed with the other two: every result, the backward operator's own included, channels-last and equal
    to float64, the bias with fprop, at the first call (gemm's full path) and the second (a stride-1 pass
    prepared: one GEMM on matrices made from the tensors, _gemm_prepared); a pass on the GEMM route runs
    no NCHW pass and copies nothing to NCHW."""
    if not backends.get("cudnn").available():
        pytest.skip("cuDNN's frontend is not installed")
    settings(tf32=False)
    monkeypatch.setattr(pt, "_gemm_runs", {})   # this test's prepared runs only (a geometry another case shares)
    chosen = dict(zip(("fprop", "accgrad", "bprop"), routes))
    nchw_ran, copied = [], []
    monkeypatch.setattr(backends, "nhwc_route", lambda p, *a, **k: chosen[p])
    real_run, real_copy = backends.run_pass, backends.layout.to_nchw
    monkeypatch.setattr(backends, "run_pass", lambda name, p, *a, **k: nchw_ran.append(p) or real_run(name, p, *a, **k))
    monkeypatch.setattr(backends.layout, "to_nchw", lambda a: copied.append(tuple(a.shape)) or real_copy(a))
    x, w, _, padding = operands((4, 12, 10, 9, 7, 1, 1, stride, (0, 0)), "cuda", seed=9)
    bias = torch.randn(10, generator=torch.Generator().manual_seed(4)).cuda().requires_grad_()
    x, w = (t.requires_grad_() for t in channels_last(x, w))
    gy, refs = float64_layer(x, w, bias, stride, padding)
    gy32 = gy.float().cuda().contiguous(memory_format=torch.channels_last)
    geometry = (tuple(x.shape), tuple(w.shape), tuple(stride), tuple(padding))
    for call in range(2):
        x.grad = w.grad = bias.grad = None
        with reuse_spectra():
            y = conv2d(x, w, stride, padding, bias=bias)
            y.backward(gy32)
        gx, gw, gb = pt._grads(gy32, x.detach(), w.detach(), stride, padding, "auto", True, True, True)
        assert all(t.is_contiguous(memory_format=torch.channels_last) for t in (y, gx))
        assert_matches((y, x.grad, w.grad, bias.grad, gx, gw, gb), refs + refs[1:])
    # two calls, each a forward, its backward and _grads (accGrad and bprop once more)
    assert sorted(nchw_ran) == sorted(p for p, r in chosen.items() if r == "nchw"
                                      for _ in range(2 if p == "fprop" else 4))
    if "nchw" not in routes:
        assert copied == []
    prepared = {k[0] for k, run in pt._gemm_runs.items() if k[1] == geometry and callable(run)}
    want = {p for p, r in chosen.items() if r == "gemm"} if stride == (1, 1) else set()
    assert want - {"accgrad"} <= prepared <= want   # accGrad's per-image form, where tuned, is not one GEMM


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend,candidates", [("gemm", None), ("auto", "ours"), ("auto", None)],
                         ids=["gemm", "auto_ours", "auto"])
@pytest.mark.parametrize("stride", [(1, 1), (2, 2)], ids=["s1", "s2"])
def test_channels_last_pointwise_layers_take_the_gemm_route_without_cudnn(monkeypatch, settings, tmp_path, device,
                                                                          backend, candidates, stride):
    """A channels-last 1x1 layer without padding runs on gemm's GEMMs on the tensors as they are wherever
    that route exists: with backend gemm (CPU and GPU), and with auto on the CPU (untimed: the first
    route) or on the GPU without cudnn among its candidates (auto_backends "ours": the route timed
    against copies; a pass whose copies won runs NCHW, and nothing else does). Two calls (on the GPU
    the second prepared), each forward and backward equal to float64 and channels-last. A 3x3 layer on
    the same settings runs NCHW passes on copies, as before."""
    settings(tf32=False, tune_cache=str(tmp_path / "tune.json"),
             **({"auto_backends": candidates} if candidates else {}))
    if device == "cuda" and backend == "auto" and candidates is None and backends.get("cudnn").available():
        pytest.skip("cuDNN is installed: auto's routes include it (test_channels_last_auto_times_both_routes_per_pass)")
    for name in ("_routes", "_route_records"):
        monkeypatch.setattr(backends.auto, name, {})
    monkeypatch.setattr(pt, "_gemm_runs", {})
    nchw_ran = []
    real_run = backends.run_pass
    monkeypatch.setattr(backends, "run_pass", lambda name, p, *a, **k: nchw_ran.append(p) or real_run(name, p, *a, **k))
    for kernel in (1, 3):
        x, w, _, _ = operands((4, 12, 10, 9, 7, kernel, kernel, stride, (0, 0)), device, seed=9)
        bias = torch.randn(10, generator=torch.Generator().manual_seed(4)).to(device).requires_grad_()
        x, w = (t.requires_grad_() for t in channels_last(x, w))
        gy, refs = float64_layer(x, w, bias, stride, (0, 0))
        timed = device == "cuda" and backend == "auto"   # the first call times the routes: its NCHW passes too
        for call in range(2):
            nchw_ran.clear()
            x.grad = w.grad = bias.grad = None
            y = conv2d(x, w, stride, (0, 0), backend, bias)
            y.backward(gy.float().to(device).contiguous(memory_format=torch.channels_last))
            assert y.is_contiguous(memory_format=torch.channels_last)
            assert_matches((y, x.grad, w.grad, bias.grad), refs)
            if kernel == 1 and not timed:
                assert nchw_ran == [], (call, nchw_ran)
        if kernel == 3:
            assert sorted(set(nchw_ran)) == ["accgrad", "bprop", "fprop"]
            continue
        routes = {r["pass"]: r["route"] for r in backends.auto.route_choices()
                  if tuple(r["geometry"][:4]) == (4, 12, 10, 9)}
        if timed:   # gemm against copies, per pass; the second call ran NCHW passes where copies won
            assert set(routes) == {"fprop", "bprop", "accgrad"}
            assert sorted(nchw_ran) == sorted(p for p, r in routes.items() if r == "nchw")
        else:
            assert routes == {} and nchw_ran == []
        on_gemm = {p for p, r in routes.items() if r == "gemm"} if routes else {"fprop", "bprop", "accgrad"}
        if device == "cuda" and stride == (1, 1):   # prepared at the second call (accGrad's per-image form is not)
            assert {"fprop", "bprop"} & on_gemm <= {k[0] for k, run in pt._gemm_runs.items() if callable(run)}


@pytest.mark.parametrize("routes", [("nchw", "gemm", "gemm"), ("nchw", "nchw", "gemm"), ("gemm", "nchw", "gemm"),
                                    ("gemm", "gemm", "nchw")], ids=["nchw_gemm_gemm", "nchw_nchw_gemm",
                                                                    "gemm_nchw_gemm", "gemm_gemm_nchw"])
def test_channels_last_pointwise_routes_mixed_on_the_cpu(monkeypatch, settings, routes):
    """On the CPU, auto's routes (here forced per pass: fprop, accGrad, bprop) mix the GEMM on NumPy views
    with NCHW passes on copies, as CPU tuning may choose: every result channels-last and equal to float64,
    the bias with fprop, the NCHW passes exactly those of the "nchw" route, and no view left in the
    reuse_spectra() block after the backward."""
    settings(tf32=False)
    chosen = dict(zip(("fprop", "accgrad", "bprop"), routes))
    monkeypatch.setattr(backends, "nhwc_route", lambda p, *a, **k: chosen[p])
    nchw_ran = []
    real_run = backends.run_pass
    monkeypatch.setattr(backends, "run_pass", lambda name, p, *a, **k: nchw_ran.append(p) or real_run(name, p, *a, **k))
    x, w, stride, padding = operands((4, 12, 10, 9, 7, 1, 1, (1, 1), (0, 0)), "cpu", seed=3)
    bias = torch.randn(10, generator=torch.Generator().manual_seed(5)).requires_grad_()
    x, w = (t.requires_grad_() for t in channels_last(x, w))
    gy, refs = float64_layer(x, w, bias, stride, padding)
    with reuse_spectra():
        y = conv2d(x, w, stride, padding, "auto", bias)
        y.backward(gy.float().contiguous(memory_format=torch.channels_last))
        assert not pt._views
    assert sorted(nchw_ran) == sorted(p for p, r in chosen.items() if r == "nchw")
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_matches((y, x.grad, w.grad, bias.grad), refs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["cufft", "fbfft"])
def test_channels_last_layer_on_an_fft_backend_shares_gy_and_holds_nothing(device, backend, settings):
    """A channels-last 3x3 layer with backend cufft or fbfft (not auto: no route is timed; on the GPU
    through the one-scope copy path, on the CPU through contiguous copies): forward with its bias and
    backward equal to float64 and channels-last. On the GPU, inside reuse_spectra(), accGrad's gy spectrum
    serves bprop (both run NCHW on the one copy of gy) and no view is left after the backward; the CPU
    copies each operand for each pass, so there it checks the values only."""
    if backend == "fbfft" and device == "cpu":
        pytest.skip("fbfft is a GPU backend")
    settings(tf32=False, cufft_tune="off")
    x, w, stride, padding = operands((4, 6, 8, 13, 11, 3, 3, (1, 1), (1, 1)), device, seed=5)
    bias = torch.randn(8, generator=torch.Generator().manual_seed(2)).to(device).requires_grad_()
    x, w = (t.requires_grad_() for t in channels_last(x, w))
    gy, refs = float64_layer(x, w, bias, stride, padding)
    with reuse_spectra() as cache:
        y = conv2d(x, w, stride, padding, backend, bias)
        y.backward(gy.float().to(device).contiguous(memory_format=torch.channels_last))
        assert not pt._views
    if device == "cuda":   # the CPU's copies share nothing (benchmarks/NOTES.md, session 47), and keep no view
        assert "gy" in [k.role for k in cache.hit_keys], cache.hit_keys
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_matches((y, x.grad, w.grad, bias.grad), refs)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,routes", [(3, ("nchw", "nchw", "cudnn")), (1, ("gemm", "gemm", "nchw")),
                                           (1, ("nchw", "cudnn", "gemm"))], ids=["3x3", "1x1_gemm", "1x1_mixed"])
def test_channels_last_nchw_routes_in_a_cuda_graph(monkeypatch, settings, kernel, routes):
    """A channels-last layer whose passes take the "nchw" route and the others ("cudnn"; a 1x1 layer's
    "gemm", prepared after the eager steps) captured in a CUDA graph with its backward: each crossing
    (the forward's, the backward's) runs its copies, its passes on every route and its copies back in
    one entry of the device's scope and capture context; the replay equals eager."""
    if not backends.get("cudnn").available():
        pytest.skip("cuDNN's frontend is not installed")
    settings(tf32=False)
    chosen = dict(zip(("fprop", "accgrad", "bprop"), routes))
    monkeypatch.setattr(backends, "nhwc_route", lambda p, *a, **k: chosen[p])
    conv = Conv2d(6, 8, kernel, padding=kernel // 2).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(4, 6, 13, 11, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_()

    def step():
        conv.zero_grad(set_to_none=False)
        x.grad = None
        y = conv(x)
        y.backward(torch.ones_like(y))
        return y
    ref = [t.detach().clone() for t in (step(), conv.weight.grad, conv.bias.grad)]
    ref_gx = x.grad.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                                          # warm-up on the capture's stream, as PyTorch advises
    torch.cuda.current_stream().wait_stream(side)
    conv.zero_grad(set_to_none=True)                    # the captured backward makes them in its pool
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = conv(x)
        y.backward(torch.ones_like(y))
    graph.replay()
    torch.cuda.synchronize()
    assert y.is_contiguous(memory_format=torch.channels_last)
    for got, want in ((y, ref[0]), (conv.weight.grad, ref[1]), (conv.bias.grad, ref[2]), (x.grad, ref_gx)):
        assert rel_error(got.detach().cpu().numpy(), want.cpu().numpy()) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(8, 16, 24, 20, 20, 5, 5, (1, 1), (2, 2)),    # geometries of their own
                                  (8, 24, 16, 20, 20, 1, 1, (1, 1), (0, 0))],   # 1x1: the gemm route too
                         ids=["5x5", "1x1"])
def test_channels_last_auto_times_both_routes_per_pass(settings, tmp_path, case):
    """On the GPU, auto with cudnn among its candidates times a channels-last layer's routes once per
    pass (backends.nhwc_route; a 1x1 layer's three, the others' two), records every route's time, and
    keeps the choice for the next call."""
    if not backends.get("cudnn").available():
        pytest.skip("cuDNN's frontend is not installed")
    settings(tf32=False, tune_cache=str(tmp_path / "tune.json"))
    x, w, stride, padding = operands(case, "cuda", seed=7)
    x, w = (t.requires_grad_() for t in channels_last(x, w))
    y = conv2d(x, w, stride, padding)
    y.backward(torch.ones_like(y))
    g = backends.geometry(tuple(x.shape), tuple(w.shape), stride, padding)
    import cupy
    routes = backends.auto.routes_for(backends.auto_registry(), tuple(x.shape), tuple(w.shape), stride, padding, cupy)
    assert len(routes) == (3 if case[5] == 1 else 2)
    rows = [r for r in backends.auto.route_choices() if tuple(r["geometry"][:4]) == (g.S, g.f, g.fo, g.h)]
    assert {r["pass"] for r in rows} == {"fprop", "bprop", "accgrad"}
    assert all(r["route"] in routes and set(r["ms"]) | set(r["skipped"]) == set(routes) for r in rows)
    for r in rows:
        assert backends.nhwc_route(r["pass"], tuple(x.shape), tuple(w.shape), stride, padding, cupy) == r["route"]
    ref = TF.conv2d(x.detach().double().cpu(), w.detach().double().cpu(), stride=stride, padding=padding)
    assert rel_error(y.detach().cpu().numpy(), ref.numpy()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_the_weight_decides_where_the_input_says_nothing(device):
    """As PyTorch's cuDNN convolutions: an NCHW input with a channels-last weight gives channels-last
    results; a one-plane input and weight (NCHW- and NHWC-contiguous at once: a grayscale first
    layer's) strided as NCHW say nothing and give NCHW (the next layer's weight decides again), and
    such a weight or a 1x1 one strided exactly channels-last (as model.to(memory_format=
    torch.channels_last) and convert(channels_last=True) lay it out) gives channels-last. Checked by
    opcheck (fakes against the real results) and against float64."""
    g = torch.Generator().manual_seed(3)
    exactly = lambda w: torch.empty_like(w, memory_format=torch.channels_last).copy_(w)   # noqa: E731
    for xs, ws, lay, want in (((2, 3, 9, 9), (4, 3, 3, 3), channels_last, True),
                              ((2, 1, 9, 9), (4, 1, 3, 3), channels_last, False),
                              ((2, 1, 9, 9), (4, 1, 3, 3), exactly, True),
                              ((2, 3, 9, 9), (4, 3, 1, 1), exactly, True)):
        x, w = torch.randn(xs, generator=g).to(device), torch.randn(ws, generator=g).to(device)
        wl = lay(w)[0] if lay is channels_last else lay(w)
        assert pt._nhwc(x, wl) == want and not pt._nhwc(x, w)
        torch.library.opcheck(torch.ops.minitorch_fft.conv2d, (x, wl, [1, 1], [1, 1], "auto"))
        y = conv2d(x, wl, (1, 1), (1, 1))
        assert pt._channels_last(y) == want and y.is_contiguous(
            memory_format=torch.channels_last if want else torch.contiguous_format)
        ref = TF.conv2d(x.double().cpu(), w.double().cpu(), padding=1)
        assert rel_error(y.cpu().numpy(), ref.numpy()) <= 1e-5
        gy = torch.randn(y.shape, generator=g).to(device)
        torch.library.opcheck(torch.ops.minitorch_fft.conv2d_grads,
                              (gy, x, wl, [1, 1], [1, 1], "auto", [True, True, False]))


@pytest.mark.parametrize("path", PATHS)
def test_only_the_wanted_gradients_are_computed(monkeypatch, path):
    calls = []
    real = backends.run_pass
    monkeypatch.setattr(backends, "run_pass", lambda name, p, *a, **k: calls.append(p) or real(name, p, *a, **k))
    x, w, stride, padding = operands(CASES[0], "cpu")
    call(path, x, w.requires_grad_(), stride, padding).sum().backward()     # the first layer: no gradInput
    assert calls == ["fprop", "accgrad"]
    calls.clear()
    call(path, x.requires_grad_(), w.detach(), stride, padding).sum().backward()   # a frozen layer
    assert calls == ["fprop", "bprop"]


@pytest.mark.parametrize("path", PATHS)
def test_bad_input_says_why(path):
    x, w, stride, padding = operands(CASES[0], "cpu")
    with pytest.raises(TypeError, match="float32"):
        call(path, x.double(), w.double(), stride, padding)
    with pytest.raises(TypeError, match="float32"):
        call(path, x.half(), w, stride, padding)
    with pytest.raises(ValueError, match="unknown convolution backend"):
        call(path, x, w, stride, padding, "no_such_backend")
    with pytest.raises(ValueError, match="conv2d: channel mismatch"):   # the op named
        call(path, x, w[:, :2], stride, padding)
    with pytest.raises(pt.GeometryError, match="conv2d: channel mismatch"):   # a RuntimeError, as nn.Conv2d's
        call(path, x, w[:, :2], stride, padding)
    assert issubclass(pt.GeometryError, RuntimeError) and issubclass(pt.GeometryError, ValueError)
    with pytest.raises(ValueError, match=rf"bias of shape \(3,\).*one value per output plane, \({w.shape[0]},\)"):
        call(path, x, w, stride, padding, bias=torch.zeros(3))
    with pytest.raises(TypeError, match="float32"):
        call(path, x, w, stride, padding, bias=torch.zeros(w.shape[0], dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown convolution backend"):
        Conv2d(3, 4, 3, backend="nope")
    with pytest.raises(ValueError, match="groups=3"):
        Conv2d(3, 3, 3, groups=3)


def test_stride_and_padding_as_pytorch_takes_them_else_a_clear_type_error():
    """NumPy ints are ints (nn.functional.conv2d takes them); a float, None, a string ('same') or a
    triple is a TypeError naming the argument (it had been "'numpy.int64' object is not iterable")."""
    x, w, _, _ = operands(CASES[0], "cpu")
    ref = TF.conv2d(x, w, stride=2, padding=1)
    assert torch.allclose(conv2d(x, w, np.int64(2), (np.int32(1), 1)), ref, atol=1e-5)
    for bad in (2.0, None, "same", (1, 1, 1)):
        with pytest.raises(TypeError, match=r"conv2d: padding must be an int or a pair \(h, w\) of ints, got"):
            conv2d(x, w, 1, bad)
    with pytest.raises(TypeError, match="conv2d: stride must be"):
        conv2d(x, w, 1.5, 0)


def test_a_converted_layer_refuses_what_its_backends_do_not_take():
    """padding_mode, dilation, groups or string padding set after convert() (a loop over a model's
    Conv2d layers): a ValueError, the old value kept, where the layer had gone on zero-padding, a
    silent wrong answer (0.87 off with padding_mode='circular'). Other values still take."""
    net = convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1)))
    layer = net[0]
    for name, value, old in (("padding_mode", "circular", "zeros"), ("dilation", (2, 2), (1, 1)),
                             ("dilation", 2, (1, 1)), ("dilation", None, (1, 1)), ("groups", 3, 1),
                             ("padding", "same", (1, 1))):
        with pytest.raises(ValueError, match=f"{name}=.*set it before convert"):
            setattr(layer, name, value)
        assert getattr(layer, name) == old
    layer.padding = (0, 2)
    x = torch.randn(1, 3, 8, 8)
    assert torch.allclose(net(x), TF.conv2d(x, layer.weight, layer.bias, padding=(0, 2)), atol=1e-5)
    copy.deepcopy(net)                                    # a copy sets nothing through __setattr__


@pytest.mark.parametrize("path", PATHS)
def test_autocast_runs_in_float32(path):
    """Under autocast the inputs are cast to float32 (differentiably: x's gradient comes back in
    its own bfloat16) and the result is float32; float64 is left alone, and refused."""
    x, w, stride, padding = operands(CASES[0], "cpu")
    xb = x.bfloat16().requires_grad_()
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = call(path, xb, w, stride, padding)
        with pytest.raises(TypeError, match="float32"):
            call(path, x.double(), w.double(), stride, padding)
    assert y.dtype == torch.float32
    x64, w64 = xb.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = TF.conv2d(x64, w64, stride=stride, padding=padding)
    assert rel_error(y.detach().numpy(), ref.detach().numpy()) <= 1e-5
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y.backward(gy.float())
    ref.backward(gy)
    assert xb.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert rel_error(w.grad.numpy(), w64.grad.numpy()) <= 1e-5
    assert rel_error(xb.grad.double().numpy(), x64.grad.numpy()) <= 1e-2     # bfloat16's rounding


def test_torch_func_derivatives_are_refused_not_wrong():
    """Under torch.func's derivative transforms custom_op's autograd cannot serve the operator (jvp
    and jacfwd gave zero tangents silently; grad raised PyTorch's setup_context error): a clear
    NotImplementedError instead, on both layer and function; eager forward-mode AD likewise. vmap
    still runs (test_traced_calls_take_the_operator)."""
    torch.manual_seed(0)
    c = Conv2d(3, 4, 3)
    x, t = torch.randn(1, 3, 6, 6), torch.randn(1, 3, 6, 6)
    frozen = Conv2d(3, 4, 3).requires_grad_(False)   # tracked by nothing: runs inside the transforms
    _, tan = torch.func.jvp(lambda a: frozen(x) + 0 * a.sum(), (x,), (t,))
    assert torch.equal(tan, torch.zeros_like(tan))
    assert torch.allclose(torch.func.grad(lambda a: (frozen(x) * a.sum()).sum())(x),
                          TF.conv2d(x, frozen.weight, frozen.bias).sum().expand_as(x), rtol=1e-5)
    for transform in (lambda: torch.func.jvp(c, (x,), (t,)), lambda: torch.func.jacfwd(c)(x),
                      lambda: torch.func.grad(lambda a: c(a).sum())(x),
                      lambda: torch.func.vjp(lambda w: conv2d(x, w), c.weight),
                      lambda: torch.func.vmap(torch.func.grad(lambda a: conv2d(a[None], c.weight).sum()))(x)):
        with pytest.raises(NotImplementedError, match="torch.func's derivative transforms"):
            transform()
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
            c(fwAD.make_dual(x, t))


def test_reuse_blocks_of_two_threads_may_end_out_of_order():
    """Two threads' reuse_spectra() blocks, the first opened ending first: neither raises, and after
    both nothing is left open (the old code left the second's view dict set for good: every later
    call kept a view of its input, and so the input)."""
    import threading
    from minitorch_fft.backends import reuse
    steps = [threading.Event() for _ in range(3)]
    errors = []

    def second():
        try:
            with reuse_spectra():
                steps[0].set()       # B open, after A
                steps[1].wait(10)    # A ends
                conv2d(torch.randn(1, 3, 6, 6), torch.randn(4, 3, 3, 3))
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)
        steps[2].set()

    with reuse_spectra():
        thread = threading.Thread(target=second)
        thread.start()
        steps[0].wait(10)
    steps[1].set()
    steps[2].wait(10)
    thread.join(10)
    assert not errors, errors
    assert pt._views is None and not pt._open_views and reuse.active() is None and not reuse._open


def test_view_blocks_of_threads_opening_and_ending_at_once_stay_open_while_they_run():
    """The adapter's view dicts (reuse_spectra()'s, _view_block) under threads opening and ending
    blocks at once, as test_reuse's threads test does for the spectra blocks (the same OpenBlocks
    class): each thread's dict is among the open ones all the while its block runs, _views names the
    last open one whenever it is read under the lock, and nothing is left open after; each thread's
    full reuse_spectra() block as well."""
    from test_reuse import _consistent, run_at_once
    lost, stale, errors = [], [], []

    def worker():
        try:
            for i in range(2000):
                views = {}
                with pt._open_views.open(views), (reuse_spectra() if i % 2 else contextlib.nullcontext()):
                    blocks, ok = _consistent(pt._open_views, lambda: pt._views, lambda b: b)
                    if not any(b is views for b in blocks):
                        lost.append(i)
                    if not ok:
                        stale.append(i)
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    run_at_once(worker)
    assert not errors, errors
    assert not lost, f"{len(lost)} view dicts dropped from the open ones while their blocks ran"
    assert not stale, f"_views named another dict than the last open one {len(stale)} times"
    assert pt._views is None and not pt._open_views


def test_a_subclass_of_conv2d_is_made_and_runs():
    """A subclass of the adapter's Conv2d is the user's own extension of it: made and run as Conv2d
    (a subclass of nn.Conv2d, whose forward may differ, is what convert() leaves alone)."""
    class Logged(Conv2d):
        calls = 0

        def forward(self, x):
            Logged.calls += 1
            return super().forward(x)

    layer = Logged(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 8, 8)
    assert torch.allclose(layer(x), TF.conv2d(x, layer.weight, layer.bias, padding=1), atol=1e-5)
    assert Logged.calls == 1 and unsupported(layer) is None

    class Own(torch.nn.Conv2d):
        pass
    assert "subclass of nn.Conv2d" in unsupported(Own(3, 4, 3))


# -- which path a call takes, and what crosses ------------------------------------------------------

def profiled_names(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_eager_calls_skip_the_dispatcher():
    """conv2d and Conv2d, eager, with and without gradients: EagerConv2d runs, torch.ops never
    (the profiler lists every operator call, so it sees one if it is made: the direct call shows)."""
    x, w, stride, padding = operands(CASES[0], "cpu")
    x.requires_grad_(), w.requires_grad_()

    def step():
        y = conv2d(x, w, stride, padding)
        y.backward(torch.ones_like(y))
        with torch.no_grad():
            conv2d(x, w, stride, padding)
        module = Conv2d(3, 4, 3, padding=1)
        module(x).sum().backward()
    names = profiled_names(step)
    assert "EagerConv2d" in names and any("EagerConv2dBackward" in n for n in names)
    assert not any(n.startswith("minitorch_fft::") for n in names), sorted(names)
    for xi, wi in ((x, w), (x, w.detach()), (x.detach(), w)):   # whichever gradients: one operator
        names = profiled_names(lambda: call("operator", xi, wi, stride, padding).sum().backward())
        assert {"minitorch_fft::conv2d", "minitorch_fft::conv2d_grads"} <= names
        assert not {"minitorch_fft::conv2d_bprop", "minitorch_fft::conv2d_accgrad"} & names


def test_traced_calls_take_the_operator():
    """Whatever must see the operator sees it: a dispatch mode on real tensors, make_fx, FakeTensor
    (the eager path would run the backends on tensors with no data), functorch's vmap (which loops
    the operator over the batch)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    x, w, stride, padding = operands(CASES[1], "cpu")
    with Seen() as seen:
        conv2d(x, w, stride, padding)
    assert torch.ops.minitorch_fft.conv2d.default in seen.ops
    xs = torch.stack([x, 2 * x])                              # a batch of two calls
    ys = torch.func.vmap(lambda a: conv2d(a, w, stride, padding))(xs)
    for a, y in zip(xs, ys):
        ref = TF.conv2d(a.double(), w.double(), stride=stride, padding=padding)
        assert rel_error(y.numpy(), ref.numpy()) <= 1e-5
    graph = make_fx(lambda a, b: conv2d(a, b, stride, padding))(x, w).graph
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [torch.ops.minitorch_fft.conv2d.default]
    mode = FakeTensorMode()
    fx, fw = mode.from_tensor(x), mode.from_tensor(w)
    with mode:
        y = conv2d(fx, fw, stride, padding)
    z = conv2d(fx, fw, stride, padding)                      # a tensor subclass, no mode active
    for out in (y, z):
        assert isinstance(out, FakeTensor)
        assert out.shape == TF.conv2d(x, w, stride=stride, padding=padding).shape


def address(a):
    """Where a NumPy or CuPy array's data starts."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("device", DEVICES)
def test_no_copies_at_the_boundary(device, path, monkeypatch):
    """Every array a pass gets is the tensor's own memory, and every tensor a pass returns is
    the array's: fprop, bprop and accGrad, on both paths."""
    seen = []
    real = backends.run_pass

    def run_pass(name, pass_name, a, b, *rest, **kwargs):
        out = real(name, pass_name, a, b, *rest, **kwargs)
        seen.append((pass_name, address(a), address(b), address(out)))
        return out
    monkeypatch.setattr(backends, "run_pass", run_pass)
    x, w, stride, padding = operands(CASES[0], device)
    x.requires_grad_(), w.requires_grad_()
    y = call(path, x, w, stride, padding)
    gy = torch.randn_like(y)                                  # contiguous: nothing to copy
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    got = {p: (a, b, out) for p, a, b, out in seen}
    assert got == {"fprop": (x.data_ptr(), w.data_ptr(), y.data_ptr()),
                   "bprop": (gy.data_ptr(), w.data_ptr(), gx.data_ptr()),
                   "accgrad": (gy.data_ptr(), x.data_ptr(), gw.data_ptr())}


@pytest.mark.parametrize("path", PATHS)
def test_no_second_derivative_on_either_path(path):
    """backward(create_graph=True) works; a second backward through the passes says why it cannot."""
    x, w, stride, padding = operands(CASES[0], "cpu")
    x.requires_grad_(), w.requires_grad_()
    gx, = torch.autograd.grad(call(path, x, w, stride, padding).sum(), x, create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        gx.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_spectra_are_shared_across_the_autograd_boundary(device, settings):
    """One cufft layer's step in a reuse_spectra() block: fprop's weight spectrum serves bprop,
    fprop's x serves accGrad and accGrad's gy serves bprop (3 hits; inputs=False: not x's), with
    the same gradients as without. cufft's
    own tuning is off: a tuned pass may pick its own basis, and then shares nothing (reuse.py).
    Weight spectra kept (reuse_weight_spectra; off by default, saving memory)."""
    settings(cufft_tune="off", reuse_weight_spectra=True)
    x, w, stride, padding = operands(STRIDE1[0], device)
    grads = []
    for share in (None, True, False):     # no block; a block; a block keeping no input spectrum
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        if share is None:
            conv2d(xs, ws, stride, padding, "cufft").square().sum().backward()
        else:
            with reuse_spectra(inputs=share) as cache:
                conv2d(xs, ws, stride, padding, "cufft").square().sum().backward()
            assert sorted(k.role for k in cache.hit_keys) == (["gy", "w", "x"] if share else ["gy", "w"])
        grads.append((xs.grad, ws.grad))
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["eager", "operator"])
def test_backward_runs_accgrad_before_bprop_and_holds_nothing_after(device, path, settings, monkeypatch):
    """A layer's backward: accGrad, then bprop (the input gradient is not alive beside accGrad's
    workspace; the comment above EagerConv2d), on both paths. Eagerly in a reuse_spectra() block,
    accGrad keeps gy's spectrum for bprop and nothing else (run_pass's `later`), and after the
    backward the block holds no view; so does the traced path's conv2d_grads, in the caller's block,
    or without one in a block of its own. The gradients are those of the order before (bprop
    first), which the single-pass operators give when called so."""
    settings(cufft_tune="off")
    x, w, stride, padding = operands(STRIDE1[0], device)
    calls = []
    real = pt.backends.run_pass

    def run_pass(name, pass_name, *args, later=None, **kw):
        calls.append((pass_name, later))
        return real(name, pass_name, *args, later=later, **kw)

    monkeypatch.setattr(pt.backends, "run_pass", run_pass)
    inner, real_block = [], pt.reuse_spectra

    @contextlib.contextmanager
    def block(**kw):
        with real_block(**kw) as cache:
            inner.append(cache)
            yield cache
    monkeypatch.setattr(pt, "reuse_spectra", block)    # the one conv2d_grads enters
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    with reuse_spectra() as cache:
        if path == "eager":
            y = conv2d(xs, ws, stride, padding, "cufft")
        else:
            y = torch.ops.minitorch_fft.conv2d(xs, ws, list(stride), list(padding), "cufft")
        y.square().sum().backward()
        assert pt._views == {}
    gy = 2 * y.detach()
    hits = sorted(k.role for k in cache.hit_keys)
    assert calls == [("fprop", None), ("accgrad", ("bprop",)), ("bprop", ())]
    assert hits == ["gy"] and inner == []     # inputs=False: no x; weight spectra not kept by default
    if path == "operator":                    # no block open: conv2d_grads shares in one of its own
        xs.grad = ws.grad = None
        torch.ops.minitorch_fft.conv2d(xs, ws, list(stride), list(padding), "cufft").square().sum().backward()
        assert [sorted(k.role for k in c.hit_keys) for c in inner] == [["gy"]] and pt._views is None
    monkeypatch.setattr(pt.backends, "run_pass", real)
    gx = torch.ops.minitorch_fft.conv2d_bprop(gy, w, list(x.shape), list(stride), list(padding), "cufft")
    gw = torch.ops.minitorch_fft.conv2d_accgrad(gy, x, list(w.shape), list(stride), list(padding), "cufft")
    assert torch.equal(xs.grad, gx) and torch.equal(ws.grad, gw)


@pytest.mark.parametrize("device", DEVICES)
def test_the_block_holds_no_view_after_a_layers_last_pass(device, settings):
    """A first layer (no input gradient) runs fprop and accGrad only: its gradOutput feeds one pass.
    The block must not keep a view of it (that kept the tensor alive until the block ended: 95 MiB
    on AlexNet b128). What is left after backward is fprop's view of w, which no bprop took (a
    tensor the model holds anyway): accGrad took x's, and nothing of gy is kept."""
    settings(cufft_tune="off")
    x, w, stride, padding = operands(STRIDE1[0], device)
    ws = w.clone().requires_grad_()
    with reuse_spectra():
        y = conv2d(x, ws, stride, padding, "cufft")
        y.square().sum().backward()
        held = list(pt._views.values())
    assert [tuple(a.shape) for a in held] == [tuple(w.shape)]
    assert pt.reuse_spectra.__wrapped__.__defaults__ == (False,)   # the adapter's default: no input spectra


@pytest.mark.parametrize("device", DEVICES)
def test_copies_are_not_held_by_the_block(device, settings):
    """A channels-last layer on the NCHW passes (here backend cufft) runs them on contiguous copies,
    which no later pass can find: the block keeps none of them (it kept every layer's x, w and gy
    copies until it ended), as it holds nothing for the NCHW layer (a middle one: both gradients)."""
    settings(cufft_tune="off")
    x, w, stride, padding = operands(STRIDE1[0], device)
    held = {}
    for layout in (torch.contiguous_format, torch.channels_last):
        xs, ws = (t.contiguous(memory_format=layout).requires_grad_() for t in (x, w))
        with reuse_spectra():
            y = conv2d(xs, ws, stride, padding, "cufft")
            y.square().sum().backward()
            held[layout] = [tuple(a.shape) for a in pt._views.values()]
        assert y.is_contiguous(memory_format=layout)
    assert held[torch.channels_last] == [] and held[torch.contiguous_format] == [], held


# -- the module and convert() -------------------------------------------------------------------

class Odd(torch.nn.Conv2d):
    pass


def mixed_model():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, groups=2), torch.nn.Conv2d(8, 8, 3, dilation=2),
        torch.nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"), torch.nn.Conv2d(8, 8, 3, padding="same"),
        Odd(8, 8, 1), torch.nn.Conv2d(8, 4, 3, stride=2, bias=False))


def test_convert_in_place_and_reports(caplog):
    model = mixed_model()
    params = list(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="minitorch_fft.pytorch"):
        assert convert(model, backend="gemm") is model
    assert [type(m) for m in model] == [Conv2d, torch.nn.ReLU, torch.nn.Conv2d, torch.nn.Conv2d,
                                        torch.nn.Conv2d, torch.nn.Conv2d, Odd, Conv2d]
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert isinstance(model[0], torch.nn.Conv2d) and model[0].backend == "gemm"
    assert "backend='gemm'" in repr(model[0])
    text = caplog.text
    for reason in ("groups=2", "dilation=(2, 2)", "padding_mode='reflect'", "padding='same'", "Odd is a subclass"):
        assert reason in text
    assert unsupported(model[2]) == "groups=2 (the backends take groups=1)"
    # state_dict interchangeable both ways
    stock = mixed_model()
    stock.load_state_dict(model.state_dict())
    assert all(torch.equal(before[k], v) for k, v in stock.state_dict().items())
    model.load_state_dict(mixed_model().state_dict())
    x = torch.randn(2, 3, 12, 12)
    assert rel_error(model(x).detach().numpy(), _stock_copy(model)(x).detach().numpy()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_a_converted_layer_takes_what_nn_conv2d_takes(device):
    """An unbatched (C, H, W) image and an empty batch, which nn.Conv2d takes: the same output and
    gradients as the stock layer (float64 reference for the image)."""
    torch.manual_seed(0)
    ours = Conv2d(3, 4, 3, padding=1).to(device)
    stock = _stock_copy(ours).double()
    x = torch.randn(3, 8, 8, device=device, requires_grad=True)
    y = ours(x)
    x64 = x.detach().double().requires_grad_()
    ref = stock(x64)
    assert y.shape == ref.shape == (4, 8, 8)
    assert rel_error(y.detach().cpu().numpy(), ref.detach().cpu().numpy()) <= 1e-5
    y.sum().backward()
    ref.sum().backward()
    assert rel_error(x.grad.cpu().numpy(), x64.grad.cpu().numpy()) <= 1e-5
    assert rel_error(ours.weight.grad.cpu().numpy(), stock.weight.grad.cpu().numpy()) <= 1e-5
    empty = torch.randn(0, 3, 8, 8, device=device, requires_grad=True)
    out = ours(empty)
    assert out.shape == (0, 4, 8, 8)
    grads = [p.grad.clone() for p in ours.parameters()]
    out.sum().backward()
    assert empty.grad.shape == empty.shape                       # and the layer's gradients gain nothing
    assert all(torch.equal(p.grad, g) for p, g in zip(ours.parameters(), grads))


def test_a_list_where_a_tensor_belongs_is_a_type_error_naming_it():
    """As nn.Conv2d: a TypeError (the dispatcher would raise a RuntimeError), naming the argument."""
    layer = Conv2d(1, 1, 1)
    with pytest.raises(TypeError, match="conv2d: x must be a torch.Tensor, got list"):
        layer([[1.0]])
    with pytest.raises(TypeError, match="conv2d: weight must be a torch.Tensor, got ndarray"):
        conv2d(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 1, 1).numpy())
    with pytest.raises(TypeError, match="conv2d: bias must be a torch.Tensor, got list"):
        conv2d(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 1, 1), bias=[0.0])


def test_torch_fx_traces_a_converted_model():
    """The type check lets a tracer's proxies through (torch.fx.Proxy is no Tensor): the traced module
    computes what the model does."""
    torch.manual_seed(0)
    model = convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(4, 2, 3, stride=2)))
    traced = torch.fx.symbolic_trace(model)
    x = torch.randn(2, 3, 9, 9)
    assert torch.equal(traced(x), model(x))
    # each layer a leaf of the trace, its forward called whole (torch.fx.wrap): an unbatched image and
    # an empty batch run as in the model (traced through, only the operator's call had been kept, and
    # both raised "input must be 4-D" and "zero-size dimension")
    assert [n.target for n in traced.graph.nodes if n.op == "call_function"] == [pt._layer, pt._layer]
    assert torch.equal(traced(x[0]), model(x[0])) and traced(x[0]).shape == (2, 4, 4)
    empty = traced(x[:0])
    assert empty.shape == (0, 2, 4, 4) and torch.equal(empty, model(x[:0]))


def test_torchvision_feature_extraction_of_a_converted_model():
    """torchvision's create_feature_extractor (an fx trace) on a converted ResNet-18 gives the stock
    model's features: the converted layers are leaves of its trace."""
    from torchvision.models import resnet18
    from torchvision.models.feature_extraction import create_feature_extractor
    torch.manual_seed(0)
    stock = resnet18().eval()
    converted = convert(copy.deepcopy(stock), backend="gemm")
    nodes = {"layer1": "low", "layer3.1.conv2": "conv"}
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        want = create_feature_extractor(stock, nodes)(x)
        got = create_feature_extractor(converted, nodes)(x)
    for k in nodes.values():
        assert got[k].shape == want[k].shape
        assert rel_error(got[k].numpy(), want[k].double().numpy()) <= 1e-5


def test_convert_refuses_what_it_cannot_serve_when_asked():
    """Not a module: a TypeError naming the type. A backend this process cannot run (cudnn without
    cuDNN or a GPU): a ValueError when the layer is made, not at its first forward."""
    with pytest.raises(TypeError, match="takes a torch.nn.Module, got NoneType"):
        convert(None)
    if backends.get("cudnn").available():
        pytest.skip("cuDNN runs here")
    with pytest.raises(ValueError, match="backend 'cudnn' cannot run in this process"):
        convert(torch.nn.Conv2d(3, 4, 3), backend="cudnn")
    with pytest.raises(ValueError, match="backend 'cudnn' cannot run in this process"):
        Conv2d(3, 4, 3, backend="cudnn")


def bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                               torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 8, 3, padding=1),
                               torch.nn.ReLU(), torch.nn.Conv2d(8, 6, 1), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(6, 10))


@pytest.mark.parametrize("device", DEVICES)
def test_convert_channels_last_runs_an_nchw_model_channels_last(device, strict_fp32):
    """convert(model, channels_last=True): the same Parameter objects, their 4-d ones laid out
    channels-last with the same values; an NCHW batch in, the first layer takes it as it is and every
    layer gives a channels-last output, so the later ones take channels-last inputs (batch norm, ReLU
    and pooling keep the layout); the batch is not copied for the backward (the first layer keeps
    the caller's tensor); output and every gradient as the stock NCHW model's in float64; no hook
    on the model however often convert() runs; the state_dict loads into the stock model and back."""
    stock = bn_net().to(device)
    model = copy.deepcopy(stock)
    params = list(model.parameters())
    assert convert(model, channels_last=True) is model
    convert(model, channels_last=True)
    convert(model)                                     # channels_last=False leaves the layout as it is
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(pt._channels_last(p) for p in params if p.dim() == 4)   # exactly: the 1x1 weight too
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), stock.state_dict().values()))
    seen = []
    for m in model.modules():
        if isinstance(m, Conv2d):
            m.register_forward_hook(lambda m, args, y: seen.append(
                (args[0].is_contiguous(memory_format=torch.channels_last), y.is_contiguous(
                    memory_format=torch.channels_last))))
    x = torch.randn(4, 3, 12, 12, device=device)
    assert x.is_contiguous()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(x)
    assert seen == [(False, True), (True, True), (True, True)]
    batches = [t for t in saved if t.shape == x.shape]
    assert batches and all(t.data_ptr() == x.data_ptr() for t in batches)   # the caller's, no copy
    ref_model = stock.double()
    x64 = x.double()
    ref = ref_model(x64)
    assert rel_error(out.detach().cpu().numpy(), ref.detach().cpu().numpy()) <= 1e-4
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert rel_error(a.grad.cpu().numpy(), b.grad.cpu().numpy()) <= 1e-4, name
    back = bn_net().to(device)
    back.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    with torch.no_grad():
        for p in back.parameters():
            p.add_(1.0)
    model.load_state_dict(back.state_dict())                # the stock model's values, laid out as before
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))
    assert all(pt._channels_last(p) for p in params if p.dim() == 4)   # exactly: the 1x1 weight too


@pytest.mark.parametrize("first", ["grayscale", "1x1"])
def test_convert_channels_last_lays_out_weights_of_both_layouts_too(first, strict_fp32):
    """A first layer whose weight is NCHW- and NHWC-contiguous at once (one input channel, or a 1x1
    kernel): convert(channels_last=True) strides it exactly channels-last (as model.to() does), so its
    output from the NCHW batch is channels-last like every later layer's; values and gradients as
    the stock model's in float64."""
    torch.manual_seed(0)
    cin, layer = (1, torch.nn.Conv2d(1, 4, 3, padding=1)) if first == "grayscale" else (3, torch.nn.Conv2d(3, 4, 1))
    stock = torch.nn.Sequential(layer, torch.nn.ReLU(), torch.nn.Conv2d(4, 5, 3), torch.nn.Conv2d(5, 6, 1))
    model = convert(copy.deepcopy(stock), channels_last=True)
    assert all(pt._channels_last(p) for p in model.parameters() if p.dim() == 4)
    outs = []
    for m in model:
        if isinstance(m, Conv2d):
            m.register_forward_hook(lambda m, args, y: outs.append(pt._channels_last(y)))
    x = torch.randn(2, cin, 8, 8)
    out = model(x)
    assert outs == [True, True, True]
    ref_model = stock.double()
    ref = ref_model(x.double())
    assert rel_error(out.detach().numpy(), ref.detach().numpy()) <= 1e-5
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert rel_error(a.grad.numpy(), b.grad.numpy()) <= 1e-5, name
    assert all(pt._channels_last(p.grad) for p in model.parameters() if p.dim() == 4)   # the gradients too
    # a (4, 1, 1, 1) weight has the same strides either way (_channels_last never says yes): laid out
    # already, like every other weight, and not copied again by a second convert
    head = convert(torch.nn.Sequential(torch.nn.Conv2d(3, 1, 3, padding=1), torch.nn.Conv2d(1, 4, 1)), channels_last=True)
    storage = [p.data_ptr() for p in head.parameters()]
    convert(head, channels_last=True)
    assert [p.data_ptr() for p in head.parameters()] == storage


def test_convert_channels_last_leaves_the_callers_batch_as_it_is():
    """A model whose forward takes its batch by keyword (the pre-hook before 7e04df1 copied keyword
    arguments too): its first layer gets the caller's tensor itself, NCHW, and gives a channels-last
    output with the stock model's values."""
    class ByKeyword(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, *, image):
            return self.conv(image)
    torch.manual_seed(0)
    stock = ByKeyword()
    model = convert(copy.deepcopy(stock), channels_last=True)
    seen = []
    model.conv.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x = torch.randn(2, 3, 8, 8)
    out = model(image=x)
    assert len(seen) == 1 and seen[0] is x and x.is_contiguous()
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert rel_error(out.detach().numpy(), stock(image=x).detach().numpy()) <= 1e-5


def test_convert_channels_last_relays_tensors_in_place():
    """The same tensor objects whatever torch.__future__ says (model.to() makes new Parameters under
    overwrite_module_params_on_conversion), a buffer two modules share still shared, a gradient
    already there re-laid too, and a 5-d parameter (Conv3d) left as it is (model.to() raised on it,
    leaving the model half converted)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv3d(1, 1, 1))
    shared = torch.randn(1, 2, 3, 4)
    model[0].register_buffer("t", shared)
    model[1].register_buffer("t", shared)
    model[0].weight.grad = torch.randn_like(model[0].weight)
    weight, grad, values = model[0].weight, model[0].weight.grad, model[0].weight.detach().clone()
    saved = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        convert(model, channels_last=True)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(saved)
    assert model[0].weight is weight and weight.grad is grad and torch.equal(weight, values)
    assert weight.is_contiguous(memory_format=torch.channels_last)
    assert grad.is_contiguous(memory_format=torch.channels_last)
    assert model[0].t is model[1].t is shared and shared.is_contiguous(memory_format=torch.channels_last)
    assert model[1].weight.dim() == 5 and model[1].weight.is_contiguous()


def test_convert_channels_last_takes_a_bool():
    with pytest.raises(TypeError, match="channels_last takes True or False, got 'yes'"):
        convert(small_net(), channels_last="yes")


def test_convert_channels_last_refuses_lazy_parameters_before_changing_anything():
    """A LazyConv2d's uninitialized weight has no layout to set: a ValueError saying to run a forward
    first, raised before any layer is swapped; after one forward it converts."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.LazyConv2d(5, 3))
    with pytest.raises(ValueError, match=r"2 uninitialized \(lazy\) parameters or buffers \(1.weight, 1.bias\).*"
                                         r"run one forward first"):
        convert(model, channels_last=True)
    assert type(model[0]) is torch.nn.Conv2d and model[0].weight.is_contiguous()   # untouched
    model(torch.randn(1, 3, 9, 9))
    convert(model, channels_last=True)
    assert all(type(m) is Conv2d and m.weight.is_contiguous(memory_format=torch.channels_last) for m in model)


def _stock_copy(model):
    """A deep copy with every Conv2d back to nn.Conv2d (the reference)."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if type(m) is Conv2d:
            m.__class__ = torch.nn.Conv2d
    return ref


def test_conv2d_module_matches_nn_conv2d():
    torch.manual_seed(0)
    ours = Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 0))
    stock = torch.nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 0))
    assert list(ours.state_dict()) == list(stock.state_dict())
    stock.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 9, 8)
    assert rel_error(ours(x).detach().numpy(), stock(x).detach().numpy()) <= 1e-5


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("frozen", [False, True], ids=["all", "bias_only"])
def test_conv2d_bias_added_in_place_has_nn_conv2ds_gradients(path, frozen, monkeypatch):
    """Conv2d's bias goes into the operator, which adds it in place on its output (as nn.Conv2d's
    cuDNN path does): the input's, weight's and bias's gradients are nn.Conv2d's on both paths, and
    with the weight frozen (the backward then asked for the input's and the bias's alone)."""
    if path == "operator":
        monkeypatch.setattr(pt, "_eager", lambda *tensors: False)
    torch.manual_seed(1)
    ours = Conv2d(3, 4, 3, padding=1)
    stock = torch.nn.Conv2d(3, 4, 3, padding=1)
    stock.load_state_dict(ours.state_dict())
    for m in (ours, stock):
        m.weight.requires_grad_(not frozen)
    x = torch.randn(2, 3, 7, 7)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    gy = torch.randn(2, 4, 7, 7)
    for m, xi in zip((ours, stock), xs):
        m(xi).backward(gy)
    assert rel_error(xs[0].grad.numpy(), xs[1].grad.numpy()) <= 1e-5
    assert rel_error(ours.bias.grad.numpy(), stock.bias.grad.numpy()) <= 1e-5
    if frozen:
        assert ours.weight.grad is None
    else:
        assert rel_error(ours.weight.grad.numpy(), stock.weight.grad.numpy()) <= 1e-5


# -- whole networks ------------------------------------------------------------------------------

NETS = {"resnet18": 64, "alexnet": 64}   # name -> input size (small: CI's CPU)


def _torchvision(name):
    import torchvision
    torch.manual_seed(0)
    return getattr(torchvision.models, name)(num_classes=10)


def network_check(name, device, tol=1e-4, channels_last=False):
    """A converted torchvision net (channels_last: convert(channels_last=True)'s, on the same NCHW
    batch) against the original in float32 (output and every gradient to `tol`), and each conv's
    weight gradient against the original in float64. Both originals take
    the converted net's branch at every ReLU and max-pool (reference.Kinks): an input within
    rounding of a kink may fall on either side in each precision, which moves a gradient by a
    whole term (0.5-1.5 % on ResNet-18; benchmarks/NOTES.md, session 19) without any conv being
    wrong. The flips themselves must be rounding: each within `tol` of its input's RMS."""
    stock = _torchvision(name).to(device)
    ours = convert(copy.deepcopy(stock), channels_last=channels_last)
    ref64 = copy.deepcopy(stock).double()
    # eval: dropout (AlexNet) draws differently in each; BatchNorm then normalises with its
    # running statistics, so each net is a fixed function of its weights
    nets = [m.eval() for m in (ours, stock, ref64)]
    kinks = Kinks()
    kinks.record(ours)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, NETS[name], NETS[name], generator=g)
    y = torch.randint(0, 10, (2,), generator=g)
    outs = []
    for net in nets:
        if net is not ours:
            kinks.replay(net, tol=tol)
        dtype = next(net.parameters()).dtype
        out = net(x.to(device, dtype))
        TF.cross_entropy(out, y.to(device)).backward()
        outs.append(out)
    kinks.remove()
    assert not kinks.too_large, f"forward off at kinks (not rounding): {kinks.too_large[:10]}; {kinks.report()}"
    assert rel_error(outs[0].detach().cpu().numpy(), outs[1].detach().cpu().numpy()) <= tol
    assert rel_error(outs[0].detach().cpu().double().numpy(), outs[2].detach().cpu().numpy()) <= tol
    # The original's own fp32 error counts too: cuDNN's benchmark mode may pick, per run, a
    # weight-gradient algorithm 1e-4 or more from float64 (3.6e-3 on AlexNet at b128).
    # Every gradient over its bound is named, with the kinks and auto's choices, in one message
    # (a string: pytest shortens a tuple's).
    over = []
    for (pname, p), q, r in zip(ours.named_parameters(), stock.parameters(), ref64.parameters()):
        stock_err = rel_error(q.grad.cpu().double().numpy(), r.grad.cpu().numpy())
        err = rel_error(p.grad.cpu().numpy(), q.grad.cpu().numpy())
        if err > tol + stock_err:
            over.append(f"{pname}: {err:.2e} from stock fp32 (stock {stock_err:.1e} from float64)")
        if pname.endswith("weight") and p.dim() == 4:
            err64 = rel_error(p.grad.cpu().double().numpy(), r.grad.cpu().numpy())
            if err64 > tol:
                over.append(f"{pname}: {err64:.2e} from float64")
    assert not over, ("gradients over their bound:\n" + "\n".join(over) + f"\n{kinks.report()}\n"
                      + backends.auto.format_choices())
    n_conv = sum(type(m) is Conv2d for m in ours.modules())
    assert n_conv == sum(type(m) is torch.nn.Conv2d for m in stock.modules()) > 0
    return ours


def test_kinks_replay_takes_the_recorded_branch():
    """reference.Kinks, what network_check relies on: a reference whose inputs sit on the other
    side of a ReLU's 0 and of a max-pool's tie, by 1e-7, takes the recorded branch (its input
    gradient then equals the recorded run's), counts both flips as rounding, and a flip by about half
    of the input's RMS is too large."""
    net = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.MaxPool2d(2))
    base = torch.tensor([[[[1e-7, 2.0, 3.0, 1.0], [0.5, -1.0, 3.0 + 1e-7, 0.2]]]], dtype=torch.float64)
    other = base.clone()
    other[0, 0, 0, 0] = -1e-7                 # ReLU: off in the reference, on in the recorded run
    other[0, 0, 0, 2], other[0, 0, 1, 2] = 3.0 + 1e-7, 3.0   # the max-pool's tie, the other way round
    weights = torch.tensor([[[[1.0, -2.0]]]], dtype=torch.float64)

    def grad(x, kinks=None, tol=1e-4):
        x = x.clone().requires_grad_()
        if kinks is not None:
            kinks.replay(net, tol)
        (net(x) * weights).sum().backward()
        if kinks is not None:
            kinks.remove()
        return x.grad

    kinks = Kinks()
    kinks.record(net)
    recorded = grad(base)
    kinks.remove()
    assert not torch.equal(grad(other), recorded)        # the branches differ without the replay
    assert torch.equal(grad(other, kinks), recorded)
    assert sorted(n for n, _ in kinks.flips) == ["0", "1"] and not kinks.too_large
    assert kinks.report().startswith("2 kink(s)")
    far = other.clone()
    far[0, 0, 0, 0] = -1.0                               # the recorded run had 1e-7 there
    loose = Kinks()
    loose.recorded = kinks.recorded
    grad(far, loose)
    assert [n for n, _ in loose.too_large] == ["0"]


@pytest.fixture
def strict_fp32():
    """PyTorch's cuDNN and cuBLAS without TF32 (cuDNN's default is TF32) until the test ends."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(NETS))
def test_torchvision_network(name, device, strict_fp32):
    network_check(name, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(NETS))
def test_torchvision_network_run_channels_last_inside(name, device, strict_fp32):
    """convert(channels_last=True): the same bounds as the NCHW conversion, every converted layer's output
    channels-last from an NCHW batch."""
    ours = network_check(name, device, channels_last=True)
    laid = []
    for m in ours.modules():
        if type(m) is Conv2d:
            m.register_forward_hook(lambda m, args, y: laid.append(pt._channels_last(y)))
    with torch.no_grad():   # network_check's batch shape: auto's choices are cached, nothing is timed again
        ours(torch.randn(2, 3, NETS[name], NETS[name], device=device))
    assert len(laid) == sum(type(m) is Conv2d for m in ours.modules()) and all(laid), laid


def small_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 8, 5, stride=2, padding=2), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10))


# Operands both NCHW- and NHWC-contiguous on some side: (x, w, stride, padding), laid out as named
AMBIGUOUS = {
    "one_class_head": ((2, 3, 9, 9, "cl"), (1, 3, 3, 3, "cl"), 1, 1),       # y (2, 1, 9, 9)
    "grayscale": ((2, 1, 9, 9, "nchw"), (4, 1, 3, 3, "cl"), 1, 1),         # x, w and gx of one channel
    "one_by_one": ((2, 8, 5, 5, "cl"), (6, 8, 1, 1, "cl"), 1, 0),           # w and gw 1x1
    "one_pixel": ((2, 8, 3, 3, "cl"), (6, 8, 3, 3, "cl"), 1, 0),            # y and gy of 1x1 planes
    # NCHW layers: a backend's own strides on dimensions of size 1 (direct's one-channel output, tiledfft's
    # 1x1 weight gradient) must not make the result look channels-last
    "one_class_head_nchw": ((2, 3, 9, 9, "nchw"), (1, 3, 3, 3, "nchw"), 1, 1),
    "one_class_head_nchw_stride2": ((2, 3, 8, 8, "nchw"), (1, 3, 3, 3, "nchw"), 2, 1),
    "one_by_one_nchw": ((2, 8, 5, 5, "nchw"), (6, 8, 1, 1, "nchw"), 1, 0),
    "one_pixel_nchw": ((2, 8, 3, 3, "nchw"), (6, 8, 3, 3, "nchw"), 1, 0),
}


def _laid(shape, device, seed):
    *dims, layout = shape
    t = torch.randn(*dims, generator=torch.Generator().manual_seed(seed)).to(device)
    return torch.empty_like(t, memory_format=torch.channels_last).copy_(t) if layout == "cl" else t.contiguous()


@pytest.mark.parametrize("case,backend", [(c, b) for c in AMBIGUOUS for b in ("auto", "direct", "tiledfft")
                                          if not (b == "tiledfft" and AMBIGUOUS[c][2] != 1)])   # tiledfft: stride 1
@pytest.mark.parametrize("device", DEVICES)
def test_the_operators_return_the_strides_their_fakes_say(case, device, backend, strict_fp32):
    """Each operator's result has exactly the strides its fake implementation gives (what torch.compile
    plans the next op on), where a tensor is NCHW- and NHWC-contiguous at once: before, such a result of
    a channels-last layer came back C-order strided (NumPy's and DLPack's), so a 1x1 layer after a
    one-class head ran NCHW where its fake said channels-last; and an NCHW layer's could come back with
    channels-last's strides (direct's one-channel output), so the next layer ran channels-last and
    `y.view(n, -1)` raised. The eager path's results too (through autograd.grad: the operator's own,
    not AccumulateGrad's, which may copy a gradient into its variable's strides)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    xs, ws, stride, padding = AMBIGUOUS[case]
    x, w = _laid(xs, device, 1), _laid(ws, device, 2)
    nhwc = "cl" in (xs[-1], ws[-1])
    ops = torch.ops.minitorch_fft
    st, pad = [stride] * 2, [padding] * 2

    def each(results):
        return {k: [t.stride() for t in (v if isinstance(v, tuple) else (v,))] for k, v in results.items()}

    y = ops.conv2d(x, w, st, pad, backend, None)
    gy = _laid((*y.shape, "cl" if nhwc else "nchw"), device, 3)
    real = {"fprop": y,
            "bprop": ops.conv2d_bprop(gy, w, list(x.shape), st, pad, backend),
            "accgrad": ops.conv2d_accgrad(gy, x, list(w.shape), st, pad, backend),
            "grads": ops.conv2d_grads(gy, x, w, st, pad, backend, [True, True, False])[:2]}
    with FakeTensorMode() as mode:
        fx, fw, fgy = (mode.from_tensor(t) for t in (x, w, gy))
        strides = each({"fprop": ops.conv2d(fx, fw, st, pad, backend, None),
                        "bprop": ops.conv2d_bprop(fgy, fw, list(x.shape), st, pad, backend),
                        "accgrad": ops.conv2d_accgrad(fgy, fx, list(w.shape), st, pad, backend),
                        "grads": ops.conv2d_grads(fgy, fx, fw, st, pad, backend, [True, True, False])[:2]})
    assert each(real) == strides
    assert {pt._channels_last(t) for v in real.values() for t in (v if isinstance(v, tuple) else (v,))} == {nhwc}
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    ye = pt.conv2d(xe, we, stride, padding, backend=backend)
    gx, gw = torch.autograd.grad(ye, (xe, we), gy)
    assert [ye.stride(), gx.stride(), gw.stride()] == [*strides["fprop"], *strides["grads"]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_a_one_class_head_then_a_1x1_layer(device, strict_fp32):
    """convert(channels_last=True)'s model with a one-channel activation between two layers (a one-class
    head, then a 1x1 layer on it, whose (4, 1, 1, 1) weight says nothing of its layout, so the head's
    output strides decide): compiled whole (inductor on the GPU, which checks its operators' strides;
    aot_eager on the CPU), its output channels-last as the eager run's, with its values and gradients.
    (With an elementwise op between, PyTorch's own kernels give the one-channel tensor C order's
    strides, and both paths then run the 1x1 layer NCHW.)"""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = convert(torch.nn.Sequential(torch.nn.Conv2d(3, 1, 3, padding=1), torch.nn.Conv2d(1, 4, 1)).to(device),
                    channels_last=True)
    x = torch.randn(2, 3, 9, 9, device=device)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    out = compiled(x)
    assert pt._channels_last(out)
    out.square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x)
    assert pt._channels_last(ref) and ref.stride() == out.stride()
    ref.square().sum().backward()
    assert rel_error(out.detach().cpu().numpy(), ref.detach().cpu().numpy()) <= 1e-5
    for a, p in zip(got, model.parameters()):
        assert rel_error(a.cpu().numpy(), p.grad.cpu().numpy()) <= 1e-5


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "convert_channels_last"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph(device, layout, strict_fp32):
    """torch.compile(fullgraph=True) raises on a graph break: the operator traces whole, and the
    compiled forward and backward call the operators, not the eager path (on the CPU aot_eager's
    graphs are kept and read); a channels-last model and input too, and an NCHW input to
    convert(channels_last=True)'s model (its first layer NCHW in, channels-last out)."""
    torch._dynamo.reset()
    converted_cl = layout == "convert_channels_last"
    model = convert(small_net(), channels_last=converted_cl).to(device)
    layout = torch.channels_last if layout == "channels_last" else torch.contiguous_format   # the input's
    if layout == torch.channels_last:
        model = model.to(memory_format=layout)
    graphs, conv_out = [], []
    if device == "cpu":
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def keep(gm, example_inputs):
            graphs.append({n.target for n in gm.graph.nodes if n.op == "call_function"})
            conv_out.extend(n.meta["val"].is_contiguous(memory_format=torch.channels_last) for n in gm.graph.nodes
                            if n.op == "call_function" and n.target == torch.ops.minitorch_fft.conv2d.default)
            return make_boxed_func(gm.forward)
        backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)
    else:
        backend = "inductor"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(2, 3, 12, 12, device=device).contiguous(memory_format=layout)
    out = compiled(x)
    out.square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x)
    ref.square().sum().backward()
    assert rel_error(out.detach().cpu().numpy(), ref.detach().cpu().numpy()) <= 1e-5
    for a, p in zip(got, model.parameters()):
        assert rel_error(a.cpu().numpy(), p.grad.cpu().numpy()) <= 1e-5
    if device == "cpu":
        ops = torch.ops.minitorch_fft
        forward, backward = graphs
        assert ops.conv2d.default in forward
        # every layer's gradients (the first's without bprop): one operator each
        assert ops.conv2d_grads.default in backward
        assert not {ops.conv2d_accgrad.default, ops.conv2d_bprop.default} & backward
        # each layer's output as traced: channels-last but for the NCHW model (convert(channels_last=True)'s
        # first layer too, from an NCHW input)
        assert conv_out == [layout == torch.channels_last or converted_cl] * 2


# -- GPU: CUDA graphs, no copies, streams ---------------------------------------------------------

def use_path(monkeypatch, path):
    """Conv2d's calls on the eager path, or (for "operator") through torch.ops as if traced."""
    if path == "operator":
        monkeypatch.setattr(pt, "_eager", lambda *tensors: False)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_cuda_graph_training_step_replays(strict_fp32, path, monkeypatch):
    """A converted model's whole step (forward, backward, SGD) captured with torch.cuda.graph;
    replays on new batches match the same steps run eagerly from the same state."""
    use_path(monkeypatch, path)
    model = convert(small_net()).cuda()
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    static_x = torch.randn(4, 3, 12, 12, device="cuda")
    static_y = torch.randint(0, 10, (4,), device="cuda")

    def step(net, optimizer, x, y):
        optimizer.zero_grad(set_to_none=False)
        loss = TF.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):          # warm-up as PyTorch asks: tunes, plans, momentum buffers
        for _ in range(2):
            step(model, opt, static_x, static_y)
            step(eager, opt_eager, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, opt, static_x, static_y)
    eager.load_state_dict(model.state_dict())
    # a deep copy: load_state_dict would keep the very momentum buffers the graph updates
    opt_eager.load_state_dict(copy.deepcopy(opt.state_dict()))
    for i in range(3):
        x, y = torch.randn(4, 3, 12, 12, device="cuda"), torch.randint(0, 10, (4,), device="cuda")
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        loss = step(eager, opt_eager, x, y)
        torch.cuda.synchronize()
        assert abs(static_loss.item() - loss.item()) <= 1e-5 * abs(loss.item())
        for p, q in zip(model.parameters(), eager.parameters()):
            assert rel_error(p.detach().cpu().numpy(), q.detach().cpu().numpy()) <= 1e-5


def reduce_overhead_steps(model, steps, scope=contextlib.nullcontext):
    """`steps` training steps of `model` compiled with mode="reduce-overhead" and of an eager copy of it,
    side by side on fresh random batches, each forward and backward inside scope(); after each step the
    losses and the parameters agree to 1e-5. Returns, at the end of each backward (compiled, then eager,
    per step), the length of what scope() yielded (reuse_spectra's StepCache: the spectra still kept), or
    None where it yielded nothing. The gradients are set to None, not zeroed in place: a gradient the
    last replay made is the graph's output, overwritten by the next replay, and PyTorch refuses to
    accumulate into it."""
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    kept = []
    for i in range(steps):
        x, y = torch.randn(4, 3, 12, 12, device="cuda"), torch.randint(0, 10, (4,), device="cuda")
        losses = []
        for net, optimizer in ((compiled, opt), (eager, opt_eager)):
            if net is compiled:
                torch.compiler.cudagraph_mark_step_begin()
            optimizer.zero_grad(set_to_none=True)
            with scope() as got:
                loss = TF.cross_entropy(net(x), y)
                loss.backward()
                kept.append(None if got is None else len(got))
            optimizer.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), (i, losses)
        for p, q in zip(model.parameters(), eager.parameters()):
            assert rel_error(p.detach().cpu().numpy(), q.detach().cpu().numpy()) <= 1e-5
    return kept


@pytest.mark.gpu
def test_torch_compile_reduce_overhead_training_replays(strict_fp32, monkeypatch):
    """torch.compile(mode="reduce-overhead"): inductor records the compiled forward and backward, the
    operators in them, as CUDA graphs (its cudagraph trees, on a pool and stream of their own) and
    skips none; steps that replay them match the same steps run eagerly from the same state. The
    operators' results are tensors of PyTorch's allocator, with no copy (a DLPack capsule's deleter
    stopped the trees at the end of their warm-up: "Expected standard deleter")."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    replays = [0]

    def replay(graph, _real=torch.cuda.CUDAGraph.replay):
        replays[0] += 1
        return _real(graph)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", replay)
    copied = pt._copied_out[0]
    reduce_overhead_steps(convert(small_net()).cuda(), 5)   # the trees run eagerly once, record, then replay
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert replays[0] >= 3          # steps 3-5 at least replayed graphs
    assert pt._copied_out[0] == copied


@pytest.mark.gpu
def test_reduce_overhead_first_step_drops_a_gy_spectrum_bprop_did_not_take(strict_fp32, monkeypatch):
    """torch.compile(mode="reduce-overhead") on a converted model with no eager step before it, inside
    reuse_spectra(): in auto's first step an untuned bprop counts as accGrad's backend, so accGrad
    (fbfft here) keeps gy's spectrum for bprop, which runs on gemm. Kept to the end of the step, that
    spectrum was a live allocation in the cudagraph trees' pool that no graph returned, and the trees
    refused the backward's warm-up ("tensor(s) in the cudagraph pool not tracked as outputs": converted
    AlexNet's first step in TF32 mode, session 55). The steps now run and match eager ones."""
    from minitorch_fft.backends import auto, fbfft

    def pick(registry, pass_name, x_shape, w_shape, stride, padding, xp=None):
        return "fbfft" if pass_name == "accgrad" and fbfft.supports(x_shape, w_shape, stride, padding) else "gemm"
    monkeypatch.setattr(auto, "pick", pick)
    monkeypatch.setattr(auto, "remembered", lambda *args, **kwargs: None)   # every consumer untuned
    torch._dynamo.reset()
    kept = reduce_overhead_steps(convert(small_net()).cuda(), 4, reuse_spectra)   # warm-up, recording, replays
    assert kept == [0] * 8


@pytest.mark.gpu
@pytest.mark.parametrize("own_handle", [False, True], ids=["as found", "own handle forced"])
def test_captured_gemms_take_no_workspace_of_ours(strict_fp32, own_handle, monkeypatch):
    """Where PyTorch calls our libcublas, a captured pass's GEMMs run on PyTorch's cuBLAS handle for
    the capture stream (the workspace PyTorch binds to it, as the stock model's captured GEMMs use)
    and no handle of ours is made; else (forced here too) on ours, whose workspace the first capture
    takes (from its pool), never an eager pass. Strict fp32 stays strict where PyTorch allows TF32
    matmuls (it sets TF32 math on its handle). Two captures on two streams replay right, the first
    freed first."""
    from minitorch_fft.backends import cgemm
    monkeypatch.setattr(pt, "_graph_handles", {})
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    if own_handle:
        monkeypatch.setattr(pt, "_torch_shares_libcublas", lambda: False)
    borrowed_handles = []

    class Spy(cgemm.BorrowedHandle):
        def __init__(self, ptr):
            super().__init__(ptr)
            borrowed_handles.append(ptr)
    monkeypatch.setattr(cgemm, "BorrowedHandle", Spy)
    conv = Conv2d(16, 32, 3, padding=1, bias=False, backend="gemm").cuda()
    x = torch.randn(4, 16, 20, 20, device="cuda")
    with torch.no_grad():
        ref = conv(x)                                   # eager: CuPy's handle, strict
        index = torch.cuda.current_device()
        borrowed = pt._torch_shares_libcublas()
        assert (pt._graph_handles[index] is None) == borrowed
        if not borrowed:
            assert pt._graph_handles[index].workspace is None
        graph, static_x = torch.cuda.CUDAGraph(), x.clone()
        with torch.cuda.graph(graph):
            static_y = conv(static_x)
    assert bool(borrowed_handles) == borrowed
    handle = pt._graph_handles[index]
    if borrowed:
        assert handle is None
    else:
        assert handle.workspace is not None and handle.workspace.nbytes == cgemm.GRAPH_WORKSPACE_BYTES
    static_y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(static_y.cpu().numpy(), ref.cpu().numpy()) <= 1e-5    # TF32 would be ~1e-3
    with torch.no_grad(), torch.cuda.graph(graph2 := torch.cuda.CUDAGraph(), stream=torch.cuda.Stream()):
        static_y2 = conv(static_x)
    assert pt._graph_handles[index] is handle
    del graph, static_y
    torch.cuda.empty_cache()
    static_y2.zero_()
    graph2.replay()
    torch.cuda.synchronize()
    assert rel_error(static_y2.cpu().numpy(), ref.cpu().numpy()) <= 1e-5


@pytest.mark.gpu
def test_pytorch_shares_our_libcublas_where_one_is_loaded():
    """The identity check is positive where it should be: PyTorch's CUDA library in torch/lib and a
    single libcublas file loaded (a pip install, as on the lent GPUs) means one library, shared."""
    from pathlib import Path

    from minitorch_fft.backends import cgemm
    torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")     # PyTorch's cuBLAS, loaded
    cgemm._libcublas()                                                      # and CuPy's
    if len(cgemm._libcublas_paths()) != 1 or not (Path(torch.__file__).parent / "lib" / "libtorch_cuda.so").exists():
        pytest.skip("not a single libcublas with PyTorch's CUDA library in torch/lib")
    assert pt._torch_shares_libcublas()


CONV_ONLY_CAPTURE = """
import copy, torch
from minitorch_fft import pytorch as pt
from minitorch_fft.pytorch import Conv2d
torch.manual_seed(0)
net = torch.nn.Sequential(Conv2d(3, 8, 3, padding=1, backend="gemm"), torch.nn.ReLU(),
                          Conv2d(8, 4, 3, padding=1, backend="fbfft")).cuda()
eager = copy.deepcopy(net)
opt, opt_eager = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, eager))
static_x = torch.randn(4, 3, 12, 12, device="cuda")

def step(m, o, x):
    o.zero_grad(set_to_none=False)
    loss = m(x).square().mean()     # no GEMM of PyTorch's anywhere in the step
    loss.backward()
    o.step()
    return loss

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    step(net, opt, static_x)
    step(eager, opt_eager, static_x)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_loss = step(net, opt, static_x)
eager.load_state_dict(net.state_dict())
for _ in range(2):
    x = torch.randn(4, 3, 12, 12, device="cuda")
    static_x.copy_(x)
    graph.replay()
    loss = step(eager, opt_eager, x)
    torch.cuda.synchronize()
    assert abs(static_loss.item() - loss.item()) <= 1e-5 * abs(loss.item()), (static_loss.item(), loss.item())
    for p, q in zip(net.parameters(), eager.parameters()):
        assert (p - q).abs().max().item() <= 1e-5 * q.abs().max().item()
print("replayed; PyTorch's handle borrowed:", pt._graph_handles[torch.cuda.current_device()] is None)
"""


@pytest.mark.gpu
def test_a_conv_only_step_captures_in_a_fresh_process():
    """A converted network with no GEMM of PyTorch's (convolutions, ReLU, a mean), in a process
    where PyTorch has made no cuBLAS handle before the capture: its training step captures, and
    replays as eager steps run. Where captures borrow PyTorch's handle, the capture is where
    PyTorch first makes it."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", CONV_ONLY_CAPTURE], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"replayed; PyTorch's handle borrowed: {pt._torch_shares_libcublas()}" in run.stdout, run.stdout


def test_a_result_on_a_tensors_block_is_its_own_tensor_not_a_view():
    """The operators' results on the GPU, while an operator runs, are tensors on the storage of the torch.empty
    block that CuPy's allocation took (_from_cupy: PyTorch's own deleter, for inductor's CUDA graphs). Not
    views: an operator's output that autograd sees as a view may not be changed in place, and a converted
    model's ReLU(inplace=True) runs after it wherever the torch.ops path runs untraced (a torch function
    mode, or a direct call). Checked here with CPU tensors and a toy operator: the same calls."""
    base = torch.arange(16, dtype=torch.float32).view(torch.uint8)        # a block of 64 bytes
    t = pt._on_storage(base, (2, 3), (12, 4), 8)                          # from its third float
    assert not t._is_view() and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert torch.equal(t, torch.arange(2, 8, dtype=torch.float32).view(2, 3))
    nhwc = pt._on_storage(base, (1, 2, 2, 2), (32, 4, 16, 8), 0)          # channels-last strides
    assert torch.equal(nhwc, base.view(torch.float32)[:8].view(1, 2, 2, 2).permute(0, 3, 1, 2))

    @torch.library.custom_op("minitorch_fft_test::on_block", mutates_args=())
    def on_block(x: torch.Tensor) -> torch.Tensor:
        block = torch.empty(x.numel() * 4, dtype=torch.uint8)
        y = pt._on_storage(block, x.shape, [4 * s for s in x.contiguous().stride()], 0)
        y.copy_(x)
        return y
    on_block.register_autograd(lambda ctx, g: g)
    x = torch.randn(3, 4, requires_grad=True)
    y = torch.ops.minitorch_fft_test.on_block(x)
    torch.nn.functional.relu(y, inplace=True)                             # refused on a view
    y.sum().backward()
    assert torch.equal(x.grad, (x > 0).float())


def test_dense_arrays_keep_their_layout_in_a_copied_result():
    """_from_cupy's copy (a result no owned block holds) keeps a dense array's strides, channels-last
    included, and makes the others contiguous first (their strides would not make a tensor): NumPy
    arrays have the same strides and flags as CuPy's."""
    import numpy as np
    a = np.zeros((2, 3, 4, 5), np.float32)
    assert pt._dense(a) and pt._dense(a.transpose(0, 2, 3, 1).copy().transpose(0, 3, 1, 2))
    assert not pt._dense(a[:, :, ::2]) and not pt._dense(a[::-1]) and pt._dense(a[:0])
    assert not pt._dense(np.broadcast_to(np.zeros(5, np.float32), (3, 5)))


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_no_device_copies_at_the_boundary(path, monkeypatch):
    """The profiler sees no copy between PyTorch and CuPy: no Memcpy, no aten::copy_."""
    from torch.profiler import ProfilerActivity, profile
    use_path(monkeypatch, path)
    conv = Conv2d(16, 32, 3, padding=1, bias=False).cuda()
    x = torch.randn(4, 16, 20, 20, device="cuda", requires_grad=True)
    conv(x).sum().backward()              # tunes first
    torch.cuda.synchronize()
    copied = pt._copied_out[0]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        y = conv(x)
        y.backward(torch.ones_like(y))
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any(n == ("EagerConv2d" if path == "eager" else "minitorch_fft::conv2d") for n in names)
    copies = [n for n in names if n.startswith("Memcpy") or n in ("aten::copy_", "aten::contiguous", "aten::clone")]
    assert copies == []
    assert pt._copied_out[0] == copied    # the operators' results are views of the blocks they were made in


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_runs_on_pytorchs_current_stream(path, monkeypatch):
    """On a side stream (non-blocking, as PyTorch makes them) the three passes queue behind the
    stream's earlier work: the input is made there after a long sleep kernel, so a pass issued on
    any other stream would read it unwritten."""
    use_path(monkeypatch, path)
    conv = Conv2d(8, 8, 3, padding=1, bias=False).cuda()
    base = torch.randn(2, 8, 16, 16, device="cuda")
    gy = torch.randn(2, 8, 16, 16, device="cuda")
    conv(base.requires_grad_()).sum().backward()      # tunes first, on the default stream
    conv.weight.grad = None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)                  # tens of ms on the GPU
        x = (base.detach() * 2).requires_grad_()
        y = conv(x)
        y.backward(gy)
    side.synchronize()
    x64, w64 = (t.detach().double().cpu().requires_grad_() for t in (x, conv.weight))
    y64 = TF.conv2d(x64, w64, padding=1)
    y64.backward(gy.double().cpu())
    for got, ref in ((y, y64), (x.grad, x64.grad), (conv.weight.grad, w64.grad)):
        assert rel_error(got.detach().cpu().numpy(), ref.detach().numpy()) <= 1e-5


@pytest.mark.gpu
def test_crossings_share_memory_and_keep_it_alive():
    """_cupy_view is the tensor's memory and keeps it alive after the tensor is dropped (its
    storage is not handed out again meanwhile); _from_cupy is the array's memory."""
    import gc

    import cupy as cp
    t = torch.arange(24, dtype=torch.float32, device="cuda").reshape(2, 3, 4)
    ptr = t.data_ptr()
    a = pt._cupy_view(t, cp)
    assert a.data.ptr == ptr and a.shape == (2, 3, 4) and a.dtype == cp.float32
    del t
    gc.collect()
    other = torch.full((24,), 7.0, device="cuda")        # would take the freed block
    assert other.data_ptr() != ptr
    assert cp.asnumpy(a).ravel().tolist() == list(range(24))
    b = cp.arange(6, dtype=cp.float32).reshape(2, 3)
    u = pt._from_cupy(b)
    assert u.data_ptr() == b.data.ptr and u.tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.gpu
def test_stream_scope_is_made_once_per_stream():
    """_cuda_scope finds PyTorch's current stream by its raw pointer, reuses what it made for it,
    and its allocator takes memory from PyTorch's caching allocator (counted there)."""
    import cupy as cp
    index = torch.cuda.current_device()
    _, on, _ = pt._cuda_scope(index)
    assert on.stream.ptr == torch.cuda.current_stream().cuda_stream
    assert pt._cuda_scope(index)[1] is on
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _, on_side, _ = pt._cuda_scope(index)
    assert on_side is not on and on_side.stream.ptr == side.cuda_stream
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with on.device, on.stream, cp.cuda.using_allocator(on.malloc):
        a = cp.empty(1 << 20, dtype=cp.float32)               # 4 MiB
        assert torch.cuda.memory_allocated() - before >= a.nbytes
    del a
    assert torch.cuda.memory_allocated() == before


@pytest.mark.gpu
def test_a_pass_that_fits_in_pytorchs_cache_is_not_refused(monkeypatch):
    """PyTorch keeps what a model freed reserved: the GPU can show a few MiB free while PyTorch's
    allocator holds gigabytes unused, which it hands out to the passes. The output check counts
    them (before: a 71 MiB fprop output refused as 'more than the 40 MiB free on the GPU'). The
    driver's figure is made 40 MiB here (filling the GPU would starve the other test processes)."""
    from minitorch_fft.backends import common
    monkeypatch.setattr(backends, "_prepared", {})                  # the full path, with its check
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(17, 64, 128, 128, device="cuda", generator=g)  # output 17x64x128x128: 71 MiB
    w = torch.randn(64, 64, 1, 1, device="cuda", generator=g)
    spare = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del spare                                                       # 256 MiB reserved by PyTorch, unused
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= 256 << 20
    monkeypatch.setattr(common, "_gpu_free_bytes", lambda cp: 40 << 20)
    y = conv2d(x, w, backend="gemm")                                # refused before the fix
    ref = TF.conv2d(x.double(), w.double())
    assert rel_error(y.cpu().numpy(), ref.cpu().numpy()) <= 1e-5


def test_pytorchs_out_of_memory_falls_back_to_gemm(monkeypatch):
    """The adapter's passes allocate from PyTorch's caching allocator, which raises
    torch.OutOfMemoryError (a RuntimeError, not CuPy's MemoryError): run_pass treats it as out of
    memory too, and the layer falls back to gemm in a smaller workspace, saying so."""
    calls = []

    def short_of_memory(*args, **kwargs):
        calls.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(backends.fbfft, "fprop", short_of_memory)
    monkeypatch.setattr(backends, "_warned", set())
    x, w, stride, padding = operands(STRIDE1[0], "cpu")
    with pytest.warns(ResourceWarning, match=r"fbfft ran out of GPU memory in fprop .* falling back to gemm"):
        y = conv2d(x, w, stride, padding, backend="fbfft")
    assert calls == [1]
    ref = TF.conv2d(x.double(), w.double(), stride=stride, padding=padding)
    assert rel_error(y.numpy(), ref.numpy()) <= 1e-5


def test_the_memory_checks_count_a_registered_pools_unused_bytes(monkeypatch):
    """common.register_pool: while its allocator is CuPy's current one, available_bytes adds the
    pool's unused bytes to the GPU's free memory and names them (a stand-in CuPy here)."""
    import types

    from minitorch_fft.backends import common
    allocator = object()
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: types.SimpleNamespace(is_capturing=lambda: False),
        runtime=types.SimpleNamespace(memGetInfo=lambda: (40 << 20, 80 << 30)),
        get_allocator=lambda: allocator, MemoryPool=type("MemoryPool", (), {})),
        get_default_memory_pool=lambda: types.SimpleNamespace(malloc=None))
    assert common.available_bytes(cp) == (40 << 20, "free on the GPU")
    monkeypatch.setattr(common, "_FOREIGN_POOLS", {})
    common.register_pool(allocator, lambda: 1 << 30, "the pool's unused blocks")
    assert common.available_bytes(cp) == ((40 << 20) + (1 << 30), "free on the GPU (with the pool's unused blocks)")
    with pytest.raises(ValueError, match=r"needs 2\.0 GiB, more than the 1\.0 GiB free on the GPU \(with the pool's"):
        common.check_fits(2 << 30, cp, "an output")
    common.check_fits(1 << 30, cp, "an output")


def test_torch_jit_script_is_refused_in_one_clear_error_and_trace_works():
    """TorchScript cannot compile the forward's Python: a TypeError saying so (it failed deep inside with
    "function '_layer' is called recursively"); tracing the same model runs it."""
    import warnings
    model = torch.nn.Sequential(torch.nn.ReLU(), convert(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)))[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                 # torch.jit's deprecation and tracer warnings
        with pytest.raises(TypeError, match=r"cannot be scripted \(torch.jit.script\).*torch.jit.trace"):
            torch.jit.script(model)
        x = torch.randn(2, 3, 8, 8)
        assert torch.equal(torch.jit.trace(model, x)(x), model(x))
