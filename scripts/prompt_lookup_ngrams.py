#!/usr/bin/env python
"""Prompt lookup's greedy tau on the held-out text, per n-gram range (which suffix lengths to match).

    python scripts/prompt_lookup_ngrams.py --heldout results/cpu_smollm2_v3/tau_vs_steps.heldout.jsonl \
        --out results/prompt_lookup_ngrams

The held-out text is the target's own greedy continuation of each evaluation prompt (the file
`scripts/tau_vs_steps.py` caches), so greedy decoding with prompt lookup alone can be replayed
exactly without running the target: at each step the row verifies up to B-1 tokens copied from
the latest earlier occurrence of its longest matching suffix (lilicorr.ngram.NgramIndex, the
engine's own index) and accepts their leading run equal to the target's tokens, plus the bonus
token. Reported per suite: tau, the share of steps with a match, and the drafts accepted per
matched step (what a lookup step gains over a drafter step).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lilicorr.ngram import replay_lookup  # noqa: E402
from lilicorr.results_io import write_report  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heldout", type=Path, required=True, help="JSONL: a key line, then {suite, prompt, completion}")
    ap.add_argument("--ranges", default="2:1,3:1,3:2,4:2,6:3", help="max:min n-gram sizes to compare")
    ap.add_argument("--slots", type=int, default=7, help="drafted tokens per step at most (B-1)")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.md and OUT.json")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in args.heldout.read_text().splitlines()[1:] if line.strip()]
    ranges = [tuple(int(x) for x in r.split(":")) for r in args.ranges.split(",")]
    suites = list(dict.fromkeys(r["suite"] for r in rows))
    table, data = [], []
    for max_n, min_n in ranges:
        for suite in suites + ["all"]:
            sums = [0, 0, 0, 0]
            for r in rows:
                if suite in ("all", r["suite"]):
                    got = replay_lookup(r["prompt"] + r["completion"], len(r["prompt"]), max_n, args.slots, min_n)
                    sums = [a + b for a, b in zip(sums, got)]
            steps, tokens, matched, gained = sums
            rec = {"max_ngram": max_n, "min_ngram": min_n, "suite": suite, "steps": steps, "tau": tokens / steps,
                   "match_share": matched / steps, "accepted_per_match": gained / max(matched, 1)}
            data.append(rec)
            table.append(f"| {max_n}..{min_n} | {suite} | {rec['tau']:.3f} | {rec['match_share']:.2f} | "
                         f"{rec['accepted_per_match']:.2f} |")
    md = [f"Held-out text: `{args.heldout}` ({len(rows)} greedy continuations); at most {args.slots} drafts per step.",
          "", "| n-grams (max..min) | suite | tau (lookup alone) | steps with a match | drafts accepted per match |",
          "|---|---|---:|---:|---:|", *table]
    write_report(args.out, "scripts/prompt_lookup_ngrams.py", argv, "Prompt lookup on the held-out text, per n-gram range",
                 "\n".join(md), {"points": data, "heldout": str(args.heldout), "slots": args.slots})
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
