"""Experiment (not a benchmark of record): which of a tuning cache's auto choices could move if some
backends' host work a call changed (session 67 gave fbfft, polyphase and tiledfft prepared calls,
~15-45 % less host work a call; the seed's records were timed before). auto decides on burst times
(GPU and host together) and, within its margin, on host work a call (the tie rule). So a choice can
move only where (a) the record was decided by a host tie (a tie given to the layer's other passes'
backend, for their shared spectra, does not weigh host work), or (b) a changed backend is within
--within of the winner's time. For (b) the rows are listed with the changed backend's host work where
the record has it (a tie record keeps every candidate's): a burst of a GPU-bound pass (host under GPU
time) does not move with the host.

  python -m benchmarks.experiments.exp_host_ties results/nvidia-h200/tuning/autotune_s66_call3.json.gz
"""
import argparse
import collections
import gzip
import json


def auto_records(path):
    """{(device, key list): record} of the cache's auto choices (a .json or .json.gz tuning cache)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    out = {}
    for device, records in data.get("devices", {}).items():
        for k, record in records.items():
            key = json.loads(k)
            if key[-1] == "auto" and isinstance(record, dict) and isinstance(record.get("ms"), dict):
                out[device, k] = (key, record)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache")
    ap.add_argument("--changed", default="fbfft,polyphase,tiledfft", help="backends whose host work changed")
    ap.add_argument("--within", type=float, default=0.15, help="a changed backend this close to the winner")
    args = ap.parse_args()
    changed = [b.strip() for b in args.changed.split(",")]
    records = auto_records(args.cache)
    whys = collections.Counter()
    ties, near = [], []
    for (device, _), (key, record) in sorted(records.items()):
        why = record.get("why", "")
        whys["host tie" if "less host work" in why else "the layer's tie" if "the layer's" in why
             else why.split(":")[0][:40]] += 1
        winner, ms, host = record["choice"], record["ms"], record.get("host_ms", {})
        if "less host work" in why:
            ties.append((key, winner, ms, host))
        if winner not in ms:
            continue
        for b in changed:
            if b != winner and b in ms and ms[b] <= (1 + args.within) * ms[winner]:
                near.append((key, winner, ms[winner], b, ms[b], host.get(b)))
    print(f"{len(records)} auto records in {args.cache}; decided by: " +
          ", ".join(f"{w or '(no why)'} {n}" for w, n in whys.most_common()))
    print("\nDecided by a host tie (burst ms; host ms a call):")
    for key, winner, ms, host in ties:
        rivals = ", ".join(f"{b} {ms[b]:.4f} ({host.get(b, float('nan')):.3f})" for b in ms if b != winner
                           and ms[b] <= 1.05 * ms[winner])
        print(f"  {key[1]} {key[3]:7s} {key[2]}: {winner} {ms[winner]:.4f} ({host.get(winner, float('nan')):.3f}); "
              f"within 5 %: {rivals}")
    print(f"\nA backend of {', '.join(changed)} within {args.within:.0%} of the winner (burst ms; its host ms a call "
          "where recorded):")
    for key, winner, w_ms, b, b_ms, b_host in near:
        host = "" if b_host is None else f" (host {b_host:.3f})"
        print(f"  {key[1]} {key[3]:7s} {key[2]}: {winner} {w_ms:.4f}, {b} {b_ms:.4f}{host}")


if __name__ == "__main__":
    main()
