#!/usr/bin/env python3
"""Table and plot of `scripts/draft_weights_cpu.sh`'s runs: per drafter-weight precision (int8,
float32), mean over passes of tau, tokens/s of `ar` and `lilicorr` (whole block) and their ratio,
and the drafting stages per block (ms).

    python scripts/draft_weights_table.py results/draft_weights_amx   # writes table.md and stages.png
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from lilicorr.results_io import save_figure

STAGES = ("target_verify", "draft_backbone", "lm_head_projection", "speculative_head", "accept_residual")


def summarise(folder: Path) -> dict[str, dict]:
    runs: dict[str, list[dict]] = {}
    for f in sorted(folder.glob("*-pass*.json")):
        runs.setdefault(f.name.split("-pass")[0], []).append(json.loads(f.read_text()))
    if not runs:
        raise SystemExit(f"no *-pass*.json in {folder}")
    out = {}
    for w, docs in runs.items():
        o = [d["overall"] for d in docs]
        p = [d["profile"]["lilicorr"] for d in docs]
        out[w] = {"passes": len(docs),
                  "tau": statistics.mean(x["lilicorr"]["tau"] for x in o),
                  "ar_tps": statistics.mean(x["ar"]["tokens_per_s"] for x in o),
                  "spec_tps": statistics.mean(x["lilicorr"]["tokens_per_s"] for x in o),
                  "ratio": statistics.mean(x["lilicorr"]["tokens_per_s"] / x["ar"]["tokens_per_s"] for x in o),
                  "ar_step_ms": statistics.mean(d["profile"]["ar"]["per_block_wall_ms"] for d in docs),
                  "block_ms": statistics.mean(x["per_block_wall_ms"] for x in p),
                  "head_share": statistics.mean(x["head_share_pct"] for x in p),
                  **{s: statistics.mean(x["stages_ms"][s] for x in p) for s in STAGES}}
    return out


def main(argv=None) -> int:
    folder = Path((argv or sys.argv[1:] or ["results/draft_weights_amx"])[0])
    rows = summarise(folder)
    lines = ["| drafter weights | passes | tau | `ar` tok/s | `lilicorr` tok/s | vs `ar` | `ar` step ms | block ms | "
             "verify | backbone | LM head | head | drafting (3 stages) | head share |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w, r in rows.items():
        drafting = r["draft_backbone"] + r["lm_head_projection"] + r["speculative_head"]
        lines.append(f"| {w} | {r['passes']} | {r['tau']:.3f} | {r['ar_tps']:.1f} | {r['spec_tps']:.1f} | {r['ratio']:.2f}x | "
                     f"{r['ar_step_ms']:.1f} | {r['block_ms']:.1f} | {r['target_verify']:.1f} | {r['draft_backbone']:.2f} | "
                     f"{r['lm_head_projection']:.2f} | {r['speculative_head']:.2f} | {drafting:.2f} | {r['head_share']:.1f}% |")
    text = "\n".join(lines) + "\n"
    (folder / "table.md").write_text(text)
    print(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    names = list(rows)
    left = [0.0] * len(names)
    for s in STAGES[1:4]:
        vals = [rows[w][s] for w in names]
        ax.barh(names, vals, left=left, label=s.replace("_", " "))
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("ms per drafted block (lilicorr, batch 1)")
    ax.set_title("Drafting cost by drafter weight precision")
    ax.legend(fontsize=8)
    save_figure(fig, folder / "stages.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
