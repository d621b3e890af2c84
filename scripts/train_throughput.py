#!/usr/bin/env python
"""Training-step throughput of the `cpu` preset: blocks/s and supervised tokens/s, side by side.

    python scripts/train_throughput.py --target .cache/smollm2-135m-instruct-float32 \
        --json results/train_throughput.json [--steps 3] [--threads 2]

Every variant runs the real `Trainer.train_step` (forward, backward, AdamW) on the same 8
sequences of 512 tokens, with target features read from a real feature store built once (as
training does), one after another in a round-robin so machine noise hits all of them alike.
Variants: the previous recipe (fp32, full 49k LM head, 3 captured layers, 24 anchors), a draft
vocabulary, and the current preset (5 layers, dense anchors); `--bf16` adds the preset under bf16
autocast, which pays only on CPUs with native bf16 matmuls (AVX512-BF16 or AMX). The token ids are
random (throughput does not depend on them), the draft vocabulary is their most frequent ids.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lilicorr.config import preset  # noqa: E402
from lilicorr.draft_vocab import build_draft_vocab, token_counts  # noqa: E402
from lilicorr.features import FeatureStore, build_feature_store  # noqa: E402
from lilicorr.target import load_target  # noqa: E402
from lilicorr.trainer import Trainer  # noqa: E402
from lilicorr.training import Sequence  # noqa: E402

VARIANTS = {   # name: (bf16 autocast, draft vocab, captured layers, anchors)
    "before: fp32, full head, n=3, 24 anchors": (False, 0, 3, 24),
    "fp32, draft vocab 16k, n=3, 24 anchors": (False, 16384, 3, 24),
    "fp32, draft vocab 16k, n=5, 64 anchors (preset)": (False, 16384, 5, 64),
}


def make_sequences(n: int, length: int, vocab: int, seed: int) -> list[Sequence]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = rng.randint(length // 5, length // 3)
        # a Zipf-like draw so that a frequency-ranked draft vocabulary means something
        ids = [min(vocab - 1, int(rng.paretovariate(1.1))) + 17 for _ in range(length)]
        out.append(Sequence(ids, [0] * prompt + [1] * (length - prompt)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="also time the preset under bf16 autocast")
    ap.add_argument("--profile", action="store_true",
                    help="print a torch.profiler table (top ops by self CPU time) of one step of the last variant")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.bf16:
        VARIANTS["bf16 autocast, draft vocab 16k, n=5, 64 anchors"] = (True, 16384, 5, 64)
    target = load_target(args.target)
    cfg0 = preset("cpu")
    seqs = make_sequences(cfg0.train.global_batch, cfg0.train.seq_len, target.config.vocab_size - 17, 0)
    counts = token_counts(seqs, target.config.vocab_size)
    trainers = {}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {}
        for name, (bf16, draft, n_layers, anchors) in VARIANTS.items():
            cfg = preset("cpu")
            cfg.drafter.num_target_layers_captured = n_layers
            cfg.drafter.draft_vocab_size = draft
            cfg.train.num_anchors = anchors
            cfg.train.max_steps = 10_000
            cfg.drafter = cfg.drafter.for_target(target.config)
            ids = tuple(cfg.drafter.target_layer_ids)
            if ids not in stores:
                build_feature_store(target, seqs, list(ids), Path(tmp) / f"f{len(stores)}")
                stores[ids] = FeatureStore(Path(tmp) / f"f{len(stores)}", target.config, list(ids), seqs)
            tr = Trainer(cfg, target, seqs, Path(tmp) / "ckpt", pad_id=0, autocast_bf16=bf16,
                         features=stores[ids])
            if draft:
                tr.model.drafter.set_draft_vocab(build_draft_vocab(counts, draft))
            tr.train_step()                                        # warm-up
            print(f"ready: {name}", flush=True)
            trainers[name] = tr
        times = {name: [] for name in VARIANTS}
        blocks = {}
        for _ in range(args.rounds):
            for name, tr in trainers.items():
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    rec = tr.train_step()
                    times[name].append(time.perf_counter() - t0)
                blocks[name] = sum(tr.cfg.train.num_anchors for _ in seqs)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainers[name].train_step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    base = statistics.median(times[next(iter(VARIANTS))])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        b = blocks[name]
        s = trainers[name].cfg.drafter.block_size - 1
        rows.append({"variant": name, "step_s": med, "blocks_per_s": b / med,
                     "slot_tokens_per_s": b * s / med, "speedup_blocks_per_s": (b / med) / (blocks[next(iter(VARIANTS))] / base)})
    out = {"command": "python scripts/train_throughput.py " + shlex.join(sys.argv[1:] if argv is None else argv),
           "threads": args.threads, "batch": cfg0.train.global_batch, "seq_len": cfg0.train.seq_len,
           "steps_timed": args.steps * args.rounds, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    md = ["| variant | s/step | blocks/s | slot tokens/s | blocks/s vs before |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['variant']} | {r['step_s']:.2f} | {r['blocks_per_s']:.1f} | {r['slot_tokens_per_s']:.0f} | "
                  f"{r['speedup_blocks_per_s']:.2f}x |")
    print("\n".join(md))
    args.json.with_suffix(".md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
