"""PyTorch training steps, stock against converted (minitorch_fft.pytorch.convert), on the GPU.

  python -m benchmarks.bench_pytorch                       # AlexNet, VGG-16 b64, ResNet-50, OverFeat-fast b128
  python -m benchmarks.bench_pytorch --quick               # smoke: batch 8, 1 warm-up, 3 repeats (*_quick files)
  python -m benchmarks.bench_pytorch --nets resnet50       # one network (one result file per network)
  python -m benchmarks.bench_pytorch --nets alexnet --batch 32 --compile
  MINITORCH_TUNE_CACHE=/path/autotune.json python -m benchmarks.bench_pytorch   # a kept tuning cache

One step is torchvision's model at 224x224 (OverFeat-fast: benchmarks.harness.torch_model's, at
231x231), 1000 classes: forward, cross-entropy, backward, SGD
with momentum. Rows per network:
  PyTorch fp32 strict   cuDNN and cuBLAS with TF32 off (benchmark mode, every algorithm tried)
  PyTorch default       cuDNN on TF32, as PyTorch ships (its matmul default stays fp32)
  converted fp32        every conv on the project's backends under `auto`, strict fp32; the rest of
                        the model as PyTorch strict
  converted TF32        the same with the FFT backends' complex GEMM on TF32
                        (backends.config override tf32=True); the rest as PyTorch's default
each eager and captured as one CUDA graph (torch.cuda.graph, replayed on the same static batch),
and with --compile also under torch.compile (inductor; those rows after every eager and graph row,
each compiled in a fresh Dynamo state, inductor's compile workers shut before each is timed:
row_rounds, _compiled_row; --compile-mode reduce-overhead: inductor's CUDA graphs, files
*_reduce_overhead). The converted rows share spectra across a
layer's passes (minitorch_fft.pytorch.reuse_spectra() around forward and backward, its default:
no spectrum held from forward to backward, accGrad's gradOutput spectrum serving bprop); --no-reuse
leaves that out (result files *_no_reuse); --input-reuse also keeps each layer's input spectrum
from forward for accGrad (reuse_spectra(inputs=True): faster, and on AlexNet b128 310 MiB more at
the step's peak, above stock's; benchmarks/NOTES.md sessions 11-13; result files *_input_reuse).
--pass-graphs turns the pass_graphs setting on for the converted rows (minitorch_fft.pytorch: a layer's
passes replayed as one CUDA graph; result files *_pass_graphs): their warm-up runs on until a step
captures nothing more (at most SETTLE steps past --warmup). The graphs' temporaries are held
throughout: their arena is a tensor, in the row's peaks already; what of the pool is allocated at no
moment between replays (temporaries that did not fit the arena) is added to them. The row's pass
graphs' MiB are the two together. The CUDA-graph rows run with the setting off: a
whole-step capture records the passes as they run, and the pass graphs' warm-up path would only add
its copies to the row's peak. --pass-graph-mb N captures only the layers whose passes take at most N MiB
of temporaries (the pass_graph_mb setting; files *_pass_graphs_Nmb): a smaller arena, more host time.
Both flags decide for the converted rows: MINITORCH_PASS_GRAPHS and MINITORCH_PASS_GRAPH_MB in the
environment are overridden there (the header's settings list what the environment had).

Each row gives two times a step: the median of single steps, each waited for (CUDA events, a
wait after every step: the step's latency from an idle GPU, which the targets judge), and "back to
back", the median over bursts of BURST steps queued without a wait, per step (what a training loop
that does not read its loss every step runs at: the host queues the next step while the GPU works,
which hides a host-heavy step's issue time), and the host's time to issue one step on a drained GPU
("issue ms": where it nears the step's, the row is host-bound). Converted AlexNet on an H200,
session 30: 1.14x strict single, 1.10x back to back here, 1.54x in exp_pytorch_host's process,
which issued the same step in 6.4 ms of host where others took ~10 (benchmarks/NOTES.md).

Before timing, each row's loss and conv weight gradients (dropout off, BatchNorm on the batch's
statistics) are checked against the stock model in float64 on the same weights and batch;
the largest relative error is reported beside the time. Peak memory is
torch.cuda.max_memory_allocated() over the row's timed steps (the converted rows' CuPy work
allocates through PyTorch's caching allocator, so it is counted), less what earlier rows left
allocated when the row began (130 MiB on AlexNet after the stock rows' CUDA graph, session 13);
that leftover is logged and kept in the row ("leftover_mib"). Should a row free part of it (a
compiled row's Dynamo reset did, session 54), the part freed is added back to its peak
(charge_freed_leftover). That peak, the one judged, counts the
allocator's blocks: each request rounded up to 512 bytes, and a large free block taken whole where
what would be left of it is 1 MiB or less. Which blocks a step's requests meet depends on what ran
before, so two rows that ask for the same bytes can differ by MiBs (session 34, eager TF32 rows:
VGG-16 by 0.75 MiB, ResNet-50 by 4.25).
Beside it, not judged, each row gives the peak of the bytes asked for (the allocator's
requested_bytes), less the leftover in the same terms. `auto` tunes at a layer's first
step (cold tuning cache: minutes for all three networks; the cache is backends.config tune_cache).
Batch per network as benchmarks/paper.py runs them (BATCH; --batch sets one for all). Before each
network the log gives a wall-clock estimate from this device's last result file for it (its rows'
seconds, scaled by the batch), and after its first row one from that row; a cold tuning cache
adds auto's tuning to the converted rows' first step. Targets (TARGETS: converted fp32 against
strict, converted TF32 against PyTorch's default, peak memory against stock, same mode) are checked
per network: each missed one is a SHORTFALL line in the log and in the result's notes.
Results go to results/<device>/bench_pytorch_<network>.{json,md}, each written when its network is
done, with device, date, command, commit and the tuning cache used. While a network runs, the rows it
has finished are in bench_pytorch_<network>.partial.{json,md} (after each implementation's rows, so a
run cut by a time limit keeps them: session 39 lost VGG-16's eager rows to one); the finished file
removes them, as does the next run when it starts the network. The metadata says whether auto had the
cudnn backend (its frontend installed) among its candidates.
"""
import argparse
import contextlib
import copy
import functools
import sys
import time
from pathlib import Path

from benchmarks.harness import (RESULTS_DIR, TOLERANCE, host_probe_ms, median_ms, provenance, rel_error, set_tf32,
                                setup_cudnn, slug, torch_model, write_results)

NETS = ("alexnet", "vgg16", "resnet50", "overfeat_fast")
BATCH = {"alexnet": 128, "vgg16": 64, "resnet50": 128, "overfeat_fast": 128}   # as benchmarks/paper.py runs them
IMAGE = {"overfeat_fast": 231}   # the input side where it is not 224 (OverFeat-fast's classifier takes 6x6)
# The issue's targets: (converted row's precision, stock row's precision, least speed-up or None
# for the networks it does not name); peak memory at most the stock row's everywhere.
TARGETS = {"alexnet": {"strict": 1.3, "tf32": 1.0}, "vgg16": {"strict": 1.0}, "resnet50": {"strict": 1.0},
           "overfeat_fast": {"strict": 1.0, "tf32": 1.0}}
# A converted row's error against float64 must be within TOLERANCE[precision] or STEP_FACTOR times
# the stock model's in the same precision and run, whichever is larger: at initialisation a deep
# net's weight gradients are ill-conditioned (a ReLU sign or a max-pooling argmax at a near-tie
# flips in fp32, and BatchNorm's backward cancels), so PyTorch's own fp32 strict is 1e-3 to 2e-2
# off on VGG-16 and ResNet-50 (benchmarks/paper.py's STEP_FACTOR, for the same reason).
STEP_FACTOR = 2
IMPLS = {  # --impls name: (label, converted, precision "strict" | "tf32"); each converted row after its stock one
    "strict": ("PyTorch fp32 strict", False, "strict"),
    "default": ("PyTorch default (cuDNN TF32)", False, "tf32"),
    "fp32": ("converted fp32", True, "strict"),
    "tf32": ("converted TF32", True, "tf32"),
}
STOCK_OF = {"fp32": "strict", "tf32": "default"}   # the stock row a converted one is judged against
BURST = 5   # steps queued back to back per timed burst (the "back to back" column)
SETTLE = 8  # warm-up steps at most past --warmup while the pass graphs still capture (timed_row)


def result_name(net, args):
    """The result files' stem: bench_pytorch_NET, then _tf32 where every row is a TF32 one (--impls
    default,tf32), then the options that change what the rows measure. A TF32 run and a strict one
    (or all four rows, the default) write apart, so neither replaces the other's files."""
    tf32_only = all(IMPLS[i][2] == "tf32" for i in args.impls)
    return (f"bench_pytorch_{net}" + ("_tf32" if tf32_only else "") + ("_quick" if args.quick else "")
            + ("_no_reuse" if args.no_reuse else "") + ("_input_reuse" if args.input_reuse else "")
            + ("_channels_last" if args.channels_last else "")
            + ("_convert_channels_last" if args.convert_channels_last else "")
            + ("_pass_graphs" if args.pass_graphs else "")
            + (f"_{args.pass_graph_mb:g}mb" if args.pass_graphs and args.pass_graph_mb else "")
            + ("_reduce_overhead" if args.compile_mode == "reduce-overhead" else ""))


def row_rounds(impls, compile_rows):
    """[(impl name, compiled)] in the order run_network makes rows: every implementation's eager and
    graph rows first, then, with --compile, every compiled row. Compiled rows used to follow each
    implementation's own, and the converted eager rows that ran after a compiled stock row took 1.6x
    longer than without --compile (15.76 against 9.74 ms, AlexNet at a0eb958, session 14; not
    explained: inductor's compile workers or Dynamo's state were the candidates)."""
    return [(name, False) for name in impls] + [(name, True) for name in impls if compile_rows]


def conv_weights(model):
    import torch
    return [(n, m.weight) for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]


def gradients(model, x, y):
    """(loss, [conv weight gradients as float64 CPU tensors]), dropout off: in training mode
    otherwise, so BatchNorm normalises with the batch's statistics (at initialisation its running
    ones would let ResNet-50's activations grow until fp32 rounding decides the softmax)."""
    import torch
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.eval()
    model.zero_grad(set_to_none=True)
    dtype = next(model.parameters()).dtype
    loss = torch.nn.functional.cross_entropy(model(x.to(dtype)), y)
    loss.backward()
    grads = [w.grad.detach().double().cpu() for _, w in conv_weights(model)]
    model.zero_grad(set_to_none=True)
    model.train()
    return loss.item(), grads


def check(model, x, y, reference):
    """(largest relative error, where): the loss and every conv weight gradient against float64."""
    loss, grads = gradients(model, x, y)
    errors = {"loss": abs(loss - reference[0]) / abs(reference[0])}
    for (name, _), g, r in zip(conv_weights(model), grads, reference[1], strict=True):
        errors[name] = rel_error(g.numpy(), r.numpy())
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def held(torch):
    """(allocated, requested) bytes the caching allocator holds now: its blocks, and the sizes
    asked for (module docstring: why both)."""
    return torch.cuda.memory_allocated(), torch.cuda.memory_stats().get("requested_bytes.all.current", 0)


def peak_held(torch):
    """held()'s two figures at their peaks since the last reset_peak_memory_stats()."""
    return torch.cuda.max_memory_allocated(), torch.cuda.memory_stats().get("requested_bytes.all.peak", 0)


def timed_row(step, args, peak_from, leftover, window_open=False):
    """(median ms of single steps, median ms a step back to back, median issue ms, peak MiB,
    requested peak MiB, pass graphs' MiB: arena and pool's free bytes) of step() after warm-up: the
    second over bursts of BURST steps with no wait between them (module docstring), the third the
    host's time to issue one step on a drained GPU (where it nears the step's time, the row is
    host-bound); the peaks over all (and over `peak_from`), less `leftover` (what earlier rows left
    allocated), plus the part of the converted layers' pass-graph pool that is not allocated between
    replays (pass_graph_stats' pool_free_bytes: temporaries that did not fit the arena, reserved at
    every moment; the pool's allocated blocks, such as a cuBLAS workspace made in a capture, and the
    arena, a tensor, are in the allocated peak already). peak_from and leftover are (allocated,
    requested) byte pairs, as held() gives them. window_open: the caller reset the peak stats before
    steps of its own that count (the cudagraph trees' recording), and the peaks run on from there
    through the warm-up, where the trees could record again, instead of from the timed steps alone."""
    import torch

    from minitorch_fft.pytorch import pass_graph_stats
    for _ in range(args.warmup):
        step()
    warming = _warming(pass_graph_stats())
    for _ in range(SETTLE):   # pass graphs still warming (eager calls, captures): steps until a step has none
        step()
        before, warming = warming, _warming(pass_graph_stats())
        if warming == before:
            break
    torch.cuda.synchronize()
    if not window_open:
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step, "torch", 0, args.repeat)

    def burst():
        for _ in range(BURST):
            step()
    steady = median_ms(burst, "torch", 0, max(3, args.repeat // BURST)) / BURST
    issue = median_ms(step, "cpu", 0, args.repeat, before=torch.cuda.synchronize)
    stats = pass_graph_stats()
    pool = stats["pool_free_bytes"]
    peak, requested = (max(now, before) - left + pool
                       for now, before, left in zip(peak_held(torch), peak_from, leftover))
    return ms, steady, issue, peak / 2**20, requested / 2**20, (pool + stats["arena_bytes"]) / 2**20


def _warming(stats):
    """The pass graphs' calls that are not replays: eager ones before a capture, captures, failures."""
    return stats["eager"] + stats["captures"] + stats["failed"]


def timed_fields(mode, timed, batch):
    """A row's fields from timed_row's (ms, back to back ms, issue ms, peak MiB, requested peak MiB,
    pass graphs' MiB: arena and pool's free bytes), in `mode`, with the pass graphs' counts so far
    (pass_graph_stats)."""
    from minitorch_fft.pytorch import pass_graph_stats
    ms, steady, issue, peak, requested, pool = timed
    stats = pass_graph_stats()
    return {"mode": mode, "step_ms": ms, "steady_ms": steady, "issue_ms": issue,
            "images_per_s": batch / ms * 1e3, "peak_mib": peak, "peak_requested_mib": requested,
            "pass_graph_pool_mib": pool,
            "pass_graphs": {k: stats[k] for k in ("eager", "captures", "replays", "failed", "over", "graphs")}}


def timed_text(timed):
    """timed_row's result as a log line gives it."""
    ms, steady, issue, peak, requested, pool = timed
    return (f"{ms:8.2f} ms ({steady:.2f} back to back, issue {issue:.2f})  peak {peak:8.0f} MiB "
            f"(requested {requested:.1f}{f'; pass graphs pool {pool:.1f}' if pool else ''})")


def run_network(net, args, log, on_rows=None):
    """(rows, failures) of one network (row_rounds' order); on_rows(rows, failures), if given, after
    each implementation's rows are in (main writes them as the network's partial result)."""
    import torch

    from minitorch_fft import backends
    from minitorch_fft.pytorch import convert, reuse_spectra
    torch.manual_seed(args.seed)
    base = torch_model(net, 1000)
    g = torch.Generator().manual_seed(args.seed)
    side = IMAGE.get(net, 224)
    x = torch.randn(args.batch, 3, side, side, generator=g).cuda()
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    y = torch.randint(0, 1000, (args.batch,), generator=g).cuda()
    ref_model = copy.deepcopy(base).double().cuda()
    reference = gradients(ref_model, x.double(), y)
    x = x.contiguous(memory_format=layout)   # after the reference: float64 NCHW, as every other run's
    del ref_model
    _free(torch)
    floor = held(torch)   # the batch: every row's
    rows, failures, yardstick = [], [], {}
    for name, compiled in row_rounds(args.impls, args.compile):
        label, converted, precision = IMPLS[name]
        t0 = time.perf_counter()
        first = len(rows)
        leftover = tuple(now - f for now, f in zip(held(torch), floor))   # earlier rows' (after _free)
        set_tf32(precision)
        with backends.config.override(tf32=converted and precision == "tf32", pass_graphs=args.pass_graphs,
                                      pass_graph_mb=args.pass_graph_mb):
            model = copy.deepcopy(base).cuda().to(memory_format=layout)
            if converted:
                convert(model, channels_last=args.convert_channels_last)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            scope = (contextlib.nullcontext if not converted or args.no_reuse else
                     functools.partial(reuse_spectra, inputs=args.input_reuse))
            shared = {}

            def step():
                opt.zero_grad(set_to_none=False)
                with scope() as cache:
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                opt.step()
                if cache is not None:
                    shared["hits"] = cache.hits

            # checked first, on the weights the reference has; auto tunes every layer and pass here
            err, worst = check(model, x, y, reference)
            tuned_s = time.perf_counter() - t0
            if not converted:
                yardstick[precision] = err    # stock's own error is reported, not judged
            elif not compiled:                # (a compiled round checks the same eager model again)
                bound = max(TOLERANCE[precision], STEP_FACTOR * yardstick[precision])
                if not err <= bound:
                    failures.append(f"{net} {label}: {worst} relative error {err:.1e} against float64, bound "
                                    f"{bound:.1e} ({STEP_FACTOR} x stock PyTorch's in the same precision)")
            common = {"network": net, "implementation": label, "precision": precision, "converted": converted,
                      "max_err": err, "worst": worst, "leftover_mib": leftover[0] / 2**20,
                      "leftover_requested_mib": leftover[1] / 2**20}
            if compiled:
                rows.append({**common, **_compiled_row(model, opt, scope, x, y, args, net, label, log, leftover)})
            else:
                timed = timed_row(step, args, (0, 0), leftover)
                rows.append({**common, **timed_fields("eager", timed, args.batch),
                             "spectra_reused": shared.get("hits")})
                log(f"{net:9s} {label:30s} eager {timed_text(timed)}  err {err:.1e} ({worst})  "
                    f"check+tuning {tuned_s:.1f} s  spectra reused {shared.get('hits')}  "
                    f"(earlier rows' leftover {leftover[0] / 2**20:.0f} MiB, not counted)")
                if not args.no_graphs:
                    rows.append({**common, **_graph_row(step, args, net, label, log, leftover)})
            del model, opt, step
            _free(torch)
        after = tuple(now - f for now, f in zip(held(torch), floor))
        charge_freed_leftover(rows[first:], leftover, after, log)
        row_s = (time.perf_counter() - t0) / (len(rows) - first)
        for row in rows[first:]:
            row["row_s"] = row_s      # wall seconds per row, check and tuning included (the estimates)
        if first == 0:
            more = row_s * len(rows) * (len(args.impls) - 1) + row_s * len(args.impls) * args.compile
            log(f"{net:9s} estimate: {more:.0f} s more for this network from its first rows, with a warm "
                f"tuning cache (a cold one adds auto's tuning{'; and compiling, not in this' if args.compile else ''})")
        if on_rows is not None:
            on_rows(speedups(rows), failures)
    set_tf32("strict")
    return speedups(rows), failures


def charge_freed_leftover(rows, leftover, after, log):
    """A row's peaks are its allocator peaks less `leftover`, what earlier rows held when it began.
    Where less is held once the row is done and freed (`after`; both (allocated, requested) byte
    pairs), the row released earlier rows' memory, perhaps before its peak, and the subtraction may
    have taken what its own tensors used: the difference is added back to `rows`' peaks (an upper
    bound: it counts as if freed before the peak), recorded as "leftover_freed_mib" and
    "leftover_freed_requested_mib", and logged. Session 54 found 243 MiB so freed on AlexNet's
    converted reduce-overhead row (_free now drops compiled rows' models). The comparison is net:
    memory the row itself leaves held (`after` above `leftover`; _free leaves none in the rows of
    record) would hide as much freed, so that case is logged as unchecked."""
    freed = [max(0, left - now) for left, now in zip(leftover, after)]
    kept = [max(0, now - left) for left, now in zip(leftover, after)]
    for row in rows:
        row["leftover_freed_mib"] = freed[0] / 2**20
        row["leftover_freed_requested_mib"] = freed[1] / 2**20
        what = f"{row['network']:9s} {row['implementation']:30s} {row['mode']}"
        if freed[0] or freed[1]:
            row["peak_mib"] += freed[0] / 2**20
            row["peak_requested_mib"] += freed[1] / 2**20
            log(f"{what}: {freed[0] / 2**20:.1f} MiB ({freed[1] / 2**20:.1f} requested) of earlier rows' leftover "
                f"freed during the row: added back to its peaks, now {row['peak_mib']:.0f} MiB")
        if kept[0] or kept[1]:
            log(f"{what}: the row left {kept[0] / 2**20:.1f} MiB ({kept[1] / 2**20:.1f} requested) held after it was "
                "freed, which would hide as much of the earlier rows' leftover freed during it: unchecked")


def speedups(rows):
    """rows, each given its speed-up over the stock row of the same precision and mode, both ways
    timed (vs_stock, vs_stock_steady; None where that stock row is not among them)."""
    for row in rows:
        stock = [r for r in rows if not r["converted"] and r["precision"] == row["precision"]
                 and r["mode"] == row["mode"]]
        row["vs_stock"] = stock[0]["step_ms"] / row["step_ms"] if stock else None
        row["vs_stock_steady"] = stock[0]["steady_ms"] / row["steady_ms"] if stock else None
    return rows


def shortfalls(net, rows):
    """(lines, missed): every target checked on this network's rows (TARGETS: speed-up over the
    stock row of the same mode, converted fp32 against strict and converted TF32 against PyTorch's
    default; peak memory at most that stock row's), and those missed."""
    lines, missed = [], []
    for row in rows:
        stock = [r for r in rows if not r["converted"] and r["precision"] == row["precision"]
                 and r["mode"] == row["mode"]]
        if not row["converted"] or not stock:
            continue
        stock = stock[0]
        what = f"{net} {row['implementation']}, {row['mode']}"
        least = TARGETS.get(net, {}).get(row["precision"])
        if least is not None:
            ok = row["vs_stock"] >= least
            steady = row.get("vs_stock_steady")
            lines.append(f"{what}: {row['vs_stock']:.2f}x {stock['implementation']} (target >= {least}x)"
                         f"{'' if ok else ': SHORTFALL'}"
                         f"{'' if steady is None else f' (back to back, not judged: {steady:.2f}x)'}")
            if not ok:
                missed.append(lines[-1])
        ok = row["peak_mib"] <= stock["peak_mib"]
        ours, theirs = row["peak_mib"], stock["peak_mib"]
        digits = 3 if abs(ours - theirs) < 1 else 0     # a sub-MiB difference shown to the KiB
        requested = row.get("peak_requested_mib"), stock.get("peak_requested_mib")
        lines.append(f"{what}: peak {ours:.{digits}f} MiB against stock's {theirs:.{digits}f} MiB "
                     f"(target: at most stock's){'' if ok else ': SHORTFALL'}"
                     + ("" if None in requested else
                        f" (requested, not judged: {requested[0]:.3f} against {requested[1]:.3f} MiB)"))
        if not ok:
            missed.append(lines[-1])
    return lines, missed


PARTIAL = ".partial"   # a network's result name while it runs


def write_network(name, net, meta, rows, failures, cols, out, partial=False):
    """(paths, missed targets): `name`.{json,md} for one network's rows (write_results), with the
    targets checked (shortfalls) and any failed check named in the notes. partial: the rows so far
    of a network still running, as `name`.partial.{json,md}, which say so and judge no target (a
    run cut by a time limit leaves them); the finished file removes them."""
    notes = ("Max rel err: the loss and every conv weight gradient against the stock model in float64, "
             "dropout off, same weights and batch.\n\nBack to back: the median over bursts of "
             f"{BURST} steps queued with no wait between them, per step (the module docstring says why).\n\n")
    missed = []
    if partial:
        notes = (f"PARTIAL: the rows finished so far ({len(rows)}); this run had not finished the network when "
                 "it wrote this file. Targets are judged in the finished file only.\n\n" + notes)
    else:
        targets, missed = shortfalls(net, rows)
        notes += ("Targets (issue 19; speed-up over the stock row of the same mode, judged on the single-step "
                  "median):\n" + "\n".join(f"- {t}" for t in targets))
    if failures:
        notes += "\n\nFAILED (reported, not hidden):\n" + "\n".join(f"- {f}" for f in failures)
    title = (f"PyTorch training step, {net}, stock against converted, batch {meta['batch']}, {meta['device']}"
             + (" (partial)" if partial else ""))
    paths = write_results(name + PARTIAL if partial else name, meta, rows, cols, title, notes, out_dir=out)
    if not partial:
        remove_partial(paths[0].parent, name)   # superseded
    return paths, missed


def remove_partial(folder, name):
    """`name`'s partial files in `folder` (write_network's), if any."""
    for ext in (".json", ".md"):
        (folder / f"{name}{PARTIAL}{ext}").unlink(missing_ok=True)


def earlier_estimate(name, batch, folder):
    """(seconds, path): what the last result file `name` in `folder` took (its rows' row_s), scaled
    by the batch; seconds None where there is none (or it predates row_s)."""
    import json
    path = folder / f"{name}.json"
    try:
        old = json.loads(path.read_text())
        seconds = sum(r["row_s"] for r in old["rows"])
        return seconds * batch / old["meta"]["batch"], path
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None, path


def _graph_row(step, args, net, label, log, leftover):
    import torch

    from minitorch_fft import backends
    from minitorch_fft.pytorch import release_pass_graphs
    release_pass_graphs()      # the eager row's: this row captures the whole step, passes as they run
    torch.cuda.empty_cache()
    with backends.config.override(pass_graphs=False):   # module docstring
        return _captured_row(step, args, net, label, log, leftover)


def _captured_row(step, args, net, label, log, leftover):
    import torch
    torch.cuda.reset_peak_memory_stats()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    timed = timed_row(graph.replay, args, peak_held(torch), leftover)   # the capture's peak counts
    log(f"{net:9s} {label:30s} graph {timed_text(timed)}")
    del graph
    return timed_fields("CUDA graph", timed, args.batch)


def _compiled_row(model, opt, scope, x, y, args, net, label, log, leftover):
    """A row under torch.compile, compiled in a fresh Dynamo state (torch._dynamo.reset(): what an
    earlier row compiled is dropped, as in a process that trains one model). Session 36: converted
    AlexNet's compiled step took 8.99 ms before the stock compiled row and 10.63 after it, in one
    process; 9.17 and 9.64 with a reset before each (exp_compile_gap --reset)."""
    import torch
    torch._dynamo.reset()
    graphs = args.compile_mode == "reduce-overhead"
    compiled = torch.compile(model, mode=args.compile_mode if graphs else None)

    def step():
        if graphs:   # a new step: the trees' graphs may reuse the last step's outputs' memory
            torch.compiler.cudagraph_mark_step_begin()
        # under the trees, the gradients are the last replay's outputs, which the next overwrites: set to
        # None, not zeroed in place (PyTorch refuses to accumulate into them: "accessing tensor output of
        # CUDAGraphs that has been overwritten by a subsequent run")
        opt.zero_grad(set_to_none=graphs)
        with scope():
            loss = torch.nn.functional.cross_entropy(compiled(x), y)
            loss.backward()
        opt.step()
    t0 = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t0
    _stop_compile_workers()
    if graphs:   # the trees run eagerly at the first call and record at the second: as a captured row's
        torch.cuda.reset_peak_memory_stats()   # capture, the recording's peak counts (between replays the
        step()                                 # pool is reserved, not allocated), and any later recording's
    timed = timed_row(step, args, (0, 0), leftover, window_open=graphs)   # the compiling call's does not
    log(f"{net:9s} {label:30s} compiled {timed_text(timed)}  (compile {compile_s:.0f} s)")
    return timed_fields("torch.compile" + ("" if args.compile_mode == "default" else f" {args.compile_mode}"),
                        timed, args.batch)


def _stop_compile_workers():
    """Shut inductor's compile-worker processes once a model is compiled: idle or not, they are not
    to share the host with the timed steps (the eager adapter is host-bound on lent machines)."""
    try:
        from torch._inductor.async_compile import shutdown_compile_workers
    except ImportError:            # another PyTorch: nothing to shut
        return
    shutdown_compile_workers()


def _free(torch):
    """Drop what the finished row keeps: cufft's scratch and plans, PyTorch's cuBLAS workspaces
    (one a handle and stream, made at the first GEMM there and kept: left in place, the row that
    made one would count it and a later row on the same stream would not; session 34's graph rows
    differed from stock's by exactly 33 MiB requested), PyTorch's cached blocks. So every row pays
    for its own workspaces, made in its check and warm-up steps. First what a compiled row left
    compiled: Dynamo's code and inductor's cudagraph trees, which keep the row's model (its
    parameters) alive; kept, they were an earlier row's "leftover" that the next compiled row freed
    when it reset Dynamo, so its peak, less that leftover, read low (session 54: 243 MiB on AlexNet,
    618 on OverFeat-fast, in the converted reduce-overhead rows)."""
    import gc

    from minitorch_fft import backends
    from minitorch_fft.pytorch import release_pass_graphs
    torch._dynamo.reset()
    trees = sys.modules.get("torch._inductor.cudagraph_trees")   # imported where a row made trees
    if trees is not None and hasattr(trees, "reset_cudagraph_trees"):   # (Dynamo's reset may do it too)
        trees.reset_cudagraph_trees()
    gc.collect()               # the compiled model's reference cycles
    release_pass_graphs()      # the converted row's pass graphs, their pool and the buffers they held
    backends.cufft.release_buffers()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)   # private; absent in another PyTorch
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--nets", default=",".join(NETS), help=f"comma-separated, of {', '.join(NETS)}")
    parser.add_argument("--batch", type=int, default=None, help="one batch for every network "
                        f"(default: {', '.join(f'{n} {b}' for n, b in BATCH.items())})")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="batch 8, warm-up 1, repeat 3 (a smoke run)")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma-separated rows, of {', '.join(IMPLS)} (a converted row needs its stock one: "
                             f"{', '.join(f'{c} needs {s}' for c, s in STOCK_OF.items())})")
    parser.add_argument("--no-graphs", action="store_true", help="eager rows only")
    parser.add_argument("--no-reuse", action="store_true",
                        help="converted rows without spectra reuse (less memory; result files *_no_reuse)")
    parser.add_argument("--pass-graphs", action="store_true",
                        help="the converted layers replay their passes as CUDA graphs (the pass_graphs setting; "
                             "its pool counted in each row's peak; result files *_pass_graphs)")
    parser.add_argument("--pass-graph-mb", type=float, default=None,
                        help="with --pass-graphs: capture only the layers whose passes take at most this many MiB "
                             "of temporaries (the pass_graph_mb setting; result files *_pass_graphs_<N>mb)")
    parser.add_argument("--input-reuse", action="store_true",
                        help="converted rows also keep each layer's input spectrum from forward for accGrad "
                             "(reuse_spectra(inputs=True): faster, more memory; result files *_input_reuse)")
    parser.add_argument("--compile", action="store_true", help="add torch.compile (inductor) rows")
    parser.add_argument("--compile-mode", choices=("default", "reduce-overhead"), default="default",
                        help="with --compile: torch.compile's mode; reduce-overhead replays the compiled forward "
                             "and backward as CUDA graphs (inductor's cudagraph trees; result files "
                             "*_reduce_overhead)")
    parser.add_argument("--channels-last", action="store_true",
                        help="every row's model and input channels-last (model.to(memory_format=torch.channels_last)): "
                             "each converted pass runs cuDNN's NHWC plans or our NCHW passes on copies, whichever auto "
                             "timed faster (minitorch_fft.pytorch)")
    parser.add_argument("--convert-channels-last", action="store_true",
                        help="the converted rows' models by convert(model, channels_last=True): the NCHW model run "
                             "channels-last inside (its parameters laid out channels-last; the NCHW batch taken as it "
                             "is, every conv's output channels-last), the stock rows' models and the batch NCHW as given (inductor lays out its "
                             "compiled model itself); result files *_convert_channels_last")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if args.compile_mode != "default" and not args.compile:
        parser.error(f"--compile-mode {args.compile_mode} needs --compile")
    if args.convert_channels_last and args.channels_last:
        parser.error("--convert-channels-last converts an NCHW model; with --channels-last every model is "
                     "channels-last already")
    if args.no_reuse and args.input_reuse:
        parser.error("--no-reuse and --input-reuse exclude each other")
    if args.pass_graph_mb is not None and (not args.pass_graphs or not 0 < args.pass_graph_mb < float("inf")):
        parser.error(f"--pass-graph-mb takes MiB > 0 with --pass-graphs, got {args.pass_graph_mb}"
                     f"{'' if args.pass_graphs else ' without --pass-graphs'}")
    nets = args.nets.split(",")
    if any(n not in NETS for n in nets):
        parser.error(f"--nets takes some of {', '.join(NETS)}, got {args.nets!r}")
    impls = args.impls.split(",")
    if any(i not in IMPLS for i in impls) or any(STOCK_OF[i] not in impls for i in impls if i in STOCK_OF):
        parser.error(f"--impls takes some of {', '.join(IMPLS)}, each converted row with its stock one "
                     f"({', '.join(f'{c} needs {s}' for c, s in STOCK_OF.items())}), got {args.impls!r}")
    args.impls = [i for i in IMPLS if i in impls]   # stock rows first: the converted ones are judged by them
    if args.quick:
        args.batch, args.warmup, args.repeat = 8, 1, 3
    if (args.batch is not None and args.batch < 1) or args.warmup < 0 or args.repeat < 1:
        parser.error(f"need --batch >= 1, --warmup >= 0, --repeat >= 1, got {args.batch}, {args.warmup}, "
                     f"{args.repeat}")

    import torch
    if not torch.cuda.is_available():
        sys.exit("bench_pytorch.py needs a CUDA GPU visible to PyTorch and CuPy")
    import cupy as cp

    from minitorch_fft.backends import cudnn as cudnn_backend
    from minitorch_fft.backends import tuning
    cudnn_setup = setup_cudnn(torch)
    # whether auto had the cudnn backend among its candidates (session 39: two runs without the frontend
    # installed retuned the layer-passes a cache had on cudnn, and nothing in the result said so)
    backend_versions = cudnn_backend.versions()
    meta = provenance(tuning.device_name(cp), torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                      cudnn_backend=(f"frontend {backend_versions['frontend']}, cuDNN {backend_versions['cudnn']}"
                                     if backend_versions else "not available: auto chose among the other backends"),
                      cupy=cp.__version__, warmup=args.warmup, repeat=args.repeat,
                      image={net: IMAGE.get(net, 224) for net in nets},
                      tune_cache=str(tuning.cache_path()),
                      memory_format="channels_last" if args.channels_last else "contiguous",
                      convert_channels_last=args.convert_channels_last, host_probe_ms=round(host_probe_ms(), 2), **cudnn_setup)
    batches = {net: args.batch or BATCH[net] for net in nets}
    start = time.perf_counter()

    def log(line):
        print(f"[{time.perf_counter() - start:6.1f} s] {line}", flush=True)

    cols = [("network", "network", ""), ("implementation", "implementation", ""), ("mode", "mode", ""),
            ("step ms", "step_ms", ".2f"), ("images/s", "images_per_s", ".0f"),
            ("speed-up vs stock, same precision and mode", "vs_stock", ".2f"),
            ("back to back ms", "steady_ms", ".2f"), ("back to back vs stock", "vs_stock_steady", ".2f"),
            ("issue ms", "issue_ms", ".2f"),
            ("peak MiB", "peak_mib", ".0f"), ("requested peak MiB", "peak_requested_mib", ".1f"),
            ("max rel err vs fp64", "max_err", ".1e"), ("where", "worst", ""),
            ("spectra reused / step", "spectra_reused", "")]
    folder = args.out / slug(meta["device"])
    log(f"tuning cache {meta['tune_cache']}; batches {batches}; host probe {meta['host_probe_ms']} ms "
        "(harness.host_probe_ms: the converted eager rows are host-bound on a slow host)")
    name = {net: result_name(net, args) for net in nets}
    for net in nets:
        seconds, path = earlier_estimate(name[net], batches[net], folder)
        log(f"{net:9s} estimate: " + (f"{seconds:.0f} s, from {path.name} scaled to batch {batches[net]}"
                                       if seconds is not None else f"none yet ({path.name} has no row_s)"))
    missed_all = []
    for net in nets:   # one result file per network, written as soon as it is done
        net_args = argparse.Namespace(**{**vars(args), "batch": batches[net]})
        net_meta = {**meta, "batch": batches[net]}

        def partial(rows, failures, net=net, net_meta=net_meta):
            write_network(name[net], net, net_meta, rows, failures, cols, args.out, partial=True)
        remove_partial(folder, name[net])   # an earlier cut run's: not to pass for this run's before its first rows
        rows, failures = run_network(net, net_args, log, on_rows=partial)
        paths, missed = write_network(name[net], net, net_meta, rows, failures, cols, args.out)
        for line in missed:
            log(f"SHORTFALL {line}")
        missed_all += missed
        print(paths[1].read_text())
    log(f"done; {len(missed_all)} target(s) missed" + "".join(f"\n  SHORTFALL {m}" for m in missed_all))


if __name__ == "__main__":
    main()
