#!/usr/bin/env python
"""Does greedy speculative decoding reproduce plain greedy decoding, per target precision?

    python scripts/greedy_equality.py --target .cache/smollm2-135m-instruct-float32 \
        --ckpt checkpoints/smollm2-lilicorr --dtypes float32,fp16-weights,bfloat16 \
        --prompts humaneval --limit 8 --max-tokens 64 --out results/greedy_equality_cpu

For each precision the same engine decodes every prompt with rule `ar` (one token per step) and with
`lilicorr` (whole-block verify) at batch 1 and at batch `--batch`, and counts the prompts whose
token sequences are equal. A precision written NAME:plain keeps PyTorch's own kernels where
`load_target` would switch on batch-invariant mode (bf16 on a CPU; `lilicorr.batch_invariant`).
Writes OUT.md and OUT.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lilicorr.results_io import write_report  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--dtypes", default="float32,fp16-weights,bfloat16")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, type=Path, help="writes OUT.md and OUT.json")
    args = ap.parse_args(argv)
    import torch

    from lilicorr.engine import SpecEngine
    from lilicorr.eval import load_suites
    from lilicorr.target import precision_variant
    from lilicorr.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    tok = Tokenizer.from_dir(args.target)
    prompts = [p["ids"] for ps in load_suites(args.prompts, tok, args.limit).values() for p in ps]
    rows = []
    for spec in args.dtypes.split(","):
        dtype, invariant = precision_variant(spec)
        engine = SpecEngine.from_paths(args.target, args.ckpt, max_batch=args.batch, dtype=dtype,
                                       batch_invariant=invariant)
        kernels = "batch-invariant" if engine.target.batch_invariant else "PyTorch's"
        ar = engine.generate(prompts, args.max_tokens, rule="ar")
        for batch in sorted({1, args.batch}):
            equal = 0
            for i in range(0, len(prompts), batch):
                spec = engine.generate(prompts[i: i + batch], args.max_tokens, rule="lilicorr")
                equal += sum(a.tokens == s.tokens for a, s in zip(ar[i: i + batch], spec))
            rows.append({"dtype": dtype, "kernels": kernels, "batch": batch,
                         "equal": equal, "prompts": len(prompts)})
            print(rows[-1], flush=True)
    table = ["| target precision | kernels | batch | lilicorr == ar |", "|---|---|---:|---:|"]
    table += [f"| {r['dtype']} | {r['kernels']} | {r['batch']} | {r['equal']} / {r['prompts']} |" for r in rows]
    body = (f"Greedy, {len(prompts)} prompts of {args.prompts}, up to {args.max_tokens} new tokens, checkpoint "
            f"`{args.ckpt}`, {args.threads} thread(s).\n\n" + "\n".join(table) + "\n")
    print(write_report(args.out, "scripts/greedy_equality.py", argv, "Greedy speculative output against plain "
                       "greedy decoding, per precision", body, {"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
