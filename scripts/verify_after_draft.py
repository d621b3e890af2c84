#!/usr/bin/env python3
"""A/A check: does a drafter pass slow the target verify that follows it? Times an 8-token verify of
the target (1 row, 200 cached tokens, 1 thread) right after nothing, after an int8 drafter pass and
after a float32 one (the three draft parts of each engine of `scripts/draft_weights_cpu.sh`), the
three orders taking turns (A B C, C B A, ...); medians after 4 warm-up rounds.

    python scripts/verify_after_draft.py --out results/draft_weights_amx/verify_after_draft.md
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from lilicorr import checkpoint as ckpt_io
from lilicorr.export import _flat_draft_feeds, draft_inputs
from lilicorr.model import LiLiCorrModel
from lilicorr.ort_runner import OrtSession, run_draft_parts
from lilicorr.target import load_target

PARTS = ("backbone", "lm_head", "head")
SUFFIX = {"int8": ".int8.onnx", "float32": ".ort.onnx"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=".cache/smollm2-135m-instruct-float32")
    p.add_argument("--ckpt", default="checkpoints/smollm2-lilicorr")
    p.add_argument("--engines", default="engines/draft-weights-{}", help="engine dir pattern ({} = int8 | float32)")
    p.add_argument("--dtype", default="fp16-weights")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target = load_target(args.target, dtype=args.dtype)
    cfg, _ = ckpt_io.read_config(args.ckpt)
    model = LiLiCorrModel(cfg, load_target(args.target))
    feeds = _flat_draft_feeds(model, draft_inputs(model, 1, 200))   # input shapes only; weights do not matter
    sessions = {w: [OrtSession(Path(args.engines.format(w)) / f"draft.{part}{SUFFIX[w]}", threads=1) for part in PARTS]
                for w in SUFFIX}
    cache = target.new_cache(1, capacity=260)
    slot = torch.tensor([cache.allocate()])
    ids = torch.randint(0, target.config.vocab_size, (1, 208), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(208)[None]
    target(ids[:, :200], pos[:, :200], cache=cache, rows=slot, logits=False)
    base = torch.tensor([200])

    def verify() -> float:
        t0 = time.perf_counter()
        target(ids[:, 200:], pos[:, 200:], cache=cache, rows=slot).logits.argmax(-1)
        dt = time.perf_counter() - t0
        cache.truncate(slot, base)
        return dt

    kinds = ["none", "int8", "float32"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            if k != "none":
                run_draft_parts(sessions[k], feeds)
            times[k].append(verify())
    med = {k: statistics.median(v[4:]) * 1e3 for k, v in times.items()}
    lines = ["# Target verify after a drafter pass", "", "Made by:", "",
             "    python " + " ".join(shlex.quote(a) for a in ["scripts/verify_after_draft.py", *(argv or sys.argv[1:])]), "",
             f"8-token verify, {args.dtype}, 1 row, 200 cached tokens, 1 thread; median of {args.rounds - 4} rounds.", "",
             "| before the verify | verify ms | vs none |", "|---|---:|---:|"]
    lines += [f"| {k} | {med[k]:.1f} | {med[k] / med['none']:.3f}x |" for k in kinds]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
