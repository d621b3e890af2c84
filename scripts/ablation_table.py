#!/usr/bin/env python3
"""A same-budget training ablation over seeds: the engine's greedy tau of every arm and seed per
suite, each arm's change against the reference arm seed by seed, and the seed-to-seed spread.

    python scripts/ablation_table.py --runs work/self_distill/seed-42 work/self_distill/seed-7 \\
        --arms lilicorr distill --base-eval results/cpu_smollm2_v12/eval-lilicorr.json \\
        results/cpu_smollm2_v12/eval-lilicorr-chat.json --out results/self_distill_ablation/table

Each run folder is one seed of scripts/cpu_experiment.sh's `train` phase: `ckpt-<arm>/` (its
config.json names the seed, meta.json holds the training history) and the eval JSONs of
`python -m lilicorr.eval` (`eval-<arm>.json` on the suites, `eval-<arm>-chat.json` on general
chat). An arm is `NAME` (read with --rule) or `NAME:RULE` (that run's evaluation of one rule, e.g.
`vanilla:argmax`, or `lilicorr:argmax` beside `lilicorr` for the walk against argmax on one drafter).
The first arm is the reference. --base-eval: the same evaluations of the checkpoints the arms started
from, `PATH` for every arm or `NAME=PATH` for the arms of that name. Writes OUT.md, OUT.json and
OUT.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from lilicorr.results_io import save_figure, write_report

POOLED = "suites pooled"


def load(paths: list[Path]) -> list[dict]:
    return [json.loads(path.read_text()) for path in paths]


def pooled(doc: dict, rule: str) -> dict:
    """`rule`'s entry over a whole eval JSON: `overall` of a multi-suite run, else its one suite."""
    if len(doc["results"]) > 1 and doc.get("overall"):
        return doc["overall"][rule]
    return next(iter(doc["results"].values()))[rule]


def suite_taus(docs: list[dict], rule: str) -> dict[str, float]:
    """{suite: tau of `rule`} over eval JSONs, plus POOLED from a multi-suite JSON's `overall`."""
    out = {}
    for doc in docs:
        if len(doc["results"]) > 1 and doc.get("overall"):
            out[POOLED] = doc["overall"][rule]["tau"]
        for suite, rules in doc["results"].items():
            out[Path(suite).stem if suite.endswith(".jsonl") else suite] = rules[rule]["tau"]
    return out


def pooled_stats(doc: dict, rule: str) -> dict:
    r = pooled(doc, rule)
    return {"slot1": r["slot_acceptance"][0], "slot_accepted": r["slot_accepted"], "slot_reached": r["slot_reached"],
            "tau_over_oracle": r["tau_over_oracle"], "wall_s": r["wall_s"]}


def train_seconds(folder: Path) -> float | None:
    """The folder's last `train` phase time (scripts/cpu_experiment.sh's phase-times.tsv), if any."""
    tsv = folder / "phase-times.tsv"
    rows = [l.split("\t") for l in tsv.read_text().splitlines()] if tsv.is_file() else []
    times = [float(r[1]) for r in rows if r[0] == "train"]
    return times[-1] if times else None


def arm_spec(spec: str, default_rule: str) -> tuple[str, str, str]:
    """`NAME` or `NAME:RULE` -> (label, checkpoint name, rule)."""
    name, _, rule = spec.partition(":")
    return (f"{name} ({rule})" if rule else name), name, rule or default_rule


def run_of(folder: Path, spec: str, default_rule: str, last: int) -> dict | str:
    """One arm of one seed folder: its seed, engine tau per suite, training-batch means of the last
    `last` steps; or why it is not there yet (a run that has not finished or not been evaluated)."""
    label, arm, rule = arm_spec(spec, default_rule)
    ckpt = folder / f"ckpt-{arm}"
    if not (ckpt / "meta.json").is_file():
        return f"`{ckpt}`: no checkpoint"
    cfg = json.loads((ckpt / "config.json").read_text())["lilicorr"]
    meta = json.loads((ckpt / "meta.json").read_text())
    hist = meta["history"][-last:]
    if meta["step"] < meta["total_steps"]:
        return f"`{ckpt}`: step {meta['step']} of {meta['total_steps']}"
    evals = [folder / f"eval-{arm}.json", folder / f"eval-{arm}-chat.json"]
    missing = [p.name for p in evals if not p.is_file()]
    if missing:
        return f"`{folder}`: no {', '.join(missing)}"
    docs = load(evals)
    if any(rule not in rules for doc in docs for rules in doc["results"].values()):
        return f"`{folder}`: eval-{arm}*.json has no `{rule}` rule"
    return {"arm": label, "rule": rule, "folder": str(folder), "seed": cfg["train"]["seed"],
            "distill": cfg["loss"]["distill"], "steps": hist[-1]["step"], "tau": suite_taus(docs, rule),
            "train_tau": statistics.mean(h[f"tau_{rule}"] for h in hist) if f"tau_{rule}" in hist[-1] else None,
            "train_top1": statistics.mean(h["top1_acc"][0] for h in hist),
            "finished": meta["time"], "train_s": train_seconds(folder),
            "suites": pooled_stats(docs[0], rule), "chat": pooled_stats(docs[1], rule)}


def starts(paths: list[str], specs: list[str], default_rule: str) -> dict[str, dict[str, float]]:
    """{arm label: {suite: tau of its rule}} from --base-eval's `PATH` (every arm) and `NAME=PATH`
    (the arms of checkpoint NAME) entries; an arm with no start is left out."""
    entries = [(p.partition("=")[0], p.partition("=")[2]) if "=" in p else (None, p) for p in paths]
    docs = dict(zip([path for _, path in entries], load([Path(path) for _, path in entries])))
    out = {}
    for spec in specs:
        label, name, rule = arm_spec(spec, default_rule)
        mine = [docs[path] for who, path in entries if who in (None, name)]
        if mine:
            out[label] = suite_taus(mine, rule)
    return out


def tables(runs: list[dict], arms: list[str], bases: dict[str, dict[str, float]], last: int) -> str:
    seeds = sorted({r["seed"] for r in runs}, key=[r["seed"] for r in runs].index)
    at = {(r["arm"], r["seed"]): r for r in runs}
    ref = arms[0]
    suites = list(runs[0]["tau"])
    spread = [a for a in arms if sum((a, s) in at for s in seeds) > 1]      # arms with 2+ seeds
    paired = [s for s in seeds if (ref, s) in at]

    def tau(a, s, suite):
        return f"{at[a, s]['tau'][suite]:.3f}" if (a, s) in at else "—"

    # one start column when every arm started from the same evaluation, else one per arm
    shared = len({json.dumps(b, sort_keys=True) for b in bases.values()}) <= 1 and len(bases) in (0, len(arms))
    start_cols = ["start"] if shared else [f"{a} start" for a in arms if a in bases]
    base_of = {a: bases.get(a, {}) for a in arms}

    def start_cells(suite):
        cols = [next(iter(bases.values()), {})] if shared else [base_of[a] for a in arms if a in bases]
        return [f"{b[suite]:.3f}" if suite in b else "—" for b in cols]

    head = ["suite", *start_cols] + [f"{a} seed {s}" for a in arms for s in seeds] \
        + [f"{a} vs {ref}, seed {s}" for a in arms[1:] for s in paired] + [f"{a} seed spread" for a in spread]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for suite in suites:
        cells = [suite, *start_cells(suite)]
        cells += [tau(a, s, suite) for a in arms for s in seeds]
        cells += [f"{100 * (at[a, s]['tau'][suite] / at[ref, s]['tau'][suite] - 1):+.1f}%" if (a, s) in at else "—"
                  for a in arms[1:] for s in paired]
        for a in spread:          # (max - min) / mean over the arm's seeds
            vals = [at[a, s]["tau"][suite] for s in seeds if (a, s) in at]
            cells.append(f"{100 * (max(vals) - min(vals)) / statistics.mean(vals):.1f}%")
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"Training batches, mean of each run's last {last} steps:", "",
            "| arm | seed | steps | training-batch tau (the arm's rule) | slot-1 top-1 |", "|---|---:|---:|---:|---:|"]
    out += [f"| {r['arm']} | {r['seed']} | {r['steps']} | "
            f"{'—' if r['train_tau'] is None else format(r['train_tau'], '.3f')} | {r['train_top1']:.3f} |" for r in runs]
    out += ["", "Per arm, over its seeds: the mean, and the change against its start (lowest to highest seed):",
            "", f"| suite | {' | '.join(start_cols)} | " + " | ".join(f"{a} mean | {a} vs start" for a in arms) + " |",
            "|---|" + "---:|" * len(start_cols) + "---:|---:|" * len(arms)]
    for suite in suites:
        cells = [suite, *start_cells(suite)]
        for a in arms:
            vals = [at[a, s]["tau"][suite] for s in seeds if (a, s) in at]
            b = base_of[a]
            cells.append(f"{statistics.mean(vals):.3f}" if vals else "—")
            cells.append(f"{100 * (min(vals) / b[suite] - 1):+.1f}% to {100 * (max(vals) / b[suite] - 1):+.1f}%"
                         if vals and suite in b else "—")
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Per run: slot-1 acceptance and tau / oracle of the engine (suites pooled, chat), the "
            "training phase's wall (both arms of a seed side by side), how long after the reference arm "
            "of its seed the run finished, and the evaluation wall:", "",
            "| arm | seed | slot-1 acceptance, suites / chat | tau / oracle, suites / chat | training phase s "
            f"| finished after {ref} s | eval wall s, suites / chat |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        after = f"{r['finished'] - at[ref, r['seed']]['finished']:.0f}" if (ref, r["seed"]) in at else "—"
        train_s = f"{r['train_s']:.0f}" if r["train_s"] is not None else "—"
        su, ch = r["suites"], r["chat"]
        out.append(f"| {r['arm']} | {r['seed']} | {su['slot1']:.3f} / {ch['slot1']:.3f} | "
                   f"{su['tau_over_oracle']:.3f} / {ch['tau_over_oracle']:.3f} | {train_s} | {after} | "
                   f"{su['wall_s']:.0f} / {ch['wall_s']:.0f} |")
    out += ["", "Where the tokens are won or lost, per arm over its seeds: the conditional acceptance at each drafted "
            "slot (accepted / verified, both summed over the seeds; the times verified in brackets), and tau / "
            "oracle (mean):", ""]
    n_slots = max(len(r["suites"]["slot_reached"]) for r in runs)
    out += ["| arm | prompts | " + " | ".join(f"slot {j + 1}" for j in range(n_slots)) + " | tau / oracle |",
            "|---|---|" + "---:|" * (n_slots + 1)]
    for a in arms:
        mine = [at[a, s] for s in seeds if (a, s) in at]
        for key, name in (("suites", "suites pooled"), ("chat", "chat")):
            cells = []
            for j in range(n_slots):
                acc = sum(r[key]["slot_accepted"][j] for r in mine if j < len(r[key]["slot_accepted"]))
                seen = sum(r[key]["slot_reached"][j] for r in mine if j < len(r[key]["slot_reached"]))
                cells.append(f"{acc / seen:.3f} ({seen})" if seen else "— (0)")
            ratio = statistics.mean(r[key]["tau_over_oracle"] for r in mine)
            out.append(f"| {a} | {name} | " + " | ".join(cells) + f" | {ratio:.3f} |")
    return "\n".join(out)


def plot(runs: list[dict], arms: list[str], bases: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(runs[0]["tau"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        mine = [r for r in runs if r["arm"] == arm]
        for i, suite in enumerate(suites):
            x = i + (j - (len(arms) - 1) / 2) * width
            vals = [r["tau"][suite] for r in mine]
            ax.bar(x, statistics.mean(vals), width * 0.9, color=f"C{j}", alpha=0.5, label=arm if i == 0 else None)
            ax.scatter([x] * len(vals), vals, color=f"C{j}", s=12, zorder=3)
        for i, suite in enumerate(suites):     # the arm's start, over its bar
            if suite in bases.get(arm, {}):
                x = i + (j - (len(arms) - 1) / 2) * width
                ax.hlines(bases[arm][suite], x - width * 0.45, x + width * 0.45, colors="k",
                          linestyles="dashed", label="start" if i == 0 and j == min(
                              k for k, a in enumerate(arms) if a in bases) else None)
    ax.set_xticks(range(len(suites)), suites)
    lo = min(min(r["tau"].values()) for r in runs)
    ax.set_ylim(lo - 0.1, None)
    ax.set_ylabel("engine greedy tau")
    ax.set_title("arms at the same budget: bars = mean over seeds, dots = seeds")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", type=Path, required=True, help="one folder per seed")
    p.add_argument("--arms", nargs="+", required=True, help="arm names; the first is the reference")
    p.add_argument("--base-eval", nargs="*", default=[], metavar="[NAME=]PATH",
                   help="eval JSONs of the starting checkpoints: PATH for every arm, NAME=PATH for arm NAME")
    p.add_argument("--rule", default="lilicorr", help="the rule an arm given as NAME is read with")
    p.add_argument("--last", type=int, default=100, help="training steps averaged per run")
    p.add_argument("--out", required=True, help="OUT.md / OUT.json / OUT.png")
    args = p.parse_args(argv)
    if len(args.arms) < 2:
        p.error("--arms needs the reference arm and at least one more")
    found = [run_of(folder, arm, args.rule, args.last) for folder in args.runs for arm in args.arms]
    runs = [r for r in found if isinstance(r, dict)]
    absent = [r for r in found if isinstance(r, str)]
    if not runs:
        p.error("no finished, evaluated run: " + "; ".join(absent))
    if len({r["steps"] for r in runs}) > 1:
        p.error("the runs trained different numbers of steps: " + ", ".join(f"{r['folder']} {r['arm']} {r['steps']}" for r in runs))
    shown = [a for a in args.arms if any(r["arm"] == arm_spec(a, args.rule)[0] for r in runs)]  # arms with a run
    if shown[0] != args.arms[0]:
        p.error(f"the reference arm {args.arms[0]} has no finished, evaluated run: " + "; ".join(absent))
    labels = [arm_spec(a, args.rule)[0] for a in shown]
    try:
        bases = starts(args.base_eval, shown, args.rule)
    except KeyError as e:
        p.error(f"a --base-eval file has no {e} rule for an arm that starts from it")
    rules = {r["arm"]: r["rule"] for r in runs}
    body = (f"Engine greedy tau per suite, each arm read with its rule ("
            + ", ".join(f"{a}: `{rules[a]}`" for a in labels if a in rules)
            + f"); every run {runs[0]['steps']} steps from its start; a per-seed change compares arms trained on "
            f"the same data order, the seed spread is (max - min) / mean over an arm's seeds.\n\n"
            + tables(runs, labels, bases, args.last)
            + "".join(f"\n\nNot in the table: {a}." for a in absent) + "\n\n![tau per arm and seed]({png})\n")
    print(write_report(args.out, "scripts/ablation_table.py", argv,
                       "Same-budget ablation over seeds", body,
                       {"runs": runs, "arms": labels, "base": bases},
                       lambda path: plot(runs, labels, bases, path)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
