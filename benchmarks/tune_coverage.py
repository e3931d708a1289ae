"""Which of the zoo networks' `auto` choices a tuning cache holds, per device and GEMM precision.

A choice the cache lacks is tuned afresh by the next run, and tuning every candidate is most of a
benchmark's time on a lent GPU: ResNet-50's training step ran 235 s without finishing its first
row in session 27, with a carried cache that held 14 of the 68 its step asks for in each
precision. Check a cache before carrying it:

    python -m benchmarks.tune_coverage .dev/tune/autotune.json [--networks alexnet,resnet50]
        [--device "NVIDIA H100 80GB HBM3"] [--label "auto[ours]"] [--batch N]

Runs on the CPU (the layers' geometries are traced there); nothing is written. "Held" counts
records in tune()'s format; auto may still tune one again where its choice is no longer a
candidate (a backend changed, a setting restricts the set), so it is an upper bound. The choices
counted are those the current settings key (auto.label(): a restricted candidate set or non-default
memory bounds have keys of their own), unless --label names others.
"""
import argparse
import sys

from minitorch_fft.backends import auto, tuning
from benchmarks.harness import PASSES, distinct_conv_layers
from benchmarks.paper import NETWORKS

PRECISIONS = ("fp32", "tf32")


def step_choices(net, batch):
    """[(layer name, x_shape, w_shape, stride, padding, pass)]: the `auto` choices a training step
    of `net` at `batch` asks for, each distinct convolution's passes in layer order. A training
    step never asks for the input image's gradient: the first layer's bprop is left out, unless a
    later layer shares its geometry."""
    return [(name, x_shape, w_shape, stride, padding, pass_name)
            for i, (name, x_shape, w_shape, stride, padding, count) in enumerate(distinct_conv_layers(net, batch))
            for pass_name in PASSES if not (i == 0 and count == 1 and pass_name == "bprop")]


def choice_key(device, math, x_shape, w_shape, stride, padding, pass_name, label="auto"):
    """The tuning cache's key of auto's choice for one pass, as auto._pick makes it (tuning.key)."""
    geometry = auto._geometry_key(x_shape, w_shape, stride, padding)
    return (device, "float32", math, tuple(int(v) for v in geometry), pass_name, label)


def coverage(cache, device, net, batch, label="auto"):
    """{precision: (held, wanted, [missing (layer name, pass)])}: the choices a training step of
    `net` at `batch` asks for (step_choices) that `cache` (a tuning.TuneCache) holds for `device`,
    keyed by `label` ("auto", or "auto[...]" for a restricted candidate set)."""
    out = {}
    wanted = step_choices(net, batch)
    for math in PRECISIONS:
        missing = [(name, pass_name) for name, *geom, pass_name in wanted
                   if not tuning.is_record(cache.get(choice_key(device, math, *geom, pass_name, label)))]
        out[math] = (len(wanted) - len(missing), len(wanted), missing)
    return out


def add_network_arguments(ap):
    """--networks and --batch, as this tool and tune_zoo take them (networks() reads them back)."""
    ap.add_argument("--networks", default=",".join(NETWORKS),
                    help=f"comma-separated, of {', '.join(NETWORKS)} (default: all)")
    ap.add_argument("--batch", type=int, help="every network at this batch (default: the benchmarks' own, "
                    "VGG-16 64, the others 128), as `paper step --batch`")


def networks(ap, args):
    """The network names add_network_arguments' options give, checked (ap.error otherwise)."""
    nets = [n.strip() for n in args.networks.split(",") if n.strip()]
    unknown = [n for n in nets if n not in NETWORKS]
    if unknown or not nets:
        ap.error(f"unknown network(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(NETWORKS)}")
    if args.batch is not None and args.batch < 1:
        ap.error(f"--batch must be at least 1, got {args.batch}")
    return nets


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cache", help="a tuning cache (the file $MINITORCH_TUNE_CACHE names)")
    add_network_arguments(ap)
    ap.add_argument("--device", help="the device name as the cache spells it (default: each device in it)")
    ap.add_argument("--label", default=None, help='the choices\' backend field: "auto[ours]" for auto over our '
                    'own algorithms alone; default: what auto.label() gives under the current settings ("auto" at '
                    'the defaults; "auto{cudnn_workspace_mb=1024}" with MINITORCH_CUDNN_WORKSPACE_MB=1024)')
    args = ap.parse_args(argv)
    nets = networks(ap, args)
    cache = tuning.TuneCache(args.cache)
    held = cache.devices()
    if not held:
        ap.error(f"{args.cache} holds no tuning choices (missing, empty, of another format version, "
                 "or not a tuning cache)")
    devices = [args.device] if args.device else held
    if args.device and args.device not in held:
        ap.error(f"{args.cache} holds no choices for {args.device!r}; it holds: {', '.join(held)}")
    print(f"| device | network | batch | {' | '.join(f'{m} held' for m in PRECISIONS)} | first missing |")
    print("|---|---|---|" + "---|" * len(PRECISIONS) + "---|")
    for device in devices:
        for net in nets:
            batch = args.batch or NETWORKS[net][0]
            found = coverage(cache, device, net, batch, args.label or auto.label())
            first = next((f"{m} {name} {p}" for m in PRECISIONS for name, p in found[m][2]), "")
            counts = " | ".join(f"{found[m][0]} / {found[m][1]}" for m in PRECISIONS)
            print(f"| {device} | {net} | {batch} | {counts} | {first} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
