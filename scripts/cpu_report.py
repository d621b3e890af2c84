"""Collect the CPU experiment (scripts/cpu_experiment.sh) into results/cpu_smollm2/.

    python scripts/cpu_report.py [--work work/cpu_smollm2] [--out results/cpu_smollm2]

Copies the eval JSON files, plots the training curves from the checkpoints' step logs, and writes
README.md (starting with OUT/notes.md, the hand-written findings, when present) with the tables: tau / tokens per second / speedup per suite and rule, tau relative to
vanilla DFlash, tau / oracle tau, the greedy-vs-Viterbi delta and the loss ablation.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODELS = {"vanilla": "vanilla DFlash (--vanilla)", "lilicorr": "LiLiCorr, joint (full loss)",
          "nodist": "LiLiCorr without L_dist (Appendix C)", "margin": "LiLiCorr + margin (Appendix G)"}


def read_log(path: Path) -> list[dict]:
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec            # a resumed run repeats steps: keep the last
    return [by_step[k] for k in sorted(by_step)]


def plot_curves(logs: dict[str, list[dict]], out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, recs in logs.items():
        steps = [r["step"] for r in recs]
        axes[0].plot(steps, [r["dflash"] for r in recs], label=name)
        axes[1].plot(steps, [r["oracle_coverage"] for r in recs], label=name)
        key = "tau_lilicorr" if "tau_lilicorr" in recs[-1] else "tau_argmax"
        axes[2].plot(steps, [r[key] for r in recs], label=f"{name} ({key[4:]})")
    for ax, title in zip(axes, ("DFlash CE (Eq. 6)", "oracle prefix length (slots)",
                                "teacher-forced tau estimate")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def collect_eval(work: Path, out: Path, stem: str) -> dict | None:
    """Copy WORK/STEM.json and its plots (STEM_*.png) into OUT; the parsed JSON, or None if absent."""
    src = work / f"{stem}.json"
    if not src.exists():
        return None
    shutil.copy(src, out / src.name)
    for png in work.glob(f"{stem}_*.png"):
        shutil.copy(png, out / png.name)
    return json.loads(src.read_text())


def plot_relative(rows: dict[str, dict[str, float | None]], out: Path) -> None:
    """Grouped bars: tau relative to vanilla DFlash (%) per suite and system."""
    systems = [("argmax", "joint, argmax"), ("lilicorr", "LiLiCorr walk"), ("viterbi", "Viterbi"),
               ("margin", "+ margin, walk")]
    systems = [(k, n) for k, n in systems if any(r.get(k) is not None for r in rows.values())]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(systems), 1)
    for j, (key, name) in enumerate(systems):
        xs = [i + j * width for i in range(len(rows))]
        ax.bar(xs, [r.get(key) or 0.0 for r in rows.values()], width, label=name)
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(rows))], list(rows))
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel("tau vs vanilla DFlash (%)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def fmt(x, spec=".3f"):
    return "–" if x is None else format(x, spec)


def pct(x):
    return "–" if x is None else f"{x:+.1f}%"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="work/cpu_smollm2")
    ap.add_argument("--out", default="results/cpu_smollm2")
    args = ap.parse_args()
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    logs = {m: read_log(work / f"ckpt-{m}.log.jsonl") for m in MODELS if (work / f"ckpt-{m}.log.jsonl").exists()}
    if logs:
        plot_curves(logs, out / "training_curves.png")
    evals = {m: d for m in MODELS if (d := collect_eval(work, out, f"eval-{m}")) is not None}

    lines = ["# LiLiCorr vs vanilla DFlash at CPU scale (SmolLM2-135M-Instruct target)", ""]
    lines += ["Produced by `bash scripts/cpu_experiment.sh` then `python scripts/cpu_report.py`.", ""]
    notes = out / "notes.md"          # hand-written findings, kept across regenerations of this file
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    files = sorted(work.glob("regen-*.jsonl")) or sorted(work.glob("regen.jsonl"))
    if files:
        recs = [json.loads(x) for f in files for x in f.read_text().splitlines() if x.strip()]
        kinds: dict[str, int] = {}
        for r in recs:
            kinds[r.get("kind", "?")] = kinds.get(r.get("kind", "?"), 0) + 1
        ntok = sum(len(r["completion_ids"]) for r in recs)
        first = next(iter(logs.values()), [{}])[-1] if logs else {}
        ev = next(iter(evals.values()))["meta"] if evals else {}
        lines += ["## Setup", "",
                  f"- Data: {len(recs)} conversations regenerated greedily by the target "
                  f"({ntok} completion tokens, at most 160 per turn; " +
                  ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) +
                  "), prompts from `lilicorr.data.prompt_sources` (no overlap with the eval suites).",
                  f"- Models: `cpu` preset (2-layer drafter at the target's width, B=8, K=8, head width 256, "
                  f"d_e=128, sigma=8). Every arm: the same data, {first.get('step', '?')} steps, global batch 8, "
                  "24 anchors per sequence, target features precomputed once (`--features`).",
                  f"- Eval: the first {ev.get('limit', '?')} prompts of each suite, at most "
                  f"{ev.get('max_tokens', '?')} new tokens, {ev.get('batch_size', '?')} concurrent sequences "
                  "(continuous batching), chat template, greedy verification unless stated.",
                  "- Machine: 2 shared CPU cores, one torch thread per process, two processes at a time. "
                  "tokens/s and speedup are measured side by side within each eval run, but runs overlapped "
                  "with each other: treat them as noisy; tau and oracle tau are exact counts.", ""]
    times = work / "phase-times.tsv"
    if times.exists():
        lines += ["## Phase times (2 cores, wall clock)", "", "| phase | minutes | finished (UTC) |", "|---|---:|---|"]
        for row in times.read_text().splitlines():
            name, sec, when = row.split("\t")
            lines.append(f"| {name} | {int(sec) / 60:.1f} | {when} |")
        lines.append("")
    if logs:
        lines += ["## Training", "", "| model | steps | final DFlash CE | oracle prefix | teacher-forced tau |",
                  "|---|---:|---:|---:|---:|"]
        for m, recs in logs.items():
            r = recs[-1]
            tau = r.get("tau_lilicorr", r.get("tau_argmax"))
            lines.append(f"| {MODELS[m]} | {r['step']} | {r['dflash']:.3f} | {r['oracle_coverage']:.2f} | {tau:.3f} |")
        lines += ["", "![training curves](training_curves.png)", ""]
    if evals:
        lines += ["## Evaluation (greedy, tau / tokens per s / speedup over ar)", ""]
        rows = []
        for m, doc in evals.items():
            for suite, per_rule in doc["results"].items():
                for rule, r in per_rule.items():
                    r0 = r if "tau" in r else next(iter(r.values()))
                    rows.append((suite, m, rule, r0))
        lines += ["| suite | model | rule | tau | oracle tau | tau/oracle | tokens/s | speedup |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        for suite, m, rule, r in sorted(rows, key=lambda x: (x[0], x[1], x[2])):
            ratio = r["tau"] / r["oracle_tau"] if r.get("tau") and r.get("oracle_tau") else None
            lines.append(f"| {suite} | {m} | {rule} | {fmt(r.get('tau'))} | {fmt(r.get('oracle_tau'))} | "
                         f"{fmt(ratio)} | {fmt(r.get('tokens_per_s'), '.1f')} | {fmt(r.get('speedup_vs_ar'), '.2f')} |")
        lines.append("")
        base = {s: pr["argmax"] for s, pr in evals.get("vanilla", {}).get("results", {}).items() if "argmax" in pr}
        rel_rows: dict[str, dict[str, float | None]] = {}
        if base and "lilicorr" in evals:
            lines += ["## tau relative to vanilla DFlash (argmax on the vanilla drafter)", "",
                      "| suite | vanilla tau | jointly trained, argmax | LiLiCorr (greedy walk) | Viterbi | "
                      "Viterbi vs greedy | + margin, walk |", "|---|---:|---:|---:|---:|---:|---:|"]
            def pooled(m):                                   # all suites pooled, like a suite
                return evals.get(m, {}).get("overall") or {}
            if pooled("vanilla").get("argmax"):
                base["all suites (pooled)"] = pooled("vanilla")["argmax"]
            suites = dict(evals["lilicorr"]["results"])
            if pooled("lilicorr"):
                suites["all suites (pooled)"] = pooled("lilicorr")
            for suite, pr in suites.items():
                b = base.get(suite, {}).get("tau")
                rel = {k: (pr[k]["tau"] / b - 1) * 100 if b and k in pr else None for k in ("argmax", "lilicorr", "viterbi")}
                mg_src = pooled("margin") if suite.startswith("all suites") else \
                    evals.get("margin", {}).get("results", {}).get(suite, {})
                mg = mg_src.get("lilicorr", {}).get("tau")
                rel["margin"] = (mg / b - 1) * 100 if b and mg else None
                rel_rows[suite] = rel
                dv = ((pr["viterbi"]["tau"] / pr["lilicorr"]["tau"] - 1) * 100
                      if "viterbi" in pr and "lilicorr" in pr else None)
                lines.append(f"| {suite} | {fmt(b)} | {pct(rel['argmax'])} | {pct(rel['lilicorr'])} | "
                             f"{pct(rel['viterbi'])} | {pct(dv)} | {pct(rel['margin'])} |")
            lines += ["", "![tau relative to vanilla](tau_vs_vanilla.png)", ""]
            plot_relative(rel_rows, out / "tau_vs_vanilla.png")
        arms = [m for m in ("lilicorr", "nodist", "margin") if m in evals]
        if len(arms) > 1:
            lines += ["## Loss ablation (Appendices C and G): tau of the lilicorr rule", "",
                      "| suite | " + " | ".join(MODELS[m] for m in arms) + " |",
                      "|---|" + "---:|" * len(arms)]
            for suite in evals["lilicorr"]["results"]:
                taus = [evals[m]["results"].get(suite, {}).get("lilicorr", {}).get("tau") for m in arms]
                lines.append(f"| {suite} | " + " | ".join(fmt(t) for t in taus) + " |")
            lines.append("")
        t1 = {m: d for m in ("vanilla", "lilicorr") if (d := collect_eval(work, out, f"eval-{m}-t1")) is not None}
        if len(t1) == 2:
            lines += ["## Temperature 1 (exact rejection sampling, mean ± std over seeds)", "",
                      "| suite | vanilla, argmax | LiLiCorr joint, lilicorr | relative | tokens/s vanilla | "
                      "tokens/s LiLiCorr |", "|---|---:|---:|---:|---:|---:|"]
            for suite, pr in t1["lilicorr"]["results"].items():
                a = t1["vanilla"]["results"].get(suite, {}).get("argmax")
                b = pr.get("lilicorr")
                if a and b:
                    lines.append(f"| {suite} | {a['tau']:.3f} ± {a.get('std', {}).get('tau') or 0:.3f} | "
                                 f"{b['tau']:.3f} ± {b.get('std', {}).get('tau') or 0:.3f} | "
                                 f"{(b['tau'] / a['tau'] - 1) * 100:+.1f}% | {fmt(a.get('tokens_per_s'), '.1f')} | "
                                 f"{fmt(b.get('tokens_per_s'), '.1f')} |")
            lines.append("")
            evals.update({f"{m}-t1": d for m, d in t1.items()})
        lines += ["## Commands", "", "The whole experiment (each phase resumable; sizes as above):", "",
                  "    bash scripts/cpu_experiment.sh regen          # REGEN_MINUTES=N caps it; rerun to resume",
                  "    bash scripts/cpu_experiment.sh features && bash scripts/cpu_experiment.sh train",
                  "    bash scripts/cpu_experiment.sh eval && bash scripts/cpu_experiment.sh eval-t1",
                  "    python scripts/cpu_report.py", "", "The eval runs it made:", ""]
        lines += [f"    {doc['meta']['command']}" for doc in evals.values()] + [""]
    (out / "README.md").write_text("\n".join(lines))
    print(out / "README.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
