"""What reading a packed verify's argmax costs: unpacking its logits to [N, T, V] then argmax (what
the engine did before `TargetOutput.greedy`) against the argmax of the packed [M, V] logits.

    python scripts/packed_greedy_cost.py --target DIR --out OUT [--mixes "4 3 2 2 1 1 1 1;8 1 1 1 1 1 1 1;4 2 1 1"]

For each mix of tokens per row: one packed verify of the real target (bf16-gemm, 1 thread, 200
cached tokens per row), then both ways of reading its argmax taken in turns, --rounds times each
(median). Writes OUT.md (with the command), OUT.json and OUT.png.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lilicorr.results_io import save_figure, write_report  # noqa: E402
from lilicorr.target import TargetOutput, load_target  # noqa: E402

WAYS = ("unpack, then argmax", "argmax of the packed logits")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--dtype", default="bf16-gemm")
    p.add_argument("--mixes", default="4 3 2 2 1 1 1 1;8 1 1 1 1 1 1 1;4 2 1 1")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--out", required=True, help="OUT: OUT.md, OUT.json, OUT.png")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target = load_target(args.target, dtype=args.dtype)
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for mix in ([int(x) for x in m.split()] for m in args.mixes.split(";")):
        n, t = len(mix), max(mix)
        cache = target.new_cache(n, capacity=512)
        rows = torch.tensor([cache.allocate() for _ in range(n)])
        ids = torch.randint(0, target.config.vocab_size, (n, 200 + t), generator=g)
        pos = torch.arange(200 + t)[None].expand(n, -1)
        with torch.no_grad():
            target(ids[:, :200], pos[:, :200], cache=cache, rows=rows, logits=False)
            out = target(ids[:, 200:], pos[:, 200:], cache=cache, rows=rows, valid=torch.tensor(mix))
        ms = {w: [] for w in WAYS}
        for r in range(args.rounds):
            for w in (WAYS if r % 2 == 0 else WAYS[::-1]):
                o = TargetOutput(out.packed_logits, None, None, out.packing)
                t0 = time.perf_counter()
                o.logits.argmax(-1) if w == WAYS[0] else o.greedy()
                ms[w].append(1e3 * (time.perf_counter() - t0))
        rows_out.append({"mix": mix, "rows": n, "tokens": t, "real": sum(mix),
                         "ms": {w: statistics.median(v) for w, v in ms.items()}})
    lines = [f"ms per verify step (median of {args.rounds} alternating rounds; {args.dtype}, 1 thread)", "",
             "| tokens per row | N x T | real tokens | " + " | ".join(WAYS) + " |", "|---|---:|---:|---:|---:|"]
    for r in rows_out:
        lines.append(f"| {' '.join(map(str, r['mix']))} | {r['rows']} x {r['tokens']} | {r['real']} | "
                     + " | ".join(f"{r['ms'][w]:.2f}" for w in WAYS) + " |")
    body = "\n".join(lines) + "\n\n![argmax cost]({png})\n"

    def plot(path):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = [" ".join(map(str, r["mix"])) for r in rows_out]
        x = range(len(rows_out))
        for j, w in enumerate(WAYS):
            ax.bar([i + 0.4 * j for i in x], [r["ms"][w] for r in rows_out], width=0.4, label=w)
        ax.set_xticks([i + 0.2 for i in x], labels, fontsize=7)
        ax.set_ylabel("ms per verify step")
        ax.legend(fontsize=7)
        save_figure(fig, path)

    print(write_report(args.out, "scripts/packed_greedy_cost.py", argv, "Reading a packed verify's argmax",
                       body, {"mixes": rows_out, "dtype": args.dtype, "rounds": args.rounds}, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
