"""Collect the CPU experiment (scripts/cpu_experiment.sh) into results/cpu_smollm2/.

    python scripts/cpu_report.py [--work work/cpu_smollm2] [--out results/cpu_smollm2]

Two stages, so that every figure in OUT/README.md comes from a file committed in OUT:
  collect (when WORK exists): copies the eval JSON files and their plots, and writes OUT/run_stats.json:
          the data sizes (WORK/regen-*.jsonl), the phase times (WORK/phase-times.tsv) and, per
          trained arm, its training config and per-step training record (WORK/ckpt-ARM/config.json
          and WORK/ckpt-ARM.log.jsonl or the history in WORK/ckpt-ARM/meta.json). An arm without
          these in WORK is taken from its committed checkpoint (checkpoints/smollm2-ARM), if any.
  render  (always, from OUT only): README.md (starting with OUT/notes.md, the hand-written
          findings, when present) with the tables: tau / tokens per second / speedup per suite
          and rule, tau relative to vanilla DFlash, tau / oracle tau, the greedy-vs-Viterbi delta,
          the loss ablation and temperature 1; the plots training_curves.png and tau_vs_vanilla.png.
Without WORK (e.g. on a fresh checkout) only the render stage runs: the README is rebuilt from
the committed files.
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
          "nodist": "LiLiCorr without L_dist (Appendix C)", "margin": "LiLiCorr + margin (Appendix G)",
          "distill": "LiLiCorr + self-logit distillation"}
REPO = Path(__file__).resolve().parents[1]
COMMITTED_CKPT = "checkpoints/smollm2-{arm}"       # the committed copy of an arm's checkpoint, if any
STATS = "run_stats.json"
CURVE_KEYS = ("step", "dflash", "oracle_coverage", "tau_argmax", "tau_lilicorr")


def read_log(path: Path) -> list[dict]:
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec            # a resumed run repeats steps: keep the last
    return [by_step[k] for k in sorted(by_step)]


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _same_checkpoint(a: Path, b: Path) -> bool:
    """Whether two checkpoint folders hold the same run (same config.json and meta.json)."""
    return all((a / f).is_file() and (b / f).is_file() and (a / f).read_bytes() == (b / f).read_bytes()
               for f in ("config.json", "meta.json"))


def training_record(work: Path, arm: str) -> dict | None:
    """One arm's training config and per-step record: from WORK (the step log, else the history in
    the checkpoint's meta.json), else from the committed checkpoint; None if neither has it."""
    committed = REPO / COMMITTED_CKPT.format(arm=arm)
    sources = [(work / f"ckpt-{arm}", work / f"ckpt-{arm}.log.jsonl"), (committed, None)]
    if _same_checkpoint(work / f"ckpt-{arm}", committed):
        sources.reverse()                 # WORK's run is the committed one: cite the committed files
    for ckpt, log in sources:
        recs, source = [], None
        if log is not None and log.exists():
            recs, source = read_log(log), log
        elif (ckpt / "meta.json").exists():
            hist = json.loads((ckpt / "meta.json").read_text()).get("history") or []
            by_step = {r["step"]: r for r in hist}
            recs, source = [by_step[k] for k in sorted(by_step)], ckpt / "meta.json"
        if not recs or not (ckpt / "config.json").exists():
            continue
        cfg = json.loads((ckpt / "config.json").read_text())["lilicorr"]
        d, h, t = cfg["drafter"], cfg["head"], cfg["train"]
        return {"source": _rel(source), "config_source": _rel(ckpt / "config.json"),
                "config": {"drafter_layers": d["num_layers"], "block_size": d["block_size"],
                           "draft_vocab_size": d.get("draft_vocab_size") or None, "vanilla": cfg["vanilla"],
                           "top_k": h["top_k"], "head_width": h["width"], "embed_dim": h["embed_dim"],
                           "sigma": h["sigma"], "global_batch": t["global_batch"], "num_anchors": t["num_anchors"],
                           "max_steps": t["max_steps"], "loss": cfg["loss"]},
                "curve": {k: [r.get(k) for r in recs] for k in CURVE_KEYS}}
    return None


def collect_stats(work: Path) -> dict:
    """Data sizes, phase times and training records of the run in WORK (see the module doc)."""
    stats: dict = {"work": _rel(work)}
    files = sorted(work.glob("regen-*.jsonl")) or sorted(work.glob("regen.jsonl"))
    if files:
        recs = [json.loads(x) for f in files for x in f.read_text().splitlines() if x.strip()]
        kinds: dict[str, int] = {}
        for r in recs:
            kinds[r.get("kind", "?")] = kinds.get(r.get("kind", "?"), 0) + 1
        stats["data"] = {"files": [f.name for f in files], "conversations": len(recs),
                         "completion_tokens": sum(len(r["completion_ids"]) for r in recs),
                         "kinds": dict(sorted(kinds.items()))}
    times = work / "phase-times.tsv"
    if times.exists():
        stats["phases"] = []
        for row in times.read_text().splitlines():
            if row.strip():
                name, sec, when = row.split("\t")
                stats["phases"].append({"phase": name, "seconds": int(sec), "finished_utc": when})
    stats["training"] = {m: rec for m in MODELS if (rec := training_record(work, m)) is not None}
    return stats


def plot_curves(training: dict[str, dict], out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rec in training.items():
        c = rec["curve"]
        axes[0].plot(c["step"], c["dflash"], label=name)
        axes[1].plot(c["step"], c["oracle_coverage"], label=name)
        key = "tau_lilicorr" if c.get("tau_lilicorr") and c["tau_lilicorr"][-1] is not None else "tau_argmax"
        axes[2].plot(c["step"], c[key], label=f"{name} ({key[4:]})")
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


def collect_eval(work: Path, out: Path, stem: str) -> None:
    """Copy WORK/STEM.json and its plots (STEM_*.png) into OUT, if present."""
    src = work / f"{stem}.json"
    if src.exists():
        shutil.copy(src, out / src.name)
        for png in work.glob(f"{stem}_*.png"):
            shutil.copy(png, out / png.name)


def read_eval(out: Path, stem: str) -> dict | None:
    src = out / f"{stem}.json"
    return json.loads(src.read_text()) if src.exists() else None


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

    stems = [f"eval-{m}{suffix}" for m in MODELS for suffix in ("", "-chat", "-t1")]
    if work.is_dir():                                   # collect: WORK -> committed files in OUT
        stats = collect_stats(work)
        stats["evals"] = [st for st in stems if (work / f"{st}.json").exists()]
        for st in stats["evals"]:
            collect_eval(work, out, st)
        stale = [st for st in stems if st not in stats["evals"] and (out / f"{st}.json").exists()]
        if stale:
            print(f"note: {', '.join(stale)} in {out} are not from this run: left out of the README "
                  "(delete them and their plots)")
        (out / STATS).write_text(json.dumps(stats, indent=1) + "\n")
    elif not (out / STATS).exists():                    # no run here: the committed checkpoints only
        (out / STATS).write_text(json.dumps(
            {"work": None, "evals": [st for st in stems if (out / f"{st}.json").exists()],
             "training": {m: r for m in MODELS if (r := training_record(work, m)) is not None}},
            indent=1) + "\n")

    # render: from the files in OUT only
    stats = json.loads((out / STATS).read_text())
    training = stats.get("training") or {}
    if training:
        plot_curves(training, out / "training_curves.png")
    listed = set(stats.get("evals") or stems)

    def run_eval(stem):
        return read_eval(out, stem) if stem in listed else None

    evals = {m: d for m in MODELS if (d := run_eval(f"eval-{m}")) is not None}

    lines = ["# LiLiCorr vs vanilla DFlash at CPU scale (SmolLM2-135M-Instruct target)", ""]
    lines += ["Produced by `bash scripts/cpu_experiment.sh` then `python scripts/cpu_report.py`. Every figure "
              f"below comes from a file in this folder: the eval runs' JSON (`eval-*.json`) and `{STATS}` (data "
              "sizes, phase times and training records, as the report script collected them).", ""]
    notes = out / "notes.md"          # hand-written findings, kept across regenerations of this file
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    ev = next(iter(evals.values()))["meta"] if evals else {}
    setup = []
    data = stats.get("data")
    if data:
        setup.append(f"- Data: {data['conversations']} conversations regenerated greedily by the target "
                     f"({data['completion_tokens']} completion tokens; " +
                     ", ".join(f"{k} {v}" for k, v in data["kinds"].items()) +
                     "), prompts from `lilicorr.data.prompt_sources` (no overlap with the eval suites).")
    for m, rec in training.items():
        c = rec["config"]
        setup.append(f"- {MODELS[m]}: {c['drafter_layers']}-layer drafter at the target's width, "
                     f"B={c['block_size']}" + (f", draft vocabulary {c['draft_vocab_size']}" if c.get("draft_vocab_size")
                                               else "") +
                     ("" if c["vanilla"] else f", head K={c['top_k']}, width {c['head_width']}, d_e={c['embed_dim']}, "
                                             f"sigma={c['sigma']:g}") +
                     f"; {rec['curve']['step'][-1]} steps, global batch {c['global_batch']}, {c['num_anchors']} "
                     f"anchors per sequence (`{rec['config_source']}`).")
    untracked = [m for m in evals if m not in training]
    if untracked:
        setup.append("- No training record is committed for " + ", ".join(f"`{m}`" for m in untracked) +
                     ": only their eval results are reported.")
    if ev:
        setup.append(f"- Eval: the first {ev.get('limit', '?')} prompts of each suite, at most "
                     f"{ev.get('max_tokens', '?')} new tokens, {ev.get('batch_size', '?')} concurrent sequences "
                     "(continuous batching), chat template, greedy verification unless stated.")
        setup.append(f"- Machine: {ev.get('cpu_count', '?')} shared CPU cores, torch threads per process: "
                     f"{ev.get('threads', '?')}. Within one eval run the rules run one after another on the same "
                     "prompts (`ar` first), so a speedup is the ratio of two runs made minutes apart on a "
                     "shared machine, and the experiment ran two eval processes at a time: tokens/s and "
                     "speedup are noisy. tau and oracle tau are exact counts.")
    if setup:
        lines += ["## Setup", ""] + setup + [""]
    if stats.get("phases"):
        lines += ["## Phase times (wall clock)", "", "| phase | minutes | finished (UTC) |", "|---|---:|---|"]
        for row in stats["phases"]:
            lines.append(f"| {row['phase']} | {row['seconds'] / 60:.1f} | {row['finished_utc']} |")
        lines.append("")
    if training:
        lines += ["## Training", "", "| model | steps | final DFlash CE | oracle prefix | teacher-forced tau | record |",
                  "|---|---:|---:|---:|---:|---|"]
        for m, rec in training.items():
            c = rec["curve"]
            tau = c["tau_lilicorr"][-1] if c.get("tau_lilicorr") and c["tau_lilicorr"][-1] is not None \
                else c["tau_argmax"][-1]
            lines.append(f"| {MODELS[m]} | {c['step'][-1]} | {c['dflash'][-1]:.3f} | {c['oracle_coverage'][-1]:.2f} | "
                         f"{tau:.3f} | `{rec['source']}` |")
        lines += ["", "![training curves](training_curves.png)", ""]
    if evals:
        lines += ["## Evaluation (greedy, tau / tokens per s / speedup over ar)", ""]
        rows = []
        chat = {m: d for m in MODELS if (d := run_eval(f"eval-{m}-chat")) is not None}   # greedy, chat suite
        for m, doc in list(evals.items()) + list(chat.items()):
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
        t1 = {m: d for m in ("vanilla", "lilicorr") if (d := run_eval(f"eval-{m}-t1")) is not None}
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
        lines += [f"    {doc['meta']['command']}" for doc in list(evals.values()) + list(chat.values())] + [""]
    (out / "README.md").write_text("\n".join(lines))
    print(out / "README.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
