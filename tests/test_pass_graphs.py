"""minitorch_fft.pytorch's pass graphs (the pass_graphs setting): a layer's passes replayed as one CUDA
graph once their operands and results come out at the same addresses again. Every result is checked
against PyTorch's convolution in float64 at every step, before the capture, at it and after it."""
import copy
import logging

import pytest
import torch

from minitorch_fft import backends
from minitorch_fft import pytorch as pt
from minitorch_fft.pytorch import Conv2d
from test_pytorch import assert_matches, float64_layer

STEPS = 8   # eager (tuning), eager, captured, then replays (a key whose results move once captures again)
ZERO = {"eager": 0, "captures": 0, "replays": 0, "failed": 0, "over": 0, "graphs": 0, "pool_bytes": 0,
        "pool_free_bytes": 0, "arena_bytes": 0}


@pytest.fixture(autouse=True)
def pass_graphs_on(settings):
    settings(pass_graphs=True)   # off by default (module docstring of minitorch_fft.pytorch: the arena)


def stats():
    return pt.pass_graph_stats()


def graphs_alive():
    """Every live pass graph's (graph, held, pool, arena)."""
    return [g for entry in pt._pass_graphs.values() for g in entry.graphs.values()]


def layer(backend, f=3, fo=4, k=3, stride=1, padding=1, nhwc=False, seed=0):
    torch.manual_seed(seed)
    conv = Conv2d(f, fo, k, stride=stride, padding=padding, backend=backend).cuda()
    return conv.to(memory_format=torch.channels_last) if nhwc else conv


def fill(t, seed):
    """t's memory refilled in place with seeded normal values (same address, new data)."""
    with torch.no_grad():
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))
    return t


def reference(x, w, bias, stride, padding, seed):
    """(gy, (y, gx, gw, gb)): the layer in float64 on the CPU under a gradOutput drawn from `seed`."""
    x64, w64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, w, bias))
    y64 = torch.nn.functional.conv2d(x64, w64, b64, stride=stride, padding=padding)
    gy = torch.randn(y64.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    y64.backward(gy)
    return gy, (y64, x64.grad, w64.grad, b64.grad)


def steps(conv, x, n=STEPS, tol=1e-5):
    """n training-style calls of conv on x: x, the weight and the bias refilled with new data in place
    before each (same addresses, so the graphs replay), a new gradOutput each; forward and backward,
    every output and gradient against float64 at every call (a replay reading stale data fails)."""
    layout = torch.channels_last if not x.is_contiguous() else torch.contiguous_format
    for i in range(n):
        fill(x, 100 + i), fill(conv.weight, 200 + i), fill(conv.bias, 300 + i)
        x.grad = conv.weight.grad = conv.bias.grad = None
        y = conv(x)
        gy, refs = reference(x, conv.weight, conv.bias, conv.stride, conv.padding, 400 + i)
        y.backward(gy.float().cuda().contiguous(memory_format=layout))
        assert_matches((y, x.grad, conv.weight.grad, conv.bias.grad), refs, tol)


CUDNN = pytest.mark.skipif("not __import__('conftest').backend_usable('cudnn')",
                           reason="cuDNN frontend not installed")
BACKENDS = ["auto", "gemm", "cufft", pytest.param("cudnn", marks=CUDNN)]


@pytest.mark.gpu
@pytest.mark.parametrize("nhwc", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_replays_match_float64(backend, nhwc):
    """A layer trained at fixed addresses: its forward and backward are captured at the third call
    and replayed after, reading each call's new data, every result within fp32 of float64."""
    conv = layer(backend, nhwc=nhwc)
    x = torch.empty(2, 3, 9, 9, device="cuda", requires_grad=True)
    if nhwc:
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_()
    steps(conv, x)
    s = stats()
    assert s["failed"] == 0
    # forward and backward each captured (once more where a warm-up step moved its results), then replayed
    assert s["captures"] >= 2 and s["replays"] >= 2 * (STEPS - 4), s


@pytest.mark.gpu
def test_tf32_mode_replays_its_own_graphs():
    """TF32 mode is a setting in the key: its calls capture graphs of their own, never replay the
    strict ones (checked within TF32's bound)."""
    conv = layer("auto", f=16, fo=16)
    x = torch.empty(4, 16, 12, 12, device="cuda", requires_grad=True)
    steps(conv, x)
    strict = stats()["captures"]
    with backends.config.override(tf32=True):
        steps(conv, x, tol=5e-3)
    assert stats()["captures"] >= strict + 2


@pytest.mark.gpu
def test_results_held_by_the_caller_are_not_written_again():
    """Each call's results are new tensors: one the caller keeps is what it was after later calls,
    which take other addresses and run eagerly, then replay graphs of their own."""
    conv = layer("auto")
    x = torch.empty(2, 3, 9, 9, device="cuda")
    with torch.no_grad():
        for i in range(STEPS):
            conv(fill(x, i))
        replays = stats()["replays"]
        kept = conv(fill(x, 50))
        assert stats()["replays"] == replays + 1
        copy = kept.clone()
        y = None
        for i in range(STEPS):
            y = conv(fill(x, 60 + i))     # the last result held through the next call: two addresses in turn
    _, refs = float64_layer(x, conv.weight, conv.bias, conv.stride, conv.padding)
    assert_matches((y,), refs[:1])
    assert torch.equal(kept, copy)
    assert stats()["replays"] >= replays + 3, stats()


@pytest.mark.gpu
def test_moving_operands_run_eagerly_and_correctly():
    """Operands at a new address every call (each kept alive): no key repeats, nothing is captured,
    and every result is right."""
    conv = layer("auto")
    xs = []
    for i in range(STEPS):
        xs.append(fill(torch.empty(2, 3, 9, 9, device="cuda", requires_grad=True), i))
        y = conv(xs[-1])
        gy, refs = float64_layer(xs[-1], conv.weight, conv.bias, conv.stride, conv.padding)
        assert_matches((y,), refs[:1])
    assert stats()["captures"] == 0 and stats()["replays"] == 0


@pytest.mark.gpu
def test_off_runs_every_pass_eagerly():
    conv = layer("auto")
    x = torch.empty(2, 3, 9, 9, device="cuda", requires_grad=True)
    with backends.config.override(pass_graphs=False):
        steps(conv, x)
    assert stats() == {**stats(), "eager": 0, "captures": 0, "replays": 0, "graphs": 0}


@pytest.mark.gpu
def test_a_capture_that_fails_leaves_the_key_eager(monkeypatch, caplog):
    """Something in one layer's passes a capture refuses (here: a wait for the device, after the passes
    took their temporaries from the arena): the capture's error is logged, that layer runs eagerly
    from then on, every result is right, and another layer still captures and replays (a failed
    capture leaves its pool unusable: the next takes a new one)."""
    passes = pt._passes

    def waiting(backend, geometry, *args, **kwargs):
        results = passes(backend, geometry, *args, **kwargs)
        if geometry[1][0] == 4 and torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().synchronize()
        return results
    monkeypatch.setattr(pt, "_passes", waiting)
    conv = layer("auto")
    x = torch.empty(2, 3, 9, 9, device="cuda", requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="minitorch_fft.pytorch"):
        steps(conv, x)
    assert stats()["failed"] >= 1 and stats()["replays"] == 0 and stats()["graphs"] == 0
    assert "could not be captured" in caplog.text and not pt._capturing   # the arena no longer cut
    other = layer("auto", fo=5)
    steps(other, x)
    assert stats()["graphs"] >= 2 and stats()["replays"] >= 2 * (STEPS - 4), stats()


@pytest.mark.gpu
def test_the_arena_and_pool_are_reported_and_released():
    """The graphs' arena is reported, and after release_pass_graphs() and cufft's release_buffers()
    (a cufft buffer cut from it in a capture keeps it) its memory is given back to PyTorch; after
    empty_cache() none of the pool's segments is left free: what stays is a block still allocated
    there (a cuBLAS workspace PyTorch keeps per stream)."""
    conv = layer("cufft", f=8, fo=8)
    x = torch.empty(4, 8, 16, 16, device="cuda", requires_grad=True)
    steps(conv, x)
    s = stats()
    assert s["graphs"] >= 2 and s["arena_bytes"] > 0, s
    pools = {pool for _, pool in pt._pools}
    held = torch.cuda.memory_allocated()
    pt.release_pass_graphs()
    backends.cufft.release_buffers()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= held - s["arena_bytes"] and not pt._arena_of
    torch.cuda.empty_cache()
    assert stats() == ZERO
    left = [seg for seg in torch.cuda.memory_snapshot() if tuple(seg.get("segment_pool_id", ())) in pools]
    assert all(seg["allocated_size"] > 0 for seg in left), left


@pytest.mark.gpu
def test_pass_graph_mb_leaves_the_layers_over_it_eager(settings):
    """A layer's passes' temporaries are counted in their eager calls (their results among them); under
    the pass_graph_mb setting the passes that took more run eagerly, correctly, and the others replay."""
    small, large = layer("auto"), layer("cufft", f=16, fo=16, k=5, padding=2, seed=1)
    xs = (torch.empty(2, 3, 9, 9, device="cuda", requires_grad=True),
          torch.empty(8, 16, 32, 32, device="cuda", requires_grad=True))

    def train():
        for conv, x in zip((small, large), xs):
            steps(conv, x)
    train()
    # (backend, geometry, passes, layout) -> bytes; the settings' state left out: the bound changes it
    took = {kind[1:5]: t for kind, t in pt._temporaries.items()}
    assert pt._measuring is None
    results = {kind: sum(4 * torch.Size(backends.common.pass_output_shape(backends.geometry(*kind[1]), p)).numel()
                         for p, _ in kind[2]) for kind in took}
    assert len(took) == 4 and all(took[kind] >= results[kind] for kind in took), (took, results)  # results counted
    # the bound in the widest gap between the counts (by ratio), far from every one of them
    ordered = sorted(took.values())
    low, high = max(zip(ordered, ordered[1:]), key=lambda pair: pair[1] / pair[0])
    assert high >= 1.5 * low, ordered
    limit = (low * high) ** 0.5 / 2**20
    under = {kind for kind, t in took.items() if t <= low}
    pt.release_pass_graphs()
    settings(pass_graph_mb=limit)
    train()
    s = stats()
    assert s["over"] == len(took) - len(under) and s["failed"] == 0, (s, took, limit)
    assert {key[1][1:5] for key, entry in pt._pass_graphs.items() if entry.graphs} == under, (took, limit)
    assert s["replays"] >= len(under) * (STEPS - 4), s


@pytest.mark.gpu
def test_a_count_that_fails_is_ended(monkeypatch):
    """A pass that raises during a counted eager call: the error reaches the caller and the
    allocator's count ends with it (a later allocation is not counted into it)."""
    passes, calls = pt._passes, []

    def failing(*args, **kwargs):
        calls.append(pt._measuring)
        if len(calls) == 2:
            raise RuntimeError("a pass failed (test)")
        return passes(*args, **kwargs)
    monkeypatch.setattr(pt, "_passes", failing)
    conv = layer("auto")
    x = fill(torch.empty(2, 3, 9, 9, device="cuda"), 1)
    with torch.no_grad():
        conv(x)
        with pytest.raises(RuntimeError, match="a pass failed"):
            conv(x)
    assert calls[1] is not None and pt._measuring is None


@pytest.mark.gpu
@pytest.mark.parametrize("backend,k,first", [pytest.param("cudnn", 3, 0, marks=CUDNN), ("gemm", 1, 2)])
def test_channels_last_routes_write_the_results_in_place(backend, k, first, monkeypatch, settings):
    """A channels-last layer on cuDNN's plans (from its first call), or a 1x1 one on the prepared GEMM
    route (from its second, accGrad's one form pinned: gemm_tune off): every pass writes its result
    into the tensor the caller gets, in the eager calls and in the graph, with no copy; every value
    right."""
    settings(gemm_tune="off")
    written, into = [], pt._into

    def recording(outs, results):
        written.append([r is o for o, r in zip(outs, results)])
        return into(outs, results)
    monkeypatch.setattr(pt, "_into", recording)
    conv = layer(backend, f=8, fo=8, k=k, padding=k // 2, nhwc=True)
    x = torch.empty(2, 8, 9, 9, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_()
    steps(conv, x)
    assert stats()["captures"] >= 2 and stats()["failed"] == 0, stats()
    assert len(written) > 4 and all(all(w) for w in written[first:]), written


@pytest.mark.gpu
def test_a_layer_found_over_after_its_capture_drops_its_graphs(settings, monkeypatch):
    """A layer's forward captured under the bound, then counted over it in a later eager call (its
    result held, so the next comes out elsewhere): the forward's graphs are dropped and it runs
    eagerly from then on, correctly, while its backward still replays."""
    settings(pass_graph_mb=1024)
    conv = layer("auto")
    x = torch.empty(2, 3, 9, 9, device="cuda", requires_grad=True)
    steps(conv, x)
    assert stats()["graphs"] >= 2 and stats()["over"] == 0, stats()

    class Huge(pt._Temporaries):
        def took(self, p, size):
            super().took(p, size + 2**31)
    monkeypatch.setattr(pt, "_Temporaries", Huge)
    with torch.no_grad():
        kept = [conv(fill(x, i)) for i in range(3)]   # held: a replay, then results elsewhere, counted
    monkeypatch.setattr(pt, "_Temporaries", Huge.__mro__[1])
    forward = {key for key in pt._pass_graphs if key[1][3][0][0] == "fprop"}
    assert stats()["over"] == 1 and forward, stats()
    assert all(pt._pass_graphs[key].off and not pt._pass_graphs[key].graphs for key in forward)
    _, refs = float64_layer(x, conv.weight, conv.bias, conv.stride, conv.padding)
    assert_matches(kept[-1:], refs[:1])
    replays = stats()["replays"]
    steps(conv, x)   # the forward eager, correct; the backward's key (its operands moved) captured again
    assert stats()["replays"] >= replays + 2 and stats()["over"] == 1, stats()
    assert all(not pt._pass_graphs[key].graphs for key in pt._pass_graphs if key[1][3][0][0] == "fprop")


@pytest.mark.gpu
def test_captures_cut_their_temporaries_from_the_arena(monkeypatch):
    """The CuPy allocations of a capture come from the stream's arena, sized to the layer's counted
    temporaries and more: each fits (none falls to the pool), and every graph holds that arena."""
    cut, take = [], pt._Arena.take

    def cutting(arena, size):
        p = take(arena, size)
        if arena.tensor is not None:   # a device arena (transient() sizes its own, without one)
            cut.append(p)
        return p
    monkeypatch.setattr(pt._Arena, "take", cutting)
    conv = layer("cufft", f=16, fo=16, k=5, padding=2)
    x = torch.empty(8, 16, 32, 32, device="cuda", requires_grad=True)
    steps(conv, x)
    (arena,) = pt._arenas.values()
    assert cut and None not in cut and not pt._capturing
    assert stats()["arena_bytes"] == arena.size >= max(pt._temporaries.values()) > 0
    graphs = graphs_alive()
    assert len(graphs) >= 2 and all(g[3] is arena for g in graphs)


@pytest.mark.gpu
def test_an_outgrown_arena_is_replaced_and_its_graphs_captured_again():
    """A small layer captured first (an arena its size), then a larger one counted and captured: a
    new arena of the larger size; the small layer's graphs, made in the old one, are dropped and
    captured again in the new one at its next calls, every result right."""
    small, large = layer("auto"), layer("cufft", f=16, fo=16, k=5, padding=2, seed=1)
    xs = (torch.empty(2, 3, 9, 9, device="cuda", requires_grad=True),
          torch.empty(8, 16, 32, 32, device="cuda", requires_grad=True))
    steps(small, xs[0])
    (first,) = pt._arenas.values()
    steps(large, xs[1])
    (second,) = pt._arenas.values()
    assert second.size > first.size and second.size >= max(pt._temporaries.values())
    graphs = graphs_alive()
    assert graphs and all(g[3] is second for g in graphs)
    captures = stats()["captures"]
    steps(small, xs[0])
    assert stats()["captures"] >= captures + 2 and stats()["failed"] == 0, stats()
    assert all(g[3] is second for g in graphs_alive())


def test_the_arena_cuts_first_fit_and_merges_what_is_given_back():
    """_Arena: allocations in multiples of 512 bytes at the first hole they fit, never overlapping
    nor past its end; None where no hole fits; given back, holes merge, so that after random takes
    and gives, all given back, it is one hole again."""
    import random
    arena = pt._Arena(4096, 64 * 512)
    a, b, c = arena.take(1), arena.take(600), arena.take(512)
    assert (a, b, c) == (4096, 4096 + 512, 4096 + 3 * 512) and arena.high == 4 * 512   # the most bytes reached
    arena.give(b)
    assert arena.take(1024) == b and arena.take(61 * 512) is None and arena.take(60 * 512) == 4096 + 4 * 512
    assert arena.high == 64 * 512
    for p in (a, b, c, 4096 + 4 * 512):
        arena.give(p)
    assert arena.holes == [(4096, 64 * 512)]
    rng = random.Random(5)
    live = set()
    for _ in range(2000):
        if live and rng.random() < 0.5:
            p = rng.choice(sorted(live))
            live.discard(p)
            arena.give(p)
        else:
            size = rng.randint(1, 8 * 512)
            p = arena.take(size)
            if p is None:
                assert all(n < size for _, n in arena.holes)
                continue
            live.add(p)
            assert p % 512 == 0 and 4096 <= p and p + size <= 4096 + 64 * 512
        spans = sorted([(q, arena.taken[q]) for q in live] + arena.holes)   # taken and holes tile the arena
        assert spans[0][0] == 4096 and all(q + n == r for (q, n), (r, _) in zip(spans, spans[1:]))
        assert sum(spans[-1]) == 4096 + 64 * 512
        assert all(q + n < r for (q, n), (r, _) in zip(arena.holes, arena.holes[1:]))   # no two holes adjacent
    for p in list(live):
        arena.give(p)
    assert arena.holes == [(4096, 64 * 512)] and not arena.taken


def test_a_busy_arena_queues_what_is_given_back():
    """A give() while the arena is busy (the garbage collector freeing a block inside take() or give(),
    or another thread) is queued, not run into the holes being changed; the next call takes it."""
    arena = pt._Arena(0, 4 * 512)
    a, b = arena.take(512), arena.take(512)
    with arena.lock:
        arena.give(a)
        assert a in arena.taken and arena.queued == [a]
    assert arena.take(512) == a and not arena.queued and arena.taken == {a: 512, b: 512}
    arena.give(a), arena.give(b)
    assert arena.holes == [(0, 4 * 512)]


def test_temporaries_count_what_is_held_at_most():
    """_Temporaries: the bytes held at their most; memory given back that was taken before counts
    nothing. transient(): the same of what was given back before the end (what a capture takes), and
    the span of an arena cutting it in its order, holes included."""
    t = pt._Temporaries()
    t.took(1, 100)
    t.took(2, 50)
    t.gave(1)
    t.took(3, 80)
    t.gave(99)   # taken before the count began
    assert (t.live, t.peak) == (130, 150)
    assert t.transient() == (100, 512)           # 2 and 3 kept: 1 alone, one 512-byte block
    t.gave(2), t.gave(3)
    # 1 at [0, 512), 2 at [512, 1024), 1 given back, 3 (80) back at [0, 512): 150 at most, 1024 spanned
    assert t.transient() == (150, 1024)
    t = pt._Temporaries()
    t.took(1, 512), t.took(2, 512), t.gave(1)
    t.took(4, 1024)   # fits not in the hole 1 left at [0, 512): at [1024, 2048)
    t.gave(2), t.gave(4)
    assert t.transient() == (1536, 2048)
    t = pt._Temporaries()
    t.took(1, 100), t.gave(1), t.took(1, 200), t.gave(1)   # one address, taken twice in turn
    assert t.transient() == (200, 512)


def test_a_pool_is_live_while_a_graph_of_it_is():
    """Captures reuse a pool only while one of its own graphs lives (not one of another pool on the
    same stream, which a failed capture leaves behind)."""
    entry, other = pt._PassGraph(), pt._PassGraph()
    entry.graphs[(1,)] = ("graph", (), "pool a", None)
    assert pt._pool_live("pool a", [entry, other]) and not pt._pool_live("pool b", [entry, other])
    entry.graphs.clear()
    assert not pt._pool_live("pool a", [entry, other])


def test_cpu_passes_take_no_graphs():
    """On the CPU the setting changes nothing: no graph, no count."""
    conv = Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    for _ in range(4):
        y = conv(x)
        y.sum().backward()
    assert stats() == ZERO
    assert backends.config.get("pass_graphs") is True


@pytest.mark.gpu
@pytest.mark.parametrize("nhwc", [False, True, "convert"], ids=["nchw", "channels_last", "convert_channels_last"])
def test_a_converted_model_replays_its_steps(nhwc):
    """A small converted network's training steps (forward, loss, backward inside reuse_spectra(), as
    bench_pytorch runs them, then SGD, which changes the weights in place) on a batch refilled in
    place: its loss and every conv's weight gradient against the same network trained in float64 at
    every step, and its layers replayed after the warm-up. Also convert(channels_last=True)'s model on
    an NCHW batch, whose first layer's passes copy the batch channels-last inside their graphs."""
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 5, padding=2), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 16, 1), torch.nn.Flatten(), torch.nn.Linear(16 * 8 * 8, 10))
    ref = copy.deepcopy(net).double()
    model = pt.convert(net.cuda(), channels_last=nhwc == "convert")
    layout = torch.channels_last if nhwc is True else torch.contiguous_format   # the batch's
    if nhwc is True:
        model = model.to(memory_format=layout)
    x = torch.empty(4, 3, 16, 16, device="cuda").contiguous(memory_format=layout)
    laid = []   # each conv's output: channels-last in both channels-last cases, NCHW batch or not
    for m in model:
        if isinstance(m, pt.Conv2d):
            m.register_forward_hook(lambda m, args, y: laid.append(pt._channels_last(y)))
    target = torch.tensor([1, 2, 3, 4], device="cuda")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, ref))
    for i in range(STEPS + 2):
        fill(x, 200 + i)
        model.zero_grad(set_to_none=False)
        with pt.reuse_spectra():
            loss = torch.nn.functional.cross_entropy(model(x), target)
            loss.backward()
        ref.zero_grad()
        loss64 = torch.nn.functional.cross_entropy(ref(x.detach().double().cpu()), target.cpu())
        loss64.backward()
        assert abs(loss.item() - loss64.item()) <= 1e-5 * abs(loss64.item())
        convs = [(m, r) for m, r in zip(model, ref) if isinstance(r, torch.nn.Conv2d)]
        assert_matches([m.weight.grad for m, _ in convs], [r.weight.grad for _, r in convs], 1e-4)
        opt.step(), ref_opt.step()
    assert stats()["failed"] == 0 and stats()["replays"] >= 6, stats()
    assert len(laid) == 3 * (STEPS + 2) and set(laid) == {nhwc is not False}, laid
