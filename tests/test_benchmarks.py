"""The benchmarks' CPU-side logic: layer tracing and command-line help (they need a GPU to run)."""
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks.harness import conv_layers, distinct_conv_layers

ROOT = Path(__file__).resolve().parent.parent


def test_conv_layers_trace_the_papers_networks():
    alex = conv_layers("alexnet", 128)
    assert [l[1] for l in alex] == [(128, 3, 224, 224), (128, 64, 27, 27), (128, 192, 13, 13),
                                    (128, 384, 13, 13), (128, 256, 13, 13)]
    assert alex[0][2:] == ((64, 3, 11, 11), (4, 4), (2, 2))
    over = conv_layers("overfeat_fast", 128)
    assert [l[1][2] for l in over] == [231, 28, 12, 12, 12]
    assert over[4][2] == (1024, 1024, 3, 3)


def test_conv_layers_trace_the_zoo_through_its_blocks():
    """VGG-16's 13 convolutions (9 distinct), ResNet-18's 20 (stem, 16 in blocks, 3 shortcuts:
    11 distinct) and ResNet-50's 53 with the v1.5 stride on the bottleneck's 3x3."""
    vgg = conv_layers("vgg16", 64)
    assert len(vgg) == 13 and len({tuple(l[1:]) for l in vgg}) == 9
    assert vgg[-1][1:] == ((64, 512, 14, 14), (512, 512, 3, 3), (1, 1), (1, 1))
    r18 = distinct_conv_layers("resnet18", 128)
    assert len(conv_layers("resnet18", 128)) == 20 and len(r18) == 11 and sum(l[-1] for l in r18) == 20
    assert r18[0][1:] == ((128, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3), 1)
    assert ((128, 64, 56, 56), (128, 64, 1, 1), (2, 2), (0, 0), 1) in [l[1:] for l in r18]   # a shortcut
    r50 = conv_layers("resnet50", 128)
    assert len(r50) == 53
    assert ((128, 128, 56, 56), (128, 128, 3, 3), (2, 2), (1, 1)) in [l[1:] for l in r50]    # stride on the 3x3


# Every entry point, run as the package's module from the repository root (python -m ...).
ENTRY_POINTS = ("benchmarks.paper", "benchmarks.bench_cufft", "benchmarks.bench_fbfft_vs_cufft",
                "benchmarks.bench_cgemm", "benchmarks.profile_layers", "benchmarks.bench_direct", "benchmarks.bench_cudnn",
                "benchmarks.bench_fft", "benchmarks.bench_correlate1d", "benchmarks.sweep", "benchmarks.bench_pytorch",
                "benchmarks.gpu_check_fbfft", "benchmarks.gpu_check_direct", "benchmarks.bench_ddp", "benchmarks.bench_tiledfft",
                "benchmarks.experiments.exp_host", "benchmarks.experiments.exp_layout",
                "benchmarks.experiments.exp_planes", "benchmarks.experiments.exp_step_error",
                "benchmarks.experiments.exp_pytorch_host", "benchmarks.experiments.exp_gemm_1x1",
                "benchmarks.experiments.exp_adapter_peak", "benchmarks.experiments.exp_profiler_residue",
                "benchmarks.experiments.exp_graph_pool", "benchmarks.experiments.exp_winograd_chunks",
                "benchmarks.experiments.exp_compile_gap", "benchmarks.experiments.exp_op_dispatch",
                "benchmarks.experiments.exp_capture_handle", "benchmarks.experiments.exp_fbfft_pieces",
                "benchmarks.experiments.exp_call_host", "benchmarks.experiments.exp_step_ab",
                "benchmarks.experiments.exp_step_profile", "benchmarks.experiments.exp_pass_graph_pool",
                "benchmarks.experiments.exp_cudnn_failed_execute", "benchmarks.experiments.exp_bench_probe",
                "benchmarks.experiments.exp_interleaved", "benchmarks.experiments.exp_host_ties",
                "benchmarks.tune_coverage", "benchmarks.tune_zoo")


def test_paper_result_files_are_one_per_network_set_and_step_candidate_set(settings):
    from benchmarks import paper
    assert paper.result_stem("table3", list(paper.NETWORKS)) == "paper_table3"
    assert paper.result_stem("table3", ["vgg16"]) == "paper_table3_vgg16"
    assert paper.result_stem("step", ["vgg16"]) == "paper_step_vgg16"
    settings(auto_backends="ours")               # the "ours alone" step beside the full one
    assert paper.result_stem("step", ["vgg16"]) == "paper_step_vgg16_auto_ours"
    assert paper.result_stem("table3", ["vgg16"]) == "paper_table3_vgg16"   # table3 has both rows


def test_paper_step_profiles_its_rows_after_timing_and_lets_their_steps_go(monkeypatch):
    """add_kernel_fractions gives each row its step's fraction and keeps no step (a step closes
    over its CUDA graph, which must not outlive the network's rows)."""
    import gc
    import weakref

    from benchmarks import paper
    monkeypatch.setattr(paper, "kernel_fraction", lambda fn: fn())

    class Step:
        def __init__(self, fraction):
            self.fraction = fraction

        def __call__(self):
            return self.fraction
    steps = [Step(0.5), Step(0.9)]
    alive = [weakref.ref(s) for s in steps]
    rows = [{"implementation": "eager"}, {"implementation": "graph"}]
    profiled = list(zip(rows, steps))
    del steps
    paper.add_kernel_fractions(profiled)
    assert [r["kernel_fraction"] for r in rows] == [0.5, 0.9] and profiled == []
    gc.collect()
    assert [ref() for ref in alive] == [None, None]


def test_exp_gemm_1x1_forms_match_float64_on_the_cpu(tmp_path):
    """Every GEMM form the experiment times computes the pass: ResNet-50's 1x1 layers, stride 1
    and 2, batch 1, NumPy, against PyTorch float64."""
    from benchmarks.experiments import exp_gemm_1x1
    out = tmp_path / "forms.json"
    exp_gemm_1x1.main(["--cpu", "--batch", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["pass_name"], r["form"]) for r in rows} == {(p, f) for p in ("fprop", "bprop", "accgrad")
                                                           for f in ("now", "flat")}
    assert {r["geometry"][-2:] for r in rows} == {"s1", "s2"}
    assert all(r["err"] < 1e-5 for r in rows), max(rows, key=lambda r: r["err"])


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_works_without_a_gpu(module):
    p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "usage" in p.stdout, p.stderr


@pytest.mark.parametrize("limits", ["abc", "64,x", "0", "-5", "inf"])
def test_exp_pass_graph_pool_refuses_bad_limits_before_it_starts(limits):
    """--limits takes MiB > 0, comma-separated: anything else is refused by argparse (exit 2, the flag
    named), before torch is imported or a model built."""
    p = subprocess.run([sys.executable, "-m", "benchmarks.experiments.exp_pass_graph_pool", "--limits", limits],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--limits" in p.stderr, p.stderr


def test_bench_cufft_help_lists_its_layers():
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench_cufft", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "--quick" in p.stdout and "table4.L1" in p.stdout


def test_sweep_configurations_and_sample():
    from benchmarks import sweep
    configs = sweep.configurations()
    assert len(configs) == 8232 == len({sweep.key(c) for c in configs})
    sample = sweep.quick_sample()
    assert len(sample) == sweep.QUICK_SAMPLE
    assert {c[3] for c in sample} == set(sweep.KERNELS) and {c[4] for c in sample} == set(sweep.OUTPUTS)


def test_sweep_run_order_is_a_fixed_shuffle_whose_prefixes_cover_the_grid():
    from benchmarks import sweep
    order = sweep.run_order()
    assert sorted(order) == sorted(sweep.configurations()) and order == sweep.run_order()
    head = order[:400]                    # what a short first chunk measures
    for axis, values in enumerate((sweep.S_SIZES, sweep.PLANES, sweep.PLANES, sweep.KERNELS, sweep.OUTPUTS)):
        assert {c[axis] for c in head} == set(values)


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
    assert "provenance: not recorded" in md                     # rows without a sidecar say so
    assert rows["3"].rstrip().endswith("| 0 | 0 |")             # nothing left out, nothing flagged


def test_sweep_small_kernels_measure_the_3x3_and_5x5_rows_in_the_shuffled_order():
    """--small-kernels: the grid's 3x3 and 5x5 configurations, each once, in run_order's order
    (so a cut-off run is a uniform sample of them); --quick with it, the quick sample's."""
    from benchmarks import sweep
    order = sweep.measure_order(small_kernels=True)
    assert len(order) == 2 * 4 * 7 * 7 * 7 == len(set(order))
    assert {c[3] for c in order} == {3, 5}
    full = sweep.run_order()
    assert order == [c for c in full if c[3] in (3, 5)]
    assert sweep.measure_order() == full
    assert sweep.measure_order(quick=True, small_kernels=True) == [c for c in sweep.quick_sample() if c[3] in (3, 5)]


def test_sweep_report_of_small_kernel_rows_counts_tiled_fft_and_winograd(tmp_path, monkeypatch):
    """Rows with tiledfft and winograd among ours: the speed-up takes the best of all four, the
    report draws only the kernels measured, counts which of ours won each pass, and sets the FFT
    backends alone beside all of ours on the same rows."""
    from benchmarks import sweep
    path = tmp_path / "sweep_small.jsonl"
    configs = [c for c in sweep.quick_sample() if c[3] in (3, 5)]
    for c in configs:
        row = synthetic_row(c, 2.0, 1.0)                        # the FFT backends lose 2x to cuDNN
        row["ours"] = list(sweep.SMALL)
        for p in sweep.PASSES:
            row["ms"][f"tiledfft_{p}"] = 0.8                    # tiled FFT wins 1.25x on 5x5
            if c[3] == 3:
                row["ms"][f"winograd_{p}"] = 0.5                # Winograd wins 2x on 3x3
        sweep.append_row(path, row)
    rows = sweep.load_done(path)
    three = next(r for r in rows.values() if r["config"][3] == 3)
    assert abs(sweep.speedups(three, "cudnn") - 2.0) < 1e-12
    assert abs(sweep.speedups(three, "cudnn", sweep.FFT) - 0.5) < 1e-12
    monkeypatch.setattr(sys, "argv", ["sweep.py", "report", str(path)])
    sweep.main()
    md = (tmp_path / "sweep_small.md").read_text()
    assert md.startswith(f"# Sweep: best of ours (cufft, fbfft, tiledfft, winograd) vs cuDNN strict and gemm "
                         f"({len(configs)} of 2744 configurations, kernels 3x3 and 5x5)")
    n3, n5 = (sum(c[3] == k for c in configs) for k in (3, 5))
    assert f"| 3 | fprop | 0 | 0 | 0 | {n3} |" in md and f"| 5 | accgrad | 0 | 0 | {n5} | 0 |" in md
    assert f"| 3 | {n3} | 0 (0%) | 0.50x | {n3} (100%) | 2.00x |" in md
    assert f"| 5 | {n5} | 0 (0%) | 0.50x | {n5} (100%) | 1.25x |" in md
    assert (tmp_path / "sweep_small_vs_cudnn.png").exists()


def test_sweep_report_counts_what_it_leaves_out(tmp_path, monkeypatch):
    """A configuration with a pass missing leaves the heat map, and one whose cuDNN result
    missed 1e-4 is timed anyway: the summary counts both, per kernel size."""
    from benchmarks import sweep
    path = tmp_path / "sweep.jsonl"
    k3 = [c for c in sweep.quick_sample() if c[3] == 3]
    broken, flagged, fine = (synthetic_row(c, 1.0, 2.0) for c in k3[:3])
    del broken["ms"]["cufft_bprop"]                             # the only FFT backend in these rows
    broken["skipped"]["cufft_bprop"] = "MemoryError: out of memory"
    flagged["skipped"]["cudnn_accgrad_precision"] = "relative error 3.0e-03 > 0.0001"
    for row in (broken, flagged, fine):
        sweep.append_row(path, row)
    monkeypatch.setattr(sys, "argv", ["sweep.py", "report", str(path)])
    sweep.main()
    md = (tmp_path / "sweep.md").read_text()
    k3_rows = [line for line in md.splitlines() if line.startswith("| 3 |")]
    assert k3_rows and all(line.startswith("| 3 | 2 |") and line.rstrip().endswith("| 1 | 1 |") for line in k3_rows)


def test_sweep_chunks_carry_their_provenance(tmp_path, monkeypatch):
    """Each run (chunk) of a resumable sweep leaves a provenance line, commit included, and the
    report lists them."""
    from minitorch_fft.backends import config
    from benchmarks import harness, sweep
    path = tmp_path / "sweep.jsonl"
    for done_before, c in enumerate(sweep.quick_sample()[:2]):
        with config.override(commit="0123abc"):
            sweep.record_chunk(path, done_before, harness.provenance("Test GPU", cupy="0"))
        sweep.append_row(path, synthetic_row(c, 1.0, 2.0))
    chunks = sweep.read_chunks(path)
    assert [c["done_before"] for c in chunks] == [0, 1] and {c["commit"] for c in chunks} == {"0123abc"}
    monkeypatch.setattr(sys, "argv", ["sweep.py", "report", str(path)])
    sweep.main()
    md = (tmp_path / "sweep.md").read_text()
    assert "measured in 2 run(s)" in md and md.count("commit 0123abc") == 2 and "Test GPU" in md


@pytest.mark.parametrize("bad, says", [("3", "must be I/N"), ("a/4", "must be I/N"), ("-1/4", "must be I/N"),
                                       ("1/2/3", "must be I/N"), ("1/0", "N >= 1"), ("4/4", "0 <= I < N")])
def test_sweep_shard_argument_is_checked(bad, says, monkeypatch, capsys):
    from benchmarks import sweep
    monkeypatch.setattr(sweep, "run", lambda args: pytest.fail("run despite a bad --shard"))
    monkeypatch.setattr(sys, "argv", ["sweep.py", "run", f"--shard={bad}"])
    with pytest.raises(SystemExit) as e:
        sweep.main()
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_sweep_shard_argument_reaches_run(monkeypatch):
    from benchmarks import sweep
    seen = []
    monkeypatch.setattr(sweep, "run", lambda args: seen.append(args.shard))
    for argv in (["run", "--shard", "7/8"], ["run", "--shard", "0/1"], ["run"]):
        monkeypatch.setattr(sys, "argv", ["sweep.py", *argv])
        sweep.main()
    assert seen == [(7, 8), (0, 1), None]                       # no --shard: the whole todo, as before


def test_sweep_shards_cover_what_is_left_once_and_do_not_shift():
    """The shards split what is left exactly, evenly after a cut-off run, and a shard's share does
    not move when the other shards' first rows land before it reads `done`."""
    from benchmarks import sweep
    order = sweep.run_order()
    done = {sweep.key(c): {} for c in order[:37] + order[500:900:7]}   # a cut-off run, and more
    todo = sweep.shard_todo(order, done)
    assert todo == [c for c in order if sweep.key(c) not in done]      # unsharded: as before
    for n in (1, 3, 8):
        assert [sweep.shard_todo(order, {}, (i, n)) for i in range(n)] == [order[i::n] for i in range(n)]
        shards = [sweep.shard_todo(order, done, (i, n)) for i in range(n)]
        assert sorted(c for s in shards for c in s) == sorted(todo)    # every configuration once
        prefix_done = [sweep.shard_todo(order, dict.fromkeys(map(sweep.key, order[:37])), (i, n)) for i in range(n)]
        assert max(map(len, prefix_done)) - min(map(len, prefix_done)) <= 1
    shards = [sweep.shard_todo(order, done, (i, 8)) for i in range(8)]
    first_rows = {sweep.key(s[0]): {} for s in shards[:3]}               # shards 0-2 start first
    assert sweep.shard_todo(order, {**done, **first_rows}, (5, 8)) == shards[5]


def test_sweep_done_counts_the_part_files(tmp_path):
    from benchmarks import sweep
    path = tmp_path / "sweep.jsonl"
    a, b, c, d = sweep.configurations()[:4]
    sweep.append_row(path, synthetic_row(a, 1.0, 2.0))
    for i, config in ((10, b), (2, c)):
        sweep.append_row(sweep.part_path(path, i), synthetic_row(config, 1.0, 2.0))
        sweep.record_chunk(sweep.part_path(path, i), 0, {"shard": f"{i}/11"})   # a sidecar is no part
    sweep.append_row(tmp_path / "sweep_quick.part0.jsonl", synthetic_row(d, 1.0, 2.0))  # another sweep's
    assert [p.name for p in sweep.part_paths(path)] == ["sweep.part2.jsonl", "sweep.part10.jsonl"]
    assert set(sweep.load_all_done(path)) == {sweep.key(x) for x in (a, b, c)}
    assert sweep.part_paths(tmp_path / "nowhere" / "sweep.jsonl") == []


def test_sweep_merge_folds_the_parts_in_once(tmp_path, monkeypatch, capsys):
    """Main file first, then the parts by number; a key seen before takes the later row in its
    place (a re-measurement), a torn line is dropped, the parts' provenance follows the main
    file's, the parts go, a second merge does nothing, and merging the same parts again (a merge
    cut off before its deletes) gives the same file."""
    from benchmarks import sweep
    path = tmp_path / "sweep.jsonl"
    a, b, c, d = sweep.configurations()[:4]
    part2, part10 = sweep.part_path(path, 2), sweep.part_path(path, 10)
    for file, rows in ((path, [(a, 1.0), (b, 1.0)]), (part2, [(c, 2.0), (a, 9.0)]), (part10, [(d, 3.0), (c, 9.0)])):
        sweep.record_chunk(file, 0, {"from": file.name})
        for config, fft_ms in rows:
            sweep.append_row(file, synthetic_row(config, fft_ms, 1.0))
    with open(part10, "a") as fh:
        fh.write('{"key": "S1_f1_fo1_k3_y')                                 # a shard killed mid-write
    saved = {p: p.read_text() for p in (part2, part10, sweep.provenance_path(part2), sweep.provenance_path(part10))}

    monkeypatch.setattr(sys, "argv", ["sweep.py", "merge", str(path)])
    sweep.main()
    summary = capsys.readouterr().out
    assert "2 rows before, 2 added from 2 part file(s), 2 replaced by a later row, 4 rows after" in summary
    rows = [json.loads(line) for line in path.read_text().splitlines()]   # every line whole
    assert [(r["key"], r["ms"]["cufft_fprop"]) for r in rows] == [(sweep.key(a), 9.0), (sweep.key(b), 1.0),
                                                                   (sweep.key(c), 9.0), (sweep.key(d), 3.0)]
    assert [ch["from"] for ch in sweep.read_chunks(path)] == [path.name, part2.name, part10.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.jsonl", "sweep.provenance.jsonl"]

    merged = path.read_text()
    sweep.main()
    assert "nothing to merge" in capsys.readouterr().out and path.read_text() == merged

    for p, text in saved.items():       # a merge cut off after rewriting, before deleting the parts
        p.write_text(text)
    sweep.main()
    assert "4 replaced by a later row, 4 rows after" in capsys.readouterr().out
    assert path.read_text() == merged and len(sweep.read_chunks(path)) == 3


def test_sweep_report_refuses_while_parts_are_left(tmp_path, monkeypatch):
    from benchmarks import sweep
    path = tmp_path / "sweep.jsonl"                                     # a first sharded run: no main file yet
    k3 = [c for c in sweep.quick_sample() if c[3] == 3]
    sweep.append_row(sweep.part_path(path, 0), synthetic_row(k3[0], 1.0, 2.0))
    sweep.append_row(sweep.part_path(path, 1), synthetic_row(k3[1], 1.0, 2.0))
    monkeypatch.setattr(sys, "argv", ["sweep.py", "report", str(path)])
    with pytest.raises(SystemExit) as e:
        sweep.main()
    assert "sweep.part0.jsonl, sweep.part1.jsonl" in str(e.value.code) and f"merge {path}" in str(e.value.code)
    assert not (tmp_path / "sweep.md").exists()
    monkeypatch.setattr(sys, "argv", ["sweep.py", "merge", str(path)])
    sweep.main()
    monkeypatch.setattr(sys, "argv", ["sweep.py", "report", str(path)])
    sweep.main()
    assert "(2 of 8232 configurations)" in (tmp_path / "sweep.md").read_text()


def test_source_commit_marks_a_tree_that_differs_from_head(tmp_path, monkeypatch):
    from benchmarks import harness
    monkeypatch.delenv("MINITORCH_COMMIT", raising=False)
    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no git")
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    run("add", "f.txt")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert harness.source_commit(tmp_path) == head
    (tmp_path / "f.txt").write_text("b")
    assert harness.source_commit(tmp_path) == f"{head} with uncommitted changes"
    monkeypatch.setenv("MINITORCH_COMMIT", "named")
    assert harness.source_commit(tmp_path) == "named"
    monkeypatch.delenv("MINITORCH_COMMIT")
    (tmp_path / "copy").mkdir()                   # a tree without .git inside another repository
    assert harness.source_commit(tmp_path / "copy").startswith("unknown")


def fbfft_vs_cufft_rows(speedups, ok=True):
    """Made-up rows (a test's inputs, never results): x in {13, 32}, p in {16, 64}, speed-up per pass."""
    from benchmarks import bench_fbfft_vs_cufft as bench
    return [{"x": x, "p": p, "pass": pn, "ms_fbfft": 1.0, "ms_cufft": speedups[pn], "speedup": speedups[pn],
             "basis_fbfft": "16x16", "basis_cufft": "15x15", "gemm_cufft": "batched",
             "err_fbfft": 1e-7 if ok else 0.5, "err_cufft": 1e-7, "ok": ok}
            for x, p in ((13, 16), (32, 64)) for pn in bench.PASSES]


def test_fbfft_vs_cufft_summary_and_report(tmp_path):
    """Speed-ups 2, 1, 4 (fprop, bprop, accGrad): mean 7/3, geometric mean 2; a row that failed its
    check stays out of the summary, and with such rows the target is "not established" (a mean
    over the rows that passed would select); without them it is met."""
    import json
    import statistics

    from benchmarks import bench_fbfft_vs_cufft as bench
    from benchmarks.harness import provenance
    rows = fbfft_vs_cufft_rows({"fprop": 2.0, "bprop": 1.0, "accgrad": 4.0})
    rows += fbfft_vs_cufft_rows({"fprop": 100.0, "bprop": 100.0, "accgrad": 100.0}, ok=False)
    summary = bench.summarize(rows)
    assert summary["all"]["n"] == 6 and abs(summary["all"]["mean"] - 7 / 3) < 1e-12
    assert abs(summary["all"]["geomean"] - 2.0) < 1e-12
    assert (summary["all"]["min"], summary["all"]["max"]) == (1.0, 4.0)
    assert abs(summary["all"]["std"] - statistics.stdev([2, 1, 4] * 2)) < 1e-12
    assert summary["accgrad"] == {"n": 2, "mean": 4.0, "std": 0.0, "geomean": 4.0, "min": 4.0, "max": 4.0}

    meta = provenance("Test GPU 0")
    json_path, md_path, png_path = bench.write_report(meta, rows, tmp_path, failures=["x=13 p=16 fprop fbfft"])
    assert json_path.parent == tmp_path / "test-gpu-0" and png_path.stat().st_size > 0
    data = json.loads(json_path.read_text())
    assert data["target_met"] is False and data["summary"]["all"]["n"] == 6 and len(data["rows"]) == 12
    assert data["paper_quoted"]["mean"] == 1.51 and data["paper_quoted"]["min"] == 1.21
    md = md_path.read_text()
    assert "| all passes | 6 | 2.33 | 1.37 | 2.00 | 1.00 | 4.00 |" in md
    assert "| paper §5.4 (quoted, not measured) |  | 1.51 | 0.21 | 1.49 | 1.21 |  |" in md
    assert "overall mean speedup of 1.51× with standard deviation 0.21" in md
    assert "**not established**: 6 row(s) failed" in md and "6 row(s) failed the float64 check" in md
    assert "host time included" in md
    assert "- x=13 p=16 fprop fbfft" in md and "- command: `" in md and "- date: " in md
    assert "| 32 | 64 | accgrad | 1.000 | 4.000 | 4.00 | 16x16 | 15x15 | batched |" in md

    clean = fbfft_vs_cufft_rows({"fprop": 2.0, "bprop": 1.0, "accgrad": 4.0})
    assert "**met**: measured mean 2.33x" in bench.summary_notes(bench.summarize(clean), clean)
    low = fbfft_vs_cufft_rows(dict.fromkeys(bench.PASSES, 1.2))
    assert "**missed**: measured mean 1.20x" in bench.summary_notes(bench.summarize(low), low)


def test_fbfft_vs_cufft_configurations():
    from benchmarks import bench_fbfft_vs_cufft as bench
    assert len(bench.parse_args([]).configs) == 24                     # the paper's 6 sizes x 4 problems
    assert sorted(bench.parse_args(["--quick"]).configs) == [(13, 16), (13, 128), (32, 16), (32, 128),
                                                             (64, 16), (64, 128)]
    assert bench.parse_args(["--sizes", "27", "--planes", "32,64"]).configs == [(27, 32), (27, 64)]
    for bad in (["--sizes", "2"], ["--planes", "x"], ["--repeat", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.parametrize("name", ["cufft", "fbfft"])
def test_bench_cufft_fused_step_runs_the_three_passes_sharing_spectra(name):
    """The fused step bench_cufft times: right against float64, 3 FFTs saved, the block closed."""
    import numpy as np

    from minitorch_fft import backends
    from benchmarks.bench_cufft import fused_step
    from reference import conv_reference, rel_error
    rng = np.random.default_rng(0)
    x, w, gy = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 9, 9), (4, 3, 3, 3), (2, 4, 9, 9)))
    outputs, cache = fused_step(backends.get(name), x, w, gy, (1, 1), (1, 1))
    assert cache.hits == 3 and len(cache) == 0 and backends.reuse.active() is None
    for got, ref in zip(outputs, conv_reference(x, w, gy, (1, 1), (1, 1)), strict=True):
        assert rel_error(got, ref) < 1e-5


def test_bench_cufft_writes_the_fused_step_table(tmp_path):
    import json

    from benchmarks import bench_cufft
    from benchmarks.harness import provenance, write_results
    step_rows = [{"layer": "table4.L5", "backend": "fbfft", "ms_passes": 3.0, "ms_step": 2.0, "speedup_step": 1.5,
                  "hits": 3, "ms_cudnn_strict": 4.0, "speedup_strict": 2.0, "err_max": 1e-6}]   # made up
    json_path, md_path = write_results("bench_cufft", provenance("Test GPU 0"), [], bench_cufft.MARKDOWN_COLUMNS,
                                       "t", out_dir=tmp_path, extra={"step_rows": step_rows},
                                       sections=[("Fused training step", step_rows, bench_cufft.STEP_COLUMNS)])
    assert json.loads(json_path.read_text())["step_rows"] == step_rows
    md = md_path.read_text()
    assert "## Fused training step" in md
    assert "| table4.L5 | fbfft | 3.000 | 2.000 | 1.50 | 3 | 4.000 | 2.00 | 1.0e-06 |" in md


def test_paper_tables_bookkeeping_without_a_gpu(monkeypatch):
    """table3 and table4 with the GPU work replaced by stand-ins (made-up times, never results):
    every (layer, pass) of every implementation is measured once, interleaved (all
    implementations finish a layer's pass before the next starts), totals are sums over layers
    and passes, ratios are cuDNN over ours, and cuDNN's own precision misses are reported."""
    import types

    from minitorch_fft import backends
    from benchmarks import paper
    calls = []

    class StandIn:
        def __init__(self, x_shape, w_shape, stride, padding, seed):
            self.geom = (x_shape, w_shape, stride, padding)
            self.g = backends.geometry(x_shape, w_shape, stride, padding)

        def cudnn(self, pn):
            return pn

        def measure(self, fn, lib, pn, tol, args, flagged=None):
            calls.append((self.geom, pn, "cudnn"))
            if flagged is not None and pn == "accgrad":
                flagged.append("relative error 3e-3 > 1e-4")
            return 1.0, 1e-7

    def run_ours(layer, impl, pn, args, tf32=False):
        calls.append((layer.geom, pn, impl))
        return (0.25 if tf32 else 0.5), 1e-7, "fbfft"

    monkeypatch.setattr(paper, "Layer", StandIn)
    monkeypatch.setattr(paper, "run_ours", run_ours)
    monkeypatch.setattr(paper, "set_tf32", lambda mode: None)
    args = types.SimpleNamespace(batch=4, seed=0, cgemm_tf32=True, warmup=0, repeat=1,
                                 networks=["alexnet", "overfeat_fast"], impls=None)
    bar = types.SimpleNamespace(set_postfix_str=lambda s: None, update=lambda n: None)
    rows, cols, failures, shortfalls, sections = paper.table3(args, bar)
    assert shortfalls == []                                    # 0.5 ms against cuDNN's 1.0 everywhere
    n_layers = {net: len(conv_layers(net, 4)) for net in ("alexnet", "overfeat_fast")}
    ours = [r for r in rows if "quoted" not in r["implementation"]]
    impls = paper.implementations("all") + ["auto TF32", "cudnn_strict", "cudnn_tf32"]
    assert {"auto", "auto[ours]"} <= set(impls)
    (_, layer_rows, _), = sections
    assert len(layer_rows) == 3 * sum(n_layers.values())       # per distinct layer and pass
    assert len(ours) == 2 * len(impls)
    for r in ours:
        n = n_layers[r["network"]]
        per_call = 1.0 if r["implementation"].startswith("cudnn") else 0.25 if "TF32" in r["implementation"] else 0.5
        assert r["total_ms"] == pytest.approx(3 * n * per_call)
        assert r["x_strict"] == pytest.approx(1.0 / per_call)
    # interleaved: the first len(impls) measurements are one (layer, pass), one per implementation
    first = calls[:len(impls)]
    assert len({(g, pn) for g, pn, _ in first}) == 1
    assert sum("(cuDNN itself)" in f for f in failures) == 2 * sum(n_layers.values())   # accGrad of each
    assert ("auto TF32 x TF32", "x TF32 auto TF32", ".2f") in sections[0][2]
    assert all(r["x TF32 auto TF32"] == pytest.approx(4.0) for r in layer_rows)

    # TF32 mode slower than cuDNN's TF32 (1.2 ms against 1.0): every layer-pass and each total said
    monkeypatch.setattr(paper, "run_ours", lambda layer, impl, pn, args, tf32=False: (1.2 if tf32 else 0.5, 1e-7, "fbfft"))
    _, _, _, shortfalls, _ = paper.table3(args, bar)
    assert len(shortfalls) == 3 * sum(n_layers.values()) + 2, shortfalls
    assert all("auto TF32" in f and "cuDNN TF32's" in f for f in shortfalls)
    monkeypatch.setattr(paper, "run_ours", run_ours)

    # --runs 3: each network timed three times; the median run, every run's total, the spread
    calls.clear()
    times = iter([0.5, 0.6, 0.4] * 1000)                  # our calls, run after run
    monkeypatch.setattr(paper, "run_ours", lambda layer, impl, pn, args, tf32=False: (next(times), 1e-7, "fbfft"))
    args.runs, args.cgemm_tf32 = 3, False
    rows, cols, failures, _, sections = paper.table3(args, bar)
    assert ("total ms per run", "runs_ms", "") in cols
    assert sum("(cuDNN itself)" in f for f in failures) == 2 * sum(n_layers.values())   # not once per run
    cudnn = next(r for r in rows if r["network"] == "alexnet" and r["implementation"] == "cudnn_strict")
    assert cudnn["total_ms"] == pytest.approx(3 * n_layers["alexnet"]) and cudnn["spread"] == 0
    assert len(calls) == 3 * 3 * sum(n_layers.values()) * 2                             # cuDNN: 2 modes
    (_, layer_rows, _), = sections
    row = layer_rows[0]          # every run's time and the backend that ran, per layer-pass (JSON only)
    assert row["backend auto"] == "fbfft" and len(row["runs auto"].split(" / ")) == 3
    # a stall in one run of one layer-pass stays out of the total: each layer-pass's median, summed
    seen = []

    def stalled(layer, impl, pn, args, tf32=False):          # auto's second run of the first layer-pass
        seen.append((layer.geom, pn, impl))
        return (5.0 if impl == "auto" and seen.count(seen[0][:2] + ("auto",)) == 2 and seen[-1][:2] == seen[0][:2]
                else 0.5), 1e-7, "fbfft"
    monkeypatch.setattr(paper, "run_ours", stalled)
    rows, _, _, _, _ = paper.table3(args, bar)
    auto = next(r for r in rows if r["network"] == "alexnet" and r["implementation"] == "auto")
    assert auto["total_ms"] == pytest.approx(3 * n_layers["alexnet"] * 0.5)
    assert max(float(v) for v in auto["runs_ms"].split(" / ")) > auto["total_ms"]    # the stalled run

    # a zoo network: the two autos only, by default; a layer where auto loses is a shortfall
    calls.clear()
    slow = distinct_conv_layers("resnet18", 4)[4][1:5]                                  # a 1x1 shortcut

    def run_ours(layer, impl, pn, args, tf32=False):
        calls.append((layer.geom, pn, impl))
        return (2.0 if layer.geom == slow and pn == "fprop" and impl == "auto" else 0.5), 1e-7, "gemm"
    monkeypatch.setattr(paper, "run_ours", run_ours)
    args.runs, args.networks = 1, ["resnet18"]
    rows, cols, failures, shortfalls, sections = paper.table3(args, bar)
    assert {impl for _, _, impl in calls} == {"auto", "auto[ours]", "cudnn"}
    assert len(shortfalls) == 1 and "resnet18 conv8" in shortfalls[0] and "fprop" in shortfalls[0]
    assert "0.500x cuDNN strict" in shortfalls[0]


def test_poisoned_fills_every_allocation_and_restores_the_allocator(monkeypatch):
    """benchmarks.harness.poisoned, with a stand-in for CuPy's allocator API: every block the
    call allocates is memset to 0xFF (NaN as float32) on the current stream, and the previous
    allocator comes back, also when the call raises."""
    import types

    from benchmarks import harness
    state = {"allocator": None, "memsets": []}
    pool_malloc = lambda size: types.SimpleNamespace(ptr=1000 + size)  # noqa: E731
    state["allocator"] = pool_malloc
    cuda = types.SimpleNamespace(
        get_allocator=lambda: state["allocator"],
        set_allocator=lambda a: state.__setitem__("allocator", a),
        get_current_stream=lambda: types.SimpleNamespace(ptr=7),
        runtime=types.SimpleNamespace(memsetAsync=lambda ptr, v, n, s: state["memsets"].append((ptr, v, n, s))))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))

    def work():
        state["allocator"](64)
        state["allocator"](0)
        return "result"

    assert harness.poisoned(work) == "result"
    assert state["memsets"] == [(1064, 0xFF, 64, 7)] and state["allocator"] is pool_malloc

    def fails():
        state["allocator"](8)
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError):
        harness.poisoned(fails)
    assert state["allocator"] is pool_malloc and state["memsets"][-1] == (1008, 0xFF, 8, 7)


def test_step_check_agrees_with_pytorch_and_catches_a_wrong_gradient(monkeypatch):
    """harness.step_check (paper.step's check) on the CPU (AlexNet, 10 classes, 2 images): our
    fp32 loss and weight gradients agree with PyTorch float64 on copied weights, and a weight
    gradient 1 % off in one pass of the conv backend is caught."""
    import numpy as np

    from minitorch_fft import backends
    import minitorch_fft as mt
    from minitorch_fft import models
    from benchmarks import harness, paper
    mt.manual_seed(0)
    net = models.get("alexnet", num_classes=10, backend="gemm")
    x = np.random.default_rng(0).standard_normal((2, 3, 224, 224), dtype=np.float32)
    y = np.array([3, 7])
    errors = harness.step_check(net, harness.torch_model("alexnet", 10), x, y)
    assert len(errors) == 1 + len(net.parameters())
    assert max(errors.values()) <= paper.STEP_TOL, errors
    assert all(p.grad is None for p in net.parameters())
    with pytest.raises(ValueError, match="differ in order or shape"):
        harness.step_check(net, harness.torch_model("overfeat_fast", 10), x, y)
    real = backends.gemm.accgrad
    monkeypatch.setattr(backends.gemm, "accgrad", lambda *a, **k: real(*a, **k) * np.float32(1.01))
    wrong = harness.step_check(net, harness.torch_model("alexnet", 10), x, y)
    assert wrong["features.0.weight"] > paper.STEP_TOL and wrong["loss"] <= paper.STEP_TOL
    # The yardstick: PyTorch float32 on the same weights. On the CPU it is far below STEP_TOL,
    # so the bounds stay at STEP_TOL and the 1 % error is still a failure.
    yardstick = harness.torch_fp32_errors(net, harness.torch_model("alexnet", 10), x, y)
    assert set(yardstick) == set(errors) and max(yardstick.values()) < paper.STEP_TOL
    import torch
    reference = harness.torch_gradients(net, harness.torch_model("alexnet", 10), x, y, torch.float64)
    assert harness.step_check(net, None, x, y, reference=reference) == wrong   # as paper.step calls it
    assert harness.torch_fp32_errors(net, harness.torch_model("alexnet", 10), x, y, reference=reference) == yardstick
    assert paper.step_verdict(errors, yardstick)[2]
    worst, bound, passed = paper.step_verdict(wrong, yardstick)
    assert not passed and worst.endswith(".weight") and bound == paper.STEP_TOL
    import torch
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = True, True
    try:
        with pytest.raises(ValueError, match="differ in order or shape"):   # it raises...
            harness.torch_fp32_errors(net, harness.torch_model("overfeat_fast", 10), x, y)
        real_copy = torch.Tensor.copy_
        monkeypatch.setattr(torch.Tensor, "copy_", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):                       # ...or fails inside...
            harness.torch_fp32_errors(net, harness.torch_model("alexnet", 10), x, y)
        monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark) == (True, True)  # ...and restores
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved


def test_our_branch_is_replayed_in_the_reference_and_a_far_flip_is_reported():
    """paper.step's branch_errors on the CPU (AlexNet, 10 classes, 2 images): the float64 and
    float32 references take our forward's branch at its 7 ReLUs and 3 max-pools, and then agree
    with ours far below STEP_TOL; a mask entry changed where the input is far from 0 is a flip
    above KINK_TOL (a forward error, not rounding) and moves the gradients; a branch recorded
    from one architecture is refused by another."""
    import numpy as np
    import torch

    import minitorch_fft as mt
    from minitorch_fft import models
    from benchmarks import harness, paper
    mt.manual_seed(0)
    net = models.get("alexnet", num_classes=10, backend="gemm")
    x = np.random.default_rng(0).standard_normal((2, 3, 224, 224), dtype=np.float32)
    y = np.array([3, 7])
    branch = harness.OurBranch()
    ours = harness.our_gradients(net, x, y, branch)
    assert len(branch.masks) == 7 and len(branch.indices) == 3
    assert all(p.grad is None for p in net.parameters()) and net.training
    reference = harness.torch_gradients(net, harness.torch_model("alexnet", 10), x, y, torch.float64, branch=branch)
    errors = harness.step_errors(net, ours, reference)
    assert max(errors.values()) < 1e-5, errors
    assert not branch.too_large and all(size <= harness.KINK_TOL for _, size in branch.flips)
    yardstick = harness.torch_fp32_errors(net, harness.torch_model("alexnet", 10), x, y, reference=reference,
                                          branch=branch)
    assert max(yardstick.values()) < 1e-5, yardstick
    # The first ReLU's mask recorded inverted: every input is then a flip, most far from 0
    branch.masks[0] = ~branch.masks[0]
    wrong = harness.torch_gradients(net, harness.torch_model("alexnet", 10), x, y, torch.float64, branch=branch)
    assert len(branch.too_large) > 1000 and max(size for _, size in branch.too_large) > 1.0
    assert harness.step_errors(net, ours, wrong)["features.0.weight"] > 0.1
    failures = []
    paper.checked(failures, "alexnet", errors, yardstick, branch.flips, "float32")
    assert len(failures) == 1 and "other side of the kink" in failures[0]
    with pytest.raises(ValueError, match="differ in order or shape|recorded|never reached|more often"):
        harness.torch_gradients(net, harness.torch_model("overfeat_fast", 10), x, y, torch.float64, branch=branch)


def test_step_check_carries_the_running_statistics_over():
    """paper.step checks a ResNet after a training step has moved its batch norms' running
    statistics: the check (evaluation mode) copies them into torchvision's model with the
    weights, so the two agree; and they matter (reset, the loss changes)."""
    import numpy as np
    import torch

    import minitorch_fft as mt
    from minitorch_fft import models
    from benchmarks import harness, paper
    mt.manual_seed(0)
    net = models.get("resnet18", num_classes=10, backend="gemm")
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)
    y = np.array([3, 7])
    opt = mt.optim.SGD(net.parameters(), lr=0.0)         # the statistics move, the weights stay
    mt.train_step(net, mt.CrossEntropyCriterion(), opt, mt.Tensor(3 * x + 1), y)
    assert int(net.layer1[0].bn1.num_batches_tracked.data) == 1
    theirs = harness.torch_model("resnet18", 10)           # copied by each call, never changed
    moved = harness.torch_gradients(net, theirs, x, y, torch.float64)
    errors = harness.step_check(net, None, x, y, reference=moved)
    assert max(errors.values()) <= paper.STEP_TOL, errors
    for name, b in net.named_buffers():
        if "running" in name:
            b.data[...] = 1.0 if name.endswith("var") else 0.0
    reset = harness.torch_gradients(net, theirs, x, y, torch.float64)
    assert abs(reset[0] - moved[0]) > 1e-3 * abs(moved[0])


def test_step_verdict_bounds_a_network_by_pytorch_float32():
    from benchmarks import paper
    tol, factor, cap = paper.STEP_TOL, paper.STEP_FACTOR, paper.STEP_CAP
    ours = {"loss": 1e-8, "a.weight": 3e-3, "b.weight": 9e-4}
    # PyTorch float32's largest error 2e-3 (on any tensor): the bound is 4e-3 for every tensor
    assert paper.step_verdict(ours, {"loss": 1e-8, "a.weight": 1e-6, "b.weight": 2e-3}) == \
        ("a.weight", factor * 2e-3, True)
    assert paper.step_verdict(ours, {"loss": 1e-8, "a.weight": 1e-6, "b.weight": 1e-6}) == \
        ("a.weight", tol, False)                      # float32 exact here: 1e-3 flat
    assert paper.step_verdict(dict(ours, **{"a.weight": 6e-3}), {"loss": 1e-8, "a.weight": 1e-2,
                                                                 "b.weight": 1e-6})[1:] == (cap, False)
    worst, _, passed = paper.step_verdict(dict(ours, **{"b.weight": float("nan")}),
                                          {"loss": 1e-8, "a.weight": 2e-3, "b.weight": 2e-3})
    assert (worst, passed) == ("b.weight", False)     # a NaN gradient fails, it is not skipped
    assert not paper.step_verdict(ours, {"loss": 1e-8, "a.weight": float("nan"), "b.weight": 1e-6})[2]


def test_sweep_report_breaks_the_summary_down_by_batch_size():
    from benchmarks import sweep
    rows = [synthetic_row((1, 4, 4, 3, 8), 2.0, 1.0), synthetic_row((1, 4, 16, 5, 8), 2.0, 1.0),
            synthetic_row((128, 4, 4, 9, 8), 1.0, 4.0), synthetic_row((128, 16, 4, 9, 4), 2.0, 1.0)]
    table = {line.split("|")[1].strip(): line for line in sweep.by_batch(rows, "cudnn") if line.startswith("| 1")}
    assert set(table) == {"1", "128"}                                  # S = 16 and 64: nothing measured
    assert "| 2 | 0 (0%) | 0.50x | 0.50x |" in table["1"]
    assert "| 2 | 1 (50%) | 4.00x | 4.00x |" in table["128"]


def test_paper_step_shadows_none_of_the_module_functions_it_calls():
    """paper.step runs only on a GPU. A local name equal to a module-level function it calls
    (a nested `def torch_step` once hid the function torch_step: UnboundLocalError on the
    device) is caught here, on the CPU, from the compiled code."""
    import types

    from benchmarks import paper
    module_functions = {name for name, v in vars(paper).items() if isinstance(v, types.FunctionType)}
    code = paper.step.__code__
    assert not (set(code.co_varnames) | set(code.co_cellvars)) & module_functions


def test_sweep_remeasures_the_rows_that_name_no_commit(tmp_path):
    """--remeasure-unnamed: rows from before rows named their commit count as not done, so a run
    (or a shard) measures them again; once it has, the key is done, with the new row."""
    from benchmarks import sweep
    path = tmp_path / "sweep.jsonl"
    order = sweep.run_order()[:6]
    for i, config in enumerate(order[:4]):
        row = synthetic_row(config, 1.0, 2.0)
        if i % 2:
            row["commit"] = "abc1234"
        sweep.append_row(path, row)
    assert sweep.shard_todo(order, sweep.load_all_done(path)) == order[4:]
    redo = sweep.load_all_done(path, remeasure_unnamed=True)
    assert sweep.shard_todo(order, redo) == [order[0], order[2]] + order[4:]
    assert sweep.shard_todo(order, redo, (0, 2)) == [order[0], order[2], order[4]]
    again = dict(synthetic_row(order[0], 5.0, 2.0), commit="def5678")
    sweep.append_row(sweep.part_path(path, 0), again)                  # a shard re-measured order[0]
    assert sweep.load_all_done(path, remeasure_unnamed=True)[sweep.key(order[0])] == again
    assert sweep.shard_todo(order, sweep.load_all_done(path, remeasure_unnamed=True), (0, 2)) == [order[2], order[4]]


def test_profile_categories_keep_the_cufft_backends_own_kernels_out_of_fft():
    """profile_layers sorts kernels by name: cuFFT's and fbfft's transforms are "fft", cuBLAS's
    GEMMs "gemm"; the cufft backend's place / crop / transpose kernels (cufft_*) are "other",
    though their names contain "fft"."""
    from benchmarks.profile_layers import category
    assert [category(k) for k in ("regular_fft_c2r<16>", "vector_fft_r2c", "fbfft_rfft2<16>",
                                  "sm90_xmma_gemm_f32f32", "cutlass_80_tensorop", "cufft_transpose",
                                  "cufft_place", "cufft_crop", "minitorch_sgd_momentum")] == \
        ["fft", "fft", "fft", "gemm", "gemm", "other", "other", "other", "other"]


def _step_row(impl, converted, precision, mode, ms, peak):
    return {"implementation": impl, "converted": converted, "precision": precision, "mode": mode,
            "step_ms": ms, "peak_mib": peak}


def test_bench_pytorch_names_each_missed_target():
    """shortfalls(): speed-up over the stock row of the same precision and mode against TARGETS,
    peak memory against that row's; a met target is listed, a missed one also returned."""
    from benchmarks.bench_pytorch import TARGETS, shortfalls
    rows = [_step_row("PyTorch fp32 strict", False, "strict", "eager", 10.0, 1000),
            _step_row("PyTorch default (cuDNN TF32)", False, "tf32", "eager", 8.0, 1000),
            _step_row("converted fp32", True, "strict", "eager", 8.0, 900),    # 1.25x: under AlexNet's 1.3
            _step_row("converted TF32", True, "tf32", "eager", 7.0, 1100)]     # fast enough, too much memory
    for r in rows:
        stock = next(s for s in rows if not s["converted"] and s["precision"] == r["precision"])
        r["vs_stock"] = stock["step_ms"] / r["step_ms"]
    lines, missed = shortfalls("alexnet", rows)
    assert TARGETS["alexnet"]["strict"] == 1.3 and len(lines) == 4
    assert missed == [lines[0], lines[3]]
    assert "1.25x PyTorch fp32 strict (target >= 1.3x): SHORTFALL" in missed[0]
    assert "peak 1100 MiB against stock's 1000 MiB" in missed[1]
    assert "requested" not in missed[1]            # rows without the requested peak (older results)
    lines, missed = shortfalls("vgg16", rows)      # 1.0x for fp32 only; no TF32 speed target there
    assert missed == [lines[2]] and len(lines) == 3
    rows[2]["vs_stock_steady"] = 1.54              # back to back: reported beside, never judged
    lines, missed = shortfalls("alexnet", rows)
    assert "1.25x PyTorch fp32 strict (target >= 1.3x): SHORTFALL (back to back, not judged: 1.54x)" in lines[0]
    assert missed == [lines[0], lines[3]]
    # a sub-MiB excess is shown to the KiB; the requested peak beside it, never judged
    rows[3]["peak_mib"], rows[1]["peak_mib"] = 6522.021, 6521.271     # VGG-16 TF32 eager, fdfbb2a: 0.75 MiB
    rows[3]["peak_requested_mib"], rows[1]["peak_requested_mib"] = 6518.768, 6518.768
    lines, missed = shortfalls("alexnet", rows)
    assert missed[1] == ("alexnet converted TF32, eager: peak 6522.021 MiB against stock's 6521.271 MiB (target: "
                         "at most stock's): SHORTFALL (requested, not judged: 6518.768 against 6518.768 MiB)")
    rows[3]["peak_mib"] = 6525.4                                        # a MiB or more apart: whole MiB
    assert "peak 6525 MiB against stock's 6521 MiB" in shortfalls("alexnet", rows)[1][1]


def test_bench_pytorch_keeps_a_cut_networks_rows(tmp_path):
    """write_network(): while a network runs, its rows so far go to <name>.partial.{json,md}, which
    say so and judge no target; the finished file judges them and removes the partial ones."""
    from benchmarks.bench_pytorch import speedups, write_network
    meta = {"device": "Test GPU", "batch": 128}
    cols = [("implementation", "implementation", ""), ("step ms", "step_ms", ".2f"), ("vs", "vs_stock", ".2f")]
    rows = [_step_row("PyTorch fp32 strict", False, "strict", "eager", 10.0, 1000),
            _step_row("converted fp32", True, "strict", "eager", 8.0, 900)]   # 1.25x: short of 1.3
    for row, steady in zip(rows, (9.0, 6.0)):
        row["steady_ms"] = steady
    speedups(rows)
    assert [(r["vs_stock"], r["vs_stock_steady"]) for r in rows] == [(1.0, 1.0), (1.25, 1.5)]
    paths, missed = write_network("bench_pytorch_alexnet", "alexnet", meta, rows[:1], [], cols, tmp_path,
                                  partial=True)
    assert [p.name for p in paths] == ["bench_pytorch_alexnet.partial.json", "bench_pytorch_alexnet.partial.md"]
    assert missed == [] and not (paths[0].parent / "bench_pytorch_alexnet.json").exists()
    text = paths[1].read_text()
    assert "PARTIAL: the rows finished so far (1)" in text and "Targets (issue 19" not in text and "(partial)" in text
    assert json.loads(paths[0].read_text())["rows"][0]["step_ms"] == 10.0
    paths, missed = write_network("bench_pytorch_alexnet", "alexnet", meta, rows, ["a check failed"], cols,
                                  tmp_path)
    assert sorted(p.name for p in paths[0].parent.iterdir()) == ["bench_pytorch_alexnet.json",
                                                                 "bench_pytorch_alexnet.md"]
    text = paths[1].read_text()
    assert "PARTIAL" not in text and "1.25x PyTorch fp32 strict (target >= 1.3x): SHORTFALL" in text
    assert "FAILED (reported, not hidden):\n- a check failed" in text and len(missed) == 1
    assert speedups([rows[1]])[0]["vs_stock"] is None    # its stock row not (yet) among them


def _bench_pytorch_main(monkeypatch, tmp_path, run_network):
    """bench_pytorch.main() for AlexNet, strict and fp32 rows, with run_network a stand-in and no GPU."""
    import types

    import torch

    from minitorch_fft.backends import cudnn, tuning
    from benchmarks import bench_pytorch
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(__version__="0"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 0)
    monkeypatch.setattr(tuning, "device_name", lambda cp: "Test GPU")
    monkeypatch.setattr(cudnn, "versions", lambda: {})
    monkeypatch.setattr(bench_pytorch, "setup_cudnn", lambda torch: {})
    monkeypatch.setattr(bench_pytorch, "host_probe_ms", lambda: 1.0)
    monkeypatch.setattr(bench_pytorch, "run_network", run_network)
    monkeypatch.setattr(sys, "argv", ["bench_pytorch", "--nets", "alexnet", "--impls", "strict,fp32",
                                      "--out", str(tmp_path)])
    bench_pytorch.main()


def test_bench_pytorch_main_writes_the_rows_so_far(monkeypatch, tmp_path, capsys):
    """main() on a stand-in network: an earlier run's partial files go when it starts the network;
    after each implementation's rows the partial file holds them; at the end the finished file and
    no partial one; other result names' partial files are not touched. A run cut after its first
    rows leaves them in the partial file and writes no finished one."""
    from benchmarks import bench_pytorch
    folder = tmp_path / "test-gpu"
    folder.mkdir()
    others = ["bench_pytorch_alexnet_quick.partial.json", "bench_pytorch_vgg16.partial.md"]
    for file in others + ["bench_pytorch_alexnet.partial.json", "bench_pytorch_alexnet.partial.md"]:
        (folder / file).write_text("{}")
    seen = []

    def run_network(net, args, log, on_rows=None, cut=False):
        seen.append(sorted(p.name for p in folder.iterdir()))    # the stale partial files already gone
        rows = []
        for impl, converted, ms in (("PyTorch fp32 strict", False, 10.0), ("converted fp32", True, 7.0)):
            rows.append({**_step_row(impl, converted, "strict", "eager", ms, 900), "steady_ms": ms,
                         "network": net})
            on_rows(bench_pytorch.speedups(rows), [])
            seen.append([r["implementation"] for r in
                         json.loads((folder / "bench_pytorch_alexnet.partial.json").read_text())["rows"]])
            if cut:
                raise KeyboardInterrupt("cut")    # what a time limit's signal would end it with
        return bench_pytorch.speedups(rows), []
    _bench_pytorch_main(monkeypatch, tmp_path, run_network)
    assert seen == [sorted(others), ["PyTorch fp32 strict"], ["PyTorch fp32 strict", "converted fp32"]]
    assert sorted(p.name for p in folder.iterdir()) == sorted(others + ["bench_pytorch_alexnet.json",
                                                                        "bench_pytorch_alexnet.md"])
    out = capsys.readouterr().out
    assert "1.43x PyTorch fp32 strict (target >= 1.3x)" in out
    assert "cudnn_backend: not available: auto chose among the other backends" in out
    for file in ("bench_pytorch_alexnet.json", "bench_pytorch_alexnet.md"):
        (folder / file).unlink()
    with pytest.raises(KeyboardInterrupt):
        _bench_pytorch_main(monkeypatch, tmp_path, lambda *a, **k: run_network(*a, **k, cut=True))
    assert sorted(p.name for p in folder.iterdir()) == sorted(others + ["bench_pytorch_alexnet.partial.json",
                                                                        "bench_pytorch_alexnet.partial.md"])
    assert "PARTIAL: the rows finished so far (1)" in (folder / "bench_pytorch_alexnet.partial.md").read_text()


def test_bench_pytorch_times_single_steps_and_bursts(monkeypatch):
    """timed_row(): the single-step median, then bursts of BURST steps with no wait inside one,
    per step, then the host's issue time of one step on a drained GPU; the peak over all, less what
    earlier rows left."""
    import argparse

    import torch

    from benchmarks import bench_pytorch
    calls, timed = [], []

    def median_ms(fn, lib, warmup, repeat, before=None):
        if before is not None:
            before()
        start = len(calls)
        fn()
        timed.append((lib, len(calls) - start, repeat, before))
        return 10.0 * (len(calls) - start) if lib == "torch" else 4.0   # 10 ms a step; issued in 4
    monkeypatch.setattr(bench_pytorch, "median_ms", median_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 300 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"requested_bytes.all.peak": 290 * 2**20})
    args = argparse.Namespace(warmup=2, repeat=10)
    ms, steady, issue, peak, requested, pool = bench_pytorch.timed_row(lambda: calls.append(1), args, (0, 0),
                                                                       (100 * 2**20, 99 * 2**20))
    burst = bench_pytorch.BURST
    # one step a call; BURST a burst, 3 bursts at least; the issue time on the host clock, drained first
    assert timed == [("torch", 1, 10, None), ("torch", burst, 3, None), ("cpu", 1, 10, torch.cuda.synchronize)]
    # warm-up, one settling step, the peak window opened, then one call of each
    assert calls == [1] * (2 + 1) + ["reset"] + [1] * (1 + burst + 1)
    assert (ms, steady, issue, peak, requested, pool) == (10.0, 10.0, 4.0, 200.0, 191.0, 0.0)
    # a reduce-overhead row opened the window itself before the trees' recording: warm-up steps count too
    calls.clear()
    bench_pytorch.timed_row(lambda: calls.append(1), args, (0, 0), (0, 0), window_open=True)
    assert calls == [1] * (2 + 1 + 1 + burst + 1)
    # a CUDA graph row's capture peak counts where it is the higher (allocated and requested apart)
    *_, peak, requested, _ = bench_pytorch.timed_row(lambda: None, args, (350 * 2**20, 10), (0, 0))
    assert (peak, requested) == (350.0, 290.0)
    # the pass graphs' pool's free bytes are held at every moment and allocated at none between replays:
    # added to both; their arena is allocated (in the peaks already): reported beside them, not added
    import minitorch_fft.pytorch as adapter
    quiet = {"eager": 0, "captures": 0, "failed": 0, "pool_free_bytes": 64 * 2**20, "arena_bytes": 32 * 2**20}
    monkeypatch.setattr(adapter, "pass_graph_stats", lambda: quiet)
    *_, peak, requested, pool = bench_pytorch.timed_row(lambda: None, args, (0, 0), (0, 0))
    assert (peak, requested, pool) == (364.0, 354.0, 96.0)
    # warm-up goes on while a step still captures (or runs a key eagerly before its capture), SETTLE at most
    counts = iter([0, 1, 3, 3] + [100 * i for i in range(2 * bench_pytorch.SETTLE + 2)])   # one read a step
    monkeypatch.setattr(adapter, "pass_graph_stats", lambda: {**quiet, "eager": next(counts)})
    calls.clear()
    bench_pytorch.timed_row(lambda: calls.append(1), argparse.Namespace(warmup=0, repeat=10), (0, 0), (0, 0))
    assert calls.count(1) == 3 + 1 + burst + 1                   # settled at the third step: 3 -> 3
    counts = iter(100 * i for i in range(2 * bench_pytorch.SETTLE + 2))
    calls.clear()
    bench_pytorch.timed_row(lambda: calls.append(1), argparse.Namespace(warmup=0, repeat=10), (0, 0), (0, 0))
    assert calls.count(1) == bench_pytorch.SETTLE + 1 + burst + 1   # never settled: SETTLE steps, then timed


def test_bench_pytorch_frees_the_cublas_workspaces_between_rows(monkeypatch):
    """_free(): each row pays for its own cuBLAS workspaces (a workspace made by one row and found by
    the next would be counted by the first only), cleared before the cached blocks are returned."""
    import torch

    from minitorch_fft import backends
    from benchmarks import bench_pytorch
    calls = []
    monkeypatch.setattr(backends.cufft, "release_buffers", lambda: calls.append("cufft"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("cublas"), raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    # first what a compiled row keeps (its model with it): Dynamo's caches, and inductor's cudagraph trees
    # where a row made some (their module imported)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("dynamo"))
    trees = types.SimpleNamespace(reset_cudagraph_trees=lambda: calls.append("trees"))
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)
    bench_pytorch._free(torch)
    assert calls == ["dynamo", "trees", "cufft", "sync", "cublas", "empty"]
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")      # another PyTorch: nothing to clear
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees")   # no row made trees
    calls.clear()
    bench_pytorch._free(torch)
    assert calls == ["dynamo", "cufft", "sync", "empty"]


def test_bench_pytorch_charges_a_freed_leftover_to_the_row():
    """What earlier rows held at a row's start is subtracted from its peak; where the row freed some of
    it, that part is added back to each of its rows (an upper bound), allocated and requested apart,
    recorded and logged; a kept leftover changes nothing, and memory the row leaves held (which would
    hide as much freed) is logged as unchecked."""
    from benchmarks.bench_pytorch import charge_freed_leftover
    mib = 2**20

    def rows():
        return [{"network": "alexnet", "implementation": "converted fp32", "mode": mode,
                 "peak_mib": 900.0, "peak_requested_mib": 896.0} for mode in ("eager", "torch.compile")]
    lines = []
    charged = rows()
    charge_freed_leftover(charged, (243 * mib, 242 * mib), (0, 0), lines.append)
    assert [(r["peak_mib"], r["peak_requested_mib"], r["leftover_freed_mib"], r["leftover_freed_requested_mib"])
            for r in charged] == [(1143, 1138, 243, 242)] * 2
    assert len(lines) == 2 and "243.0 MiB (242.0 requested) of earlier rows' leftover freed" in lines[1]
    assert "torch.compile" in lines[1] and "now 1143 MiB" in lines[1]
    lines.clear()
    charged = rows()
    charge_freed_leftover(charged, (130 * mib, 130 * mib), (130 * mib, 129 * mib), lines.append)   # requested only
    assert (charged[0]["peak_mib"], charged[0]["peak_requested_mib"]) == (900, 897)
    assert "0.0 MiB (1.0 requested)" in lines[0]
    lines.clear()
    charged = rows()
    charge_freed_leftover(charged, (130 * mib, 130 * mib), (130 * mib, 130 * mib), lines.append)   # kept
    assert [(r["peak_mib"], r["peak_requested_mib"], r["leftover_freed_mib"]) for r in charged] == [(900, 896, 0)] * 2
    assert lines == []
    charge_freed_leftover(charged, (130 * mib, 130 * mib), (160 * mib, 130 * mib), lines.append)   # the row left 30
    assert [(r["peak_mib"], r["peak_requested_mib"]) for r in charged] == [(900, 896)] * 2
    assert len(lines) == 2 and "left 30.0 MiB (0.0 requested) held" in lines[0] and "unchecked" in lines[0]


def test_bench_pytorch_estimates_from_its_last_result(tmp_path):
    from benchmarks.bench_pytorch import earlier_estimate
    assert earlier_estimate("bench_pytorch_alexnet", 128, tmp_path)[0] is None
    (tmp_path / "bench_pytorch_alexnet.json").write_text(json.dumps(
        {"meta": {"batch": 8}, "rows": [{"row_s": 3.0}, {"row_s": 5.0}]}))
    seconds, path = earlier_estimate("bench_pytorch_alexnet", 128, tmp_path)
    assert seconds == 128 and path.name == "bench_pytorch_alexnet.json"


def test_bench_pytorch_overfeat_fast_runs_at_its_image_size():
    """OverFeat-fast is not a torchvision model: bench_pytorch takes harness.torch_model's at 231x231
    (its classifier takes 1024 x 6 x 6), every conv convertible, with the TF32 target the issue
    names for it."""
    import torch

    from benchmarks.bench_pytorch import BATCH, IMAGE, NETS, TARGETS
    from benchmarks.harness import torch_model
    from minitorch_fft.pytorch import Conv2d, convert
    assert "overfeat_fast" in NETS and BATCH["overfeat_fast"] == 128 and TARGETS["overfeat_fast"]["tf32"] == 1.0
    model = convert(torch_model("overfeat_fast", 1000), backend="gemm")
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 5 and all(isinstance(m, Conv2d) for m in convs)
    side = IMAGE["overfeat_fast"]
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 3, side, side)).shape == (1, 1000)


def test_tune_coverage_counts_the_choices_a_step_asks_for(tmp_path, capsys, monkeypatch):
    import numpy as np

    from minitorch_fft.backends import auto, config, tuning
    from benchmarks import tune_coverage
    device = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(tuning, "device_name", lambda xp: device)
    cache = tuning.TuneCache(tmp_path / "tune.json")
    layers = distinct_conv_layers("alexnet", 128)
    name, x, w, s, p, _ = layers[1]          # conv2: its three passes, in fp32 only, keyed as auto keys them
    geometry = auto._geometry_key(x, w, s, p)
    record = {"choice": "fbfft", "ms": {"fbfft": 1.0}, "skipped": {}, "why": "fastest"}
    for pass_name in ("fprop", "bprop", "accgrad"):
        cache.put(tuning.key(np, np.float32, geometry, pass_name, auto.label(), math="fp32"), record)
    with config.override(auto_backends="ours"):                             # another label
        cache.put(tuning.key(np, np.float32, geometry, "fprop", auto.label(), math="tf32"), record)
    cache.put(tuning.key(np, np.float32, auto._geometry_key(*layers[2][1:5]), "fprop", auto.label(), math="fp32"),
              {"choice": "gemm"})                                          # not in tune()'s format
    found = tune_coverage.coverage(tuning.TuneCache(tmp_path / "tune.json"), device, "alexnet", 128)
    # five distinct layers, three passes each, less conv1's bprop (the image's gradient is never asked for)
    assert found["fp32"][:2] == (3, 14) and found["tf32"][:2] == (0, 14)
    assert ("conv1", "bprop") not in found["tf32"][2] and ("conv1", "fprop") in found["tf32"][2]
    assert (name, "fprop") not in found["fp32"][2] and (name, "fprop") in found["tf32"][2]
    assert tune_coverage.main([str(tmp_path / "tune.json"), "--networks", "alexnet"]) == 0
    table = capsys.readouterr().out
    assert f"| {device} | alexnet | 128 | 3 / 14 | 0 / 14 | fp32 conv1 fprop |" in table
    with config.override(cudnn_workspace_mb=1024):       # another bound, its own keys: none held
        assert tune_coverage.main([str(tmp_path / "tune.json"), "--networks", "alexnet"]) == 0
    assert f"| {device} | alexnet | 128 | 0 / 14 | 0 / 14 | fp32 conv1 fprop |" in capsys.readouterr().out
    assert tune_coverage.main([str(tmp_path / "tune.json"), "--networks", "alexnet", "--label", "auto[ours]"]) == 0
    assert f"| {device} | alexnet | 128 | 0 / 14 | 1 / 14 | fp32 conv1 fprop |" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--networks", "lenet"], "unknown network(s) lenet"),
    (["--device", "NVIDIA A100"], "holds no choices for 'NVIDIA A100'"),
])
def test_tune_coverage_names_what_it_cannot_read(tmp_path, capsys, args, message):
    from minitorch_fft.backends import tuning
    from benchmarks import tune_coverage
    tuning.TuneCache(tmp_path / "tune.json").put(("NVIDIA H100 80GB HBM3", "float32", "fp32", (1,) * 11, "fprop",
                                                  "auto"), {"choice": "gemm"})
    with pytest.raises(SystemExit):
        tune_coverage.main([str(tmp_path / "tune.json"), "--batch", "0"])
    assert "--batch must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune_coverage.main([str(tmp_path / "tune.json")] + args)
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune_coverage.main([str(tmp_path / "missing.json")])
    assert "holds no tuning choices" in capsys.readouterr().err


def test_tune_zoo_orders_choices_as_a_step_asks_for_them():
    """Forward fprops first, then from the last layer back each layer's bprop before its accGrad."""
    from benchmarks.tune_zoo import step_order
    names = ["conv1", "conv2", "conv3"]
    missing = [(n, p) for n in names for p in ("fprop", "bprop", "accgrad") if (n, p) != ("conv1", "bprop")]
    assert step_order(missing[::-1], names) == [
        ("conv1", "fprop"), ("conv2", "fprop"), ("conv3", "fprop"), ("conv3", "bprop"), ("conv3", "accgrad"),
        ("conv2", "bprop"), ("conv2", "accgrad"), ("conv1", "accgrad")]


TINY_NET = [("conv1", (2, 3, 10, 10), (4, 3, 3, 3), (1, 1), (1, 1), 1),
            ("conv2", (2, 4, 10, 10), (5, 4, 3, 3), (1, 1), (1, 1), 2)]


@pytest.fixture
def tiny_zoo(monkeypatch, settings):
    """tune_zoo and tune_coverage on two small layers standing for AlexNet's, tuned on the CPU
    (auto_tune on; NumPy also where a GPU answers), with no choice remembered from earlier tests."""
    import numpy as np

    from minitorch_fft.backends import auto
    from benchmarks import tune_coverage, tune_zoo
    monkeypatch.setattr(tune_coverage, "distinct_conv_layers", lambda net, batch: list(TINY_NET))
    monkeypatch.setattr(tune_zoo, "_array_module", lambda: np)
    monkeypatch.setattr(auto, "_memory", {})
    monkeypatch.setattr(auto, "_fast", {})
    settings(auto_tune="on")


def _a_new_process(monkeypatch):
    """auto's in-process memory and the cache objects gone: only the cache file remembers."""
    from minitorch_fft.backends import auto, tuning
    monkeypatch.setattr(auto, "_memory", {})
    monkeypatch.setattr(auto, "_fast", {})
    monkeypatch.setattr(tuning, "_caches", {})


def test_tune_zoo_tunes_what_the_cache_lacks_and_keeps_it(tmp_path, capsys, monkeypatch, tiny_zoo):
    """Every choice the step asks for lands in the file, in step order; a second run finds them
    all and tunes nothing; tune_coverage (an independent count, from the file) agrees."""
    from minitorch_fft import backends
    from minitorch_fft.backends import tuning
    from benchmarks import tune_coverage, tune_zoo
    asked, real = [], backends.choose

    def choose(name, pass_name, x_shape, *rest, **kwargs):
        asked.append((tuple(x_shape), pass_name))
        return real(name, pass_name, x_shape, *rest, **kwargs)
    monkeypatch.setattr(backends, "choose", choose)
    cache = tmp_path / "sub" / "tune.json"
    assert tune_zoo.main([str(cache), "--networks", "alexnet", "--precisions", "fp32"]) == 0
    conv1, conv2 = (layer[1] for layer in TINY_NET)
    steps = [(conv1, "fprop"), (conv2, "fprop"), (conv2, "bprop"), (conv2, "accgrad"), (conv1, "accgrad")]
    assert asked == steps
    assert "| alexnet | fp32 | 0 | 5 | 5 | 5 |" in capsys.readouterr().out
    found = tune_coverage.coverage(tuning.TuneCache(cache), "cpu", "alexnet", 128)
    assert found["fp32"] == (5, 5, [])
    written = cache.read_bytes()
    _a_new_process(monkeypatch)
    asked.clear()
    assert tune_zoo.main([str(cache), "--networks", "alexnet", "--precisions", "fp32"]) == 0
    assert asked == steps and "| alexnet | fp32 | 5 | 0 | 5 | 5 |" in capsys.readouterr().out
    assert cache.read_bytes() == written


def test_tune_zoo_tunes_again_what_auto_would(tmp_path, capsys, monkeypatch, tiny_zoo):
    """A held record that never timed one of today's candidates (made before a backend joined)
    counts as held, but auto would tune it again in the step: tune_zoo tunes it now."""
    import json

    from benchmarks import tune_zoo
    cache = tmp_path / "tune.json"
    assert tune_zoo.main([str(cache), "--networks", "alexnet", "--precisions", "fp32"]) == 0
    data = json.loads(cache.read_text())
    for entries in data["devices"].values():
        for record in entries.values():
            if isinstance(record, dict) and isinstance(record.get("ms"), dict) and len(record["ms"]) > 1:
                record["ms"] = {record["choice"]: record["ms"][record["choice"]]}   # the others never timed
                record["skipped"] = {}
    cache.write_text(json.dumps(data))
    _a_new_process(monkeypatch)
    capsys.readouterr()
    assert tune_zoo.main([str(cache), "--networks", "alexnet", "--precisions", "fp32"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| alexnet |"))
    held, tuned = (int(v) for v in row.split("|")[3:5])
    assert held == 5 and tuned > 0


def test_tune_zoo_stops_at_its_time_limit_and_says_so(tmp_path, capsys, tiny_zoo):
    from benchmarks import tune_zoo
    assert tune_zoo.main([str(tmp_path / "tune.json"), "--networks", "alexnet", "--precisions", "fp32",
                          "--seconds", "1e-9"]) == 3
    captured = capsys.readouterr()
    assert "| alexnet | fp32 | 0 | 0 | 0 | 5 |" in captured.out
    assert "stopped after" in captured.err and "run it again to go on" in captured.err


@pytest.mark.parametrize("args, message", [
    (["--networks", "lenet"], "unknown network(s) lenet"),
    (["--precisions", "fp16"], "--precisions takes fp32 and tf32"),
    (["--seconds", "0"], "--seconds must be positive, got 0.0"),
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--precisions", "tf32"], "tf32 is a GPU precision"),
    ([], "tf32 is a GPU precision"),                  # the default asks for both
    (["--precisions", "fp32", "--backends", "gemm,nosuch"], "nosuch"),
    (["--precisions", "fp32", "--untuned"], "on the CPU auto times nothing unless MINITORCH_AUTO_TUNE=on"),
])
def test_tune_zoo_refuses_what_it_cannot_do(tmp_path, capsys, monkeypatch, settings, args, message):
    import numpy as np

    from benchmarks import tune_zoo
    monkeypatch.setattr(tune_zoo, "_array_module", lambda: np)
    settings(auto_tune="off" if "--untuned" in args else "on")
    args = [a for a in args if a != "--untuned"]
    with pytest.raises(SystemExit):
        tune_zoo.main([str(tmp_path / "tune.json"), *args])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "tune.json").exists()


@pytest.mark.parametrize("place", ["foreign", "under a file"])
def test_tune_zoo_refuses_a_cache_it_could_not_write_before_tuning(tmp_path, capsys, monkeypatch, tiny_zoo, place):
    """Minutes of tuning into a cache that keeps them in memory only would be lost: refused first."""
    from minitorch_fft import backends
    from benchmarks import tune_zoo
    monkeypatch.setattr(backends, "choose", lambda *a, **k: pytest.fail("tuned before refusing"))
    if place == "foreign":
        cache = tmp_path / "notes.json"
        cache.write_text('{"mine": 1}')
    else:
        (tmp_path / "a_file").write_text("x")
        cache = tmp_path / "a_file" / "sub" / "tune.json"
    with pytest.warns(UserWarning, match="untouched"), pytest.raises(SystemExit):   # the cache's own word
        tune_zoo.main([str(cache), "--networks", "alexnet", "--precisions", "fp32"])
    err = capsys.readouterr().err
    assert "the choices would stay in memory and be lost" in err
    assert ("is not a tuning cache this code wrote" if place == "foreign" else "cannot write in") in err
    if place == "foreign":
        assert cache.read_text() == '{"mine": 1}'


def test_tune_zoo_tunes_a_choice_two_networks_share_once(tmp_path, capsys, monkeypatch, tiny_zoo):
    """The same layers under two network names (as ResNet-18 and ResNet-50 share their stem): each
    choice is asked for and counted once, under the first network, and both are complete after."""
    from minitorch_fft import backends
    from benchmarks import tune_zoo
    asked, real = [], backends.choose
    monkeypatch.setattr(backends, "choose", lambda *a, **k: asked.append(a[:2]) or real(*a, **k))
    assert tune_zoo.main([str(tmp_path / "tune.json"), "--networks", "alexnet,resnet18", "--precisions", "fp32"]) == 0
    out = capsys.readouterr().out
    assert len(asked) == 5
    assert "| alexnet | fp32 | 0 | 5 | 5 | 5 |" in out and "| resnet18 | fp32 | 0 | 0 | 5 | 5 |" in out


def test_paper_step_phases_say_what_started_and_when():
    """A step cut by its time limit names the phase it was in: each line is written as the phase
    starts, with the seconds since the network's first."""
    from benchmarks import paper
    clock = iter([100.0, 100.0, 112.34, 250.0])
    lines = []
    phase = paper.Phases("resnet50", write=lines.append, clock=lambda: next(clock))
    phase("strict: the first step")
    phase("strict: checked")
    phase("done")
    assert lines == ["step resnet50 +0.0 s: strict: the first step", "step resnet50 +12.3 s: strict: checked",
                     "step resnet50 +150.0 s: done"]


def test_bench_pytorch_times_compiled_rows_after_every_eager_one():
    """With --compile, no eager or graph row runs after a compiled one (session 14: the converted
    eager rows after a compiled stock row ran 1.6x slower)."""
    from benchmarks.bench_pytorch import row_rounds
    impls = ["strict", "default", "fp32", "tf32"]
    assert row_rounds(impls, False) == [(name, False) for name in impls]
    order = row_rounds(impls, True)
    assert order == [(name, False) for name in impls] + [(name, True) for name in impls]


def test_tune_zoo_keeps_what_it_made_when_a_choice_fails(tmp_path, capsys, monkeypatch, tiny_zoo):
    """A choice that raises (every backend failed) ends the run with its traceback, the table of what
    was done, and exit 1; the choices made before it are in the file."""
    from minitorch_fft import backends
    from minitorch_fft.backends import tuning
    from benchmarks import tune_coverage, tune_zoo
    real, calls = backends.choose, []

    def choose(*a, **k):
        calls.append(a[:2])
        if len(calls) == 3:
            raise RuntimeError("auto: every backend failed")
        return real(*a, **k)
    monkeypatch.setattr(backends, "choose", choose)
    cache = tmp_path / "tune.json"
    assert tune_zoo.main([str(cache), "--networks", "alexnet", "--precisions", "fp32"]) == 1
    captured = capsys.readouterr()
    assert "| alexnet | fp32 | 0 | 2 | 2 | 5 |" in captured.out
    assert "RuntimeError: auto: every backend failed" in captured.err
    assert "failed at alexnet fp32 conv2 bprop" in captured.err
    assert tune_coverage.coverage(tuning.TuneCache(cache), "cpu", "alexnet", 128)["fp32"][0] == 2


def test_gpu_tables_refuses_a_tune_cache_that_is_not_there(tmp_path):
    """TUNE naming no file stops gpu_tables.sh before any work (no device.txt written, nothing
    tuned afresh in its place), with the path in the message; a bad option too."""
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "TUNE": str(tmp_path / "missing.json")}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_tables.sh"), "alexnet"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert f"TUNE={tmp_path / 'missing.json'} is not a file" in run.stderr
    assert list(tmp_path.iterdir()) == []
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_tables.sh"), "alexnet", "--bogus"],
                         env={**env, "TUNE": ""}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "unknown option --bogus" in run.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("options,failing,status", [
    (["--no-step"], "", 0), ([], "", 0), (["--ours"], "", 0),
    (["--no-step"], "paper table3", 3), ([], "paper step", 3), (["--ours"], "AUTO_BACKENDS=ours", 3),
])
def test_gpu_tables_exits_with_its_steps_status(tmp_path, options, failing, status):
    """gpu_tables.sh exits 0 after clean steps (until session 60 it exited 1 after every run without
    --ours: its summary's last test was for step_ours's log), and with a failing step's status where
    the earlier steps passed; its summary shows the logs of this run's steps alone, not an earlier
    run's left in a reused $OUT. nvidia-smi and python3 are stand-ins: python3 prints a row naming
    what it was asked, and exits 3 where its arguments (or, for the ours step, its environment) hold
    `failing`."""
    bin_dir, scratch, out = tmp_path / "bin", tmp_path / "scratch", tmp_path / "out"
    for d in (bin_dir, scratch, out):
        d.mkdir()
    (out / "step_ours_alexnet.log").write_text("| alexnet | an earlier run's row |\n")
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in'\n")
    (bin_dir / "python3").write_text(
        '#!/bin/sh\nargs="$* AUTO_BACKENDS=${MINITORCH_AUTO_BACKENDS:-all}"\n'
        f'case "$args" in *"{failing or "no such step"}"*) exit 3 ;; esac\n'
        'echo "| alexnet | $3 | $MINITORCH_AUTO_BACKENDS |"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out), "TMPDIR": str(scratch), "TUNE": ""}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_tables.sh"), "alexnet", *options], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == status, run.stdout + run.stderr
    assert f"table3 alexnet: exit {3 if failing == 'paper table3' else 0}" in run.stdout
    assert ("step alexnet: exit" in run.stdout) == ("--no-step" not in options)
    assert ("| alexnet | an earlier run's row |" in run.stdout) is False
    assert (out / "results.tgz").exists() and (scratch / "minitorch_results").is_dir()


def test_exp_step_error_tf32_rows_are_settings_the_config_takes():
    """exp_step_error --tf32's rows: auto as tuned, winograd at F(2x2), and every default candidate
    but winograd; each row's settings are ones config.override accepts (checked before a GPU run)."""
    from minitorch_fft.backends import auto, config
    from benchmarks.experiments import exp_step_error
    rows = exp_step_error.tf32_rows()
    assert list(rows) == ["auto", "auto, winograd F(2x2) only", "auto without winograd"]
    without = rows["auto without winograd"]["auto_backends"]
    assert "winograd" not in without and set(without) | {"winograd"} == set(auto.PREFERENCE)
    for settings in rows.values():
        with config.override(**settings):
            assert all(config.get(k) == v for k, v in settings.items())


def test_exp_winograd_chunks_runs_both_factors_side_by_side_on_the_cpu(tmp_path, monkeypatch):
    """The experiment's NumPy smoke run: a tiny layer whose chunks differ between the factors
    (the floor off), results equal between them, the module's factor restored, files written."""
    from minitorch_fft.backends import winograd
    from benchmarks.experiments import exp_winograd_chunks as exp
    monkeypatch.setitem(exp.LAYERS, "tiny", (2, 3, 10, 3))     # (f, f', h = w, batch)
    monkeypatch.setattr(winograd, "TRANSIENT_FLOOR", 0)
    before = winograd.TRANSIENT_FACTOR
    rows = exp.main(["--cpu", "--layers", "tiny", "--factors", "8,2", "--rounds", "2", "--repeat", "1",
                     "--out", str(tmp_path)])
    assert [(r["pass"], r["bound"]) for r in rows] == [(p, f"factor {k}") for p in ("fprop", "bprop", "accgrad")
                                                       for k in (8, 2)]
    by = {(r["pass"], r["bound"]): r for r in rows}
    assert all(by[(p, "factor 8")]["chunks"] == 1 and by[(p, "factor 2")]["chunks"] == 3
               for p in ("fprop", "bprop", "accgrad"))
    assert all(r["rel_diff"] < 1e-6 and len(r["ms_rounds"]) == 2 for r in rows)
    assert winograd.TRANSIENT_FACTOR == before
    assert sorted(p.name for p in tmp_path.rglob("exp_winograd_chunks.*")) == ["exp_winograd_chunks.json",
                                                                               "exp_winograd_chunks.md"]


def test_exp_winograd_chunks_varies_one_pass_floor_with_floors(tmp_path, monkeypatch):
    """--floors (MiB): TRANSIENT_FLOOR varied while the pass is measured (the factors off, so the
    floor alone bounds the chunks), the module's floor and factors restored; --passes picks the
    passes; its own files."""
    from minitorch_fft.backends import winograd
    from benchmarks.experiments import exp_winograd_chunks as exp
    monkeypatch.setitem(exp.LAYERS, "tiny", (2, 3, 10, 3))
    monkeypatch.setattr(winograd, "TRANSIENT_FACTOR", {p: 0 for p in ("fprop", "bprop", "accgrad")})
    floor = winograd.TRANSIENT_FLOOR
    seen, own = [], winograd._chunks
    monkeypatch.setattr(winograd, "_chunks", lambda *a, **k: seen.append(winograd.TRANSIENT_FLOOR) or own(*a, **k))
    rows = exp.main(["--cpu", "--layers", "tiny", "--floors", "1,0.00001", "--passes", "bprop", "--rounds", "1",
                     "--repeat", "1", "--out", str(tmp_path)])
    assert [(r["pass"], r["bound"], r["chunks"]) for r in rows] == [("bprop", "floor 1 MiB", 1),
                                                                    ("bprop", "floor 1e-05 MiB", 3)]
    assert set(seen) == {1 << 20, int(0.00001 * 2**20)}
    assert winograd.TRANSIENT_FLOOR == floor and winograd.TRANSIENT_FACTOR == {p: 0 for p in ("fprop", "bprop",
                                                                                               "accgrad")}
    assert sorted(p.name for p in tmp_path.rglob("exp_winograd_chunks*.*")) == ["exp_winograd_chunks_floors.json",
                                                                                "exp_winograd_chunks_floors.md"]


def test_exp_winograd_chunks_varies_min_chunk_flop(tmp_path, monkeypatch, settings):
    """--min-chunk-gflop: winograd.MIN_CHUNK_FLOP varied while the pass is measured. The tiny layer at
    F(2x2) (25 tiles, 8000 bytes of tiles an image) under a floor of three images' tiles: its 384
    byte weight transform counted (0 GFLOP), the floor holds two images (chunks of 2 and 1); not
    counted (more work than any chunk has), one chunk. The module's bounds restored; its own files."""
    from minitorch_fft.backends import winograd
    from benchmarks.experiments import exp_winograd_chunks as exp
    settings(winograd_f4=False)
    monkeypatch.setitem(exp.LAYERS, "tiny", (2, 3, 10, 3))
    monkeypatch.setattr(winograd, "TRANSIENT_FACTOR", {p: 0 for p in ("fprop", "bprop", "accgrad")})
    monkeypatch.setattr(winograd, "TRANSIENT_FLOOR", 3 * 4 * 16 * 25 * (2 + 3))
    work = winograd.MIN_CHUNK_FLOP
    rows = exp.main(["--cpu", "--layers", "tiny", "--min-chunk-gflop", "1e6,0", "--passes", "fprop,bprop",
                     "--rounds", "1", "--repeat", "1", "--out", str(tmp_path)])
    assert [(r["pass"], r["bound"], r["chunks"], r["chunk_images"]) for r in rows] == [
        (p, f"min {v} GFLOP", n, i) for p in ("fprop", "bprop") for v, n, i in (("1e+06", 1, 3), ("0", 2, 2))]
    assert all(r["rel_diff"] < 1e-6 for r in rows)
    assert winograd.MIN_CHUNK_FLOP == work and winograd.TRANSIENT_FLOOR == 3 * 4 * 16 * 25 * 5
    assert sorted(p.name for p in tmp_path.rglob("exp_winograd_chunks*.*")) == ["exp_winograd_chunks_min_flop.json",
                                                                                "exp_winograd_chunks_min_flop.md"]


def test_exp_winograd_chunks_varies_accgrads_row_parts(tmp_path, monkeypatch, settings):
    """--row-factors: winograd.ROW_FACTOR varied while accGrad is measured. The tiny layer at F(2x2),
    its floor and MIN_CHUNK_FLOP at zero: inf makes no parts, a tiny factor a row each (4); both match, each row names
    its parts. The module's bound restored; its own files."""
    from minitorch_fft.backends import winograd
    from benchmarks.experiments import exp_winograd_chunks as exp
    settings(winograd_f4=False)
    monkeypatch.setitem(exp.LAYERS, "tiny", (2, 3, 10, 3))
    monkeypatch.setattr(winograd, "TRANSIENT_FLOOR", 0)
    monkeypatch.setattr(winograd, "MIN_CHUNK_FLOP", 0)
    factor = winograd.ROW_FACTOR
    rows = exp.main(["--cpu", "--layers", "tiny", "--row-factors", "inf,1e-9", "--passes", "accgrad",
                     "--rounds", "1", "--repeat", "1", "--out", str(tmp_path)])
    assert [(r["pass"], r["bound"], r["row_parts"]) for r in rows] == [("accgrad", "rows infx", 1),
                                                                       ("accgrad", "rows 1e-09x", 4)]
    assert all(r["rel_diff"] < 1e-6 for r in rows)
    assert winograd.ROW_FACTOR == factor
    assert sorted(p.name for p in tmp_path.rglob("exp_winograd_chunks*.*")) == ["exp_winograd_chunks_rows.json",
                                                                                "exp_winograd_chunks_rows.md"]
    import json
    meta = json.loads(next(tmp_path.rglob("exp_winograd_chunks_rows.json")).read_text(),
                      parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))["meta"]
    assert meta["row_factors"] == ["inf", 1e-9]


def test_exp_winograd_chunks_refuses_bad_arguments(capsys):
    from benchmarks.experiments import exp_winograd_chunks as exp
    for argv, says in ((["--layers", "nope"], "unknown layer"), (["--factors", "2,x"], "whole numbers"),
                       (["--factors", "0"], "positive"), (["--factors", "2,2"], "distinct"),
                       (["--floors", "192,x"], "numbers of MiB"), (["--floors", "0"], "at least one byte"),
                       (["--floors", "nan"], "finite"), (["--floors", "inf"], "finite"),
                       (["--floors", "1e-9"], "at least one byte"), (["--floors", "192,192.0000001"], "distinct"),
                       (["--factors", "2,1", "--floors", "192"], "one of"),
                       (["--floors", "192", "--min-chunk-gflop", "0,38"], "one of"),
                       (["--min-chunk-gflop", "0,x"], "numbers of GFLOP"), (["--min-chunk-gflop", "-1"], "at least 0"),
                       (["--min-chunk-gflop", "inf"], "finite"), (["--min-chunk-gflop", "38,38.0"], "distinct"),
                       (["--row-factors", "inf,x"], "numbers (inf"), (["--row-factors", "0"], "above 0"),
                       (["--row-factors", "nan"], "above 0"), (["--row-factors", "1,1.0"], "distinct"),
                       (["--row-factors", "inf,1", "--floors", "192"], "one of"),
                       (["--passes", "bprop,nope"], "comma-separated list"), (["--passes", "bprop,bprop"], "distinct"),
                       (["--rounds", "0"], "at least 1"), (["--batch", "0"], "at least 1")):
        with pytest.raises(SystemExit):
            exp.main(["--cpu"] + argv)
        assert says in capsys.readouterr().err


def test_exp_compile_gap_finds_where_the_gpu_waits_for_the_host():
    """Two steps (us): in the first the GPU waits 10 us at the start (under `fwd`) and 20 between
    its kernels (under `conv < fwd`), a 3 us gap is under the threshold; overlapping kernels count
    once as busy; the second step starts its kernel at once."""
    from benchmarks.experiments import exp_compile_gap as exp
    marks = [(0, 100), (200, 260)]
    device = [(10, 40), (30, 50), (53, 60), (80, 90), (200, 230)]
    ops = [(0, 95, "fwd"), (70, 85, "conv"), (201, 205, "relu")]
    idle, busy, span, where = exp.idle_gaps(marks, device, ops, top=5)
    assert where == [("conv < fwd", 0.020 / 2, 0.5), ("fwd", 0.010 / 2, 0.5)]
    assert abs(idle - 0.030 / 2) < 1e-12              # 10 + 20 us over two steps; 3 us is under min_us
    assert abs(busy - (30 + 10 + 7 + 10 + 30) / 2e3) < 1e-12
    assert abs(span - (90 + 30) / 2e3) < 1e-12


def test_exp_compile_gap_refuses_convert_channels_last_with_channels_last(monkeypatch, capsys):
    from benchmarks.experiments import exp_compile_gap as exp
    monkeypatch.setattr(sys, "argv", ["exp_compile_gap", "--channels-last", "--convert-channels-last"])
    with pytest.raises(SystemExit) as e:
        exp.main()
    assert e.value.code == 2 and "--convert-channels-last converts an NCHW model" in capsys.readouterr().err


def test_exp_compile_gap_counts_kernels_not_annotations_as_gpu_work():
    """A device event marked as a user annotation (the optimizer's range spanning its kernels) is
    not GPU work; a kernel, or an event of a profiler without the flag, is."""
    from types import SimpleNamespace

    from benchmarks.experiments import exp_compile_gap as exp
    assert not exp.gpu_work(SimpleNamespace(name="Optimizer.step#SGD.step", is_user_annotation=True))
    assert exp.gpu_work(SimpleNamespace(name="void fbfft_rfft2<16>", is_user_annotation=False))
    assert exp.gpu_work(SimpleNamespace(name="Memcpy HtoD"))


def test_exp_compile_gap_times_a_function_and_puts_it_back():
    """Timed counts the calls and host time of module.name inside its block, what the function
    returns and raises unchanged, and restores the function after it, also after an error."""
    import time
    from types import SimpleNamespace

    from benchmarks.experiments import exp_compile_gap as exp

    def work(t, fail=False):
        time.sleep(t)
        if fail:
            raise KeyError("inside")
        return t
    module = SimpleNamespace(work=work)
    with exp.Timed(module, "work") as timed:
        assert module.work(0.02) == 0.02 and module.work is not work
        with pytest.raises(KeyError):
            module.work(0.01, fail=True)
    assert module.work is work
    assert timed.calls == 2 and 0.03 <= timed.seconds < 1.0
    with pytest.raises(ValueError), exp.Timed(module, "work"):
        raise ValueError("the block")
    assert module.work is work
    with exp.Timed(module, "work", label=lambda t, **kw: t > 0.005) as labelled:
        module.work(0.01)
        module.work(0.0)
        module.work(0.0)
    assert labelled.seen == {True: 1, False: 2}


def test_exp_compile_gap_replays_an_allocator_trace_to_its_peak_and_its_end():
    """A synthetic trace: a is made and kept, b and c are alive together at the peak, then freed;
    the peak groups what was alive then by where() (the innermost frame outside the libraries),
    the end groups what the trace left alive."""
    from benchmarks.experiments import exp_compile_gap as exp
    ours = [{"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "__call__"},
            {"filename": "/x/minitorch_fft/backends/tiledfft.py", "line": 214, "name": "_correlate"}]
    step = [{"filename": "/x/benchmarks/bench.py", "line": 9, "name": "step"}]
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": step},
             {"action": "alloc", "addr": 2, "size": 50, "frames": ours},
             {"action": "alloc", "addr": 3, "size": 30, "frames": ours},
             {"action": "free_requested", "addr": 2, "size": 50},
             {"action": "free_completed", "addr": 2, "size": 50},
             {"action": "free_requested", "addr": 3, "size": 30},
             {"action": "alloc", "addr": 4, "size": 10, "frames": []}]
    peak, groups = exp.alive_at_peak(trace)
    assert peak == 180 and groups == {"bench.py:9 step": 100, "tiledfft.py:214 _correlate": 80}
    assert exp.alive_at_end(trace) == {"bench.py:9 step": 100, "(torch or CuPy only)": 10}
    assert exp.alive_at_end(trace, key=exp.where_and_inner) == {
        "bench.py:9 step <- benchmarks/bench.py:9": 100, "(torch or CuPy only) <- -": 10}


def test_exp_compile_gap_names_the_generated_call_an_allocation_of_ours_came_under(tmp_path):
    """where_and_call: an allocation made inside our operator, called from inductor's generated code,
    is named by where() and by that call's line of the code (which layer's pass); one made by the
    generated code itself, or outside any, by where() alone."""
    from benchmarks.experiments import exp_compile_gap as exp
    code = tmp_path / "torchinductor_root" / "ab" / "cabcdef.py"
    code.parent.mkdir(parents=True)
    code.write_text("def call(args):\n    buf16 = torch.ops.minitorch_fft.conv2d_grads.default(buf15, relu_3)\n")
    generated = {"filename": str(code), "line": 2, "name": "call"}
    ours = [{"filename": "/x/minitorch_fft/pytorch.py", "line": 442, "name": "malloc"},
            {"filename": "/x/cupy/_creation/basic.py", "line": 34, "name": "empty"}, generated]
    assert exp.where_and_call(ours) == \
        "pytorch.py:442 malloc <- buf16 = torch.ops.minitorch_fft.conv2d_grads.default(buf15, relu_3)"
    assert exp.where_and_call([generated]) == "inductor cabcdef.py:2 call"
    assert exp.where_and_call([{"filename": "/x/benchmarks/bench.py", "line": 9, "name": "step"}]) == "bench.py:9 step"


def test_exp_compile_gap_steps_under_cuda_graph_trees_as_bench_pytorch_does(monkeypatch):
    """--compile-mode reduce-overhead: each step begins a step of the cudagraph trees and sets the
    gradients to None (new gradient tensors every step, where the default mode zeroes them in place);
    the rows' listing then comes from the trees' recording step, so --left is refused with it."""
    import torch

    from benchmarks.experiments import exp_compile_gap as exp
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    for graphs in (False, True):
        model = torch.nn.Linear(3, 2)
        opt, step = exp.training_step(model, model, x, y, converted=False, graphs=graphs)
        step()
        first = model.weight.grad
        step()
        assert (model.weight.grad is not first) == graphs
        assert len(marks) == 2 * graphs
    monkeypatch.setattr(sys, "argv", ["exp_compile_gap", "--compile-mode", "reduce-overhead", "--left"])
    with pytest.raises(SystemExit) as stop:
        exp.main()
    assert stop.value.code == 2


def test_exp_step_profile_turns_py_spys_samples_into_host_ms_a_step(tmp_path):
    """A synthetic py-spy record (raw, gzipped, thread names as --threads writes them; its counts add
    up to py-spy's "Samples", one trace per active thread an instant): a trace is wall / traces /
    steps of a step; the wait in torch.cuda.synchronize is counted apart, the main thread outside the
    profiled loop not at all, another thread's trace with no Python frame as PyTorch's C++ work;
    leaves go to their library (ours by folder, a C frame located in its source, a native library),
    our functions inclusive and by self time, and a native leaf is named with its Python caller."""
    import gzip

    from benchmarks.experiments import exp_step_profile as exp
    loop = "<module> (x.py:1);_profiled_steps (benchmarks/experiments/exp_step_profile.py:150)"
    raw = [f"thread (0x1): MainThread;{loop};_crossing (minitorch_fft/pytorch.py:270);_gemm (minitorch_fft/backends/cgemm.py:170);"
           "cublasGemmEx (libcublas.so.13) 30",
           f"thread (0x1): MainThread;{loop};relu (torch/nn/functional.py:1721) 20",
           f"thread (0x1): MainThread;{loop};synchronize (torch/cuda/__init__.py:1083) 10",
           "thread (0x1): MainThread;<module> (x.py:1);make_steps (benchmarks/experiments/exp_step_ab.py:50) 10",
           "thread (0x2);_grads (minitorch_fft/pytorch.py:349);__Pyx_PyObject_GetAttrStr (core.cpp:100) 20",
           "thread (0x2) 10"]
    path = tmp_path / "p.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(raw) + "\n")
    meta = {"title": "t", "samples": 100, "errors": 25, "wall_s": 1.0, "steps": 10, "step_ms": 1.0, "issue_ms": 1.0}
    out = tmp_path / "p.md"
    with open(out, "w") as f:
        exp.summarize(str(path), meta, out=f)
    text = out.read_text()
    for row in ("| MainThread | 50.000 | 10.000 |", "| (unnamed) | 30.000 | 0.000 |", "| all | 80.000 | 10.000 |",
                "| native:libcublas | 30.000 | 30.000 | 0.000 |", "| py:torch | 20.000 | 0.000 | 20.000 |",
                "| native-source:core.cpp | 20.000 | 20.000 | 0.000 |", "| (no Python frame) | 10.000 | 0.000 | 10.000 |",
                "| all | 80.000 | 50.000 | 30.000 |", "| _crossing (minitorch_fft/pytorch.py) | 30.000 | 37.50 |",
                "| _gemm (minitorch_fft/backends/cgemm.py) | 30.000 | 37.50 |", "| _grads (minitorch_fft/pytorch.py) | 20.000 | 25.00 |",
                "| all | 50.000 | 62.50 |",
                "| cublasGemmEx (libcublas.so.13) <- _gemm (minitorch_fft/backends/cgemm.py:170) | 30.000 | 37.50 |"):
        assert row in text, (row, text)
    assert "make_steps" not in text and "25 instants not read" in text
    assert text.count("| _crossing (minitorch_fft/pytorch.py) |") == 1     # not deepest anywhere: no self row
    with open(out, "w") as f:
        exp.summarize(str(path), meta, out=f, also=("torch/",))
    assert "| relu (torch/nn/functional.py) | 20.000 | 25.00 |" in out.read_text()


def test_bench_pytorch_writes_tf32_and_strict_runs_apart():
    """A TF32-only run (--impls default,tf32) and a strict or full one name their files apart, so one
    never replaces the other's (both were bench_pytorch_vgg16_channels_last before session 44)."""
    import argparse
    from benchmarks.bench_pytorch import result_name
    base = dict(quick=False, no_reuse=False, input_reuse=False, channels_last=True, pass_graphs=False,
                compile_mode="default", convert_channels_last=False)
    names = {impls: result_name("vgg16", argparse.Namespace(impls=list(impls), **base))
             for impls in (("strict", "fp32"), ("default", "tf32"), ("strict", "default", "fp32", "tf32"))}
    assert names[("default", "tf32")] == "bench_pytorch_vgg16_tf32_channels_last"
    assert names[("strict", "fp32")] == names[("strict", "default", "fp32", "tf32")] == "bench_pytorch_vgg16_channels_last"
    assert result_name("alexnet", argparse.Namespace(impls=["default", "tf32"], **dict(base, channels_last=False))) \
        == "bench_pytorch_alexnet_tf32"
    bounded = dict(base, channels_last=False, pass_graphs=True, pass_graph_mb=128.0)
    assert result_name("alexnet", argparse.Namespace(impls=["strict", "fp32"], **bounded)) \
        == "bench_pytorch_alexnet_pass_graphs_128mb"
    graphed = dict(base, channels_last=False, compile_mode="reduce-overhead")
    assert result_name("alexnet", argparse.Namespace(impls=["strict", "fp32"], **graphed)) \
        == "bench_pytorch_alexnet_reduce_overhead"
    inside = dict(graphed, convert_channels_last=True)
    assert result_name("vgg16", argparse.Namespace(impls=["default", "tf32"], **inside)) \
        == "bench_pytorch_vgg16_tf32_convert_channels_last_reduce_overhead"


@pytest.mark.parametrize("argv", [["--pass-graph-mb", "64"], ["--pass-graphs", "--pass-graph-mb", "0"],
                                  ["--pass-graphs", "--pass-graph-mb", "inf"]])
def test_bench_pytorch_refuses_a_pass_graph_bound_it_cannot_use(monkeypatch, capsys, argv):
    """--pass-graph-mb without --pass-graphs, or not a size in MiB > 0: refused by name before any work."""
    from benchmarks import bench_pytorch
    monkeypatch.setattr(sys, "argv", ["bench_pytorch", *argv])
    with pytest.raises(SystemExit) as e:
        bench_pytorch.main()
    assert e.value.code == 2 and "--pass-graph-mb takes MiB > 0 with --pass-graphs" in capsys.readouterr().err


def test_bench_pytorch_refuses_a_compile_mode_without_compile(monkeypatch, capsys):
    from benchmarks import bench_pytorch
    monkeypatch.setattr(sys, "argv", ["bench_pytorch", "--compile-mode", "reduce-overhead"])
    with pytest.raises(SystemExit) as e:
        bench_pytorch.main()
    assert e.value.code == 2 and "--compile-mode reduce-overhead needs --compile" in capsys.readouterr().err


def test_bench_pytorch_refuses_convert_channels_last_with_channels_last(monkeypatch, capsys):
    from benchmarks import bench_pytorch
    monkeypatch.setattr(sys, "argv", ["bench_pytorch", "--channels-last", "--convert-channels-last"])
    with pytest.raises(SystemExit) as e:
        bench_pytorch.main()
    assert e.value.code == 2 and "--convert-channels-last converts an NCHW model" in capsys.readouterr().err


def _pytorch_result(path, net, precision, modes, commit, ratios):
    """A bench_pytorch result file: a stock and a converted row per mode; ratios {mode: (speed-up, peak ratio)}."""
    rows = []
    for mode in modes:
        speedup, peak = ratios[mode]
        base = {"network": net, "precision": precision, "mode": mode}
        rows += [{**base, "converted": False, "vs_stock": 1.0, "peak_mib": 1000.0},
                 {**base, "converted": True, "vs_stock": speedup, "peak_mib": 1000.0 * peak}]
    meta = {"device": "Test GPU", "date": "2026-11-30T00:00:00+00:00", "commit": commit,
            "command": f"python -m benchmarks.bench_pytorch --nets {net}"}
    path.write_text(json.dumps({"meta": meta, "rows": rows}))


def test_plot_pytorch_draws_the_files_of_record_and_lists_them(tmp_path):
    """plot_pytorch reads bench_pytorch_<net>[_tf32][_reduce_overhead].json and the convert-channels-last
    variants alone (a channels-last model's file is not read), one bar per converted row with its stock row,
    each figure the file's; the Markdown names each bar's file and commit, the stock modes' bars no file
    holds (not the channels_last=True ones), and each file's date and command."""
    from benchmarks import plot_pytorch
    _pytorch_result(tmp_path / "bench_pytorch_alexnet.json", "alexnet", "strict", ["eager", "CUDA graph"], "aaa1111",
                    {"eager": (1.41, 0.93), "CUDA graph": (1.45, 0.97)})
    _pytorch_result(tmp_path / "bench_pytorch_vgg16_tf32_reduce_overhead.json", "vgg16", "tf32",
                    ["eager", "torch.compile reduce-overhead"], "bbb2222",
                    {"eager": (9.0, 9.0), "torch.compile reduce-overhead": (0.89, 1.09)})
    _pytorch_result(tmp_path / "bench_pytorch_vgg16_tf32_channels_last.json", "vgg16", "tf32", ["eager"], "ccc3333",
                    {"eager": (7.0, 7.0)})
    _pytorch_result(tmp_path / "bench_pytorch_resnet50_tf32_convert_channels_last_reduce_overhead.json", "resnet50",
                    "tf32", ["eager", "torch.compile reduce-overhead"], "ddd4444",
                    {"eager": (1.02, 1.01), "torch.compile reduce-overhead": (1.03, 0.99)})
    _pytorch_result(tmp_path / "bench_pytorch_vgg16_tf32_convert_channels_last.json", "vgg16", "tf32",
                    ["eager", "CUDA graph", "torch.compile"], "eee5555",
                    {"eager": (1.38, 1.005), "CUDA graph": (1.21, 0.98), "torch.compile": (0.97, 0.97)})
    assert plot_pytorch.main([str(tmp_path)]) == 0
    assert (tmp_path / "bench_pytorch_summary.png").stat().st_size > 0
    md = (tmp_path / "bench_pytorch_summary.md").read_text()
    assert "| alexnet | strict | eager | 1.41x | 930 / 1000 | bench_pytorch_alexnet.json | aaa1111 |" in md
    assert "| alexnet | strict | CUDA graph | 1.45x | 970 / 1000 |" in md
    assert ("| vgg16 | tf32 | torch.compile reduce-overhead | 0.89x | 1090 / 1000 | "
            "bench_pytorch_vgg16_tf32_reduce_overhead.json | bbb2222 |") in md
    assert "9.00x" not in md and "7.00x" not in md and "ccc3333" not in md   # the eager rows of other files
    assert "vgg16 tf32 eager" in md.split("No bar")[1] and "alexnet strict eager;" not in md
    assert "| bench_pytorch_alexnet.json | 2026-11-30T00:00:00+00:00 | aaa1111 | `python -m benchmarks" in md
    assert ("| resnet50 | tf32 | reduce-overhead, channels_last=True | 1.03x | 990 / 1000 | "
            "bench_pytorch_resnet50_tf32_convert_channels_last_reduce_overhead.json | ddd4444 |") in md
    assert "1.02x" not in md     # an eager row of a reduce-overhead file: eager bars come from the plain files
    for mode, figure in (("eager", "1.38x | 1005 / 1000"), ("CUDA graph", "1.21x | 980 / 1000"),
                         ("torch.compile", "0.97x | 970 / 1000")):
        assert (f"| vgg16 | tf32 | {mode}, channels_last=True | {figure} | "
                "bench_pytorch_vgg16_tf32_convert_channels_last.json | eee5555 |") in md
    assert "channels_last=True" not in md.split("No bar")[1].split("\n\n")[0]
    assert "resnet50 tf32 eager;" in md                      # the NCHW file's bar, still missing


def test_plot_pytorch_refuses_a_folder_without_results(tmp_path, capsys):
    from benchmarks import plot_pytorch
    with pytest.raises(SystemExit) as e:
        plot_pytorch.main([str(tmp_path / "nowhere")])
    assert e.value.code == 2 and "is not a folder of results" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot_pytorch.main([str(tmp_path)])
    assert "no bench_pytorch_" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []                                    # nothing written


@pytest.mark.parametrize("content, why", [
    ('{"meta": {}, "rows": [', "not a readable JSON file"),
    ("[]", "not a bench_pytorch result"),
    ('{"meta": {}}', "not a bench_pytorch result"),
    ('{"meta": {}, "rows": [{"network": "alexnet", "precision": "strict", "mode": "eager", "converted": false, '
     '"vs_stock": 1.0, "peak_mib": 0}]}', "a positive vs_stock and peak_mib"),
    ('{"meta": {}, "rows": [{"network": "alexnet", "precision": "strict", "mode": "eager", "converted": true, '
     '"vs_stock": null, "peak_mib": 5}]}', "a positive vs_stock and peak_mib"),
])
def test_plot_pytorch_names_a_file_that_is_not_a_result(tmp_path, capsys, content, why):
    from benchmarks import plot_pytorch
    (tmp_path / "bench_pytorch_alexnet.json").write_text(content)
    with pytest.raises(SystemExit) as e:
        plot_pytorch.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "bench_pytorch_alexnet.json" in err and why in err and "Traceback" not in err


def test_plot_pytorch_never_replaces_a_summary_it_did_not_make(tmp_path, capsys):
    """A bench_pytorch_summary.md or .png of the user's is left as it is (an error says so); its own are
    replaced on the next run."""
    from benchmarks import plot_pytorch
    _pytorch_result(tmp_path / "bench_pytorch_alexnet.json", "alexnet", "strict", ["eager"], "aaa1111",
                    {"eager": (1.41, 0.93)})
    mine = tmp_path / "bench_pytorch_summary.md"
    mine.write_text("my notes")
    with pytest.raises(SystemExit):
        plot_pytorch.main([str(tmp_path)])
    assert "was not made by plot_pytorch" in capsys.readouterr().err and mine.read_text() == "my notes"
    assert not (tmp_path / "bench_pytorch_summary.png").exists()
    mine.unlink()
    (tmp_path / "bench_pytorch_summary.png").write_bytes(b"my picture")
    with pytest.raises(SystemExit):
        plot_pytorch.main([str(tmp_path)])
    assert (tmp_path / "bench_pytorch_summary.png").read_bytes() == b"my picture"
    (tmp_path / "bench_pytorch_summary.png").unlink()
    assert plot_pytorch.main([str(tmp_path)]) == 0 and plot_pytorch.main([str(tmp_path)]) == 0   # its own, replaced


def test_exp_bench_probe_splits_the_converted_rows_and_restores_what_it_patched(monkeypatch):
    """exp_bench_probe runs bench_pytorch's main with its row functions wrapped: each converted row,
    eager and compiled, gets an issue split right after its timed_row, no stock row and no graph
    row's replay does, and what it patched (and sys.argv) is put back. bench_pytorch's rows are
    stood in for, in its order (row_rounds: the stock rows first, the compiled ones last)."""
    import torch

    from benchmarks import bench_pytorch as bp
    from benchmarks.experiments import exp_bench_probe, exp_compile_gap
    from minitorch_fft import pytorch as pt
    split = []
    monkeypatch.setattr(exp_compile_gap, "issue_split",
                        lambda step, n: split.append(step()) or ((1.0, 0.5, 0.4, 3, 0), {}, [], [], [("fprop", 0.5)]))

    def timed_row(step, args, *rest, **kwargs):   # (ms, back to back, issue, peak, requested, pool)
        return 1.0, 1.0, 0.02 if step()[1] == "graph" else 1.0, 0.0, 0.0, 0.0

    def compiled_row(model, opt, scope, x, y, args, net, label, log, leftover):
        return bp.timed_row(lambda: (label, "compiled"), args)

    def run_network(net, args, log, on_rows=None):
        for label, converted, compiled in (("stock", False, False), ("conv", True, False), ("stock", False, True),
                                           ("conv", True, True)):
            model = torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1))
            if converted:
                pt.convert(model)
            if compiled:
                bp._compiled_row(model, None, None, None, None, args, net, label, log, None)
            else:
                bp.timed_row(lambda label=label: (label, "eager"), args)
                bp.timed_row(lambda label=label: (label, "graph"), args)
        return [], []
    monkeypatch.setattr(bp, "timed_row", timed_row)
    monkeypatch.setattr(bp, "_compiled_row", compiled_row)
    monkeypatch.setattr(bp, "run_network", run_network)
    monkeypatch.setattr(bp, "main", lambda: bp.run_network("alexnet", sys.argv, print))
    import gc
    argv, convert, callbacks = sys.argv, pt.convert, list(gc.callbacks)
    exp_bench_probe.main(["--gc", "--split", "2", "--", "--nets", "alexnet"])
    assert split == [("conv", "eager"), ("conv", "compiled")]
    assert gc.callbacks == callbacks
    assert (bp.timed_row, bp._compiled_row, bp.run_network, pt.convert, sys.argv) == (
        timed_row, compiled_row, run_network, convert, argv)
