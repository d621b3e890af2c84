"""Regeneration throughput of the target's two CPU kernel sets, side by side on the same prompts.

    python scripts/regen_throughput.py --target .cache/smollm2-135m-instruct-float32 \
        --prompts 64 --batch-sizes 32,64 --out results/regen_throughput_amx

`lilicorr.regen.regenerate` (what `train/regen.py` runs) answers the same training prompts
(`lilicorr.data.prompt_sources`, greedy, bf16) once with the serving kernels (batch-invariant,
oneDNN-prepacked weights: `load_target`'s default for bf16 on a CPU) and once with PyTorch's plain
kernels, per batch size, alternating; each run writes to a fresh temporary file. Prints and writes
`<out>.md` / `<out>.json`: new tokens per second per run, and whether both kernel sets wrote the
same answers (greedy decoding in bf16: kernels that round differently may pick another token at a
near-tie).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _run(target: str, prompts: list[dict], batch: int, invariant: bool, max_new: int) -> dict:
    import torch

    from lilicorr.engine import SpecEngine
    from lilicorr.regen import regenerate

    engine = SpecEngine.from_paths(target, ckpt_dir=None, max_batch=batch, dtype=torch.bfloat16,
                                   batch_invariant=invariant)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "regen.jsonl"
        stats = regenerate(target, out, prompts=prompts, max_new_tokens=max_new, batch_size=batch,
                           engine=engine, progress=False, dtype=torch.bfloat16)
        records = [json.loads(line) for line in out.read_text().splitlines()]
        answers = {r["id"]: r["completion_ids"] for r in records}
    return {"tokens": stats["new_tokens"], "seconds": stats["seconds"],
            "tokens_per_s": stats["new_tokens"] / stats["seconds"], "answers": answers}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", type=int, default=64, help="training prompts answered per run")
    ap.add_argument("--batch-sizes", default="32", help="comma-separated engine batch sizes")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True, help="path prefix of the .md and .json written")
    ap.add_argument("--note", default="", help="free text written under the table (e.g. the machine, what was paused)")
    args = ap.parse_args(argv)

    import torch

    from lilicorr.data.prompt_sources import iter_training_prompts

    torch.set_num_threads(args.threads)
    prompts = list(iter_training_prompts(args.prompts, seed=1))   # not seed 0: not the training data's order
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        runs = {name: _run(args.target, prompts, batch, invariant, args.max_new_tokens)
                for name, invariant in (("serving kernels", True), ("plain kernels", False))}
        same = sum(runs["serving kernels"]["answers"][k] == v for k, v in runs["plain kernels"]["answers"].items())
        row = {"batch": batch, "same_answers": same, "prompts": len(prompts)}
        for name, r in runs.items():
            row[name] = {k: r[k] for k in ("tokens", "seconds", "tokens_per_s")}
        rows.append(row)
        print(f"batch {batch}: " + ", ".join(f"{n} {r['tokens_per_s']:.1f} tokens/s" for n, r in runs.items())
              + f"; same answers {same}/{len(prompts)}", flush=True)
    doc = {"command": "python scripts/regen_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "torch": torch.__version__, "machine": platform.machine(), "threads": args.threads,
           "max_new_tokens": args.max_new_tokens, "note": args.note, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# Regeneration throughput: serving kernels against plain kernels (bf16, CPU)", "",
             f"Made by `{doc['command']}` ({args.threads} thread, torch {torch.__version__}).", "",
             "| batch | serving kernels tokens/s | plain kernels tokens/s | ratio | same answers |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        s, p = r["serving kernels"]["tokens_per_s"], r["plain kernels"]["tokens_per_s"]
        lines.append(f"| {r['batch']} | {s:.1f} | {p:.1f} | {s / p:.2f}x | {r['same_answers']}/{r['prompts']} |")
    if args.note:
        lines += ["", args.note]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
