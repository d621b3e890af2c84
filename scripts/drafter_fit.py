#!/usr/bin/env python
"""A drafter's fit on its training batches beside the engine's held-out tau, and its size.

    python scripts/drafter_fit.py --ckpt checkpoints/smollm2-lilicorr \
        --eval results/cpu_smollm2_v9/eval-lilicorr.json --base results/cpu_smollm2_v8/eval-lilicorr.json

Prints the trained parameter count (drafter and head, from model.safetensors), 100-step means of
the training-batch metrics in meta.json's `history` (tau of the walk, slot-1 top-1 accuracy), and
per suite the engine tau of --eval's rules against --base's (slot-1 acceptance, tau / oracle), and
the pooled tau of multi-suite eval JSONs.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, type=Path)
    ap.add_argument("--eval", required=True, nargs="+", type=Path, help="eval JSONs of this checkpoint")
    ap.add_argument("--base", nargs="*", type=Path, default=[], help="eval JSONs to compare with (same suites)")
    ap.add_argument("--every", type=int, default=100)
    args = ap.parse_args(argv)

    from safetensors import safe_open
    with safe_open(str(args.ckpt / "model.safetensors"), "pt") as f:
        sizes = {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}
    head = sum(n for k, n in sizes.items() if k.startswith("head"))
    print(f"trained parameters: {sum(sizes.values()) / 1e6:.2f} M (drafter {(sum(sizes.values()) - head) / 1e6:.2f} M, "
          f"head {head / 1e6:.2f} M)")
    hist = json.loads((args.ckpt / "meta.json").read_text())["history"]
    print("| steps | training-batch tau (walk) | slot-1 top-1 |\n|---|---:|---:|")
    for lo in range(0, len(hist), args.every):
        seg = hist[lo:lo + args.every]
        print(f"| {seg[0]['step']}-{seg[-1]['step']} | {statistics.mean(x['tau_lilicorr'] for x in seg):.3f} | "
              f"{statistics.mean(x['top1_acc'][0] for x in seg):.3f} |")

    def suites(paths):
        return {s: rules for p in paths for s, rules in json.loads(p.read_text())["results"].items()}

    new, old = suites(args.eval), suites(args.base)
    print("\n| suite | rule | base tau | tau | change | slot-1 acceptance | tau / oracle |\n|---|---|---:|---:|---:|---:|---:|")
    for suite, rules in new.items():
        for rule, r in rules.items():
            if rule == "ar" or not isinstance(r, dict) or "tau" not in r:
                continue
            b = old.get(suite, {}).get(rule, {}).get("tau")
            base = f"{b:.3f} | {r['tau']:.3f} | {100 * (r['tau'] / b - 1):+.1f}%" if b else f"— | {r['tau']:.3f} | —"
            print(f"| {suite} | {rule} | {base} | {r['slot_acceptance'][0]:.3f} | {r.get('tau_over_oracle') or 0:.3f} |")
    for name, paths in (("base", args.base), ("this", args.eval)):
        for path in paths:
            doc = json.loads(path.read_text())
            if len(doc["results"]) > 1 and doc.get("overall"):
                print(f"{name} pooled ({path.name}): " + ", ".join(f"{k} {v['tau']:.3f}" for k, v in doc["overall"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
