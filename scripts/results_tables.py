"""Print the summary tables of a results folder's README from its committed files.

    python scripts/results_tables.py tau results/cpu_smollm2_v6
        engine greedy tau per suite (eval-{vanilla,lilicorr}[-chat].json) and the `all` rows of
        tau_vs_steps.json from step FROM (--from, default 2760) on
    python scripts/results_tables.py bench results/main_job_cpu/fp16-weights-auto.json ...
        tokens/s, speedup over ar and tau per rule and concurrency, one column per bench JSON
        (deploy/bench.py), and each file's per-block wall of ar and lilicorr
    python scripts/results_tables.py arms results/cpu_smollm2_v10/tau_vs_steps.json --base lilicorr
        held-out tau (tau_vs_steps.json) of every arm against the base arm at the same step, per suite
    python scripts/results_tables.py fit --ckpt checkpoints/smollm2-lilicorr \
        --eval results/cpu_smollm2_v9/eval-lilicorr.json --base results/cpu_smollm2_v8/eval-lilicorr.json
        a checkpoint's trained parameter count, 100-step means of its training-batch metrics (meta.json
        `history`: tau of the walk, slot-1 top-1), and per suite the engine tau of --eval's rules
        against --base's (slot-1 acceptance, tau / oracle), with the pooled tau of multi-suite JSONs
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
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
    if not (van and li):
        return (f"{folder} has no pair eval-vanilla.json / eval-lilicorr.json to compare: for one arm against "
                "earlier runs use `fit`, for several arms of tau_vs_steps.json use `arms`")
    out += [_tau_row(s, van["results"][s], li["results"][s]) for s in van["results"]]
    out.append(_tau_row("all three", van["overall"], li["overall"]))
    for name, doc, rule in (("vanilla", van, "argmax"), ("walk", li, "lilicorr")):
        hist = [sum(x) for x in zip(*(r[rule]["accept_hist"] for r in doc["results"].values()))]
        out.append(f"\n{name}: blocks ending at slot 1 (accept_hist[1] pooled): {hist[1] / sum(hist):.3f}")
    vc, lc = _load(folder / "eval-vanilla-chat.json"), _load(folder / "eval-lilicorr-chat.json")
    if vc and lc:
        suite = next(iter(vc["results"]))
        out.insert(2 + len(van["results"]) + 1, _tau_row("chat", vc["results"][suite], lc["results"][suite]))
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
                out.append(f"{f.stem}, concurrency {conc}: per-block wall ar {ar['per_block_wall_ms']:.1f} ms "
                           f"(accept {ar['stages_ms']['accept_residual']:.2f}), "
                           f"lilicorr {li['per_block_wall_ms']:.1f} ms (verify {li['stages_ms']['target_verify']:.1f}, "
                           f"accept {li['stages_ms']['accept_residual']:.2f}, LM head "
                           f"{li['stages_ms']['lm_head_projection']:.2f}, head {li['stages_ms']['speculative_head']:.2f}), "
                           f"head share {li['head_share_pct']:.1f}%; every speculative output = ar: "
                           f"{all(c.get('matches_ar') in (None, 1.0) for c in d['cells'])}")
            for rule in sorted({r for r, c in walls if c == conc} - {"ar", "lilicorr"}):
                st = walls[(rule, conc)]
                out.append(f"{f.stem}, concurrency {conc}: {rule} per-block wall {st['per_block_wall_ms']:.1f} ms "
                           f"(verify {st['stages_ms']['target_verify']:.1f}, accept {st['stages_ms']['accept_residual']:.2f})")
        differ = [f"{c['rule']} at {c['concurrency']}: {c['matches_ar']:.0%} of outputs equal" for c in d["cells"]
                  if c.get("matches_ar") not in (None, 1.0)]
        if differ:
            out.append(f"{f.stem}: outputs that differ from ar's: " + "; ".join(differ))
    return "\n".join(out)


def arms_table(path: Path, base: str, steps: list[int] | None = None) -> str:
    """Held-out tau of every arm of a tau_vs_steps.json against arm `base` at the same step and suite:
    the walk's (lilicorr) where the arm has a head, else argmax; and each arm's oracle."""
    points = json.loads(path.read_text())["points"]
    by = {(p["arm"], p["step"], p["suite"]): p for p in points}
    arms = list(dict.fromkeys(p["arm"] for p in points))
    if base not in arms:
        raise SystemExit(f"{path}: no arm {base!r} (arms: {', '.join(arms)})")
    suites = list(dict.fromkeys(p["suite"] for p in points))
    rule = lambda p: p.get("lilicorr", p["argmax"])                        # noqa: E731
    base_steps = sorted({p["step"] for p in points if p["arm"] == base})
    out = ["| step | suite | " + " | ".join(arms) + " | " + " | ".join(f"{a} vs {base}" for a in arms if a != base)
           + " | oracle (" + ", ".join(arms) + ") |",
           "|---:|---|" + "---:|" * (2 * len(arms) - 1) + "---:|"]
    for step in steps or base_steps:
        for suite in suites:
            b = by.get((base, step, suite))
            if b is None:
                continue
            row = [by.get((a, step, suite)) for a in arms]
            taus = [f"{rule(p):.3f}" if p else "—" for p in row]
            gains = [f"{100 * (rule(p) / rule(b) - 1):+.1f}%" if p else "—"
                     for a, p in zip(arms, row) if a != base]
            oracle = ", ".join(f"{p['oracle']:.3f}" if p else "—" for p in row)
            out.append(f"| {step} | {suite} | " + " | ".join(taus + gains) + f" | {oracle} |")
    return "\n".join(out)


def fit_report(ckpt: Path, evals: list[Path], bases: list[Path], every: int) -> str:
    """A checkpoint's size and training-batch fit beside the engine tau of its eval JSONs."""
    from safetensors import safe_open

    out = []
    if (ckpt / "model.safetensors").is_file():   # a results folder may keep only the training meta.json
        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            sizes = {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}
        head = sum(n for k, n in sizes.items() if k.startswith("head"))
        out.append(f"trained parameters: {sum(sizes.values()) / 1e6:.2f} M (drafter "
                   f"{(sum(sizes.values()) - head) / 1e6:.2f} M, head {head / 1e6:.2f} M)")
    hist = json.loads((ckpt / "meta.json").read_text())["history"]
    distilled = "kd" in hist[0]          # lattice distillation: its KL (unweighted) and the distractor term
    out.append("| steps | training-batch tau (walk) | slot-1 top-1 | argmax tau | walk gain | CE |"
               + (" distractor | KL |" if distilled else "") + "\n|---|---:|---:|---:|---:|---:|"
               + ("---:|---:|" if distilled else ""))
    for lo in range(0, len(hist), every):
        seg = hist[lo:lo + every]
        walk, argmax = (statistics.mean(x[k] for x in seg) for k in ("tau_lilicorr", "tau_argmax"))
        extra = "".join(f" {statistics.mean(x[k] for x in seg):.3f} |" for k in ("dist", "kd")) if distilled else ""
        out.append(f"| {seg[0]['step']}-{seg[-1]['step']} | {walk:.3f} | "
                   f"{statistics.mean(x['top1_acc'][0] for x in seg):.3f} | {argmax:.3f} | "
                   f"{100 * (walk / argmax - 1):+.1f}% | {statistics.mean(x['ce'] for x in seg):.3f} |" + extra)

    def suites(paths):
        return {s: rules for p in paths for s, rules in json.loads(p.read_text())["results"].items()}

    new, old = suites(evals), suites(bases)
    out.append("\n| suite | rule | base tau | tau | change | slot-1 acceptance | tau / oracle |\n|---|---|---:|---:|---:|---:|---:|")
    for suite, rules in new.items():
        for rule, r in rules.items():
            if rule == "ar" or not isinstance(r, dict) or "tau" not in r:
                continue
            b = old.get(suite, {}).get(rule, {}).get("tau")
            cells = f"{b:.3f} | {r['tau']:.3f} | {100 * (r['tau'] / b - 1):+.1f}%" if b else f"— | {r['tau']:.3f} | —"
            out.append(f"| {suite} | {rule} | {cells} | {r['slot_acceptance'][0]:.3f} | {r.get('tau_over_oracle') or 0:.3f} |")
    for name, paths in (("base", bases), ("this", evals)):
        for path in paths:
            doc = json.loads(path.read_text())
            if len(doc["results"]) > 1 and doc.get("overall"):
                out.append(f"{name} pooled ({path.name}): "
                           + ", ".join(f"{k} {v['tau']:.3f}" for k, v in doc["overall"].items()))
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tau")
    t.add_argument("folder", type=Path)
    t.add_argument("--from", dest="first_step", type=int, default=2760)
    b = sub.add_parser("bench")
    b.add_argument("files", type=Path, nargs="+")
    a = sub.add_parser("arms")
    a.add_argument("points", type=Path, help="a tau_vs_steps.json")
    a.add_argument("--base", default="lilicorr", help="the arm the others are compared with")
    a.add_argument("--steps", type=int, nargs="*", default=None, help="only these steps (default: the base arm's)")
    f = sub.add_parser("fit")
    f.add_argument("--ckpt", required=True, type=Path)
    f.add_argument("--eval", required=True, nargs="+", type=Path, help="eval JSONs of this checkpoint")
    f.add_argument("--base", nargs="*", type=Path, default=[], help="eval JSONs to compare with (same suites)")
    f.add_argument("--every", type=int, default=100)
    args = p.parse_args(argv)
    if args.what == "tau":
        print(tau_tables(args.folder, args.first_step))
    elif args.what == "bench":
        print(bench_table(args.files))
    elif args.what == "arms":
        print(arms_table(args.points, args.base, args.steps))
    else:
        print(fit_report(args.ckpt, args.eval, args.base, args.every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
