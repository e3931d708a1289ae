"""The paper's 8,232-configuration sweep (Table 2, Figures 1-6): FFT convolution vs cuDNN strict.

  python -m benchmarks.sweep run --max-minutes 9     # measure until the time is up; rerun to resume
  python -m benchmarks.sweep run --quick             # a fixed sample of 84 (two per k, y cell)
  python -m benchmarks.sweep run --shard 2/8        # shard 2 of 8: every 8th configuration, from the 3rd
  python -m benchmarks.sweep merge results/<device>/sweep.jsonl   # fold the shards' part files in
  python -m benchmarks.sweep report results/<device>/sweep.jsonl  # heat maps + summary of what was measured
  bash benchmarks/sweep_gpus.sh 9 results            # one shard per GPU of the host, then merge
  python -m benchmarks.sweep run --remeasure-unnamed  # also measure again the rows that name no commit

Configurations: S in {1, 16, 64, 128}; f, f' in {1, 4, 16, 64, 96, 128, 256};
k in {3, 5, 7, 9, 11, 13}; output size y in {1, 2, 4, 8, 16, 32, 64} (input h = w = y + k - 1,
stride 1, no padding). For each one and each pass the best of our FFT backends (cufft, fbfft
where it supports the basis), gemm and cuDNN strict (fp32, TF32 off) are timed, after each
result is checked against float64. One JSON line per configuration is appended to
results/<device>/sweep.jsonl (flushed and fsynced), so a run cut off at its time limit loses at
most the configuration in flight, and the next run skips what is done. The full run visits the
configurations in a fixed shuffled order (run_order), so whatever a cut-off run has measured is
a uniform sample of the grid, not one corner of it (in the grid's own order, the first 1,372
configurations are all S = 1).

Sharded (one process per GPU), run --shard I/N measures the I-th of every N configurations of
that order that are not yet done, and appends its rows to sweep.partI.jsonl (with its own
provenance sidecar, which names the shard and the GPU: index, PCI bus id and name); every run counts the rows of
the main file and of all part files as done. merge folds the part files into the main file and
deletes them; report refuses to run while any are left, so that it never leaves rows out.
Every row names the commit it was measured at; the rows from before they did (session 5's, and
before session 6's host-time trim) can be measured again with --remeasure-unnamed, the new row
taking the old one's place (in a file and in a merge, a key's latest row wins).

  python -m benchmarks.sweep run --small-kernels      # issue 18: the 3x3 and 5x5 rows, with tiledfft and winograd

--small-kernels measures the grid's 3x3 and 5x5 configurations (2,744, in the same shuffled order,
so a cut-off run, unsharded and without --quick, is a uniform sample of them) with tiled FFT and
Winograd among ours: each row times cufft, fbfft, tiledfft and winograd (3x3 only), gemm and cuDNN
strict, and names them in its "ours" field. Its rows go to sweep_small.jsonl (sweep_small_quick.jsonl
with --quick), apart from the paper's sweep, whose rows compare the FFT backends alone.

The report draws, per kernel size, the speed-up of the best FFT backend over cuDNN strict
(geometric mean of the three passes' speed-ups, then over the configurations in a cell), on
axes of output size against problem size S*f*f' (binned by powers of 4), as the paper's
Figures 1-6 do, and the same against gemm; and it summarises where FFT wins.
"""
import argparse
import collections
import itertools
import json
import math
import os
import re
import sys
import time
from pathlib import Path

from benchmarks.harness import (PASSES, RESULTS_DIR, Layer, device_identity, provenance, save_figure, set_tf32,
                                setup_cudnn, slug, write_text)
from minitorch_fft.utils import atomic_file

S_SIZES = (1, 16, 64, 128)
PLANES = (1, 4, 16, 64, 96, 128, 256)
KERNELS = (3, 5, 7, 9, 11, 13)
OUTPUTS = (1, 2, 4, 8, 16, 32, 64)
QUICK_SAMPLE = 2 * len(KERNELS) * len(OUTPUTS)  # 84: two per heat-map cell
FFT = ("cufft", "fbfft")                          # "ours" in the paper's sweep: the FFT backends
SMALL_KERNELS = (3, 5)                            # --small-kernels: issue 18's regime
SMALL = ("cufft", "fbfft", "tiledfft", "winograd")  # ... and ours there (winograd: 3x3 only)


def configurations():
    """Every (S, f, f', k, y) of the paper's Table 2: 4 * 7 * 7 * 6 * 7 = 8,232."""
    return list(itertools.product(S_SIZES, PLANES, PLANES, KERNELS, OUTPUTS))


def run_order(seed=2015):
    """configurations() in a fixed pseudo-random order: every prefix is a uniform sample."""
    import numpy as np
    configs = configurations()
    return [configs[i] for i in np.random.default_rng(seed).permutation(len(configs))]


def measure_order(quick=False, small_kernels=False):
    """The configurations a run measures, in order: quick_sample() or run_order(), with
    small_kernels only their SMALL_KERNELS ones (a sub-sequence of a uniform shuffle is one too)."""
    order = quick_sample() if quick else run_order()
    return [c for c in order if c[3] in SMALL_KERNELS] if small_kernels else order


def quick_sample(per_cell=2, seed=0):
    """A fixed stratified sample: `per_cell` seeded (S, f, f') for every (k, y) cell of the
    heat maps (an evenly strided pick aliases with the 7 output sizes and misses some)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [(int(rng.choice(S_SIZES)), int(rng.choice(PLANES)), int(rng.choice(PLANES)), k, y)
            for k in KERNELS for y in OUTPUTS for _ in range(per_cell)]


def key(config):
    return "S{}_f{}_fo{}_k{}_y{}".format(*config)


def load_done(path):
    """{key: row} of the configurations already measured; a torn last line is ignored."""
    done = {}
    if not Path(path).exists():
        return done
    with open(path) as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a run killed mid-write: that configuration is measured again
            done[row["key"]] = row
    return done


def part_path(path, i):
    """Where shard i of the sweep file `path` appends its rows."""
    path = Path(path)
    return path.with_name(f"{path.stem}.part{i}.jsonl")


def part_paths(path):
    """The shards' part files next to `path`, by part number (part10 after part9); their
    provenance sidecars (sweep.part0.provenance.jsonl) are not part files."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    numbered = []
    for p in path.parent.glob(f"{path.stem}.part*.jsonl"):
        match = re.fullmatch(re.escape(path.stem) + r"\.part(\d+)\.jsonl", p.name)
        if match:
            numbered.append((int(match.group(1)), p))
    return [p for _, p in sorted(numbered)]


def load_all_done(path, remeasure_unnamed=False):
    """load_done of `path` and of its part files: what no shard needs to measure again.
    remeasure_unnamed: rows that name no commit (measured before rows carried theirs, and before
    session 6's host-time trim) count as not done, so a run measures them again; the new row
    replaces the old one (load_done and merge keep a key's latest row)."""
    done = load_done(path)
    for part in part_paths(path):
        done.update(load_done(part))
    if remeasure_unnamed:
        done = {k: row for k, row in done.items() if row.get("commit")}
    return done


def parse_shard(text):
    """'I/N' -> (I, N); a ValueError names what is wrong and the limits."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match:
        raise ValueError(f"--shard must be I/N with whole numbers 0 <= I < N (e.g. 0/8), got {text!r}")
    i, n = int(match.group(1)), int(match.group(2))
    if n < 1:
        raise ValueError(f"--shard I/N needs N >= 1 shards, got {text!r}")
    if i >= n:
        raise ValueError(f"--shard I/N needs 0 <= I < N (shards are numbered from 0), got {text!r}")
    return i, n


def shard_todo(order, done, shard=None):
    """The configurations of `order` that shard (I, N) measures: every N-th from the I-th, less
    those done. The shard is cut from the fixed order, not from what is left of it: the shards
    read `done` each at its own start, and rows another shard appends meanwhile must not shift
    which configurations are this one's (a shift of one would hand it a neighbour's share)."""
    mine = order if shard is None else order[shard[0]::shard[1]]
    return [c for c in mine if key(c) not in done]


def provenance_path(path):
    """The sidecar of a sweep's rows: one provenance line per run (chunk) that added to them."""
    path = Path(path)
    return path.with_name(path.stem + ".provenance.jsonl")


def record_chunk(path, done_before, prov):
    """Say where, when, how and from which commit the next chunk of `path` is measured."""
    append_row(provenance_path(path), dict(prov, done_before=done_before))


def read_chunks(path):
    """The provenance lines of `path`'s runs, oldest first ([] where none were recorded)."""
    side = provenance_path(path)
    if not side.exists():
        return []
    return [json.loads(line) for line in side.read_text().splitlines() if line.strip()]


def append_row(path, row):
    """One JSON line, flushed and fsynced before the next configuration starts."""
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def ours_of(row):
    """The backends a row counts as ours: its "ours" field (--small-kernels rows), else FFT."""
    return tuple(row.get("ours", FFT))


def speedups(row, baseline, ours=None):
    """Per pass, baseline ms / the best of ours (default ours_of(row)) ms, and their geometric
    mean (None if missing)."""
    ours = ours_of(row) if ours is None else ours
    per_pass = []
    for p in PASSES:
        fft = [row["ms"].get(f"{b}_{p}") for b in ours]
        fft = [v for v in fft if v]
        base = row["ms"].get(f"{baseline}_{p}")
        if not fft or not base:
            return None
        per_pass.append(base / min(fft))
    return math.exp(sum(math.log(v) for v in per_pass) / len(per_pass))


def problem_bin(S, f, fo):
    """log4 bin of S*f*f' (the paper's y axis)."""
    return int(math.log(S * f * fo, 4))


def heat_grid(rows, k, baseline):
    """{(problem bin, y): geometric-mean speed-up} for kernel size k."""
    cells = {}
    for r in rows:
        S, f, fo, kk, y = r["config"]
        s = speedups(r, baseline)
        if kk == k and s:
            cells.setdefault((problem_bin(S, f, fo), y), []).append(math.log(s))
    return {c: math.exp(sum(v) / len(v)) for c, v in cells.items()}


def crossover(rows, k, baseline):
    """The smallest output size y at which FFT wins in at least half the configurations of k."""
    for y in OUTPUTS:
        vs = [speedups(r, baseline) for r in rows if r["config"][3] == k and r["config"][4] == y]
        vs = [v for v in vs if v]
        if vs and 2 * sum(v > 1 for v in vs) >= len(vs):
            return y
    return None


def measure(config, args, commit):
    """The row of one configuration, measured at source `commit`: ms of every implementation and
    pass, errors checked."""
    import cupy as cp

    from minitorch_fft import backends
    S, f, fo, k, y = config
    h = y + k - 1
    layer = Layer((S, f, h, h), (fo, f, k, k), (1, 1), (0, 0), seed=args.seed)
    # The commit in every row: merged shards interleave rows of several runs (rows before session 6
    # have none; their chunks' provenance lines name 58005ef and ab24b86).
    ours = SMALL if args.small_kernels else FFT
    row = {"key": key(config), "config": list(config), "commit": commit, "ms": {}, "err": {},
           "skipped": {}}
    if args.small_kernels:
        row["ours"] = list(ours)
    for name in ours + ("gemm",):
        b = backends.get(name)
        if not b.supports(*layer.geom):
            row["skipped"][name] = "unsupported geometry"
            continue
        for p in PASSES:
            try:
                row["ms"][f"{name}_{p}"], row["err"][f"{name}_{p}"] = layer.measure(
                    layer.dispatched(name, p), "cupy", p, 1e-4, args)
            except Exception as e:  # noqa: BLE001 - recorded in the row, never hidden
                row["skipped"][f"{name}_{p}"] = f"{type(e).__name__}: {e}"[:200]
                cp.get_default_memory_pool().free_all_blocks()
    set_tf32("strict")
    for p in PASSES:
        flagged = []
        try:
            row["ms"][f"cudnn_{p}"], row["err"][f"cudnn_{p}"] = layer.measure(layer.cudnn(p), "torch", p, 1e-4,
                                                                             args, flagged)
        except Exception as e:  # noqa: BLE001 - recorded in the row; the chunk goes on
            row["skipped"][f"cudnn_{p}"] = f"{type(e).__name__}: {e}"[:200]
        if flagged:
            row["skipped"][f"cudnn_{p}_precision"] = flagged[0]
    return row


def run(args):
    import cupy as cp
    import torch
    from tqdm import tqdm

    from minitorch_fft.backends import tuning
    cudnn_setup = setup_cudnn(torch)
    name = ("sweep_small" if args.small_kernels else "sweep") + ("_quick" if args.quick else "")
    out = args.out / slug(tuning.device_name(cp)) / f"{name}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = load_all_done(out, args.remeasure_unnamed)
    todo = shard_todo(measure_order(args.quick, args.small_kernels), done, args.shard)
    dest, shard_fields = out, {}
    if args.shard:
        dest = part_path(out, args.shard[0])
        # which GPU of the host the shard ran on, as CuPy names it (sweep_gpus.sh picks it)
        shard_fields = {"shard": "{}/{}".format(*args.shard), **device_identity(cp)}
    prov = provenance(tuning.device_name(cp), cupy=cp.__version__, torch=torch.__version__, **cudnn_setup)
    if todo:
        record_chunk(dest, len(done), dict(prov, **shard_fields))
    deadline = time.monotonic() + args.max_minutes * 60
    label = f"sweep shard {shard_fields['shard']}" if args.shard else "sweep"
    for i, config in enumerate(tqdm(todo, desc=f"{label} ({len(done)} done before)")):
        if time.monotonic() > deadline:
            print(f"time is up: {len(todo) - i} configurations were left; run again to resume",
                  file=sys.stderr)
            break
        append_row(dest, measure(config, args, prov["commit"]))
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    print(dest)


def merge(args):
    """Fold the shards' part files into the sweep file, then delete them: the main file's rows
    first, then each part's in part-number order; a key seen before takes the later row (a
    re-measurement, run --remeasure-unnamed) in the earlier one's place."""
    path = Path(args.jsonl)
    parts = part_paths(path)
    if not parts:
        print(f"nothing to merge: no {path.stem}.part<I>.jsonl next to {path}")
        return
    rows = load_done(path)
    before, replaced = len(rows), 0
    for part in parts:
        for k, row in load_done(part).items():
            replaced += k in rows
            rows[k] = row
    side = provenance_path(path)
    chunks = side.read_text().splitlines() if side.exists() else []
    for part in parts:
        part_side = provenance_path(part)
        if part_side.exists():  # a line already there is from a merge cut off before the deletes
            chunks += [line for line in part_side.read_text().splitlines() if line.strip() and line not in chunks]
    # each file replaced in one step: a merge cut off midway leaves the old file whole
    with atomic_file(path) as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows.values())
    if chunks:
        with atomic_file(side) as fh:
            fh.writelines(line + "\n" for line in chunks)
    for part in parts:
        part.unlink()
        provenance_path(part).unlink(missing_ok=True)
    print(f"{path}: {before} rows before, {len(rows) - before} added from {len(parts)} part file(s), "
          f"{replaced} replaced by a later row, {len(rows)} rows after")


def report(args):
    """Heat maps (PNG) and a Markdown summary next to the sweep's JSON lines."""
    path = Path(args.jsonl)
    parts = part_paths(path)
    if parts:
        sys.exit(f"{path} has unmerged shard files ({', '.join(p.name for p in parts)}), whose rows the "
                 f"report would leave out; fold them in first: python -m benchmarks.sweep merge {path}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    rows = list(load_done(path).values())
    if not rows:
        sys.exit(f"no measured configurations in {path}")
    ours = sorted({b for r in rows for b in ours_of(r)}, key=SMALL.index)
    small = set(ours) != set(FFT)
    kernels = [k for k in KERNELS if any(r["config"][3] == k for r in rows)] if small else list(KERNELS)
    grid_size = sum(1 for c in configurations() if c[3] in kernels)
    what = f"best of ours ({', '.join(ours)})" if small else "best FFT backend"
    lines = [f"# Sweep: {what} vs cuDNN strict and gemm ({len(rows)} of {grid_size} configurations"
             f"{', kernels ' + ' and '.join(f'{k}x{k}' for k in kernels) if small else ''})", "",
             f"- source: `{path}`"]
    chunks = read_chunks(path)
    if chunks:
        lines += [f"- measured in {len(chunks)} run(s) (`{provenance_path(path).name}`; the shards of one "
                  "multi-GPU run on one line, its earliest start):"]
        runs = {}
        for c in chunks:   # shards I/N of one run differ only in I
            command = re.sub(r"--shard \d+/(\d+)", r"--shard I/\1", c.get("command", ""))
            runs.setdefault((c.get("commit"), c.get("done_before"), command), []).append(c)
        lines += [f"  - {min(c.get('date') for c in cs)} on {cs[0].get('device')}, commit {commit}, "
                  f"{done} done before{f', {len(cs)} shards' if len(cs) > 1 else ''}: `{command}`"
                  for (commit, done, command), cs in runs.items()]
    else:
        lines += ["- provenance: not recorded (these rows predate the provenance sidecar; "
                  "results/<device>/README.md names their run)"]
    by_commit = collections.Counter(r.get("commit", "not recorded (before rows named theirs)") for r in rows)
    lines += ["- rows by the commit they were measured at: "
              + ", ".join(f"{c}: {n}" for c, n in sorted(by_commit.items())), ""]
    who = "ours" if small else "FFT"
    for baseline in ("cudnn", "gemm"):
        ncols = min(3, len(kernels))
        fig, axes = plt.subplots(-(-len(kernels) // ncols), ncols, figsize=(4.7 * ncols, 4 * -(-len(kernels) // ncols)),
                                 sharex=True, sharey=True, squeeze=False)
        im = None
        bins = sorted({problem_bin(*r["config"][:3]) for r in rows})  # one y axis for every panel
        lines += [f"## Speed-up over {baseline}", "",
                  f"| k | configurations | {who} faster | median | best | crossover: smallest y where {who} wins "
                  "half | left out (a pass failed or was not run) | cuDNN missed 1e-4 (timed anyway) |",
                  "|---|---|---|---|---|---|---|---|"]
        for ax, k in zip(axes.flat, kernels):
            grid = heat_grid(rows, k, baseline)
            of_k = [r for r in rows if r["config"][3] == k]
            values = [speedups(r, baseline) for r in of_k]
            left_out = sum(v is None for v in values)
            flagged = sum(any(name.endswith("_precision") for name in r.get("skipped", {})) for r in of_k)
            values = sorted(v for v in values if v)
            if grid:
                image = [[grid.get((b, y), float("nan")) for y in OUTPUTS] for b in bins]
                im = ax.imshow(image, origin="lower", aspect="auto", cmap="RdBu", norm=LogNorm(1 / 8, 8))
                ax.set_yticks(range(len(bins)), [f"4^{b}" for b in bins])
                ax.set_xticks(range(len(OUTPUTS)), OUTPUTS)
            ax.set_title(f"{k}x{k} kernel")
            if not values:
                continue
            lines.append(f"| {k} | {summary_cells(values)} | {crossover(rows, k, baseline)} "
                         f"| {left_out} | {flagged} |")
        for ax in axes[-1]:
            ax.set_xlabel("output size y")
        for ax in axes[:, 0]:
            ax.set_ylabel("problem size S*f*f'")
        if im is not None:
            # two panels leave the label less room: ours are named in the title there
            label = (f"speed-up over {baseline}" if small
                     else f"best FFT speed-up over {baseline} (geometric mean of passes)")
            fig.colorbar(im, ax=axes, label=label)
        if small:
            fig.suptitle(f"{what} over {baseline}, geometric mean of the three passes")
        png = path.with_name(f"{path.stem}_vs_{baseline}.png")
        save_figure(fig, png, dpi=110)
        plt.close(fig)
        lines += ["", f"![heat maps vs {baseline}]({png.name})", ""]
        lines += by_batch(rows, baseline, who)
    if small:
        lines += winners(rows, kernels)
    md = path.with_suffix(".md")
    write_text(md, "\n".join(lines) + "\n")
    print(md)


def winners(rows, kernels):
    """Markdown for --small-kernels rows: which of ours is fastest, per kernel size and pass, and
    what tiled FFT and Winograd add over the FFT backends alone (the same rows, against cuDNN)."""
    lines = ["## Which of ours is fastest", "", "| k | pass | " + " | ".join(SMALL) + " |",
             "|---|---|" + "---|" * len(SMALL)]
    for k in kernels:
        for p in PASSES:
            counts = collections.Counter()
            for r in rows:
                if r["config"][3] != k:
                    continue
                timed = {b: r["ms"][f"{b}_{p}"] for b in ours_of(r) if r["ms"].get(f"{b}_{p}")}
                if timed:
                    counts[min(timed, key=timed.get)] += 1
            lines.append(f"| {k} | {p} | " + " | ".join(str(counts[b]) for b in SMALL) + " |")
    lines += ["", "## What tiled FFT and Winograd add (speed-up over cuDNN strict, same rows)", "",
              "| k | configurations | FFT alone faster | FFT alone median | ours faster | ours median |",
              "|---|---|---|---|---|---|"]
    for k in kernels:
        pairs = [(speedups(r, "cudnn", FFT), speedups(r, "cudnn")) for r in rows if r["config"][3] == k]
        pairs = [(a, b) for a, b in pairs if a and b]
        if not pairs:
            continue
        fft, ours = sorted(a for a, _ in pairs), sorted(b for _, b in pairs)
        n = len(pairs)
        lines.append(f"| {k} | {n} | {sum(v > 1 for v in fft)} ({sum(v > 1 for v in fft) / n:.0%}) | "
                     f"{fft[n // 2]:.2f}x | {sum(v > 1 for v in ours)} ({sum(v > 1 for v in ours) / n:.0%}) | "
                     f"{ours[n // 2]:.2f}x |")
    return lines + [""]


def by_batch(rows, baseline, who="FFT"):
    """Markdown: the same summary per batch size S, so that a partial sweep that measured some S
    more than others (its first chunk ran in grid order: S = 1 only) reads right."""
    lines = [f"### By batch size S (vs {baseline})", "",
             f"| S | configurations | {who} faster | median | best |", "|---|---|---|---|---|"]
    for S in S_SIZES:
        values = sorted(v for v in (speedups(r, baseline) for r in rows if r["config"][0] == S) if v)
        if values:
            lines.append(f"| {S} | {summary_cells(values)} |")
    return lines + [""]


def summary_cells(values):
    """'configurations | faster | median | best' of sorted, non-empty speed-ups."""
    wins = sum(v > 1 for v in values)
    return (f"{len(values)} | {wins} ({wins / len(values):.0%}) | {values[len(values) // 2]:.2f}x | "
            f"{values[-1]:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="measure (resumable)")
    r.add_argument("--quick", action="store_true", help=f"a fixed sample of {QUICK_SAMPLE} configurations")
    r.add_argument("--max-minutes", type=float, default=9.0, help="stop after this long (default 9)")
    r.add_argument("--warmup", type=int, default=1)
    r.add_argument("--repeat", type=int, default=5)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", type=Path, default=RESULTS_DIR)
    r.add_argument("--shard", metavar="I/N",
                   help="measure only shard I of N (0 <= I < N); its rows go to a part file (see merge)")
    r.add_argument("--remeasure-unnamed", action="store_true",
                   help="measure again the rows that name no commit (before session 6's host-time trim)")
    r.add_argument("--small-kernels", action="store_true",
                   help=f"the {SMALL_KERNELS} kernels only, with {', '.join(SMALL)} as ours (sweep_small.jsonl)")
    m = sub.add_parser("merge", help="fold the shards' part files into the sweep file")
    m.add_argument("jsonl", help="results/<device>/sweep.jsonl")
    p = sub.add_parser("report", help="heat maps and summary from a sweep file")
    p.add_argument("jsonl", help="results/<device>/sweep.jsonl")
    args = parser.parse_args()
    if args.command == "run":
        if args.max_minutes <= 0 or args.repeat < 1 or args.warmup < 0:
            parser.error("need --max-minutes > 0, --repeat >= 1, --warmup >= 0")
        if args.shard is not None:
            try:
                args.shard = parse_shard(args.shard)
            except ValueError as e:
                parser.error(str(e))
        run(args)
    elif args.command == "merge":
        merge(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
