#!/usr/bin/env python3
"""Measure the target's verify cost t(k)/t(1), k = 1..16, per precision (fp32, bf16, fp16-weights;
bf16 on a CPU runs batch-invariant, `bfloat16:plain` with PyTorch's own kernels, `bfloat16:blocked`
batch-invariant with the blocked-GEMM attention instead of the compiled kernel) at 1 and 2 threads.

    python scripts/verify_cost.py --target .cache/smollm2-135m-instruct-float32 \\
        --out results/verify_cost_cpu --rows 1

One process, every setting side by side: the settings take turns in `--rounds` rounds (each round
runs every k of every setting), and each ratio is the median over rounds of per-round medians, so
load drift on a shared machine hits every setting alike. Writes OUT.json, OUT.md and OUT.png
(t(k) in ms per setting).
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from lilicorr.config import CPU_GEMM_PRECISIONS
from lilicorr.costmodel import measure_forward_times
from lilicorr.fp16_linear import set_gemm_threads
from lilicorr.results_io import save_figure
from lilicorr.target import load_target, precision_variant, use_blocked_attention


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if "avx512" in f or "amx" in f or f == "avx2")
    except OSError:
        pass
    return []


def setting_label(dtype: str, threads: int, gemm_threads: int = 0) -> str:
    """'fp16-weights, 1' or, with GEMM threads of their own, 'fp16-weights, 1 (GEMMs 2)'."""
    return f"{dtype}, {threads}" + (f" (GEMMs {gemm_threads})" if gemm_threads else "")


def plot(rows: list[dict], path: Path) -> None:
    """t(k) in ms against k, one line per (precision, threads)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        ks = sorted(r["ms"])
        ax.plot(ks, [r["ms"][k] for k in ks], marker="o", ms=3,
                label=setting_label(r["dtype"], r["threads"], r.get("gemm_threads", 0)) + " thread(s)")
    ax.set_xlabel("tokens per forward k (1 = a plain decode step)")
    ax.set_ylabel("target forward (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Target verify cost on this CPU")
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True, help="output path without suffix (.json and .md are written)")
    p.add_argument("--rows", type=int, default=1, help="rows per forward (batch)")
    p.add_argument("--max-k", type=int, default=16)
    p.add_argument("--context", type=int, default=200, help="cached tokens per row")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=4, help="forwards per k per round")
    p.add_argument("--dtypes", default="float32,bfloat16,fp16-weights",
                   help="target precisions (PRECISIONS; NAME:plain keeps PyTorch's own kernels, see lilicorr.batch_invariant; "
                        "NAME:blocked, bf16's batch-invariant blocked-GEMM attention)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--gemm-threads", default="0",
                   help="comma list: threads of the multi-token GEMMs (fp16-weights: 2+ tokens; bf16-gemm: 32+), each beside every --threads "
                        "(0: torch's thread count; `lilicorr.fp16_linear.set_gemm_threads`)")
    p.add_argument("--note", default="", help="free text for the results file (e.g. 'machine shared')")
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    targets, names = {}, {}
    for d in dtypes:                 # NAME:plain = PyTorch's own kernels (bf16 on a CPU is batch-invariant)
        names[d], invariant = precision_variant(d.removesuffix(":blocked"))
        targets[d] = load_target(args.target, dtype=names[d], batch_invariant=invariant)
        if d.endswith(":blocked"):   # NAME:blocked = batch-invariant bf16 with the blocked-GEMM attention
            use_blocked_attention(targets[d])
    gemm = [int(g) for g in args.gemm_threads.split(",")]
    ks = range(1, args.max_k + 1)
    # setting: (precision, torch threads, GEMM threads); GEMM threads only vary the CPU GEMM kernels'
    settings = [(d, t, g) for d in dtypes for t in threads
                for g in (gemm if names[d] in CPU_GEMM_PRECISIONS else [0])]
    per_round: dict[tuple[str, int, int], list[dict[int, float]]] = {st: [] for st in settings}
    for r in range(args.rounds):
        for (d, t, g), acc in per_round.items():
            torch.set_num_threads(t)
            set_gemm_threads(g)
            acc.append(measure_forward_times(targets[d], rows=args.rows, ks=ks, context=args.context,
                                             reps=args.reps, warmup=1))
            print(f"[verify_cost] round {r + 1}/{args.rounds} {setting_label(d, t, g)}: "
                  f"t(1)={acc[-1][1] * 1e3:.1f} ms t(8)/t(1)={acc[-1][8] / acc[-1][1]:.2f}", file=sys.stderr, flush=True)
    set_gemm_threads(0)
    rows = []
    for (d, t, g), acc in per_round.items():
        t1 = statistics.median(a[1] for a in acc)
        ratios = {k: statistics.median(a[k] / a[1] for a in acc) for k in ks}
        rows.append({"dtype": d, "threads": t, "gemm_threads": g, "t1_ms": t1 * 1e3, "ratio": ratios,
                     "ms": {k: statistics.median(a[k] for a in acc) * 1e3 for k in ks}})
    ks_show = list(ks)
    head = "| dtype, threads | t(1) | " + " | ".join(f"k={k}" for k in ks_show[1:]) + " |"
    lines = [head, "|---|" + "---:|" * len(ks_show)]
    for row in rows:
        lines.append(f"| {setting_label(row['dtype'], row['threads'], row['gemm_threads'])} | {row['t1_ms']:.1f} ms | "
                     + " | ".join(f"{row['ratio'][k]:.2f}x" for k in ks_show[1:]) + " |")
    ref = next((r for r in rows if r["dtype"] == "float32" and r["threads"] == threads[0]), rows[0])
    lines += ["", "Plain step t(1) relative to "
              + f"{setting_label(ref['dtype'], ref['threads'], ref['gemm_threads'])} thread(s): "
              + ", ".join(f"{setting_label(r['dtype'], r['threads'], r['gemm_threads'])}: "
                          f"{r['t1_ms'] / ref['t1_ms']:.2f}x" for r in rows)]
    for k in sorted({min(8, ks_show[-1]), ks_show[-1]}):       # whole forwards, in ms
        lines += ["", f"Forward of k = {k} tokens: " + ", ".join(
            f"{setting_label(r['dtype'], r['threads'], r['gemm_threads'])}: {r['ms'][k]:.1f} ms" for r in rows)]
    table = "\n".join(lines)
    cmd = "python scripts/verify_cost.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    md = (f"# Target verify cost t(k)/t(1) on this CPU\n\n"
          f"A forward of k new tokens per row ({args.rows} row(s), {args.context} cached tokens), relative to "
          f"a plain 1-token step of the same setting; median over {args.rounds} interleaved rounds of "
          f"{args.reps} forwards. Made by:\n\n    {cmd}\n\n"
          f"CPU: {platform.processor() or platform.machine()}, flags {' '.join(cpu_flags()) or '(none of avx2/avx512/amx)'}; "
          f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}.\n"
          f"{args.note}\n\n{table}\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    plot(rows, out.with_suffix(".png"))
    out.with_suffix(".json").write_text(json.dumps({
        "command": cmd, "rows": args.rows, "context": args.context, "rounds": args.rounds, "reps": args.reps,
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "note": args.note,
        "results": [{**r, "ratio": {str(k): v for k, v in r["ratio"].items()},
                     "ms": {str(k): v for k, v in r["ms"].items()}} for r in rows]}, indent=2))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
