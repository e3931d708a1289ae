"""The benchmarks' CPU-side logic: layer tracing and command-line help (they need a GPU to run)."""
import subprocess
import sys

from benchmarks.paper import conv_layers


def test_conv_layers_trace_the_papers_networks():
    alex = conv_layers("alexnet", 128)
    assert [l[1] for l in alex] == [(128, 3, 224, 224), (128, 64, 27, 27), (128, 192, 13, 13),
                                    (128, 384, 13, 13), (128, 256, 13, 13)]
    assert alex[0][2:] == ((64, 3, 11, 11), (4, 4), (2, 2))
    over = conv_layers("overfeat_fast", 128)
    assert [l[1][2] for l in over] == [231, 28, 12, 12, 12]
    assert over[4][2] == (1024, 1024, 3, 3)


def test_help_works_without_a_gpu():
    for script in ("benchmarks/paper.py", "benchmarks/bench_cufft.py"):
        p = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
        assert p.returncode == 0 and "usage" in p.stdout, p.stderr


def test_sweep_configurations_and_sample():
    from benchmarks import sweep
    configs = sweep.configurations()
    assert len(configs) == 8232 == len({sweep.key(c) for c in configs})
    sample = sweep.quick_sample()
    assert len(sample) == sweep.QUICK_SAMPLE
    assert {c[3] for c in sample} == set(sweep.KERNELS) and {c[4] for c in sample} == set(sweep.OUTPUTS)


def synthetic_row(config, fft_ms, base_ms):
    """A measured row where the FFT takes fft_ms and cuDNN and gemm base_ms, every pass."""
    from benchmarks import sweep
    ms = {f"{b}_{p}": v for p in sweep.PASSES for b, v in (("cufft", fft_ms), ("cudnn", base_ms), ("gemm", base_ms))}
    return {"key": sweep.key(config), "config": list(config), "ms": ms, "err": {}, "skipped": {}}


def test_sweep_resumes_after_a_torn_line(tmp_path):
    from benchmarks import sweep
    path = tmp_path / "sweep.jsonl"
    a, b = sweep.configurations()[:2]
    sweep.append_row(path, synthetic_row(a, 1.0, 2.0))
    with open(path, "a") as fh:
        fh.write('{"key": "S1_f1_fo1_k3_y2", "conf')  # killed mid-write
    assert set(sweep.load_done(path)) == {sweep.key(a)}  # b is measured again on resume
    assert sweep.load_done(tmp_path / "missing.jsonl") == {}


def test_sweep_report_summarises_where_fft_wins(tmp_path, monkeypatch):
    """Synthetic rows where FFT wins 4x from k = 7 up and loses 2x below: the summary and
    both heat-map files say so."""
    from benchmarks import sweep
    path = tmp_path / "sweep.jsonl"
    for c in sweep.quick_sample():
        sweep.append_row(path, synthetic_row(c, 1.0, 4.0) if c[3] >= 7 else synthetic_row(c, 2.0, 1.0))
    assert abs(sweep.speedups(sweep.load_done(path)[sweep.key(sweep.quick_sample()[0])], "cudnn") - 0.5) < 1e-12
    monkeypatch.setattr(sys, "argv", ["sweep.py", "report", str(path)])
    sweep.main()
    md = (tmp_path / "sweep.md").read_text()
    assert (tmp_path / "sweep_vs_cudnn.png").exists() and (tmp_path / "sweep_vs_gemm.png").exists()
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ") and "x |" in line}
    assert "| 0 (0%) |" in rows["3"] and "(100%) | 4.00x | 4.00x | 1 |" in rows["9"]
