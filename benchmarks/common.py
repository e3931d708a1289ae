"""Benchmark helpers: CUDA-event timing, allocator high-water marks, result files with provenance.

Every result file says where and how it was measured: device name, UTC date, the exact command
line, the source commit, and library versions. Files go to results/<device-name-slug>/<name>.{json,md}.
"""
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import backends

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"


def median_ms(fn, lib, warmup=3, repeat=10):
    """Median milliseconds of fn() between CUDA events, after `warmup` untimed calls.

    lib is "cupy" or "torch": the events are recorded on that library's current stream, the one
    the work is queued on. Each timed call ends with a wait on its end event (a sync point).
    """
    if lib == "cupy":
        import cupy
        new_event, elapsed = cupy.cuda.Event, cupy.cuda.get_elapsed_time
    elif lib == "torch":
        import torch

        def new_event():
            return torch.cuda.Event(enable_timing=True)

        def elapsed(start, end):
            return start.elapsed_time(end)
    else:
        raise ValueError(f"lib must be 'cupy' or 'torch', got {lib!r}")
    if warmup < 0 or repeat < 1:
        raise ValueError(f"need warmup >= 0 and repeat >= 1, got warmup={warmup}, repeat={repeat}")
    for _ in range(warmup):
        fn()
    start, end = new_event(), new_event()
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(elapsed(start, end))
    return statistics.median(times)


def peak_extra_bytes(fn, lib):
    """Device memory fn() needs beyond what is allocated before it (inputs), output included.

    torch: the caching allocator's exact peak. cupy: the memory pool's size after one call, starting
    from an emptied pool; the pool keeps what it frees, so this is its high-water mark (to the
    pool's rounding).
    """
    if lib == "torch":
        import torch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    if lib == "cupy":
        import cupy
        pool = cupy.get_default_memory_pool()
        cupy.cuda.Device().synchronize()
        pool.free_all_blocks()
        before = pool.used_bytes()
        fn()
        cupy.cuda.Device().synchronize()
        return pool.total_bytes() - before
    raise ValueError(f"lib must be 'cupy' or 'torch', got {lib!r}")


def slug(name):
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (a directory name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def poisoned(fn):
    """fn() with every CuPy allocation it makes filled with 0xFF bytes (NaN as float32) first.

    The pool hands back blocks that the previous implementation filled with the right answer
    for the same data: an output element a backend forgot to write would pass the check. Here
    it is NaN, and the check fails."""
    import cupy as cp
    previous = cp.cuda.get_allocator()

    def allocate(size):
        mem = previous(size)
        if size:
            cp.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cp.cuda.get_current_stream().ptr)
        return mem

    cp.cuda.set_allocator(allocate)
    try:
        return fn()
    finally:
        cp.cuda.set_allocator(previous)


def setup_cudnn(torch, tf32_defaults):
    """cuDNN as every baseline here runs it: benchmark mode over every algorithm it has.

    torch.backends.cudnn.benchmark_limit defaults to 10: cuDNN would time only its heuristics'
    first ten plans, while our tuners time every candidate (results before session 4 ran with
    that default; a benchmark audit found cuDNN TF32 slower than strict on Table 4 L1-L3 bprop,
    which a full search should not give). 0 tries them all. Fills `tf32_defaults` with PyTorch's TF32
    defaults (what its "tf32" mode restores) and returns the settings for a result's meta."""
    torch.backends.cudnn.benchmark = True
    if hasattr(torch.backends.cudnn, "benchmark_limit"):
        torch.backends.cudnn.benchmark_limit = 0
    tf32_defaults.update(cudnn=torch.backends.cudnn.allow_tf32, matmul=torch.backends.cuda.matmul.allow_tf32)
    return {"cudnn_benchmark": True,
            "cudnn_benchmark_limit": getattr(torch.backends.cudnn, "benchmark_limit", None),
            "torch_tf32_defaults": dict(tf32_defaults)}


def provenance(device, **versions):
    """Where, when and how: device name, UTC date, exact command line, source commit, platform
    and versions."""
    return {
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable] + sys.argv)),
        "commit": source_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **versions,
    }


def source_commit(root=RESULTS_DIR.parent):
    """The commit the measured code comes from.

    $MINITORCH_COMMIT when set: a copy of the tree on a lent machine may carry a stale .git, so
    the caller names the commit it sent. Otherwise git's HEAD, marked when tracked files differ
    from it (then HEAD alone does not say what ran), or "unknown" without git."""
    named = backends.config.get("commit")
    if named:
        return named
    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != Path(root).resolve():
            return "unknown (not a git checkout of this tree; set MINITORCH_COMMIT)"  # an outer repo
        head, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here; set MINITORCH_COMMIT)"
    return f"{head} with uncommitted changes" if dirty else head


def markdown_table(rows, columns):
    """A Markdown table of `rows` (dicts); columns is [(header, key, format spec)]."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = []
        for _, key, spec in columns:
            value = row.get(key)
            cells.append("" if value is None else format(value, spec) if spec else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(name, meta, rows, columns, title, notes="", out_dir=RESULTS_DIR, sections=(), extra=None):
    """Write out_dir/<device slug>/<name>.json (meta + rows) and .md (provenance + table).

    sections: more Markdown tables after the main one, as (heading, rows, columns); extra: more
    top-level JSON keys (a section's rows among them). Returns the two paths.
    """
    folder = Path(out_dir) / slug(meta["device"])
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path = folder / f"{name}.json", folder / f"{name}.md"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows, **(extra or {})}, indent=1) + "\n")
    header = [f"# {title}", ""]
    header += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in meta.items()]
    body = [markdown_table(rows, columns)]
    for heading, section_rows, section_columns in sections:
        body += ["", f"## {heading}", "", markdown_table(section_rows, section_columns)]
    md_path.write_text("\n".join(header + ["", notes.strip(), ""] + body) + "\n")
    return json_path, md_path
