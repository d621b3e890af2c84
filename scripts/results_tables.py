"""Print the summary tables of a results folder's README from its committed files.

    python scripts/results_tables.py tau results/cpu_smollm2_v6
        engine greedy tau per suite (eval-{vanilla,lilicorr}[-chat].json) and the `all` rows of
        tau_vs_steps.json from step FROM (--from, default 2760) on
    python scripts/results_tables.py bench results/main_job_cpu/fp16-weights-auto.json ...
        tokens/s, speedup over ar and tau per rule and concurrency, one column per bench JSON
        (deploy/bench.py), and each file's per-block wall of ar and lilicorr
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _tau_row(name: str, v: dict, li: dict) -> str:
    va, la, lw = v["argmax"], li["argmax"], li["lilicorr"]
    return (f"| {name} | {va['tau']:.3f} | {la['tau']:.3f} | {lw['tau']:.3f} | {100 * (lw['tau'] / va['tau'] - 1):+.1f}% | "
            f"{va['slot_acceptance'][0]:.3f} / {lw['slot_acceptance'][0]:.3f} | "
            f"{va['tau_over_oracle']:.3f} / {lw['tau_over_oracle']:.3f} |")


def tau_tables(folder: Path, first_step: int) -> str:
    out = ["| suite | vanilla argmax | LiLiCorr argmax | LiLiCorr walk | walk vs vanilla | "
           "slot-1 acceptance (vanilla / walk) | tau / oracle (vanilla / walk) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    van, li = _load(folder / "eval-vanilla.json"), _load(folder / "eval-lilicorr.json")
    if van and li:
        out += [_tau_row(s, van["results"][s], li["results"][s]) for s in van["results"]]
        out.append(_tau_row("all three", van["overall"], li["overall"]))
        for name, doc, rule in (("vanilla", van, "argmax"), ("walk", li, "lilicorr")):
            hist = [sum(x) for x in zip(*(r[rule]["accept_hist"] for r in doc["results"].values()))]
            out.append(f"\n{name}: blocks ending at slot 1 (accept_hist[1] pooled): {hist[1] / sum(hist):.3f}")
    vc, lc = _load(folder / "eval-vanilla-chat.json"), _load(folder / "eval-lilicorr-chat.json")
    if vc and lc:
        suite = next(iter(vc["results"]))
        out.insert(2 + len(van["results"]) + 1 if van and li else 2, _tau_row("chat", vc["results"][suite], lc["results"][suite]))
    steps = _load(folder / "tau_vs_steps.json")
    if steps:
        by = {(p["arm"], p["step"], p["suite"]): p for p in steps["points"]}
        out += ["", "| step | vanilla argmax | LiLiCorr argmax | LiLiCorr walk | walk vs vanilla | LiLiCorr oracle |",
                "|---:|---:|---:|---:|---:|---:|"]
        for step in sorted({p["step"] for p in steps["points"] if p["step"] >= first_step}):
            v, li_ = by.get(("vanilla", step, "all")), by.get(("lilicorr", step, "all"))
            if v and li_:
                out.append(f"| {step} | {v['argmax']:.3f} | {li_['argmax']:.3f} | {li_['lilicorr']:.3f} | "
                           f"{100 * (li_['lilicorr'] / v['argmax'] - 1):+.1f}% | {li_['oracle']:.3f} |")
    return "\n".join(out)


def bench_table(files: list[Path]) -> str:
    docs = [json.loads(f.read_text()) for f in files]
    keys = [(c["rule"], c["concurrency"]) for c in docs[0]["cells"]]
    keys.sort(key=lambda k: (k[1], ["ar", "argmax", "lilicorr"].index(k[0]) if k[0] in ("ar", "argmax", "lilicorr") else 9))
    out = ["| rule | concurrency | " + " | ".join(f.stem for f in files) + " |",
           "|---|---:|" + "---:|" * len(files)]
    for rule, conc in keys:
        cells = []
        for d in docs:
            c = next((c for c in d["cells"] if c["rule"] == rule and c["concurrency"] == conc), None)
            if c is None:
                cells.append("")
            elif rule == "ar":
                cells.append(f"{c['tokens_per_s']:.1f}")
            else:
                cells.append(f"{c['tokens_per_s']:.1f} ({c['speedup']:.2f}x) {c['tau']:.2f}")
        out.append(f"| `{rule}` | {conc} | " + " | ".join(cells) + " |")
    out.append("")
    for f, d in zip(files, docs):
        walls = {(c["rule"], c["concurrency"]): c["stages"] for c in d["cells"] if c.get("stages")}
        for conc in sorted({k[1] for k in walls}):
            ar, li = walls.get(("ar", conc)), walls.get(("lilicorr", conc))
            if ar and li:
                out.append(f"{f.stem}, concurrency {conc}: per-block wall ar {ar['per_block_wall_ms']:.1f} ms, "
                           f"lilicorr {li['per_block_wall_ms']:.1f} ms (verify {li['stages_ms']['target_verify']:.1f}), "
                           f"head share {li['head_share_pct']:.1f}%; every speculative output = ar: "
                           f"{all(c.get('matches_ar') in (None, 1.0) for c in d['cells'])}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tau")
    t.add_argument("folder", type=Path)
    t.add_argument("--from", dest="first_step", type=int, default=2760)
    b = sub.add_parser("bench")
    b.add_argument("files", type=Path, nargs="+")
    args = p.parse_args(argv)
    print(tau_tables(args.folder, args.first_step) if args.what == "tau" else bench_table(args.files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
