"""What each ONNX Runtime session of an engine's drafter costs, engines side by side.

    python scripts/draft_parts_cost.py --engine A=engines/x --engine B=engines/y --rows 1,4,8 --out DIR

For every engine and row count, times the graphs the engine serves (context, backbone, LM head,
head and, where the engine has it, the tree part) on the same random inputs at a cached context of
--context positions, one intra-op thread, no spinning (as the engine runs them). The engines take
turns, --rounds times, and each figure is the median over rounds of the mean over --iters runs.
Writes OUT.md (the table and the command), OUT.json and OUT.png (stacked bars per engine).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lilicorr.engine_dir import read_manifest  # noqa: E402
from lilicorr.ort_runner import ort_session  # noqa: E402
from lilicorr.results_io import save_figure, write_report  # noqa: E402

GRAPHS = ("context", "draft_backbone", "draft_lm_head", "draft_head", "draft_tree")


def served_files(engine: Path) -> dict[str, Path]:
    m = read_manifest(engine)
    files = (m.get("onnxruntime") or {}).get("files") or {}
    return {g: engine / files[g] for g in GRAPHS if g in files}


def feeds_for(sess, rows: int, context: int, new_tokens: int, rng) -> dict[str, np.ndarray]:
    """Random inputs of the session's shapes: `rows` rows, `context` cached positions, `new_tokens`
    context tokens appended (the context graph's T)."""
    dims = {"batch": rows, "context": context}
    out = {}
    for i in sess.get_inputs():
        shape = [dims.get(d, new_tokens) if isinstance(d, str) else d for d in i.shape]
        if i.type == "tensor(int64)":
            fill = context if ("pos" in i.name or "length" in i.name) else 0
            out[i.name] = np.full(shape, fill, np.int64) + (rng.integers(0, 1000, shape) if fill == 0 else 0)
        else:
            out[i.name] = (3.0 * rng.standard_normal(shape)).astype(np.float32)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", action="append", required=True, metavar="LABEL=DIR")
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--context", type=int, default=128, help="cached context positions")
    p.add_argument("--new-tokens", type=int, default=2, help="context tokens appended per step")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", required=True, help="OUT: OUT.md, OUT.json, OUT.png")
    args = p.parse_args(argv)
    engines = dict(e.split("=", 1) for e in args.engine)
    rows = [int(r) for r in args.rows.split(",")]
    sessions = {label: {g: ort_session(f, threads=1) for g, f in served_files(Path(d)).items()}
                for label, d in engines.items()}
    rng = np.random.default_rng(0)
    times: dict = {label: {r: {g: [] for g in s} for r in rows} for label, s in sessions.items()}
    for rnd in range(args.rounds):
        order = list(sessions) if rnd % 2 == 0 else list(sessions)[::-1]
        for r in rows:
            feeds = {}
            for label in order:
                for g, sess in sessions[label].items():
                    key = (g, tuple(i.name for i in sess.get_inputs()))     # the same inputs for every engine
                    if key not in feeds:
                        feeds[key] = feeds_for(sess, r, args.context, args.new_tokens, rng)
                    f = feeds[key]
                    for _ in range(5):
                        sess.run(None, f)
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        sess.run(None, f)
                    times[label][r][g].append(1e3 * (time.perf_counter() - t0) / args.iters)
    result = {"engines": engines, "rows": rows, "context": args.context, "iters": args.iters, "rounds": args.rounds,
              "ms": {label: {str(r): {g: statistics.median(v) for g, v in per.items()} for r, per in t.items()}
                     for label, t in times.items()}}
    lines = [f"ms per session run: median of {args.rounds} alternating rounds of {args.iters} runs each, one "
             f"intra-op thread, {args.context} cached context positions. The drafter pass is every part but "
             "the tree (run only for rule `tree`).", "",
             "| engine | rows | " + " | ".join(GRAPHS) + " | drafter pass |",
             "|---|---:|" + "---:|" * (len(GRAPHS) + 1)]
    for label in engines:
        for r in rows:
            ms = result["ms"][label][str(r)]
            cells = [f"{ms[g]:.3f}" if g in ms else "-" for g in GRAPHS]
            total = sum(v for g, v in ms.items() if g != "draft_tree")
            lines.append(f"| {label} | {r} | " + " | ".join(cells) + f" | {total:.3f} |")
    body = "\n".join(lines) + "\n\n![per-part cost]({png})\n"

    def plot(path):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.5), squeeze=False)
        for ax, r in zip(axes[0], rows):
            bottom = np.zeros(len(engines))
            for g in GRAPHS:
                vals = np.array([result["ms"][label][str(r)].get(g, 0.0) for label in engines])
                ax.bar(list(engines), vals, bottom=bottom, label=g)
                bottom += vals
            ax.set_title(f"{r} row(s)")
            ax.set_ylabel("ms per drafter pass")
        axes[0][0].legend(fontsize=7)
        save_figure(fig, path)

    print(write_report(args.out, "scripts/draft_parts_cost.py", argv, "Drafter sessions, engines side by side",
                       body, result, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
