#!/usr/bin/env python3
"""Peers side by side at batch 1 on this CPU: HF transformers greedy `generate`, HF prompt-lookup
decoding (`prompt_lookup_num_tokens`), and our engine's `ar`, `argmax`, `lilicorr` (whole block and
auto draft length) and `lilicorr_served` (auto draft length with prompt lookup, as an engine built by
`convert/build_engine.py` serves by default) offline, plus `lilicorr` / `ar` through a real Triton
server (with the engine's serving defaults) when --engine is given.

    python scripts/peers_cpu.py --target .cache/smollm2-135m-instruct-float32 \\
        --ckpt checkpoints/smollm2-lilicorr --engine engines/smollm2-lilicorr-onnxruntime \\
        --suites humaneval,lilicorr/data/chat_first_turn.jsonl --limit 6 --max-tokens 64 \\
        --settings float32:1,bfloat16:2,fp16-weights:1,fp16-weights:2 --triton-settings fp16-weights:1 \\
        --out results/peers_cpu

Every setting (precision:threads) runs every system on the same prompts in one process, systems taking
turns per prompt, so load drift on a shared machine hits all of them alike; our systems share one
target and one drafter in memory, as a server does (separate copies would also compete for the CPU's
caches, which favoured whichever system ran from them). Through Triton, `ar` and `lilicorr` take
turns per prompt the same way (one request at a time, streamed). Writes OUT.json, OUT.md
and OUT.png (tokens/s per system, setting and suite). Re-run it when a new checkpoint lands.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

from lilicorr.results_io import save_figure, write_report

HF_SYSTEMS = ("hf_greedy", "hf_prompt_lookup")
OUR_SYSTEMS = ("ar", "argmax", "lilicorr", "lilicorr_auto", "lilicorr_served")


def chat_ids(tok, item) -> list[int]:
    msgs = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
    return tok.encode_chat(msgs)


def run_setting(args, dtype: str, threads: int, suites: dict, tok, log) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from lilicorr.draft_runner import TorchDraftRunner
    from lilicorr.engine import SpecEngine
    from lilicorr.model import load_model
    from lilicorr.target import load_target

    torch.set_num_threads(threads)
    systems = [s for s in args.systems if s in OUR_SYSTEMS
               or (s in HF_SYSTEMS and dtype in ("float32", "bfloat16", "float16"))]   # HF: torch dtypes only
    hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, dtype)).eval() \
        if any(s in HF_SYSTEMS for s in systems) else None
    engines = {}
    ours = [s for s in systems if s in OUR_SYSTEMS]
    if ours:      # one target and one drafter in memory, shared by every system of ours (as a server holds them)
        target = load_target(args.target, dtype=dtype)
        model = load_model(args.ckpt, target) if any(s != "ar" for s in ours) else None
    for s in ours:
        runner = None if s == "ar" else TorchDraftRunner(model, 1)
        engines[s] = SpecEngine(target, runner, max_batch=1,
                                draft_length="auto" if s in ("lilicorr_auto", "lilicorr_served") else None,
                                prompt_lookup=args.prompt_lookup if s == "lilicorr_served" else 0)
    stop = sorted(tok.eos_ids)
    rows = []
    for suite, prompts in suites.items():
        acc = {s: {"tokens": 0, "seconds": 0.0, "accepted": 0, "steps": 0} for s in systems}
        warm = [(True, it) for it in prompts[: args.warmup]] if suite == next(iter(suites)) else []
        for untimed, item in warm + [(False, it) for it in prompts]:
            ids = chat_ids(tok, item)
            for s in systems:
                t0 = time.perf_counter()
                if s in HF_SYSTEMS:
                    kw = {"prompt_lookup_num_tokens": args.lookup} if s == "hf_prompt_lookup" else {}
                    with torch.no_grad():
                        out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False,
                                          eos_token_id=stop, pad_token_id=stop[0], **kw)
                    n, acc_t, steps = out.shape[1] - len(ids), 0, 0
                else:
                    rule = "lilicorr" if s.startswith("lilicorr") else s
                    r = engines[s].generate([ids], args.max_tokens, rule=rule, stop_ids=stop)[0]
                    n, acc_t, steps = len(r.tokens), r.accepted_tokens, r.num_steps
                dt = time.perf_counter() - t0
                if untimed:
                    continue
                a = acc[s]
                a["tokens"] += n
                a["seconds"] += dt
                a["accepted"] += acc_t
                a["steps"] += steps
        for s in systems:
            a = acc[s]
            rows.append({"suite": suite, "system": s, "dtype": dtype, "threads": threads,
                         "tokens": a["tokens"], "seconds": a["seconds"],
                         "tokens_per_s": a["tokens"] / a["seconds"] if a["seconds"] else None,
                         "tau": a["accepted"] / a["steps"] if a["steps"] else None})
            log(f"[peers] {suite} {dtype}:{threads} {s:>16} {rows[-1]['tokens_per_s']:.1f} tok/s"
                + (f" tau={rows[-1]['tau']:.2f}" if rows[-1]["tau"] else ""))
    return rows


def run_triton(args, suites: dict, dtype: str, threads: int, log) -> list[dict]:
    import tempfile

    from lilicorr.serving.benchmark import run_cell
    from lilicorr.serving.client import LiLiCorrClient
    from lilicorr.serving.launcher import TritonServer
    from lilicorr.serving.repository import ServeOptions, generate_repository, read_engine_manifest

    repo = Path(tempfile.mkdtemp(prefix="lilicorr-peers-repo-"))
    generate_repository(read_engine_manifest(args.engine), repo,
                        ServeOptions(max_batch=1, dtype=dtype, num_threads=threads))
    rows = []
    server = TritonServer(repo, startup_timeout=900).start()
    try:
        client = LiLiCorrClient(server.grpc_url, timeout=1800)
        client.wait_ready(60)
        first = next(iter(suites.values()))
        # untimed warm-up requests, as offline: first-call costs count against no rule
        for rule in ("ar", "lilicorr") if args.warmup else ():
            run_cell(client, first[: args.warmup], rule, 1, args.max_tokens, None, None, None)
        for suite, prompts in suites.items():
            # the rules take turns per prompt (in alternating order), as the offline systems do, so
            # that a slow or fast minute of the shared machine falls on both
            acc = {rule: {"tokens": 0, "seconds": 0.0, "accepted": 0, "steps": 0} for rule in ("ar", "lilicorr")}
            for i, item in enumerate(prompts):
                for rule in ("ar", "lilicorr") if i % 2 == 0 else ("lilicorr", "ar"):
                    cell, _ = run_cell(client, [item], rule, 1, args.max_tokens, None, None, None)
                    if cell["errors"]:
                        raise RuntimeError(f"triton_{rule} on {suite}: {cell['error_messages']}")
                    a = acc[rule]
                    a["tokens"] += cell["output_tokens"]
                    a["seconds"] += cell["wall_s"]
                    a["accepted"] += cell["accepted_tokens"]
                    a["steps"] += cell["verify_steps"]
            for rule, a in acc.items():
                rows.append({"suite": suite, "system": f"triton_{rule}", "dtype": dtype, "threads": threads,
                             "tokens": a["tokens"], "seconds": a["seconds"],
                             "tokens_per_s": a["tokens"] / a["seconds"] if a["seconds"] else None,
                             "tau": a["accepted"] / a["steps"] if a["steps"] else None})
                log(f"[peers] {suite} {dtype}:{threads} triton_{rule:>8} {rows[-1]['tokens_per_s']:.1f} tok/s")
    finally:
        server.stop()
    return rows


def table(rows: list[dict]) -> str:
    settings = sorted({(r["dtype"], r["threads"]) for r in rows})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    out = []
    for suite in dict.fromkeys(r["suite"] for r in rows):
        out += [f"### {suite} (tokens/s, batch 1; speedup over our `ar` at the same setting)", "",
                "| system | " + " | ".join(f"{d}, {t} thr" for d, t in settings) + " |",
                "|---|" + "---:|" * len(settings)]
        for s in systems:
            cells = []
            for d, t in settings:
                r = next((x for x in rows if x["suite"] == suite and x["system"] == s and x["dtype"] == d
                          and x["threads"] == t), None)
                base = next((x for x in rows if x["suite"] == suite and x["system"] == "ar" and x["dtype"] == d
                             and x["threads"] == t), None)
                if r is None or r["tokens_per_s"] is None:
                    cells.append("")
                    continue
                txt = f"{r['tokens_per_s']:.1f}"
                if base and base["tokens_per_s"]:
                    txt += f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)"
                if r.get("tau"):
                    txt += f" tau {r['tau']:.2f}"
                cells.append(txt)
            out.append(f"| {s} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = list(dict.fromkeys(r["suite"] for r in rows))
    settings = sorted({(r["dtype"], r["threads"]) for r in rows})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, axes = plt.subplots(1, len(suites), figsize=(6 * len(suites), 4), squeeze=False)
    w = 0.8 / max(len(settings), 1)
    for ax, suite in zip(axes[0], suites):
        for j, (d, t) in enumerate(settings):
            ys = [next((x["tokens_per_s"] or 0 for x in rows if x["suite"] == suite and x["system"] == s
                        and x["dtype"] == d and x["threads"] == t), 0) for s in systems]
            ax.bar([i + j * w for i in range(len(systems))], ys, w, label=f"{d}, {t} thr")
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(systems))], systems, rotation=30, ha="right")
        ax.set_ylabel("tokens/s (batch 1)")
        ax.set_title(Path(suite).stem)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--engine", default=None, help="engine dir: also run `ar` / `lilicorr` through Triton")
    p.add_argument("--suites", default="humaneval,lilicorr/data/chat_first_turn.jsonl")
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--settings", default="float32:1,bfloat16:2,fp16-weights:1,fp16-weights:2",
                   help="precision:threads,... (HF runs only at torch dtypes; fp16-weights and bf16-gemm are ours)")
    p.add_argument("--triton-settings", default=None,
                   help="with --engine: the settings served through Triton (default: all of --settings)")
    p.add_argument("--systems", default=",".join(HF_SYSTEMS + OUR_SYSTEMS))
    p.add_argument("--lookup", type=int, default=10, help="HF's prompt_lookup_num_tokens")
    p.add_argument("--prompt-lookup", type=int, default=3,
                   help="lilicorr_served: longest n-gram our prompt lookup matches (the converter's default)")
    p.add_argument("--warmup", type=int, default=1, help="untimed prompts per system and setting, first")
    p.add_argument("--note", default="")
    p.add_argument("--out", required=True, help="output path without suffix (.json, .md, .png)")
    args = p.parse_args(argv)
    args.systems = args.systems.split(",")
    triton_settings = (args.triton_settings or args.settings).split(",")

    from lilicorr.data.suites import load_prompts
    from lilicorr.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(args.target)
    suites = {s: load_prompts(s, args.limit) for s in args.suites.split(",")}
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rows = []
    for setting in args.settings.split(","):
        dtype, threads = setting.split(":")
        rows += run_setting(args, dtype, int(threads), suites, tok, log)
        if args.engine and setting in triton_settings:
            rows += run_triton(args, suites, dtype, int(threads), log)
    body = (f"{len(next(iter(suites.values())))} prompts per suite, up to {args.max_tokens} new tokens, greedy; "
            f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{platform.machine()}. {args.note}\n\n{table(rows)}\n" + "![tokens/s]({png})\n")
    print(write_report(args.out, "scripts/peers_cpu.py", argv, "Peers on this CPU, batch 1", body,
                       {"rows": rows, "note": args.note}, lambda path: plot(rows, path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
