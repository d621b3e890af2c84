#!/usr/bin/env python3
"""The served engine offline, `ar` against `lilicorr` on one batch of chat rows: how many of
`lilicorr`'s steps take the lean plain step (`SpecEngine._plain_spec_step`: nothing verified), how
many of those had a prompt lookup that the policy priced at 0 tokens (the steps that only the
second version of the lean step covers), and tokens/s of both rules taking turns.

    python scripts/plain_steps_offline.py --engine engines/smollm2-lilicorr-onnxruntime \\
        --target .cache/smollm2-135m-instruct-float32 --prompts lilicorr/data/chat_first_turn.jsonl \\
        --rows 8 --max-tokens 64 --rounds 3 --out results/serving_plain_steps_cpu/offline

The engine opens as the Triton model opens it (`open_engine` with the parameters the server's
model repository gets: the manifest's serving defaults, the start-up cost measurement, the served
thread count); all rows join at once, as one burst of
requests at that concurrency. Writes OUT.md and OUT.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

RULES = ("ar", "lilicorr")


def count_steps(engine) -> dict[str, int]:
    """Counters of the engine's speculative steps, kept by wrapping its step methods in place."""
    counts = {"spec_steps": 0, "plain_steps": 0, "plain_steps_with_lookup": 0}
    spec, plain = engine._spec_step, engine._plain_spec_step

    def spec_step(seqs):
        counts["spec_steps"] += 1
        return spec(seqs)

    def plain_step(seqs, look):
        counts["plain_steps"] += 1
        counts["plain_steps_with_lookup"] += any(look)
        return plain(seqs, look)

    engine._spec_step, engine._plain_spec_step = spec_step, plain_step
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine directory (convert/build_engine.py)")
    p.add_argument("--target", required=True, help="the prepared target folder")
    p.add_argument("--prompts", default="lilicorr/data/chat_first_turn.jsonl")
    p.add_argument("--rows", type=int, default=8, help="prompts, all running at once")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="rounds of ar then lilicorr")
    p.add_argument("--out", required=True, help="OUT.md / OUT.json")
    args = p.parse_args(argv)

    from lilicorr.eval import load_suites
    from lilicorr.results_io import write_report
    from lilicorr.serving.repository import ServeOptions, open_engine, read_engine_manifest, template_vars
    from lilicorr.tokenizer import Tokenizer

    # the lilicorr model's parameters as the server's repository writes them, paths in place of its links
    spec = read_engine_manifest(args.engine, target=args.target)
    params = {**template_vars(spec, ServeOptions()), "engine_dir": str(spec.engine_dir),
              "target_dir": str(spec.target_dir), "ckpt_dir": ""}
    engine, _ = open_engine(params, base_dir=None)
    suite = next(iter(load_suites(args.prompts, Tokenizer.from_dir(args.target), args.rows).values()))
    ids = [p["ids"] for p in suite]
    counts = count_steps(engine)
    engine.generate(ids, 8, rule="lilicorr")                       # warm-up, not counted
    counts.update(dict.fromkeys(counts, 0))
    runs = []
    for rnd in range(args.rounds):
        for rule in RULES:
            t = time.perf_counter()
            results = engine.generate(ids, args.max_tokens, rule=rule)
            wall = time.perf_counter() - t
            tokens = sum(len(r.tokens) for r in results)
            runs.append({"round": rnd + 1, "rule": rule, "tokens": tokens, "wall_s": wall,
                         "tokens_per_s": tokens / wall,
                         "tau": sum(r.accepted_tokens for r in results) / max(1, sum(r.num_steps for r in results))})
            print(f"[plain-steps] round {rnd + 1} {rule:>8}: {tokens / wall:6.1f} tok/s", file=sys.stderr)
    rows = ["| round | `ar` tok/s | `lilicorr` tok/s | `lilicorr` tau |", "|---:|---:|---:|---:|"]
    for rnd in range(1, args.rounds + 1):
        ar, li = (next(r for r in runs if r["round"] == rnd and r["rule"] == rule) for rule in RULES)
        rows.append(f"| {rnd} | {ar['tokens_per_s']:.1f} | {li['tokens_per_s']:.1f} | {li['tau']:.2f} |")
    body = (f"{len(ids)} rows of `{args.prompts}` at once, {args.max_tokens} tokens each, the engine's serving "
            f"defaults (`open_engine` with the served model's parameters).\n\n" + "\n".join(rows) + "\n\n"
            f"`lilicorr` over all rounds: {counts['spec_steps']} speculative steps, {counts['plain_steps']} of them "
            f"lean plain steps, {counts['plain_steps_with_lookup']} of those with a prompt lookup priced at 0 tokens.\n")
    print(write_report(args.out, "scripts/plain_steps_offline.py", argv,
                       "The lean plain step offline: share of steps and tokens/s", body,
                       {"runs": runs, "steps": counts, "rows": len(ids), "max_tokens": args.max_tokens}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
