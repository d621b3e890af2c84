#!/usr/bin/env python
"""Write general-chat training prompts sampled from the target itself (the Magpie method).

    python train/magpie.py --target DIR --out chat-prompts.jsonl [--num 800] [--seed 0]
                           [--temperature 1.0] [--max-tokens 96] [--dtype bfloat16]
                           [--openers builtin|FILE]

The target's chat template is started at the user turn and the target samples the user message
(`lilicorr/data/magpie.py`); texts are deduplicated and anything equal to an evaluation prompt is
dropped. With `--openers`, every user turn starts with an opening phrase (`builtin`:
`lilicorr.data.magpie.OPENERS`, or a text file with one phrase per line) and the target writes the
rest, for turns in more of the forms users write. The output is a prompt file for
`train/regen.py --prompts`, one whole line per prompt as it is found (`lilicorr.regen.LineWriter`);
rerun the same command to resume an interrupted run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without install


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model directory (HF layout)")
    ap.add_argument("--out", required=True, type=Path, help="output prompt JSONL")
    ap.add_argument("--num", type=int, default=800, help="distinct prompts to keep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=96, help="longest user turn sampled")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-attempts", type=int, default=None,
                    help="stop after this many samples in all (default: 4 per prompt still missing)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--openers", default=None,
                    help="start every user turn with a phrase: 'builtin' or a file with one per line")
    args = ap.parse_args(argv)
    if args.num < 1:
        ap.error("--num must be >= 1")
    from lilicorr.data.magpie import OPENERS
    openers = None
    if args.openers == "builtin":
        openers = list(OPENERS)
    elif args.openers is not None:
        try:
            openers = [l.strip() for l in Path(args.openers).read_text(encoding="utf-8").splitlines() if l.strip()]
        except OSError as e:
            ap.error(f"--openers: {e}")
        if not openers:
            ap.error(f"--openers: {args.openers} holds no phrase")
    import torch
    from tqdm import tqdm

    from lilicorr.data.magpie import generate_user_turns
    from lilicorr.engine import SpecEngine
    from lilicorr.regen import LineWriter, repair_and_read
    from lilicorr.tokenizer import Tokenizer

    done = list(repair_and_read(args.out).values())
    if any(not it["id"].startswith(f"magpie-{args.seed}-") for it in done):
        print(f"error: {args.out} holds prompts of another seed; use another --out", file=sys.stderr)
        return 2
    source = "magpie:opener" if openers else "magpie"
    if any(it.get("source", "magpie") != source for it in done):
        print(f"error: {args.out} holds prompts made {'without' if openers else 'with'} --openers; "
              "use another --out", file=sys.stderr)
        return 2
    if len(done) >= args.num:
        print(f"{args.out} already holds {len(done)} prompts")
        return 0
    tok = Tokenizer.from_dir(args.target)
    engine = SpecEngine.from_paths(args.target, ckpt_dir=None, max_batch=args.batch_size, max_seq_len=512,
                                   dtype=getattr(torch, args.dtype))  # the serving kernels
    engine.keep_results = False
    t0 = time.perf_counter()
    with LineWriter(args.out) as writer, \
            tqdm(total=args.num, initial=len(done), desc="magpie prompts", unit="prompt", mininterval=10) as bar:
        def keep(item):
            writer.write(item)
            bar.update(1)
        items = generate_user_turns(engine, tok, args.num, seed=args.seed, temperature=args.temperature,
                                    max_tokens=args.max_tokens, batch_size=args.batch_size,
                                    progress=keep, done=done, openers=openers,
                                    max_attempts=args.max_attempts)
    print(json.dumps({"prompts": len(items), "new": len(items) - len(done),
                      "seconds": round(time.perf_counter() - t0, 1)}))
    if len(items) < args.num:
        print(f"error: {len(items)} of {args.num} distinct acceptable prompts after the attempts allowed; "
              "rerun the same command to draw more", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
