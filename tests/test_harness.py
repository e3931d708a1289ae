"""benchmarks.harness on the CPU: relative error, the float64 reference against a naive loop,
timing, provenance, atomic result files; and the package's shape (no sys.path edits, no
environment reads, every results file the index links to present)."""
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from minitorch_fft import backends
from minitorch_fft.backends import config
from benchmarks import harness

ROOT = Path(__file__).resolve().parent.parent


def naive_conv(x, w, stride, padding):
    """Cross-correlation by loops over every output element, in float64 (NCHW, OIHW)."""
    S, f, h, wd = x.shape
    fo, _, kh, kw = w.shape
    (sh, sw), (ph, pw) = stride, padding
    xp = np.zeros((S, f, h + 2 * ph, wd + 2 * pw))
    xp[:, :, ph:ph + h, pw:pw + wd] = x
    oh, ow = (h + 2 * ph - kh) // sh + 1, (wd + 2 * pw - kw) // sw + 1
    y = np.zeros((S, fo, oh, ow))
    for s in range(S):
        for o in range(fo):
            for i in range(oh):
                for j in range(ow):
                    y[s, o, i, j] = np.sum(xp[s, :, i * sh:i * sh + kh, j * sw:j * sw + kw] * w[o])
    return y


def test_passes_are_the_backends_contract():
    assert harness.PASSES is backends.PASSES == ("fprop", "bprop", "accgrad")


def test_rel_error_on_each_array_library():
    import torch
    ref = np.array([3.0, 4.0])                                      # norm 5
    got = np.array([3.0, 4.0 + 0.5], dtype=np.float32)
    assert harness.rel_error(got, ref) == pytest.approx(0.1)
    assert harness.rel_error(torch.tensor(got), torch.tensor(ref)) == pytest.approx(0.1)
    assert harness.rel_error(got, torch.tensor(ref)) == pytest.approx(0.1)          # mixed
    assert harness.rel_error(ref.astype(np.complex64) * 1j, ref * 1j) == 0.0          # complex
    assert harness.rel_error(np.array([1.0, 1.0 + 1e-7], np.float32), np.array([1.0, 1.0])) < 1e-7
    assert np.isnan(harness.rel_error(np.array([np.nan, 4.0]), ref))                 # NaN fails a <= check
    assert harness.rel_error(np.array([0.0, 2.0]), np.zeros(2)) == pytest.approx(2.0)  # zero ref: absolute


@pytest.mark.parametrize("stride, padding", [((1, 1), (0, 0)), ((2, 1), (1, 2))])
def test_reference64_agrees_with_a_naive_loop(stride, padding):
    """fprop against loops; bprop and accGrad as the adjoints: <gy, conv(x, w)> = <bprop(gy), x>
    = <accgrad(gy), w>, all in float64."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 2)).astype(np.float32)
    y = naive_conv(x.astype(np.float64), w.astype(np.float64), stride, padding)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    ref = harness.reference64(x, w, gy, stride, padding)
    assert set(ref) == set(harness.PASSES) and all(str(r.dtype) == "torch.float64" for r in ref.values())
    assert harness.rel_error(ref["fprop"], y) < 1e-14
    inner = float(np.sum(gy.astype(np.float64) * y))
    assert float((ref["bprop"].numpy() * x).sum()) == pytest.approx(inner, rel=1e-12)
    assert float((ref["accgrad"].numpy() * w).sum()) == pytest.approx(inner, rel=1e-12)
    assert ref["bprop"].shape == x.shape and ref["accgrad"].shape == w.shape


def test_median_ms_on_the_cpu():
    calls = []
    ms = harness.median_ms(lambda: calls.append(sum(range(20000))), "cpu", warmup=2, repeat=5)
    assert ms > 0 and len(calls) == 7
    restored = []
    harness.median_ms(lambda: None, "cpu", 1, 3, before=lambda: restored.append(1))
    assert len(restored) == 4                                       # before every call, warm-up too
    for bad in ({"lib": "numpy"}, {"lib": "cpu", "repeat": 0}, {"lib": "cpu", "warmup": -1},
                {"lib": "cpu", "spin_us": 300}):
        with pytest.raises(ValueError):
            harness.median_ms(lambda: None, **{"warmup": 0, "repeat": 1, **bad})


def test_provenance_names_device_date_command_and_commit():
    with config.override(commit="0123abc"):
        meta = harness.provenance("Test GPU 0", torch="x")
    assert {"device", "date", "command", "commit", "python", "platform", "torch"} <= set(meta)
    assert meta["device"] == "Test GPU 0" and meta["commit"] == "0123abc" and meta["torch"] == "x"
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$", meta["date"])
    assert harness.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_provenance_names_the_settings_that_differ_from_their_defaults(monkeypatch):
    """A setting the command line does not show (auto restricted to our algorithms, a workspace)
    is in the header; defaults and the commit (its own field) are not; a bad value is reported,
    not raised, so a finished run still writes its results."""
    with config.override(auto_backends=("ours",), gemm_workspace_mb=64, commit="0123abc", tf32=False):
        settings = harness.provenance("Test GPU 0")["settings"]
    assert settings["MINITORCH_AUTO_BACKENDS"] == ["ours"] and settings["MINITORCH_GEMM_WORKSPACE_MB"] == 64
    assert "MINITORCH_CGEMM_TF32" not in settings and "MINITORCH_COMMIT" not in settings
    monkeypatch.setenv("MINITORCH_FBFFT_WORKSPACE_MB", "-3")
    config.reload()
    try:
        settings = harness.provenance("Test GPU 0")["settings"]
    finally:
        monkeypatch.undo()
        config.reload()
    assert settings["MINITORCH_FBFFT_WORKSPACE_MB"].startswith("invalid: ")
    assert "MINITORCH_FBFFT_WORKSPACE_MB" in settings["MINITORCH_FBFFT_WORKSPACE_MB"]


def test_write_results_writes_both_files_atomically(tmp_path):
    meta = harness.provenance("Test GPU 0")
    rows = [{"layer": "L1", "ms": 0.5}]
    cols = [("layer", "layer", ""), ("ms", "ms", ".3f")]
    json_path, md_path = harness.write_results("t", meta, rows, cols, "title", "notes", out_dir=tmp_path)
    assert json_path == tmp_path / "test-gpu-0" / "t.json" and json.loads(json_path.read_text())["rows"] == rows
    md = md_path.read_text()
    assert md.startswith("# title\n") and "| L1 | 0.500 |" in md and "- command: `" in md
    before = json_path.read_text()
    # A failure while writing (here the file's write itself) leaves the old file whole and no
    # temporary file behind.
    with pytest.raises(TypeError):
        harness.write_results("t", meta, [{"layer": object()}], cols, "title", out_dir=tmp_path)
    with pytest.raises(TypeError):
        harness.write_text(json_path, b"not text")
    assert json_path.read_text() == before
    assert sorted(p.name for p in json_path.parent.iterdir()) == ["t.json", "t.md"]
    paths = harness.write_results("e", meta, rows, cols, "title", out_dir=tmp_path, subdir="experiments")
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == ["test-gpu-0/experiments/e.json",
                                                                  "test-gpu-0/experiments/e.md"]


def test_write_text_and_save_figure(tmp_path):
    path = harness.write_text(tmp_path / "new" / "a.md", "x\n")
    assert path.read_text() == "x\n"
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    png = harness.save_figure(fig, tmp_path / "f.png", dpi=50)
    plt.close(fig)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "f.png", "new"]


def test_set_tf32_restores_pytorchs_defaults():
    import torch
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
             torch.backends.cuda.matmul.allow_tf32, dict(harness.TORCH_TF32_DEFAULTS))
    try:
        meta = harness.setup_cudnn(torch)
        assert meta["cudnn_benchmark"] and meta["torch_tf32_defaults"] == harness.TORCH_TF32_DEFAULTS
        harness.set_tf32("strict")
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
        harness.set_tf32("tf32")
        assert torch.backends.cudnn.allow_tf32 == harness.TORCH_TF32_DEFAULTS["cudnn"]
        assert harness.setup_cudnn(torch)["torch_tf32_defaults"] == meta["torch_tf32_defaults"]   # kept
    finally:
        (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_tf32) = saved[:3]
        harness.TORCH_TF32_DEFAULTS.clear()
        harness.TORCH_TF32_DEFAULTS.update(saved[3])


def test_layer_tables():
    assert harness.NETWORK_LAYERS["table4.L1"] == (3, 96, 128, 11, 0)
    assert all(f"table4.{k}" in harness.NETWORK_LAYERS for k in harness.TABLE4)


def test_benchmarks_are_a_package_that_reads_settings_only_through_config():
    """No benchmark edits sys.path, reads the environment or sets a backend's module attribute."""
    sources = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert (ROOT / "benchmarks" / "__init__.py") in sources
    assert (ROOT / "benchmarks" / "experiments" / "__init__.py") in sources
    for path in sources:
        text = path.read_text()
        assert "sys.path" not in text and "os.environ" not in text and "getenv" not in text, path
        assert not re.search(r"\b(direct\.POISON|\.TUNE\s*=\s*\"|CHECK_LAUNCHES)", text.replace(
            'baseline.TUNE = "off"', "")), path


def test_results_index_links_resolve():
    """Every file results/<device>/README.md links to exists, and every file the top-level README links to."""
    for index in [ROOT / "README.md", *sorted((ROOT / "results").glob("*/README.md"))]:
        for target in re.findall(r"\]\(([^)#]+)\)", index.read_text()):
            if "://" not in target:
                assert (index.parent / target).exists(), f"{index}: {target}"


@pytest.mark.gpu
def test_peak_step_bytes_measures_cupy_as_pytorch_measures_itself():
    """The same allocations through CuPy and through PyTorch give the same peak: live bytes'
    high-water mark (PyTorch's max_memory_allocated, exact to its 512-byte rounding, which CuPy's
    pool shares), not the pool's size; reserved is at least that. Every request is under 1 MiB, so
    PyTorch serves it from its small pool, which always splits a cached block: a large-pool request
    may get a whole cached block with up to 1 MiB more than asked, and be counted so (3 MiB counted
    as 4 once on an H100, when other tests had left such blocks)."""
    import cupy as cp
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")

    def pattern(empty):
        keep = empty(384 << 10)        # live to the end
        a = empty(1000)                # 1000 bytes: 1024 counted
        b = empty(128 << 10)
        del a, b                       # peak so far: 512 KiB + 1024
        c = empty(256 << 10)           # peak: 640 KiB
        return keep, c

    keep = cp.empty(1 << 20, dtype=np.uint8)    # live before the call: counted, as PyTorch counts it
    before = cp.get_default_memory_pool().used_bytes()
    ours = harness.peak_step_bytes(lambda: pattern(lambda n: cp.empty(n, dtype=np.uint8)), "cupy")
    t_keep = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    t_before = torch.cuda.memory_allocated()
    theirs = harness.peak_step_bytes(lambda: pattern(lambda n: torch.empty(n, dtype=torch.uint8, device="cuda")),
                                     "torch")
    assert ours["peak"] - before == theirs["peak"] - t_before == 640 << 10
    assert ours["reserved"] >= ours["peak"] and keep.nbytes == t_keep.numel()


@pytest.mark.gpu
def test_peak_step_bytes_counts_a_graph_pool_whole():
    """A CUDA graph's own pool (GraphedStep.pool) holds its graph's buffers, free in the pool's
    books once the capture's arrays are dropped, yet written by every replay: a step that only
    replays counts every byte of it, beside what it allocates from the default pool."""
    import cupy as cp
    graph_pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(graph_pool.malloc):
        kept = cp.empty(1 << 20, dtype=np.uint8)       # in use, as a graph's static output is
        cp.empty(3 << 20, dtype=np.uint8)              # an intermediate buffer: free again here
    assert graph_pool.total_bytes() == 4 << 20 and graph_pool.used_bytes() == 1 << 20
    before = cp.get_default_memory_pool().used_bytes()
    out = harness.peak_step_bytes(lambda: cp.empty(2 << 20, dtype=np.uint8), "cupy", [graph_pool])
    assert out["peak"] - before == (4 << 20) + (2 << 20) and kept.nbytes == 1 << 20
    assert out["reserved"] >= out["peak"] - before


def test_median_ms_pauses_the_garbage_collector():
    """The collector is off inside every call median_ms makes (a collection would stall the host
    inside a timed span) and back as it was afterwards."""
    import gc

    from benchmarks.harness import median_ms
    seen = []
    median_ms(lambda: seen.append(gc.isenabled()), "cpu", warmup=1, repeat=2)
    assert seen == [False, False, False] and gc.isenabled()
    gc.disable()
    try:
        median_ms(lambda: None, "cpu", warmup=0, repeat=1)
        assert not gc.isenabled()                     # left off where it was off
    finally:
        gc.enable()


def test_stack_sampler_finds_where_a_thread_spends_its_time():
    from benchmarks.harness import StackSampler

    def busy(seconds, samples=0):
        """Spin for `seconds`, and on (10 s at most) until the sampler has `samples`: on a loaded
        machine (the suite under -n 12) its thread got too few turns in 0.15 s (session 59)."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds or (sampler.samples < samples and time.perf_counter() - t0 < 10):
            pass

    def idle_caller():
        busy(0.15, samples=30)

    switch = sys.getswitchinterval()
    sampler = StackSampler(interval_s=2e-3)
    with sampler:
        idle_caller()
    assert sampler.samples >= 10
    text = sampler.report(5)
    top_own = text.split("own: innermost source line\n")[1].splitlines()[0]
    assert "(busy)" in top_own, text
    callers = [n for where, n in sampler.within.items() if where.endswith("(idle_caller)")]
    assert callers and callers[0] >= 0.8 * sampler.own_of("(busy)"), text
    assert sys.getswitchinterval() == switch   # given back
    first = sampler.samples
    with sampler:                               # a second block adds to the counts
        busy(0.05)
    assert sampler.samples > first


def test_stack_sampler_sees_other_threads_and_skips_waits():
    """all_threads: a worker thread's Python is counted (PyTorch runs a CUDA backward on its own
    threads), and the thread that only waits for it, in a function named in `waits`, is not."""
    import threading

    from benchmarks.harness import StackSampler

    def worker_spins():   # 0.15 s, longer where a loaded host (parallel tests) lets the sampler count it less often
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.15 or (sampler.own_of("(worker_spins)") < 20 and time.perf_counter() - t0 < 5):
            pass

    def waits_for(thread):
        thread.join()

    worker = threading.Thread(target=worker_spins)
    with StackSampler(interval_s=2e-3, all_threads=True, waits=("_wait_for_tstate_lock", "join")) as sampler:
        worker.start()
        waits_for(worker)
    assert sampler.own_of("(worker_spins)") >= 10, sampler.report(5)
    assert not any(where.endswith("(waits_for)") for where in sampler.within), sampler.report(10)


def test_host_probe_times_the_same_work_each_call():
    """A positive, finite median of a fixed workload, and about the same on a second call (the
    figure is for comparing hosts, so it must not drift within one)."""
    from benchmarks.harness import host_probe_ms
    a, b = host_probe_ms(), host_probe_ms()
    assert 0 < a < 1e3 and 0 < b < 1e3
    assert max(a, b) / min(a, b) < 3
