"""Experiment: what refusing cuDNN plans that hide a NaN would cost, read from a tuning cache (session 55).

cuDNN 9.19's fused Winograd engine for fp32 3x3 fprops (eng6) gives a finite output for an input
holding NaN (exp_cudnn_nan_plans). Branch s55-cudnn-nan-probe makes the cudnn search refuse such
plans. Before that runs on the GPU, this reads a tuning cache of record and, for every cudnn choice
of ENGINE, prints its time, the best other plan's time in the same search (what the search would
keep instead), and, where auto's record for the geometry chose cudnn, auto's choice with cudnn at
that slower time and the layer-pass's slowdown. Times are the searches' own medians (no GPU here);
the cost in a network's step is the sum over its layers.

  python -m benchmarks.experiments.exp_nan_probe_cost results/nvidia-h200/tuning/autotune_s47_call4.json
"""
import argparse
import json


def rows(cache, device=None, engine="eng6", revision="_s2"):
    """[(geometry, pass, plan, ms, next plan, its ms, auto's choice, its ms, auto's new choice, its ms)] of
    every cudnn record (search `revision`) whose choice is of `engine`, slowest first."""
    devices = cache["devices"]
    records = devices[device or next(iter(devices))]
    out = []
    for k, v in records.items():
        if not k.startswith("["):
            continue
        key = json.loads(k)
        tag = key[-1]
        choice = v.get("choice")
        if not (isinstance(tag, str) and tag.startswith("cudnn@") and tag.endswith(revision)
                and isinstance(choice, dict) and choice["name"].split("_")[0] == engine):
            continue
        ms = v["ms"]
        others = {n: t for n, t in ms.items() if n.split("_")[0] != engine}
        if not others:
            continue
        nxt = min(others, key=others.get)
        auto = records.get(json.dumps([key[0], key[1], key[2][:11], key[3], "auto"]))
        a_choice = a_ms = new = new_ms = None
        if auto is not None:
            a_choice, a_ms = auto["choice"], auto["ms"].get(auto["choice"])
            alt = dict(auto["ms"])
            if "cudnn" in alt:
                alt["cudnn"] = alt["cudnn"] * others[nxt] / ms[choice["name"]]
            new = min(alt, key=alt.get)
            new_ms = alt[new]
        out.append((tuple(key[2][:5]), key[1], key[3], choice["name"], ms[choice["name"]], nxt, others[nxt],
                    a_choice, a_ms, new, new_ms))
    return sorted(out, key=lambda r: -r[4])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache", help="a tuning cache (MINITORCH_TUNE_CACHE's format)")
    ap.add_argument("--engine", default="eng6")
    args = ap.parse_args()
    from benchmarks.harness import meta_lines, provenance
    with open(args.cache) as f:
        cache = json.load(f)
    print(f"# cudnn choices of {args.engine} in {args.cache}, and what the next plan would cost\n")
    print("\n".join(meta_lines(provenance("none (reads the tuning file; the times are its searches', made on "
                                           f"{next(iter(cache['devices']))})"))) + "\n")
    print("| S, f, f', h, w | math | pass | plan | ms | next plan | ms | auto's choice, ms | with the next plan | layer-pass |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for g, math, p, name, t, nxt, tn, a, a_ms, new, new_ms in rows(cache, engine=args.engine):
        auto = "-" if a is None else f"{a} {a_ms:.3f}"
        after = "-" if new is None else f"{new} {new_ms:.3f}"
        slower = "-" if a is None else f"{new_ms / a_ms:.2f}x"
        print(f"| {', '.join(map(str, g))} | {math} | {p} | {name} | {t:.3f} | {nxt} | {tn:.3f} | {auto} | {after} | {slower} |")


if __name__ == "__main__":
    main()
