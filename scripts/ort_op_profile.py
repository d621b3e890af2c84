"""ONNX Runtime's per-node profile of one served graph of each engine, by op type.

    python scripts/ort_op_profile.py --engine before=DIR --engine after=DIR --graph draft_head --rows 1 --out OUT

For each engine: the graph's node count (and the tree part's, where the engine has one), then
--iters runs of the graph with ONNX Runtime's profiler on (1 thread, no spinning, the random inputs
of scripts/draft_parts_cost.py), the node time summed by op type. The profiler adds its own time per
node, so read the shares, not the totals. Writes OUT.md (with the command) and OUT.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draft_parts_cost import feeds_for, served_files  # noqa: E402
from lilicorr.ort_runner import ort_session  # noqa: E402
from lilicorr.results_io import write_report  # noqa: E402


def profile(path: Path, rows: int, context: int, iters: int) -> dict[str, float]:
    """us per run by op type, from ONNX Runtime's profiler."""
    sess = ort_session(path, threads=1, profile_prefix=Path(tempfile.mkdtemp()) / "ort")   # as the engine runs it
    feeds = feeds_for(sess, rows, context, 2, np.random.default_rng(0))
    for _ in range(iters):
        sess.run(None, feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    total = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            total[e["args"]["op_name"]] += e["dur"]
    return {op: us / iters for op, us in total.most_common()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", action="append", required=True, metavar="LABEL=DIR")
    p.add_argument("--graph", default="draft_head")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", required=True, help="OUT: OUT.md, OUT.json")
    args = p.parse_args(argv)
    doc, lines = {"graph": args.graph, "rows": args.rows, "engines": {}}, []
    for label, d in (e.split("=", 1) for e in args.engine):
        files = served_files(Path(d))
        nodes = {g: len(onnx.load(str(files[g]), load_external_data=False).graph.node)
                 for g in (args.graph, "draft_tree") if g in files}
        ops = profile(files[args.graph], args.rows, args.context, args.iters)
        total = sum(ops.values())
        doc["engines"][label] = {"dir": d, "nodes": nodes, "us_by_op": ops}
        lines += [f"## {label}: `{files[args.graph].name}`, {nodes[args.graph]} nodes"
                  + (f" (tree part: {nodes['draft_tree']} nodes)" if "draft_tree" in nodes else ""), "",
                  "| op type | share of node time |", "|---|---:|"]
        lines += [f"| {op} | {100 * us / total:.1f}% |" for op, us in list(ops.items())[: args.top]]
        lines.append("")
    body = (f"{args.graph} at {args.rows} row(s), {args.context} cached positions, {args.iters} profiled runs.\n\n"
            + "\n".join(lines))
    print(write_report(args.out, "scripts/ort_op_profile.py", argv, "Op profile of a drafter graph", body, doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
