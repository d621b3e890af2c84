#!/usr/bin/env python3
"""Rule `tree` against `lilicorr` (and `ar`) on this CPU: tau, tau/oracle and tokens/s at several
tree sizes M and concurrencies, greedy, through the same evaluation code as `python -m lilicorr.eval`.

    python scripts/tree_cpu.py --target .cache/smollm2-135m-instruct-float32 \\
        --ckpt checkpoints/smollm2-lilicorr --suites humaneval,lilicorr/data/chat_first_turn.jsonl \\
        --limit 6 --max-tokens 64 --nodes 8,16,32 --concurrency 1,4 --out results/tree_cpu

Each (M, concurrency) cell is one evaluation run of the rules ar, lilicorr and tree on the same
prompts, one after another in one process, so every ratio compares runs made minutes apart on the
same machine. Writes OUT.json (every run's metrics), OUT.md (the table) and OUT.png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lilicorr.results_io import save_figure, write_report

RULES = ("ar", "lilicorr", "tree")


def run_cell(args, nodes: int, concurrency: int) -> dict:
    from lilicorr.eval import evaluate

    doc = evaluate(["--target", args.target, "--ckpt", args.ckpt, "--prompts", args.suites, "--limit", str(args.limit),
                    "--max-tokens", str(args.max_tokens), "--rules", ",".join(RULES), "--tree-nodes", str(nodes),
                    "--batch-size", str(concurrency), "--threads", str(args.threads), "--dtype", args.dtype])
    return {"nodes": nodes, "concurrency": concurrency, "dtype": doc["meta"]["dtype"],
            "suites": {suite: {rule: {k: m[rule].get(k) for k in ("tau", "oracle_tau", "tau_over_oracle",
                                                                   "tokens_per_s", "speedup_vs_ar")}
                               for rule in RULES} for suite, m in doc["results"].items()}}


def table(cells: list[dict]) -> str:
    lines = ["| suite | concurrency | M | lilicorr tau | tree tau | tree / lilicorr tau | oracle tau | "
             "tree tau / oracle | ar tok/s | lilicorr tok/s | tree tok/s | tree / lilicorr tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        for suite, m in c["suites"].items():
            li, tr, ar = m["lilicorr"], m["tree"], m["ar"]
            lines.append(
                f"| {Path(suite).stem} | {c['concurrency']} | {c['nodes']} | {li['tau']:.3f} | {tr['tau']:.3f} | "
                f"{tr['tau'] / li['tau']:.2f}x | {li['oracle_tau']:.3f} | {tr['tau'] / li['oracle_tau']:.2f} | "
                f"{ar['tokens_per_s']:.1f} | {li['tokens_per_s']:.1f} | {tr['tokens_per_s']:.1f} | "
                f"{tr['tokens_per_s'] / li['tokens_per_s']:.2f}x |")
    return "\n".join(lines)


def plot(cells: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(cells[0]["suites"])
    fig, axes = plt.subplots(2, len(suites), figsize=(5.5 * len(suites), 7), squeeze=False)
    for col, suite in enumerate(suites):
        for conc in sorted({c["concurrency"] for c in cells}):
            cs = sorted((c for c in cells if c["concurrency"] == conc), key=lambda c: c["nodes"])
            ms = [c["nodes"] for c in cs]
            for row, key in enumerate(("tau", "tokens_per_s")):
                ax = axes[row][col]
                line, = ax.plot(ms, [c["suites"][suite]["tree"][key] for c in cs], marker="o",
                                label=f"tree, concurrency {conc}")
                ax.plot(ms, [c["suites"][suite]["lilicorr"][key] for c in cs], ls="--", color=line.get_color(),
                        label=f"lilicorr, concurrency {conc}")
                if key == "tokens_per_s":
                    ax.plot(ms, [c["suites"][suite]["ar"][key] for c in cs], ls=":", color=line.get_color(),
                            label=f"ar, concurrency {conc}")
        for row, label in enumerate(("tau (tokens per verify step)", "tokens/s")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tree nodes M")
            ax.set_ylabel(label)
            ax.set_title(Path(suite).stem)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--suites", default="humaneval,lilicorr/data/chat_first_turn.jsonl")
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--nodes", default="8,16,32", help="tree sizes M")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="target precision (eval's --dtype)")
    p.add_argument("--note", default="")
    p.add_argument("--out", required=True, help="output path without suffix (.json, .md, .png)")
    args = p.parse_args(argv)
    cells = []
    for conc in (int(c) for c in args.concurrency.split(",")):
        for nodes in (int(m) for m in args.nodes.split(",")):
            print(f"[tree_cpu] M={nodes} concurrency={conc}", file=sys.stderr, flush=True)
            cells.append(run_cell(args, nodes, conc))
    body = (f"Greedy, {args.limit} prompts per suite, up to {args.max_tokens} new tokens, target precision "
            f"{cells[0]['dtype']}, {args.threads} thread(s). Oracle tau: the pools' own oracle (the same pools feed "
            f"both rules). {args.note}\n\n{table(cells)}\n\n" + "![tau and tokens/s]({png})\n")
    print(write_report(args.out, "scripts/tree_cpu.py", argv, "Rule `tree` against `lilicorr` on this CPU", body,
                       {"cells": cells, "note": args.note}, lambda path: plot(cells, path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
