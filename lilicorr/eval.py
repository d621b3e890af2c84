"""Evaluate decode rules in one run: `python -m lilicorr.eval` (DESIGN.md §6).

    python -m lilicorr.eval --target DIR --ckpt DIR --prompts humaneval,math500 \\
        --rules ar,argmax,lilicorr,viterbi --max-tokens 256 --json results/eval.json \\
        [--temperature T --seed 0,1,2 --limit N --batch-size N --profile --engine ENGINE_DIR --untrained]

One process, one SpecEngine, the same prompts for every rule; the rules run one after another
(all prompts of a suite under one rule, then the next rule), so a change in machine load during
the run shows up as a difference between rules. Each prompt is rendered with the
target's chat template (lilicorr.tokenizer), decoding stops at the tokenizer's EOS ids or after
--max-tokens. For each suite and rule OUT.json holds tau (accepted tokens incl. bonus / verify
steps), oracle_tau (a perfect reranker over the drafter's top-K pools), tokens_per_s,
speedup_vs_ar (tokens/s over the `ar` rule of the same run; null without `ar`), per-slot
acceptance (accepted / reached), the acceptance-length histogram, the number of prompts and
generated tokens, plus run metadata. With several seeds (T > 0) every metric is the mean over
seeds, with `std` and `per_seed`. With --profile the stage decomposition (Table 3 format) of every
rule is added and printed (the timer synchronises at stage boundaries, which costs a little
throughput). A markdown table is printed; plots go next to OUT.json.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from lilicorr.config import DEFAULT_TREE_NODES, DTYPE_CHOICES

RULE_CHOICES = ("ar", "argmax", "lilicorr", "viterbi", "tree")
SCALARS = ("tau", "oracle_tau", "tokens_per_s", "speedup_vs_ar", "tau_over_oracle", "generated_tokens",
           "wall_s", "mean_output_len")


class EvalError(Exception):
    """A user-facing error (bad path, rule, prompts): printed without a traceback."""


# ------------------------------------------------------------------------------------- arguments
def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lilicorr.eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target HF folder (config.json, safetensors, tokenizer.json)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ckpt", help="drafter + head checkpoint directory")
    src.add_argument("--engine", help="built engine directory (manifest.json names checkpoint and graph)")
    src.add_argument("--untrained", action="store_true",
                     help="a randomly initialised drafter + head (lossless / plumbing checks)")
    p.add_argument("--prompts", required=True,
                   help="comma-separated built-in suites (humaneval, math500, gsm-symbolic) and/or JSONL files")
    p.add_argument("--rules", default="ar,argmax,lilicorr,viterbi", help="comma-separated decode rules")
    p.add_argument("--max-tokens", type=int, default=256, help="generated tokens per prompt at most")
    p.add_argument("--json", required=True, dest="json_out", help="output JSON path (plots are written next to it)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy verification")
    p.add_argument("--seed", default="0", help="seed, or comma-separated seeds (T > 0: one run per seed)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each suite")
    p.add_argument("--batch-size", type=int, default=8, help="concurrent sequences (continuous batching)")
    p.add_argument("--profile", action="store_true", help="stage decomposition per rule (Table 3 format)")
    p.add_argument("--draft-backend", default="auto",
                   help="with --engine: auto (the manifest's), torch, onnxruntime, tensorrt, tensorrt-rtx")
    p.add_argument("--block-size", type=int, default=None, help="with --untrained: block size B")
    p.add_argument("--max-seq-len", type=int, default=2048, help="context limit of the engine")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="target precision; auto = bfloat16 on CUDA and on CPUs with AMX-BF16 "
                        "(batch-invariant); on other CPUs bf16-gemm (bf16 weights and GEMM inputs, fp32 "
                        "sums; AVX512-BF16) where the CPU has it, else fp16-weights (fp16 weight matrices, "
                        "fp32 arithmetic; CPU fbgemm) where available, else float32")
    p.add_argument("--tree-nodes", type=int, default=DEFAULT_TREE_NODES,
                   help="rule tree: draft-tree nodes M verified per step (best-first over the lattice)")
    p.add_argument("--draft-length", default=None,
                   help="drafted tokens verified per step: N, or auto (per row and step from the lattice's "
                        "scores and a cost model measured at start-up); default: the whole block")
    p.add_argument("--prompt-lookup", default="0", metavar="N",
                   help="prompt lookup: where a row's last n tokens (N >= n >= 2) occurred before, verify what "
                        "followed them instead of drafting (0: off, the default)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--gemm-threads", type=int, default=0,
                   help="threads of the target's multi-token GEMMs: fp16-weights' of 2+ tokens (a verify, a "
                        "prefill, several rows), bf16-gemm's GEMMs and attention of 32+ (a prefill, many rows); "
                        "0: --threads")
    p.add_argument("--prefill-threads", type=int, default=0,
                   help="GEMM threads while prefilling (0: --gemm-threads)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up prompts per rule before timing (0: none)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed passes per suite, the rules in turn and in reverse order every other pass "
                        "(A B B A ...), so the rules share a noisy machine's slow and fast minutes; "
                        "tokens/s is over all passes, tau and outputs from the first")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="skip the plots")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.rules = _csv(args.rules)
    bad = [r for r in args.rules if r not in RULE_CHOICES]
    if bad or not args.rules:
        what = f"unknown decode rule{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}" if bad \
            else "no decode rule given"
        parser.error(f"{what}; choose from {', '.join(RULE_CHOICES)}")
    if len(set(args.rules)) != len(args.rules):
        parser.error(f"--rules lists a rule twice: {','.join(args.rules)}")
    try:
        args.seeds = [int(s) for s in _csv(args.seed)]
    except ValueError:
        parser.error(f"--seed must be an integer or comma-separated integers, got {args.seed!r}")
    if not args.seeds:
        parser.error("--seed is empty")
    if args.max_tokens <= 0:
        parser.error(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.batch_size <= 0:
        parser.error(f"--batch-size must be positive, got {args.batch_size}")
    if args.limit is not None and args.limit <= 0:
        parser.error(f"--limit must be positive, got {args.limit}")
    if not (args.temperature >= 0) or args.temperature == float("inf"):
        parser.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.block_size is not None and not args.untrained:
        parser.error("--block-size only applies with --untrained (a checkpoint fixes its block size)")
    if args.block_size is not None and args.block_size < 2:
        parser.error(f"--block-size must be >= 2, got {args.block_size}")
    if args.threads is not None and args.threads <= 0:
        parser.error(f"--threads must be positive, got {args.threads}")
    if args.gemm_threads < 0 or args.prefill_threads < 0:
        parser.error(f"--gemm-threads and --prefill-threads must be >= 0, got {args.gemm_threads}, "
                     f"{args.prefill_threads}")
    if args.repeats <= 0:
        parser.error(f"--repeats must be positive, got {args.repeats}")
    spec = [r for r in args.rules if r != "ar"]
    if spec and not (args.ckpt or args.engine or args.untrained):
        parser.error(f"rules {', '.join(spec)} need a drafter: pass --ckpt DIR, --engine DIR or --untrained")
    target = Path(args.target)
    if not target.is_dir():
        parser.error(f"--target {args.target}: no such directory")
    if not (target / "config.json").is_file():
        parser.error(f"--target {args.target} has no config.json (an HF model folder is expected)")
    if not (target / "tokenizer.json").is_file():
        parser.error(f"--target {args.target} has no tokenizer.json")
    for flag, val in (("--ckpt", args.ckpt), ("--engine", args.engine)):
        if val is not None and not Path(val).is_dir():
            parser.error(f"{flag} {val}: no such directory")
    out = Path(args.json_out)
    if out.exists() and out.is_dir():
        parser.error(f"--json {args.json_out} is a directory; give a file name")
    return args


# ------------------------------------------------------------------------------------- prompts
def load_suites(spec: str, tokenizer, limit: int | None) -> dict[str, list[dict]]:
    """{suite name: [{"id", "ids"}]} for each comma-separated suite / JSONL file."""
    from lilicorr.data.suites import load_prompts, to_messages

    suites: dict[str, list[dict]] = {}
    for item in _csv(spec):
        try:
            prompts = load_prompts(item, limit=limit)
        except (FileNotFoundError, IsADirectoryError, ValueError) as e:
            raise EvalError(f"--prompts {item}: {e}") from None
        if not prompts:
            raise EvalError(f"--prompts {item}: no prompts")
        name = prompts[0].get("suite") or Path(item).stem
        if name in suites:
            raise EvalError(f"--prompts names suite {name!r} twice")
        encoded = []
        for p in prompts:
            try:
                ids = tokenizer.encode_chat(to_messages(p))
            except Exception as e:  # template errors (unknown role, ...) name the prompt
                raise EvalError(f"--prompts {item}: prompt {p.get('id')!r} cannot be rendered: {e}") from None
            encoded.append({"id": p["id"], "ids": ids})
        suites[name] = encoded
    if not suites:
        raise EvalError("--prompts is empty")
    return suites


# ------------------------------------------------------------------------------------- metrics
def aggregate(results, rule: str, wall_s: float, block_size: int) -> dict:
    """Metrics of one (suite, rule, seed) run from the engine's Results."""
    from lilicorr.report import slot_rates

    steps = sum(r.num_steps for r in results)
    tokens = sum(len(r.tokens) for r in results)
    s = block_size - 1
    if rule == "ar":
        tau, oracle, reached, accepted = 1.0 if steps else None, None, [], []
        hist = [0, steps] + [0] * (block_size - 1)
    else:
        acc = sum(r.accepted_tokens for r in results)
        ora = sum(r.oracle_accepted for r in results)
        tau = acc / steps if steps else None
        oracle = ora / steps if steps else None
        reached = [sum(r.slot_reached[j] for r in results) for j in range(s)]
        accepted = [sum(r.slot_accepted[j] for r in results) for j in range(s)]
        hist = [sum(r.accept_hist[k] for r in results) for k in range(block_size + 1)]
    lookup = sum(r.lookup_steps for r in results)
    reasons: dict[str, int] = {}
    for r in results:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    return {
        "tau": tau,
        "oracle_tau": oracle,
        "tau_over_oracle": (tau / oracle) if tau is not None and oracle else None,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "speedup_vs_ar": None,
        "num_prompts": len(results),
        "generated_tokens": tokens,
        "mean_output_len": tokens / len(results) if results else None,
        "verify_steps": steps,
        "wall_s": wall_s,
        "slot_acceptance": slot_rates(accepted, reached),
        "slot_accepted": accepted,
        "slot_reached": reached,
        "accept_hist": hist,
        "lookup_steps": lookup,
        "lookup_step_share": (lookup / steps if steps else None) if rule != "ar" else None,
        "finish_reasons": reasons,
    }


def _combine_seeds(per_seed: dict[int, dict]) -> dict:
    """Mean over seeds of the scalar metrics (plus std and the per-seed values)."""
    from lilicorr.report import mean_std

    runs = list(per_seed.values())
    if len(runs) == 1:
        out = dict(runs[0])
        out["num_seeds"] = 1
        return out
    out = dict(runs[0])
    std = {}
    for key in SCALARS:
        m, sd = mean_std(r.get(key) for r in runs)
        out[key], std[key] = m, sd
    n_slots = len(runs[0]["slot_reached"])
    out["slot_reached"] = [sum(r["slot_reached"][j] for r in runs) for j in range(n_slots)]
    out["slot_accepted"] = [sum(r["slot_accepted"][j] for r in runs) for j in range(n_slots)]
    rates = [mean_std(r["slot_acceptance"][j] for r in runs)[0] for j in range(n_slots)]
    out["slot_acceptance"] = rates
    out["accept_hist"] = [sum(r["accept_hist"][k] for r in runs) for k in range(len(runs[0]["accept_hist"]))]
    out["verify_steps"] = sum(r["verify_steps"] for r in runs)
    out["finish_reasons"] = {}
    for r in runs:
        for k, v in r["finish_reasons"].items():
            out["finish_reasons"][k] = out["finish_reasons"].get(k, 0) + v
    out["std"] = std
    out["num_seeds"] = len(runs)
    out["per_seed"] = {str(s): {k: r[k] for k in SCALARS + ("slot_acceptance",)} for s, r in per_seed.items()}
    return out


def _versions() -> dict:
    import importlib.metadata as md

    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    for pkg in ("lilicorr", "transformers", "tokenizers", "numpy"):
        try:
            v[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return v


def _command_line(args) -> str:
    argv = ["python", "-m", "lilicorr.eval"] + list(getattr(args, "argv", None) or [])
    return " ".join(shlex.quote(a) for a in argv)


def _display_path(p) -> str:
    """Relative to the working directory when inside it (reports carry no machine paths)."""
    path = Path(p).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _git_commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------- running
def _make_engine(args):
    import torch

    from lilicorr.checkpoint import CheckpointError
    from lilicorr.engine import SpecEngine
    from lilicorr.target import resolve_precision

    kw = {"draft_backend": args.draft_backend} if args.engine else {}
    try:
        return SpecEngine.from_paths(
            args.target, ckpt_dir=args.ckpt, engine_dir=args.engine, max_batch=args.batch_size,
            max_seq_len=args.max_seq_len, device=args.device, dtype=resolve_precision(args.dtype, args.device),
            untrained_seed=0 if args.untrained else None, block_size=args.block_size,
            draft_length=args.draft_length, tree_nodes=args.tree_nodes, prompt_lookup=args.prompt_lookup, **kw)
    except CheckpointError as e:
        raise EvalError(f"--ckpt {args.ckpt}: {e}") from None
    except (FileNotFoundError, ValueError) as e:
        raise EvalError(str(e)) from None
    except RuntimeError as e:            # EngineDirError and other load-time failures of an engine dir
        if args.engine and type(e).__name__ == "EngineDirError":
            raise EvalError(f"--engine {args.engine}: {e}") from None
        raise


def _progress(total: int, desc: str, disable: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, disable=disable, leave=False,
                dynamic_ncols=True)


def run_eval(args: argparse.Namespace, log=print) -> dict:
    """Run every (suite, seed, rule) and return the JSON document (also written to args.json_out)."""
    import torch

    from lilicorr.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    from lilicorr.fp16_linear import set_gemm_threads, set_prefill_threads
    set_gemm_threads(args.gemm_threads)
    set_prefill_threads(args.prefill_threads)
    try:
        tok = Tokenizer.from_dir(args.target)
    except (FileNotFoundError, ValueError) as e:
        raise EvalError(f"--target {args.target}: {e}") from None
    suites = load_suites(args.prompts, tok, args.limit)
    stop_ids = sorted(tok.eos_ids)
    engine = _make_engine(args)
    engine.keep_results = True
    spec_rules = [r for r in args.rules if r != "ar"]
    if spec_rules and engine.runner is None:
        raise EvalError(f"rules {', '.join(spec_rules)} need a drafter")
    if any(r in ("lilicorr", "viterbi", "tree") for r in args.rules) and not engine.runner.has_head:
        raise EvalError("this checkpoint is vanilla DFlash (no LiLiCorr head): use --rules ar,argmax")
    seeds = args.seeds if args.temperature > 0 else args.seeds[:1]
    if args.temperature == 0 and len(args.seeds) > 1:
        log(f"note: greedy decoding (T = 0) is deterministic; running seed {seeds[0]} only")

    # prompts that do not fit the context are skipped (and counted), never truncated
    skipped: dict[str, list[str]] = {}
    for name, items in suites.items():
        keep = []
        for it in items:
            try:
                engine.check_request(it["ids"], args.max_tokens, "ar", args.temperature, None, stop_ids)
                keep.append(it)
            except ValueError:
                skipped.setdefault(name, []).append(it["id"])
        if not keep:
            raise EvalError(f"suite {name}: no prompt fits the context ({engine.max_seq_len} tokens "
                            f"incl. --max-tokens {args.max_tokens} and a block of {engine.block_size})")
        suites[name] = keep
        if name in skipped:
            log(f"warning: suite {name}: {len(skipped[name])} prompt(s) too long for the context, skipped")

    # warm-up: first-call costs (allocation, kernels) must not count against the first rule
    if args.warmup:
        first = next(iter(suites.values()))[: args.warmup]
        for rule in args.rules:
            engine.generate([it["ids"] for it in first], min(args.max_tokens, 8), rule=rule,
                            temperature=args.temperature, seed=0, stop_ids=stop_ids)

    engine.measure_costs()      # auto draft length: the verify cost at every load, before any timing

    # everything loaded so far is long-lived: keep the cyclic GC from rescanning it mid-run
    # (full collections with torch + tokenizer loaded cost milliseconds, landing in random stages)
    gc.collect()
    gc.freeze()
    try:
        return _measure_and_write(args, engine, suites, seeds, stop_ids, skipped, log)
    finally:
        gc.unfreeze()


def _measure_and_write(args, engine, suites, seeds, stop_ids, skipped, log) -> dict:
    import torch

    from lilicorr import report
    from lilicorr.fp16_linear import gemm_threads as fp16_gemm_threads
    from lilicorr.profiling import StageTimer

    block_size = engine.block_size
    timers = {rule: StageTimer() for rule in args.rules} if args.profile else {}
    per: dict[str, dict[str, dict[int, dict]]] = {s: {r: {} for r in args.rules} for s in suites}
    for name, items in suites.items():
        prompts = [it["ids"] for it in items]
        for seed in seeds:
            first: dict[str, list] = {}
            wall = dict.fromkeys(args.rules, 0.0)
            for rep in range(args.repeats):
                for rule in args.rules if rep % 2 == 0 else args.rules[::-1]:
                    desc = f"{name} {rule}" + (f" seed {seed}" if len(seeds) > 1 else "") \
                        + (f" pass {rep + 1}/{args.repeats}" if args.repeats > 1 else "")
                    with _progress(len(prompts) * args.max_tokens, desc, args.no_progress) as bar:
                        t0 = time.perf_counter()
                        with timers[rule].active() if args.profile else contextlib.nullcontext():
                            res = engine.generate(prompts, args.max_tokens, rule=rule, temperature=args.temperature,
                                                  seed=seed, stop_ids=stop_ids, progress=bar.update)
                        wall[rule] += time.perf_counter() - t0
                    first.setdefault(rule, res)    # a pass with the same seed decodes the same tokens
            for rule in args.rules:
                per[name][rule][seed] = aggregate(first[rule], rule, wall[rule] / args.repeats, block_size)
            if "ar" in args.rules:
                ar_tps = per[name]["ar"][seed]["tokens_per_s"]
                for rule in args.rules:
                    m = per[name][rule][seed]
                    if ar_tps and m["tokens_per_s"] is not None:
                        m["speedup_vs_ar"] = m["tokens_per_s"] / ar_tps

    results = {name: {rule: _combine_seeds(per[name][rule]) for rule in args.rules} for name in suites}
    overall = _overall(per, args.rules, seeds, block_size) if len(suites) > 1 else None

    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "meta": {
            "command": _command_line(args),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "target": _display_path(args.target),
            "ckpt": _display_path(args.ckpt) if args.ckpt else None,
            "engine": _display_path(args.engine) if args.engine else None,
            "untrained": bool(args.untrained),
            "prompts": args.prompts,
            "rules": args.rules,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "seeds": seeds,
            "limit": args.limit,
            "repeats": args.repeats,
            "batch_size": args.batch_size,
            "block_size": block_size,
            "top_k": engine.runner.model.cfg.head.top_k if engine.runner is not None and
            hasattr(engine.runner, "model") else None,
            "max_seq_len": engine.max_seq_len,
            "stop_ids": stop_ids,
            "device": args.device,
            "dtype": engine.target.precision,
            "batch_invariant": engine.target.batch_invariant,
            "dtype_requested": args.dtype,
            "draft_length": args.draft_length or "block",
            "prompt_lookup": engine.prompt_lookup,
            "tree_nodes": args.tree_nodes,
            "threads": torch.get_num_threads(),
            "gemm_threads": fp16_gemm_threads(),
            "prefill_threads": args.prefill_threads,
            "cpu_count": os.cpu_count(),
            "profile": bool(args.profile),
            "skipped_prompts": skipped,
            "git_commit": _git_commit(),
            "versions": _versions(),
        },
        "results": results,
    }
    if overall is not None:
        doc["overall"] = overall
    if args.profile:
        doc["profile"] = {rule: t.table() for rule, t in timers.items()}

    table = report.eval_table(results, args.rules)
    log(table)
    if overall is not None:
        log("")
        log(report.eval_table({"all suites": overall}, args.rules))
    if args.profile:
        log("")
        log("Stage decomposition (ms per verify step; Table 3 format)")
        first = next(iter(results.values())) if overall is None else overall
        extra = {"tau": {r: report.fmt(first[r]["tau"], 3) for r in args.rules},
                 "tokens/s": {r: report.fmt(first[r]["tokens_per_s"], 1) for r in args.rules}}
        log(report.stage_tables(doc["profile"], extra))
    if not args.no_plots:
        doc["plots"] = _plots(out, overall if overall is not None else next(iter(results.values())), args)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False))
    os.replace(tmp, out)
    log(f"wrote {out}" + (f" and {len(doc.get('plots', {}))} plots" if doc.get("plots") else ""))
    return doc


def _overall(per, rules, seeds, block_size) -> dict:
    """All suites pooled (sums of counts, tokens/s over the summed wall time), per seed then combined."""
    pooled: dict[str, dict[int, dict]] = {r: {} for r in rules}
    suites = list(per)
    for seed in seeds:
        for rule in rules:
            runs = [per[s][rule][seed] for s in suites]
            steps = sum(r["verify_steps"] for r in runs)
            tokens = sum(r["generated_tokens"] for r in runs)
            wall = sum(r["wall_s"] for r in runs)
            reached = [sum(r["slot_reached"][j] for r in runs) for j in range(len(runs[0]["slot_reached"]))]
            accepted = [sum(r["slot_accepted"][j] for r in runs) for j in range(len(runs[0]["slot_accepted"]))]
            acc = sum((r["tau"] or 0) * r["verify_steps"] for r in runs)
            ora = sum((r["oracle_tau"] or 0) * r["verify_steps"] for r in runs)
            tau = acc / steps if steps else None
            oracle = (ora / steps if steps else None) if rule != "ar" else None
            reasons: dict[str, int] = {}
            for r in runs:
                for k, v in r["finish_reasons"].items():
                    reasons[k] = reasons.get(k, 0) + v
            n = sum(r["num_prompts"] for r in runs)
            pooled[rule][seed] = {
                "tau": tau, "oracle_tau": oracle,
                "tau_over_oracle": tau / oracle if tau is not None and oracle else None,
                "tokens_per_s": tokens / wall if wall > 0 else None, "speedup_vs_ar": None,
                "num_prompts": n, "generated_tokens": tokens, "mean_output_len": tokens / n if n else None,
                "verify_steps": steps, "wall_s": wall,
                "slot_acceptance": [a / r if r else None for a, r in zip(accepted, reached)],
                "slot_accepted": accepted, "slot_reached": reached,
                "accept_hist": [sum(r["accept_hist"][k] for r in runs) for k in range(block_size + 1)],
                "lookup_steps": sum(r["lookup_steps"] for r in runs),
                "lookup_step_share": (sum(r["lookup_steps"] for r in runs) / steps
                                      if steps else None) if rule != "ar" else None,
                "finish_reasons": reasons,
            }
        if "ar" in rules and pooled["ar"][seed]["tokens_per_s"]:
            for rule in rules:
                m = pooled[rule][seed]
                if m["tokens_per_s"] is not None:
                    m["speedup_vs_ar"] = m["tokens_per_s"] / pooled["ar"][seed]["tokens_per_s"]
    return {rule: _combine_seeds(pooled[rule]) for rule in rules}


def _plots(out: Path, metrics: dict, args) -> dict:
    from lilicorr import report

    stem = out.with_suffix("")
    spec = [r for r in args.rules if r != "ar"]
    hist_path = Path(f"{stem}_accept_hist.png")
    slot_path = Path(f"{stem}_slot_accept.png")
    report.plot_acceptance_histogram({r: metrics[r]["accept_hist"] for r in spec} or
                                     {r: metrics[r]["accept_hist"] for r in args.rules},
                                     hist_path, title=f"Acceptance length ({Path(args.target).name})")
    report.plot_slot_acceptance({r: metrics[r]["slot_acceptance"] for r in spec}, slot_path,
                                title=f"Per-slot acceptance ({Path(args.target).name})")
    return {"accept_hist": hist_path.name, "slot_acceptance": slot_path.name}


def evaluate(argv: list[str], log=None) -> dict:
    """One evaluation from command-line arguments (without --json), for measurement scripts: the
    JSON document, written to a temporary file and read back; plots are skipped."""
    import tempfile

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory() as tmp:
        args = parse_args(list(argv) + ["--json", str(Path(tmp) / "eval.json"), "--no-plots"])
        args.argv = list(argv)
        return run_eval(args, log=log)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    try:
        run_eval(args)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
