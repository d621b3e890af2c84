#!/usr/bin/env python
"""Regenerate the assistant turns of the training prompts with the target (greedy, chat template).

    python train/regen.py --target DIR --out FILE.jsonl [--num-prompts N] [--max-new-tokens 256]
                          [--batch-size 8] [--seed 0] [--mix code=0.4,math=0.4,chat=0.2]
                          [--prompts FILE.jsonl] [--device cpu] [--dtype float32] [--shard I/N]
                          [--exclude DONE.jsonl[.gz] ...]

Generation goes through ``lilicorr.engine.SpecEngine`` with rule "ar". Resumable: rerun the same
command after an interruption (Ctrl-C or SIGTERM, e.g. from ``timeout``; exit status 130); ids
already in FILE are skipped and a trailing partial line is dropped. See ``lilicorr/regen.py`` for the output format.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without install

from lilicorr.regen import read_ids, regenerate  # noqa: E402


def _mix(s: str) -> dict:
    out = {}
    for part in s.split(","):
        k, _, v = part.partition("=")
        if not _:
            raise argparse.ArgumentTypeError(f"bad mix entry {part!r}; use code=0.4,math=0.4,chat=0.2")
        out[k.strip()] = float(v)
    return out


def _shard(s: str) -> tuple[int, int]:
    i, _, n = s.partition("/")
    try:
        i, n = int(i), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad shard {s!r}; use I/N, e.g. 0/2") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"bad shard {s!r}: need 0 <= I < N")
    return i, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target model directory (HF layout)")
    ap.add_argument("--out", required=True, type=Path, help="output JSONL (appended; resumable)")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", type=_mix, default=None, help="kind weights, e.g. code=0.4,math=0.4,chat=0.2")
    ap.add_argument("--prompts", default=None,
                    help="a JSONL prompt file to use instead of the built-in training sources "
                         "(the evaluation suites are refused)")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--allow-mismatch", action="store_true",
                    help="resume even if FILE.meta.json records other settings")
    ap.add_argument("--shard", type=_shard, default=None,
                    help="I/N: only the I-th of N contiguous blocks of the prompt list (run N processes, "
                         "each with its own --out, to use N cores)")
    ap.add_argument("--exclude", action="append", default=[], metavar="FILE",
                    help="a JSONL file (plain or .gz) of an earlier round: its ids leave the prompt list "
                         "before --shard splits it (repeatable)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    def stop(signum, frame):              # `timeout` / kill: stop like Ctrl-C, whole lines only
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)

    import torch
    prompts = None
    if args.prompts is not None:
        from lilicorr.data.suites import BUILTIN_SUITES, load_prompts, prompt_text, eval_prompt_texts
        if args.prompts.lower() in BUILTIN_SUITES:
            ap.error(f"{args.prompts} is an evaluation suite; training prompts must not overlap it")
        prompts = load_prompts(args.prompts, limit=args.num_prompts)
        bad = eval_prompt_texts()
        n = len(prompts)
        prompts = [p for p in prompts if prompt_text(p) not in bad]
        if len(prompts) != n:
            print(f"[regen] dropped {n - len(prompts)} prompts that equal evaluation prompts", file=sys.stderr)
    try:
        exclude = set().union(*(read_ids(f) for f in args.exclude))
        stats = regenerate(args.target, args.out, num_prompts=args.num_prompts,
                           max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                           seed=args.seed, mix=args.mix, prompts=prompts,
                           prompts_name=str(Path(args.prompts).resolve()) if args.prompts else None,
                           device=args.device, dtype=getattr(torch, args.dtype),
                           max_seq_len=args.max_seq_len, progress=not args.no_progress,
                           allow_mismatch=args.allow_mismatch, shard=args.shard, exclude=exclude)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
