#!/usr/bin/env python3
"""Fixed draft length against `--draft-length auto`, per concurrency, on this CPU: tau and tokens/s
of `lilicorr` beside `ar`, greedy, through the same evaluation code as `python -m lilicorr.eval`.

    python scripts/draft_length_cpu.py --target .cache/smollm2-135m-instruct-float32 \\
        --ckpt checkpoints/smollm2-lilicorr --suites humaneval,lilicorr/data/chat_first_turn.jsonl \\
        --limit 8 --max-tokens 64 --concurrency 1,2,4,8 --lengths block,auto --out results/draft_length_cpu

`--engine DIR` evaluates a built engine directory instead of a checkpoint (its drafter graphs, as
Triton serves them); `--profile` adds each cell's block cost from the stage timer: the lilicorr
block's wall in plain steps (the `ar` step's wall in the same run), which is also the tau at which
that block breaks even with plain decoding, and the drafter's share of it (draft backbone, LM head
and speculative head).

Each (concurrency, draft length) cell is one evaluation run of `ar` and `lilicorr` on the same
prompts in one process; with --repeats R the two take turns R times (A B B A ...), so that a shared
machine's slow and fast minutes fall on both. "block" verifies
the whole block; auto chooses per row and step from the lattice's scores and the verify cost
measured at start-up. Writes OUT.json, OUT.md and OUT.png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lilicorr.results_io import save_figure, write_report


def run_cell(args, concurrency: int, length: str) -> dict:
    from lilicorr.eval import evaluate

    source = ["--engine", args.engine] if args.engine else ["--ckpt", args.ckpt]
    argv = ["--target", args.target, *source, "--prompts", args.suites, "--limit", str(args.limit),
            "--max-tokens", str(args.max_tokens), "--rules", "ar,lilicorr", "--batch-size", str(concurrency),
            "--threads", str(args.threads), "--dtype", args.dtype, "--repeats", str(args.repeats)]
    if length != "block":
        argv += ["--draft-length", length]
    if args.prompt_lookup:
        argv += ["--prompt-lookup", str(args.prompt_lookup)]
    if args.profile:
        argv += ["--profile"]
    doc = evaluate(argv)
    pooled = doc.get("overall") or next(iter(doc["results"].values()))
    cell = {"concurrency": concurrency, "draft_length": length, "dtype": doc["meta"]["dtype"],
            "prompt_lookup": doc["meta"]["prompt_lookup"],
            "ar_tokens_per_s": pooled["ar"]["tokens_per_s"],
            "lilicorr": {k: pooled["lilicorr"].get(k) for k in ("tau", "oracle_tau", "tokens_per_s")}}
    if args.profile:
        cell["block"] = block_cost(doc["profile"])
    return cell


DRAFTER_STAGES = ("draft_backbone", "lm_head_projection", "speculative_head")


def block_cost(profile: dict) -> dict:
    """The stage timer's per-block walls (ms) -> the lilicorr block in plain steps (its wall over
    the `ar` step's; also the tau at which it breaks even with plain decoding) and the drafter's
    part of it in plain steps."""
    plain = profile["ar"]["per_block_wall_ms"]
    li = profile["lilicorr"]
    drafter = sum(li["stages_ms"][k] for k in DRAFTER_STAGES)
    return {"ar_step_ms": plain, "block_ms": li["per_block_wall_ms"], "verify_ms": li["stages_ms"]["target_verify"],
            "drafter_ms": drafter, "block_plain_steps": li["per_block_wall_ms"] / plain,
            "drafter_plain_steps": drafter / plain}


def table(cells: list[dict]) -> str:
    profiled = all("block" in c for c in cells)
    head = "| concurrency | draft length | lilicorr tau | ar tok/s | lilicorr tok/s | lilicorr / ar |"
    rule = "|---:|---|---:|---:|---:|---:|"
    if profiled:
        head += " ar step | lilicorr block | block in plain steps (break-even tau) | drafter in plain steps |"
        rule += "---:|---:|---:|---:|"
    lines = [head, rule]
    for c in cells:
        li = c["lilicorr"]
        line = (f"| {c['concurrency']} | {c['draft_length']} | {li['tau']:.3f} | {c['ar_tokens_per_s']:.1f} | "
                f"{li['tokens_per_s']:.1f} | {li['tokens_per_s'] / c['ar_tokens_per_s']:.2f}x |")
        if profiled:
            b = c["block"]
            line += (f" {b['ar_step_ms']:.1f} ms | {b['block_ms']:.1f} ms | {b['block_plain_steps']:.2f} | "
                     f"{b['drafter_plain_steps']:.2f} |")
        lines.append(line)
    return "\n".join(lines)


def plot(cells: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for length in dict.fromkeys(c["draft_length"] for c in cells):
        cs = sorted((c for c in cells if c["draft_length"] == length), key=lambda c: c["concurrency"])
        ax.plot([c["concurrency"] for c in cs], [c["lilicorr"]["tokens_per_s"] / c["ar_tokens_per_s"] for c in cs],
                marker="o", label=f"lilicorr, draft length {length}")
    ax.axhline(1.0, color="grey", ls=":", label="ar")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (rows in the engine)")
    ax.set_ylabel("tokens/s relative to ar (same run)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", help="drafter + head checkpoint (the PyTorch drafter)")
    source.add_argument("--engine", help="built engine directory (its drafter graphs, as served)")
    p.add_argument("--suites", default="humaneval,lilicorr/data/chat_first_turn.jsonl")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--lengths", default="block,auto", help="draft lengths: block, auto or N")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="target precision (eval's --dtype)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed passes per cell, ar and lilicorr in turn (eval's --repeats)")
    p.add_argument("--prompt-lookup", type=int, default=0,
                   help="eval's --prompt-lookup N (0: off): lookup rows verify copied continuations")
    p.add_argument("--profile", action="store_true",
                   help="add each cell's block cost from the stage timer (block and drafter in plain steps)")
    p.add_argument("--note", default="")
    p.add_argument("--out", required=True, help="output path without suffix (.json, .md, .png)")
    args = p.parse_args(argv)
    cells = []
    for conc in (int(c) for c in args.concurrency.split(",")):
        for length in args.lengths.split(","):
            print(f"[draft_length_cpu] concurrency={conc} draft length={length}", file=sys.stderr, flush=True)
            cells.append(run_cell(args, conc, length))
    passes = f", {args.repeats} interleaved timed passes per cell" if args.repeats > 1 else ""
    lookup = f"over {args.prompt_lookup}..2-grams" if args.prompt_lookup else "off"
    body = (f"Greedy, {args.limit} prompts per suite ({args.suites}) pooled, up to {args.max_tokens} new tokens, "
            f"target precision {cells[0]['dtype']}, {args.threads} thread(s){passes}, prompt lookup {lookup}. "
            f"{args.note}\n\n{table(cells)}\n\n![lilicorr / ar]({{png}})\n")
    print(write_report(args.out, "scripts/draft_length_cpu.py", argv,
                       "Draft length: whole block against auto, per concurrency, on this CPU", body,
                       {"cells": cells, "note": args.note}, lambda path: plot(cells, path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
