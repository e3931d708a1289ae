"""Tune ahead: every `auto` choice a zoo network's training step asks for, into a tuning cache.

A benchmark that finds its choices in the cache times; one that does not tunes first, and tuning
every candidate is most of its time on a lent GPU (session 27: ResNet-50's step ran 235 s without
finishing its first row, its carried cache holding 14 of the 68 choices per precision). This
asks auto for every choice of the step (benchmarks.tune_coverage's list) in the order the step
asks (the forward's fprops, then each layer's bprop and accGrad from the last layer back, so a tie
between FFT backends goes the way it would in the step). A choice the cache holds costs a look-up,
unless auto would tune it again (a candidate its record never timed, a backend's revision since):
then it is tuned here, as the step would. Every choice is written to the cache as it is made: a
run stopped by --seconds or a timeout keeps what it finished, and the next run goes on from there.
A cache it could not write (not a tuning cache, a folder it cannot write in) is refused first.

    python -m benchmarks.tune_zoo .dev/tune/autotune.json --networks resnet50 [--precisions fp32,tf32]
        [--seconds 540] [--backends ours] [--batch N]

On a GPU (CuPy). On the CPU auto times nothing unless MINITORCH_AUTO_TUNE=on, and there is one
precision (fp32): the CPU run exists for the tests. The last stdout lines are a table: per network
and precision, the choices the file held before (records in tune()'s format: an upper bound, as
tune_coverage's), those tuned now, and those it holds after. Exit 0: every choice held; 3: stopped
by --seconds; 1: some still missing, or a choice failed (its traceback, then the table).
"""
import argparse
import sys
import time
import traceback

from tqdm import tqdm

from minitorch_fft import backends
from minitorch_fft.backends import auto, cgemm, config, tuning
from benchmarks.paper import NETWORKS
from benchmarks.tune_coverage import (PRECISIONS, add_network_arguments, choice_key, coverage, networks,
                                      step_choices)


def step_order(choices, layer_names):
    """`choices` [(layer name, pass)] sorted as a training step asks for them: every fprop in
    layer order, then from the last layer back each layer's bprop before its accGrad."""
    index = {name: i for i, name in enumerate(layer_names)}

    def when(item):
        name, pass_name = item
        if pass_name == "fprop":
            return (0, index[name], 0)
        return (1, -index[name], 0 if pass_name == "bprop" else 1)
    return sorted(choices, key=when)


def plan(device, nets, precisions, batch_of, label):
    """[(net, precision, [(layer name, x_shape, w_shape, stride, padding, pass, cache key)])]:
    every choice each network's step asks for, in step order. A choice two networks share
    (ResNet-18's and ResNet-50's stem) is listed under the first only."""
    todo, listed = [], set()
    for net in nets:
        wanted = step_choices(net, batch_of(net))
        geometry = {name: tuple(geom) for name, *geom, _ in wanted}
        order = step_order([(name, pass_name) for name, *_, pass_name in wanted], list(geometry))
        for math in precisions:
            items = []
            for name, pass_name in order:
                key = choice_key(device, math, *geometry[name], pass_name, label)
                if key not in listed:
                    listed.add(key)
                    items.append((name, *geometry[name], pass_name, key))
            todo.append((net, math, items))
    return todo


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cache", help="the tuning cache to fill (made if missing; never replaced if it is not one)")
    add_network_arguments(ap)
    ap.add_argument("--precisions", default=",".join(PRECISIONS),
                    help="comma-separated GEMM precisions to tune, of fp32 (strict) and tf32 (the TF32 mode)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="start no new choice after this many seconds (a choice under way finishes)")
    ap.add_argument("--backends", default=None,
                    help="auto's candidate set, as MINITORCH_AUTO_BACKENDS (ours: our own algorithms alone)")
    args = ap.parse_args(argv)
    nets = networks(ap, args)
    precisions = [m.strip() for m in args.precisions.split(",") if m.strip()]
    if not precisions or any(m not in PRECISIONS for m in precisions):
        ap.error(f"--precisions takes {' and '.join(PRECISIONS)}, comma-separated; got {args.precisions!r}")
    if args.seconds is not None and not args.seconds > 0:
        ap.error(f"--seconds must be positive, got {args.seconds}")
    xp = _array_module()
    if xp.__name__ == "numpy" and "tf32" in precisions:
        ap.error("tf32 is a GPU precision: on the CPU only --precisions fp32 can be tuned")
    if not tuning.enabled("auto_tune", xp):
        ap.error("auto times nothing here: MINITORCH_AUTO_TUNE is off" if xp.__name__ != "numpy" else
                 "no GPU (CuPy) here, and on the CPU auto times nothing unless MINITORCH_AUTO_TUNE=on")
    settings = {"tune_cache": args.cache}
    if args.backends is not None:
        settings["auto_backends"] = args.backends
    try:
        with config.override(**settings):   # a bad --backends is refused by name, before any work
            backends.auto_registry()
    except ValueError as e:
        ap.error(str(e))
    why = tuning.TuneCache(args.cache).unwritable()
    if why is not None:
        ap.error(f"the choices would stay in memory and be lost: {why}")
    with config.override(**settings):
        return _tune_all(xp, nets, precisions, args)


def _array_module():
    """CuPy where a CUDA device answers, else NumPy."""
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:
        import numpy
        return numpy


def _tune_all(xp, nets, precisions, args):
    start = time.perf_counter()
    cache = tuning.default_cache()
    device, label = tuning.device_name(xp), auto.label()
    batch_of = lambda net: args.batch or NETWORKS[net][0]   # noqa: E731
    before = {net: coverage(cache, device, net, batch_of(net), label) for net in nets}
    todo = plan(device, nets, precisions, batch_of, label)
    tuned = {(net, math): 0 for net, math, _ in todo}
    stopped = None
    total = sum(len(items) for *_, items in todo)
    print(f"tune_zoo: {device}, {label}, cache {cache.path}: {total} choices to find or tune", file=sys.stderr)
    current = failed = None
    try:
        with tqdm(total=total, desc="tuning", unit="choice", file=sys.stderr) as bar:
            for net, math, items in todo:
                with cgemm.tf32(math == "tf32"):
                    for name, x_shape, w_shape, stride, padding, pass_name, key in items:
                        if args.seconds is not None and time.perf_counter() - start > args.seconds:
                            stopped = f"stopped after {time.perf_counter() - start:.0f} s (--seconds {args.seconds:g})"
                            break
                        current = f"{net} {math} {name} {pass_name}"
                        bar.set_postfix_str(current)
                        # every choice, held or not, as the step asks: a held record auto would tune
                        # again (a candidate it never timed, a backend's revision since) is tuned here
                        old = cache.get(key)
                        backends.choose("auto", pass_name, x_shape, w_shape, stride, padding, xp=xp)
                        tuned[(net, math)] += cache.get(key) is not old
                        bar.update(1)
                if stopped:
                    break
    except Exception:  # noqa: BLE001 - said with its traceback, after the table of what was done
        traceback.print_exc()
        failed = current
    # counted again from the file: what a later run will find, whatever this one believes it wrote
    after = {net: coverage(tuning.TuneCache(cache.path), device, net, batch_of(net), label) for net in nets}
    print(f"{device}, {label}, {cache.path}: {time.perf_counter() - start:.0f} s")
    print("| network | precision | held before | tuned now | held now | wanted |")
    print("|---|---|---|---|---|---|")
    for net, math, _ in todo:
        held, wanted, _ = before[net][math]
        print(f"| {net} | {math} | {held} | {tuned[(net, math)]} | {after[net][math][0]} | {wanted} |")
    if failed is not None:
        print(f"tune_zoo: failed at {failed} (the traceback above); the choices made before it are in "
              f"{cache.path}", file=sys.stderr)
        return 1
    if stopped:
        print(f"tune_zoo: {stopped}; run it again to go on", file=sys.stderr)
        return 3
    missing = sum(wanted - held for found in after.values() for math, (held, wanted, _) in found.items()
                  if math in precisions)
    if missing:
        print(f"tune_zoo: {missing} choice(s) still missing from {cache.path} after tuning (a pass with one "
              "candidate is never written; a cache write that failed warned above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
