#!/usr/bin/env python3
"""Closed-loop load benchmark of the LiLiCorr Triton server: every rule in one run, one after another at each concurrency.

    python deploy/bench.py --url 127.0.0.1:8001 --prompts humaneval --limit 32 \\
        --concurrency 1,2,4,8,16,32 --rules ar,argmax,lilicorr --max-tokens 128 --json results/bench.json

Reports output tokens/s, tau (accepted incl. bonus / verify steps), speedup over `ar` at the same
concurrency, p50/p99 TTFT and per-token latency (TPOT), prints a markdown table, writes OUT.json
and a speedup-vs-concurrency plot OUT.png next to it. --profile adds the server's Table 3 stage
decomposition per cell (start the server with `deploy/serve.py --profile`). Instead of --url,
--engine DIR starts a server for the run (on free loopback ports) and stops it afterwards.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from lilicorr.config import DEFAULT_TREE_NODES
from lilicorr.data.suites import load_prompts
from lilicorr.serving.benchmark import (add_comparisons, markdown_table, plot_speedup, request_kwargs,
                                        run_cell, scrape_metrics, settled_metrics, stage_delta,
                                        summarize_cell)
from lilicorr.serving.client import GenerationError, LiLiCorrClient


def parse_list(s: str, cast=str) -> list:
    return [cast(x) for x in s.replace(" ", "").split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="gRPC HOST:PORT of a running server")
    p.add_argument("--engine", help="start a server for this engine dir instead of using --url")
    p.add_argument("--metrics-url", help="Prometheus endpoint (default: http://HOST:8002/metrics)")
    p.add_argument("--prompts", default="humaneval", help="built-in suite name or JSONL file")
    p.add_argument("--limit", type=int, default=None, help="first N prompts")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per cell (default: max(#prompts, concurrency); prompts are cycled)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--rules", default="ar,argmax,lilicorr")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1, help="untimed requests per rule before the run")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed passes per concurrency, the rules in turn and in reverse order every other pass "
                        "(A B C C B A ...), so a shared machine's slow and fast minutes fall on every rule; "
                        "a cell sums its passes (requests, tokens, wall, stage times)")
    p.add_argument("--json", required=True, help="output JSON path (the PNG plot goes next to it)")
    p.add_argument("--profile", action="store_true", help="per-cell stage decomposition from /metrics")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout (s)")
    p.add_argument("--dtype", default="", help="with --engine: target precision (auto, float32, bfloat16, fp16-weights, bf16-gemm; "
                   "default: the manifest's serving dtype, else auto)")
    p.add_argument("--tree-nodes", type=int, default=DEFAULT_TREE_NODES, help="with --engine: rule tree's draft-tree size M")
    p.add_argument("--draft-length", default="", help="with --engine: drafted tokens verified per step, N or "
                   "auto (default: the manifest's serving choice, else the whole block)")
    p.add_argument("--prompt-lookup", default="", help="with --engine: longest n-gram of prompt lookup, or off "
                   "(default: the manifest's serving choice, else off)")
    p.add_argument("--threads", type=int, default=0, help="with --engine: torch threads of the engine (0: default)")
    p.add_argument("--gemm-threads", type=int, default=0,
                   help="with --engine: threads of the target's multi-token GEMMs (fp16-weights: 2+ tokens; "
                        "bf16-gemm: 32+) (0: default)")
    p.add_argument("--prefill-threads", type=int, default=0,
                   help="with --engine: GEMM threads while prefilling new requests (0: --gemm-threads)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be positive, got {args.repeats}")
    if args.threads < 0 or args.gemm_threads < 0 or args.prefill_threads < 0:
        p.error("--threads, --gemm-threads and --prefill-threads must be >= 0")

    concurrencies = parse_list(args.concurrency, int)
    rules = parse_list(args.rules)
    if "ar" in rules:      # the baseline first at every concurrency
        rules = ["ar"] + [r for r in rules if r != "ar"]
    else:
        print("note: no `ar` in --rules, so no speedup column", file=sys.stderr)
    prompts = load_prompts(args.prompts, args.limit)
    if not prompts:
        print("no prompts", file=sys.stderr)
        return 2

    server = None
    if args.engine:
        import tempfile

        from lilicorr.serving.launcher import TritonServer
        from lilicorr.serving.repository import ServeOptions, generate_repository, read_engine_manifest
        repo = Path(tempfile.mkdtemp(prefix="lilicorr-bench-repo-"))
        generate_repository(read_engine_manifest(args.engine), repo,
                            ServeOptions(max_batch=max(concurrencies), profile=args.profile, dtype=args.dtype,
                                         draft_length=args.draft_length, tree_nodes=args.tree_nodes,
                                         prompt_lookup=args.prompt_lookup, num_threads=args.threads,
                                         gemm_threads=args.gemm_threads, prefill_threads=args.prefill_threads))
        server = TritonServer(repo, startup_timeout=900).start()
        url, metrics_url = server.grpc_url, server.metrics_url
    elif args.url:
        url = args.url
        metrics_url = args.metrics_url or f"http://{url.rsplit(':', 1)[0]}:8002/metrics"
    else:
        p.error("pass --url HOST:PORT or --engine DIR")

    client = LiLiCorrClient(url, timeout=args.timeout)
    cells, outputs = [], {}
    try:
        client.wait_ready(60)
        warm_before = scrape_metrics(metrics_url) if args.profile else None
        warm_sent = 0
        for rule in rules:
            for item in prompts[: args.warmup]:
                warm_sent += 1
                try:
                    client.generate(max_tokens=min(8, args.max_tokens), decode_rule=rule, **request_kwargs(item))
                except GenerationError as e:
                    print(f"[bench] warm-up request failed ({rule}): {e}", file=sys.stderr)
        if args.profile and warm_sent:
            # The server publishes a request's last step after sending its response. Until the
            # warm-up's is published, the first pass's opening scrape would lack it, its closing
            # scrape would count the warm-up's end as one of its own and settle a request early,
            # and the steps of that pass's last request would be lost to its stage table.
            settled_metrics(metrics_url, warm_before, warm_sent)
        for c in concurrencies:
            runs = {rule: {"results": [], "wall": 0.0, "metrics": {}} for rule in rules}
            for rep in range(args.repeats):
                for rule in rules if rep % 2 == 0 else rules[::-1]:
                    before = scrape_metrics(metrics_url) if args.profile else None
                    part, results = run_cell(client, prompts, rule, c, args.max_tokens, args.requests,
                                             args.temperature, args.seed)
                    run = runs[rule]
                    run["results"] += results
                    run["wall"] += part["wall_s"]
                    if args.profile:                  # this pass's metric increments, summed over passes
                        for k, v in settled_metrics(metrics_url, before, len(results)).items():
                            run["metrics"][k] = run["metrics"].get(k, 0.0) + v - before.get(k, 0.0)
            for rule in rules:
                run = runs[rule]
                cell = summarize_cell(rule, c, run["results"], run["wall"])
                if args.profile:
                    cell["stages"] = stage_delta({}, run["metrics"])
                cells.append(cell)
                outputs[(rule, c)] = run["results"]
                print(f"[bench] {rule:>8} c={c:<3} {cell['tokens_per_s']:8.1f} tok/s  "
                      f"tau={cell['tau'] if cell['tau'] is None else round(cell['tau'], 2)}  "
                      f"errors={cell['errors']}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
            import shutil
            shutil.rmtree(repo, ignore_errors=True)

    add_comparisons(cells, outputs)
    table = markdown_table(cells)
    print(table)
    if args.profile:
        from lilicorr.profiling import format_table
        for cell in cells:
            if cell.get("stages") and cell["stages"]["blocks"]:
                print("\n" + format_table(cell["stages"], f"{cell['rule']} @ concurrency {cell['concurrency']}"))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {k: v for k, v in vars(args).items()},
        "url": url, "num_prompts": len(prompts), "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cells": cells, "table_markdown": table,
    }
    out.write_text(json.dumps(report, indent=2))
    png = out.with_suffix(".png")
    plot_speedup(cells, str(png), title=f"{args.prompts}, max_tokens={args.max_tokens}")
    print(f"\nwrote {out} and {png}", file=sys.stderr)
    return 0 if all(c["errors"] == 0 for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
