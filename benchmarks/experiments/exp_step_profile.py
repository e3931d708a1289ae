"""Experiment (not a benchmark of record): where a torchvision model's training step (forward,
backward, SGD; exp_step_ab's) spends the host's time, sampled from outside the process by py-spy:
no cProfile inflation, no timers wrapped around functions, and with --native the C frames under
the Python ones (CuPy's Cython, the CUDA driver, cuBLAS, cuDNN, libtorch, the interpreter).

The script warms the step up, times it unprofiled (the step's median from CUDA events, and its
issue time: the host clock around a step started on an idle GPU), then starts py-spy on its own
process and runs steps, each from an idle GPU, until py-spy has sampled --seconds. The summary
turns py-spy's stack traces (one per active thread an instant: its "Samples", which the raw
file's counts add up to) into host milliseconds a step, a category's share of the traces times
the wall time a step; the instants whose stacks py-spy could not read (its "Errors", 6-26 % of
them without pausing, session 38) are taken to be spread like those read. Tables: by thread, by
library at the leaf (what the host was executing; a thread's trace with no Python frame, C++ work
such as the autograd engine's, as "(no Python frame)"), our functions inclusive and by self time
(the deepest of our frames), and the leaf frames with their nearest Python caller. Time in
torch.cuda.synchronize (the wait between steps, a spin) is counted apart as "sync"; the main
thread outside the profiled loop is not counted.

py-spy pauses the process for each sample where --native is given (slower steps; shares stay
meaningful), and reads it without pausing otherwise (--rate can be higher). It needs ptrace
rights over the process; where they are refused the script says so and stops.

  python -m benchmarks.experiments.exp_step_profile --net alexnet --tf32 --model converted --native --out DIR
  python -m benchmarks.experiments.exp_step_profile --summarize DIR/profile_alexnet_tf32_converted_native.txt
"""
import argparse
import collections
import gc
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time

from benchmarks.experiments.exp_step_ab import make_steps
from benchmarks.harness import median_ms, source_commit

OURS = ("minitorch_fft/",)
_FRAME = re.compile(r"^(?P<name>.*) \((?P<where>[^()]*)\)$")
_PYLINE = re.compile(r"^(?P<file>.*):(?P<line>\d+)$")


def _frame(text):
    """(name, file or library, line or None) of one py-spy frame ("f (file.py:12)", "sym (lib.so)")."""
    m = _FRAME.match(text)
    if not m:
        return text, "?", None
    name, where = m["name"], m["where"]
    py = _PYLINE.match(where)
    if py:
        return name, py["file"], int(py["line"])
    return name, where, None


def _is_python(where, line):
    """Whether a frame is Python's: a line number, and not a C frame py-spy located in its source."""
    return line is not None and not where.endswith((".c", ".cpp", ".cxx", ".h", ".hpp", ".pyx", ".pxd"))


def _is_ours(where, line):
    return _is_python(where, line) and where.startswith(OURS)


def _library(where, line):
    """The category of a frame: a Python frame's top package (ours by folder), a native frame's library."""
    if line is not None and not _is_python(where, line):
        return "native-source:" + os.path.basename(where)   # a C frame py-spy located in its source
    if _is_ours(where, line):
        return where.split("/", 1)[0]
    if line is not None:
        parts = where.split("/")
        return "py:" + (parts[0] if len(parts) > 1 else where)
    base = os.path.basename(where)
    base = re.sub(r"\.cpython-.*$|\.so(\.\d+)*$", "", base)
    if "/" in where and where.split("/")[0] in ("cupy", "cupy_backends"):
        return "cython:" + base
    return "native:" + base


def read_raw(path):
    """[(thread, [(name, where, line)], count)] from py-spy's raw (collapsed) output, with --threads."""
    rows = []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for text in f:
            text = text.rstrip("\n")
            if not text:
                continue
            stack, _, count = text.rpartition(" ")
            parts = stack.split(";")
            thread = re.sub(r"^thread \(\w+\):?\s*", "", parts[0]) or "(unnamed)"
            rows.append((thread, [_frame(p) for p in parts[1:]], int(count)))
    return rows


def _errors(meta):
    errors = meta.get("errors")
    return "py-spy's errors not recorded" if errors is None else f"{errors} instants not read"


def summarize(path, meta, top=30, out=sys.stdout, also=()):
    """Print the tables described in the module's docstring for a raw file and its run's meta; with
    `also` (file prefixes, e.g. "torch/_library/"), the functions of those files inclusive too."""
    rows = read_raw(path)
    per_sample = meta["wall_s"] / meta["samples"] / meta["steps"] * 1e3   # ms a step for one trace

    def ms(count):
        return count * per_sample
    also = tuple(also)
    threads, sync, libs, mine, under_ours, inclusive, own, leaves, theirs = (collections.Counter() for _ in range(9))
    for thread, frames, count in rows:
        if not frames:
            if thread != "MainThread":                # C++ work of a thread of PyTorch's (the autograd engine)
                threads[thread] += count
                libs["(no Python frame)"] += count
                mine["(no Python frame)"] += count
                leaves["(no Python frame)"] += count
            continue
        if any(name == "synchronize" and "torch/cuda" in where for name, where, _ in frames):
            sync[thread] += count
            continue
        if thread == "MainThread" and not any(name == "_profiled_steps" for name, _, _ in frames):
            continue                                  # the main thread outside the profiled loop
        threads[thread] += count
        name, where, line = frames[-1]
        lib = _library(where, line)
        libs[lib] += count
        ours = [f for f in frames if _is_ours(f[1], f[2])]
        (under_ours if ours else mine)[lib] += count
        for key in {(n, w) for n, w, _ in ours}:
            inclusive[key] += count
        if ours:
            own[ours[-1][:2]] += count
        if also:
            for key in {(n, w) for n, w, ln in frames if _is_python(w, ln) and w.startswith(also)}:
                theirs[key] += count
        caller = next((f for f in reversed(frames) if _is_python(f[1], f[2])), None)
        label = f"{name} ({os.path.basename(where)}{'' if line is None else f':{line}'})"
        if line is None and caller:
            label += f" <- {caller[0]} ({caller[1]}:{caller[2]})"
        leaves[label] += count
    total = sum(threads.values())

    def share(count):
        return 100 * count / total if total else 0.0
    print(f"{meta['title']}\n{meta['samples']} stack traces ({_errors(meta)}) over {meta['wall_s']:.2f} s, {meta['steps']} steps "
          f"({meta['wall_s'] / meta['steps'] * 1e3:.2f} ms a step profiled; unprofiled: step "
          f"{meta['step_ms']:.2f} ms, issue {meta['issue_ms']:.2f} ms); host ms a step below\n", file=out)
    print("| thread | active ms | sync ms |\n|---|---|---|", file=out)
    for t in sorted(set(threads) | set(sync), key=lambda t: -threads[t]):
        print(f"| {t} | {ms(threads[t]):.3f} | {ms(sync[t]):.3f} |", file=out)
    print(f"| all | {ms(total):.3f} | {ms(sum(sync.values())):.3f} |\n", file=out)
    print("| leaf library | ms | under our functions | elsewhere (PyTorch's side) |\n|---|---|---|---|", file=out)
    for lib, n in libs.most_common(top):
        print(f"| {lib} | {ms(n):.3f} | {ms(under_ours[lib]):.3f} | {ms(mine[lib]):.3f} |", file=out)
    print(f"| all | {ms(total):.3f} | {ms(sum(under_ours.values())):.3f} | {ms(sum(mine.values())):.3f} |\n",
          file=out)
    print("| our function (inclusive) | ms | % of active |\n|---|---|---|", file=out)
    for (name, where), n in inclusive.most_common(top):
        print(f"| {name} ({where}) | {ms(n):.3f} | {share(n):.2f} |", file=out)
    print("\n| our function (self: the deepest of ours in the trace) | ms | % of active |\n|---|---|---|", file=out)
    for (name, where), n in own.most_common(top):
        print(f"| {name} ({where}) | {ms(n):.3f} | {share(n):.2f} |", file=out)
    print(f"| all | {ms(sum(own.values())):.3f} | {share(sum(own.values())):.2f} |", file=out)
    if also:
        print(f"\n| function of {', '.join(also)} (inclusive) | ms | % of active |\n|---|---|---|", file=out)
        for (name, where), n in theirs.most_common(top):
            print(f"| {name} ({where}) | {ms(n):.3f} | {share(n):.2f} |", file=out)
    print("\n| leaf frame | ms | % of active |\n|---|---|---|", file=out)
    for label, n in leaves.most_common(top):
        print(f"| {label} | {ms(n):.3f} | {share(n):.2f} |", file=out)


def _py_spy(path):
    """py-spy's executable: `path`, else on PATH, else beside this interpreter (a virtual environment's)."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    found = path or shutil.which("py-spy") or (beside if os.path.exists(beside) else None)
    if not found:
        raise SystemExit("py-spy not found: pip install py-spy, or give --py-spy PATH")
    return found


def _profiled_steps(step, sync, spy):
    """Steps, each from an idle GPU, until py-spy exits; the number run."""
    n = 0
    while spy.poll() is None:
        sync()
        step()
        n += 1
    sync()
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", default="alexnet")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--model", choices=("converted", "stock"), default="converted")
    ap.add_argument("--tf32", action="store_true",
                    help="PyTorch's TF32 defaults for the stock model, the framework's TF32 mode for the converted")
    ap.add_argument("--compile", action="store_true", help="the model under torch.compile (inductor)")
    ap.add_argument("--native", action="store_true", help="C frames too (py-spy pauses the process a sample)")
    ap.add_argument("--rate", type=int, default=250, help="samples a second")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out", default=".", help="folder for the raw profile, its meta and summary")
    ap.add_argument("--py-spy", dest="py_spy", default=None)
    ap.add_argument("--summarize", metavar="RAW", help="only summarize RAW, a .txt or .txt.gz (its .json beside it)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--also", action="append", default=[], metavar="PREFIX",
                    help="with --summarize: the functions of files starting PREFIX inclusive too (repeatable)")
    args = ap.parse_args()
    if args.summarize:
        with open(re.sub(r"\.txt(\.gz)?$", "", args.summarize) + ".json") as f:
            summarize(args.summarize, json.load(f), args.top, also=args.also)
        return
    if args.rate < 1 or args.seconds <= 0:
        ap.error("--rate must be at least 1 and --seconds above 0")
    spy_bin = _py_spy(args.py_spy)

    import torch
    step = make_steps(args.net, args.batch, args.tf32, {args.model == "converted"},
                      args.compile)[args.model == "converted"]
    for _ in range(5):                                # tunes (auto), compiles, warms up
        step()
    torch.cuda.synchronize()
    step_ms = median_ms(step, "torch", 2, 20)
    issue_ms = median_ms(step, "cpu", 0, 20, before=torch.cuda.synchronize)
    name = (f"profile_{args.net}_{'tf32' if args.tf32 else 'fp32'}_{args.model}{'_compiled' if args.compile else ''}"
            f"_{'native' if args.native else 'python'}")
    os.makedirs(args.out, exist_ok=True)
    raw = os.path.join(args.out, name + ".txt")
    cmd = [spy_bin, "record", "--pid", str(os.getpid()), "--rate", str(args.rate), "--duration",
           str(max(1, round(args.seconds))), "--format", "raw", "--threads", "-o", raw]
    cmd.append("--native" if args.native else "--nonblocking")
    gc.disable()                                      # as median_ms times the step
    t0 = time.perf_counter()                          # the steps' rate over py-spy's life is its rate while sampling
    spy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    steps = _profiled_steps(step, torch.cuda.synchronize, spy)
    wall = time.perf_counter() - t0
    gc.enable()
    said = spy.stdout.read()
    m = re.search(r"Samples: (\d+)", said)
    errors = re.search(r"Errors: (\d+)", said)
    if spy.returncode != 0 or not m or not os.path.exists(raw):
        raise SystemExit(f"py-spy failed (rc {spy.returncode}):\n{said}")
    meta = {"title": f"{args.net} b{args.batch} {'TF32' if args.tf32 else 'fp32'} {args.model}"
                     f"{' under torch.compile' if args.compile else ''}, py-spy "
                     f"{'--native' if args.native else '--nonblocking'} at {args.rate}/s, "
                     f"{torch.cuda.get_device_name()}, commit {source_commit()}",
            "samples": int(m[1]), "errors": int(errors[1]) if errors else None, "py_spy_said": said[-2000:],
            "wall_s": wall, "steps": steps, "step_ms": step_ms, "issue_ms": issue_ms,
            "command": " ".join(sys.argv)}
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        summarize(raw, meta, args.top, out=f)
    summarize(raw, meta, args.top)


if __name__ == "__main__":
    main()
