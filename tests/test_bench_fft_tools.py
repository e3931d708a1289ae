"""The pure-Python parts of benchmarks/bench_fft.py and bench_correlate1d.py: target checks
and tables, on made-up rows (no GPU; nothing here is written to results/)."""
from benchmarks import bench_correlate1d, bench_fft


def row(n, batch, fwd_x, inv_x, gbs, dim=2, err=1e-7):
    return {"dim": dim, "n": n, "batch": batch, "speedup_fwd": fwd_x, "speedup_inv": inv_x,
            "speedup_base": "cufft", "fbfft_fwd_ms": 1.0, "fbfft_inv_ms": 1.0, "cufft_fwd_ms": fwd_x,
            "cufft_inv_ms": inv_x, "cupyfft_fwd_ms": 1.0, "cupyfft_inv_ms": 1.0, "fbfft_fwd_gbs": gbs,
            "fbfft_inv_gbs": gbs, "fbfft_fwd_err": err, "fbfft_inv_err": err}


def test_fft_targets_report_the_worst_case_and_miss_honestly():
    rows = [row(16, 4096, 2.0, 2.5, 3000), row(32, 65536, 1.4, 2.1, 1000), row(32, 256, 0.5, 0.5, 10),
            row(64, 4096, 0.6, 0.9, 1500)]
    got = dict(bench_fft.targets(rows, copy_gbs=4000))
    fwd = [t for t in got if t.startswith("2-D forward")][0]
    assert "worst 1.40x (n=32, batch=65536)" in fwd and got[fwd] is False   # batch 256 is exempt
    inv = [t for t in got if t.startswith("2-D inverse")][0]
    assert "worst 2.10x" in inv and got[inv] is True
    bw = {t.split(":")[0]: ok for t, ok in got.items() if "bandwidth" in t}
    assert bw == {"2-D n=16": True, "2-D n=32": False, "2-D n=64": False}
    # with a 50 MiB L2, n=16 at batch 4096 (8 MB) may be served from it: not judged at all
    assert not any(t.startswith("2-D n=16") for t, _ in bench_fft.targets(rows, 4000, l2_bytes=50 << 20))
    failed = bench_fft.targets(rows + [row(8, 4096, 2.0, 2.0, 100, err=3e-3)], copy_gbs=4000)
    assert failed == [("no target judged: 1 row(s) failed the correctness check", False)]


def test_fft_table_flags_wrong_results():
    table = bench_fft.format_table([row(8, 4096, 2.0, 2.0, 100, err=3e-3)], copy_gbs=4000)
    assert "FAILED CHECKS" in table and "n=8 batch=4096" in table
    assert "FAILED" not in bench_fft.format_table([row(8, 4096, 2.0, 2.0, 100)], copy_gbs=4000)


def test_fft_case_bytes():
    assert bench_fft.case_bytes(8, 2, dim=2) == (2 * 64 * 4, 8 * 5 * 2 * 8)
    assert bench_fft.case_bytes(8, 2, dim=2, stored=True) == (2 * 64 * 4, 34 * 2 * 8)  # 8^2/2 + 2
    assert bench_fft.case_bytes(8, 2, dim=1) == (2 * 8 * 4, 5 * 2 * 8)


def test_correlate1d_gflops_and_failures():
    assert bench_correlate1d.gflops(2047, 1_000_000 - 2046, 1.0) == 2 * 2047 * (1_000_000 - 2046) / 1e6
    rows = [{"K": 15, "err_direct": 1e-7, "err_cupyx_fft": 2e-4}, {"K": 63, "err_direct": float("nan")}]
    bad = bench_correlate1d.failures(rows)
    assert len(bad) == 2 and "K=15 cupyx_fft" in bad[0] and "K=63 direct" in bad[1]
