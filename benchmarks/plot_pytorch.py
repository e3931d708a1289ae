"""The adapter's results at a glance: converted against stock PyTorch, from bench_pytorch's files.

Reads the result files of record for NCHW models that `python -m benchmarks.bench_pytorch` wrote into
one device's folder (bench_pytorch_<net>[_tf32][_reduce_overhead].json, and
bench_pytorch_<net>[_tf32]_convert_channels_last[_reduce_overhead].json: the same stock NCHW model
against `convert(model, channels_last=True)`; the channels-last models', pass-graph and other
variants are left out) and draws, per precision (strict fp32 against PyTorch strict, TF32 mode
against PyTorch's default), each network's converted step as a multiple of the stock step's speed
in the same mode and run (the files' "vs_stock"), and its peak memory as a fraction of stock's. Bars
are the modes: eager, CUDA graph, torch.compile, torch.compile reduce-overhead, and each again with
channels_last=True where a convert-channels-last file holds it (an eager row comes from the plain
file of its variant, as the NCHW eager bars do: a reduce-overhead file's eager rows are not drawn).
A panel has a slot for each mode it draws. Nothing is measured here: every figure is a file's, and
the Markdown beside the plot lists each file's commit, date and command.

  python -m benchmarks.plot_pytorch                          # results/nvidia-h200
  python -m benchmarks.plot_pytorch results/nvidia-h100-80gb-hbm3

Writes <folder>/bench_pytorch_summary.{png,md}.
"""
import argparse
import json
import sys
from pathlib import Path

from benchmarks.harness import RESULTS_DIR, save_figure, write_text

NETWORKS = ("alexnet", "overfeat_fast", "vgg16", "resnet50")
# the rows' "precision" -> (the column's title, the file name's part)
PRECISIONS = {"strict": ("strict fp32, against PyTorch strict", ""),
              "tf32": ("TF32 mode, against PyTorch's default", "_tf32")}
# a bar: its label -> (the rows' "mode", the file name's part after the precision's)
BARS = {"eager": ("eager", ""), "CUDA graph": ("CUDA graph", ""), "torch.compile": ("torch.compile", ""),
        "torch.compile reduce-overhead": ("torch.compile reduce-overhead", "_reduce_overhead"),
        "eager, channels_last=True": ("eager", "_convert_channels_last"),
        "CUDA graph, channels_last=True": ("CUDA graph", "_convert_channels_last"),
        "torch.compile, channels_last=True": ("torch.compile", "_convert_channels_last"),
        "reduce-overhead, channels_last=True": ("torch.compile reduce-overhead",
                                                "_convert_channels_last_reduce_overhead")}
MODES = tuple(BARS)
STOCK_MODES = MODES[:4]   # the bars every network and precision should have (the Markdown names those missing)
NAME = "bench_pytorch_summary"


def source(folder, net, precision, bar):
    """The result file of record holding (net, precision, bar)'s rows."""
    return Path(folder) / f"bench_pytorch_{net}{PRECISIONS[precision][1]}{BARS[bar][1]}.json"


class BadResult(ValueError):
    """A file named as a bench_pytorch result that does not hold one (the message names it and why)."""


def _read(path):
    """A bench_pytorch result file's JSON ({"meta", "rows"}), None where there is no file; BadResult
    for anything else at that path."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadResult(f"{path}: not a readable JSON file ({e})") from None
    if not (isinstance(data, dict) and isinstance(data.get("meta"), dict) and isinstance(data.get("rows"), list)
            and all(isinstance(r, dict) for r in data["rows"])):
        raise BadResult(f"{path}: not a bench_pytorch result (a JSON object with \"meta\" and a list of \"rows\")")
    for r in data["rows"]:
        fields = {"network": str, "precision": str, "mode": str, "converted": bool}
        numbers = ("vs_stock", "peak_mib")
        if not (all(isinstance(r.get(k), t) for k, t in fields.items())
                and all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) and r[k] > 0
                        for k in numbers)):
            raise BadResult(f"{path}: a row without {', '.join(fields)} or a positive {' and '.join(numbers)}: "
                            f"{r!r:.200}")
    return data


def collect(folder):
    """(bars, sources): bars [{network, precision, mode, speedup, peak_ratio, commit}] for every converted
    row found; sources {file name: meta} of the files read. BadResult for a file that is not a result."""
    bars, sources, cache = [], {}, {}
    for net in NETWORKS:
        for precision in PRECISIONS:
            for mode in MODES:
                path = source(folder, net, precision, mode)
                row_mode = BARS[mode][0]
                if path not in cache:
                    cache[path] = _read(path)
                data = cache[path]
                if data is None:
                    continue
                rows = [r for r in data["rows"] if r["network"] == net and r["precision"] == precision
                        and r["mode"] == row_mode]
                stock = [r for r in rows if not r["converted"]]
                ours = [r for r in rows if r["converted"]]
                if not (stock and ours):
                    continue
                sources[path.name] = data["meta"]
                bars.append({"network": net, "precision": precision, "mode": mode, "speedup": ours[0]["vs_stock"],
                             "peak_ratio": ours[0]["peak_mib"] / stock[0]["peak_mib"],
                             "peak": (ours[0]["peak_mib"], stock[0]["peak_mib"]),
                             "commit": data["meta"].get("commit", "not recorded"), "file": path.name})
    return bars, sources


def plot(bars, path, device):
    """Two rows (speed-up, peak ratio) by one column per precision; a bar a mode, grouped by network."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(PRECISIONS), figsize=(14, 8), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]   # a mode's colour the same in every panel
    for col, precision in enumerate(PRECISIONS):
        drawn_modes = [m for m in MODES if any(b["precision"] == precision and b["mode"] == m for b in bars)]
        width = 0.8 / max(len(drawn_modes), 1)
        for row, (key, label) in enumerate((("speedup", "speed-up over stock (same mode, same run)"),
                                            ("peak_ratio", "peak memory / stock's"))):
            ax = axes[row][col]
            for k, mode in enumerate(drawn_modes):
                points = [(NETWORKS.index(b["network"]) + (k - (len(drawn_modes) - 1) / 2) * width, b[key])
                          for b in bars if b["precision"] == precision and b["mode"] == mode]
                xs, ys = zip(*points)
                drawn = ax.bar(xs, ys, width, label=mode, color=colors[MODES.index(mode) % len(colors)])
                ax.bar_label(drawn, fmt="%.2f", fontsize=7, rotation=90, padding=2)
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_ylabel(label)
            ax.grid(axis="y", alpha=0.3)
            ax.margins(y=0.15)
            if row == 0:
                ax.set_title(PRECISIONS[precision][0])
            ax.set_xticks(range(len(NETWORKS)), NETWORKS)
    handles = {h.get_label(): h for ax in axes.flat for h in ax.containers}
    fig.legend([handles[m] for m in MODES if m in handles], [m for m in MODES if m in handles],
               loc="upper center", ncol=4, fontsize=9, bbox_to_anchor=(0.5, 0.02))
    fig.suptitle(f"minitorch_fft.pytorch.convert: training step against stock PyTorch, {device}\n"
                 f"(the files of record, commits in {NAME}.md; above 1 is faster, below 1 is less memory;\n"
                 "channels_last=True: convert(model, channels_last=True) against the stock NCHW model)")
    fig.subplots_adjust(top=0.86)   # the three-line title above the panels' own
    save_figure(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)


MADE_BY = "Made by `python -m benchmarks.plot_pytorch`"   # the Markdown's own line: a summary it may replace


def ours(folder):
    """Whether the summary files in `folder` are absent or plot_pytorch's own (its Markdown says so):
    a file of the same name the user made is never replaced."""
    md, png = folder / f"{NAME}.md", folder / f"{NAME}.png"
    if md.exists():
        try:
            return MADE_BY in md.read_text()
        except (OSError, UnicodeDecodeError):
            return False
    return not png.exists()


def markdown(bars, sources, device):
    lines = [f"# Converted against stock PyTorch, {device}: the plot's figures and their files", "",
             f"![summary]({NAME}.png)", "",
             f"{MADE_BY} from the result files below (nothing measured by it).", "",
             "| network | precision | mode | speed-up | peak MiB, ours / stock | file | commit |",
             "|---|---|---|---|---|---|---|"]
    for b in bars:
        lines.append(f"| {b['network']} | {b['precision']} | {b['mode']} | {b['speedup']:.2f}x | "
                     f"{b['peak'][0]:.0f} / {b['peak'][1]:.0f} | {b['file']} | {b['commit']} |")
    missing = [f"{net} {precision} {mode}" for net in NETWORKS for precision in PRECISIONS for mode in STOCK_MODES
               if not any((b["network"], b["precision"], b["mode"]) == (net, precision, mode) for b in bars)]
    if missing:
        lines += ["", "No bar (no file of record in this folder holds both rows): " + "; ".join(missing) + "."]
    lines += ["", "| file | date | commit | command |", "|---|---|---|---|"]
    for name, meta in sorted(sources.items()):
        lines.append(f"| {name} | {meta.get('date', '')} | {meta.get('commit', '')} | `{meta.get('command', '')}` |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", default=str(RESULTS_DIR / "nvidia-h200"),
                        help="a device's results folder (default: results/nvidia-h200)")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        parser.error(f"{folder} is not a folder of results (expected results/<device>/)")
    try:
        bars, sources = collect(folder)
    except BadResult as e:
        parser.error(str(e))
    if not bars:
        parser.error(f"no bench_pytorch_<net>[_tf32][_convert_channels_last][_reduce_overhead].json with stock and "
                     f"converted rows in {folder}")
    if not ours(folder):
        parser.error(f"{folder / NAME}.md or .png is there and was not made by plot_pytorch; move it away first")
    device = next(iter(sources.values())).get("device", folder.name)
    png, md = folder / f"{NAME}.png", folder / f"{NAME}.md"
    write_text(md, markdown(bars, sources, device))   # first: a plot beside its Markdown is ours to replace
    plot(bars, png, device)
    print(f"{len(bars)} bars from {len(sources)} files: {png}, {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
