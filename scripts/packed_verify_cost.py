#!/usr/bin/env python3
"""What a verify costs when its rows check different numbers of tokens: padded (every row runs to
the longest, as the engine verified before) against packed (`lilicorr.target.Packing`: each row
computes only its own tokens, what the engine verifies now), in plain steps of the same rows.

    python scripts/packed_verify_cost.py --target .cache/smollm2-135m-instruct-float32 \\
        --out results/packed_verify_epyc/verify-cost-rows8 --rows 8 --dtype bf16-gemm

One process; the length mixes (tokens per row: the anchor plus its drafts) and both forms take turns
in `--rounds` rounds of `--reps` forwards each over `--context` cached tokens per row, and each ratio
is the median of the per-round medians over the same round's plain step. The packed and padded
forwards give every real token the same bits in the batch-invariant precisions
(tests/test_target.py). Writes OUT.json and OUT.md.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from lilicorr.target import load_target
from verify_cost import cpu_flags


def mixes(rows: int) -> dict[str, list[int]]:
    """Name -> tokens per row of each length mix measured at `rows` rows."""
    out = {"plain step": [1] * rows}
    if rows > 1:
        out["one row +1"] = [2] + [1] * (rows - 1)
        out["one row +3"] = [4] + [1] * (rows - 1)
        out["one row +7"] = [8] + [1] * (rows - 1)
        out["half the rows +1"] = [2] * (rows // 2) + [1] * (rows - rows // 2)
        out["a mix"] = ([4, 3, 2, 2] + [1] * rows)[:rows]
    out["every row +1"] = [2] * rows
    return out


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True, help="output path without suffix (.json and .md are written)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--dtype", default="bf16-gemm", help="target precision")
    p.add_argument("--context", type=int, default=200, help="cached tokens per row")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=4, help="forwards per mix and form per round")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype)
    n, ctx = args.rows, args.context
    cache = target.new_cache(n, capacity=ctx + 9)
    slots = torch.tensor([cache.allocate() for _ in range(n)])
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (n, ctx + 8), generator=gen)
    pos = torch.arange(ctx + 8).expand(n, -1)
    target(ids[:, :ctx], pos[:, :ctx], cache=cache, rows=slots, logits=False)
    base = torch.full((n,), ctx)
    capture = [0, len(target.layers) // 2, len(target.layers) - 1]

    def forward(tokens: list[int], packed: bool) -> float:
        t = max(tokens)
        valid = torch.tensor(tokens) if packed else None
        t0 = time.perf_counter()
        out = target(ids[:, ctx: ctx + t], pos[:, ctx: ctx + t], cache=cache, rows=slots, valid=valid,
                     capture=capture)
        out.logits.argmax(-1).tolist()                      # what the engine reads
        dt = time.perf_counter() - t0
        cache.truncate(slots, base)
        return dt

    cases = mixes(n)
    forms = [(name, packed) for name in cases for packed in (False, True)]
    per_round = {f: [] for f in forms}
    for r in range(args.rounds):
        for name, packed in forms:
            forward(cases[name], packed)                    # warm
            per_round[(name, packed)].append(statistics.median(forward(cases[name], packed) for _ in range(args.reps)))
        print(f"[packed_verify_cost] round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    plain = per_round[("plain step", False)]
    rows = []
    for name, tokens in cases.items():
        ratio = {packed: statistics.median(t / b for t, b in zip(per_round[(name, packed)], plain))
                 for packed in (False, True)}
        rows.append({"mix": name, "tokens": tokens, "drafts": sum(tokens) - n, "padded": ratio[False],
                     "packed": ratio[True]})
    cmd = "python scripts/packed_verify_cost.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    lines = ["| length mix | tokens per row | drafts in all | padded | packed |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['mix']} | {' '.join(map(str, r['tokens']))} | {r['drafts']} | {r['padded']:.2f} | {r['packed']:.2f} |"
              for r in rows]
    md = (f"# Packed against padded verify, {n} rows, {args.dtype}\n\n"
          f"Cost of one target forward in plain steps of the same {n} rows ({ctx} cached tokens each, "
          f"{args.threads} thread(s)); median over {args.rounds} interleaved rounds of {args.reps} forwards. "
          f"Padded: every row runs to the longest row's tokens. Packed: each row only its own. Made by:\n\n"
          f"    {cmd}\n\nCPU flags: {' '.join(cpu_flags())}; torch {torch.__version__}; plain step "
          f"{statistics.median(plain) * 1e3:.1f} ms.\n\n" + "\n".join(lines) + "\n")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps({
        "command": cmd, "rows": n, "dtype": args.dtype, "context": ctx, "rounds": args.rounds, "reps": args.reps,
        "threads": args.threads, "torch": torch.__version__, "cpu_flags": cpu_flags(),
        "plain_step_ms": statistics.median(plain) * 1e3, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "results": rows}, indent=2))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
