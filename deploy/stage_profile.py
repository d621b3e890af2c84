#!/usr/bin/env python3
"""Table 3 stage decomposition of the speculative engine, from the stage timer and (with --nsys)
from an Nsight Systems NVTX summary of the same run, side by side.

    python deploy/stage_profile.py --rules lilicorr,argmax,ar --suite gsm-symbolic --num-prompts 8 \\
        --max-tokens 64 --out results/stage_breakdown_cpu.md          # CPU default, untrained drafter
    python deploy/stage_profile.py --ckpt checkpoints/NAME --device cuda --dtype bfloat16 --nsys

Workload: the target (default: the CPU default SmolLM2-135M-Instruct folder), a drafter + head
from --ckpt, --engine-dir, or untrained (the `cpu` preset, seed 0: acceptance is then ~1 token per
block, only the stage costs mean anything), the first N prompts of a built-in suite (chat
template applied), every rule run to exactly --max-tokens tokens (stop tokens ignored) with up to
--max-batch rows per engine step. One *block* is one engine step over the running rows. A warm-up
runs with profiling off first. The rules run side by side, one engine per rule (sharing the
target and drafter weights), stepped in turn, so load drift on shared machines hits them alike.

--nsys: each rule runs in its own child process under `nsys profile -t cuda,nvtx`; the NVTX
summary (`nsys stats --report nvtx_sum --format csv`, or `nvtxsum` on older nsys) is parsed into
the same table (lilicorr.profiling.parse_nvtx_sum_csv). The child keeps its stage timer on, so
stage boundaries are device-synchronised and the two sources time the same intervals. Without nsys
on PATH it says so and prints the stage-timer table alone.

`deploy/profile.sh` runs this script (so no module in deploy/ is named like the stdlib `profile`).
"""
from __future__ import annotations

import os
import sys

import argparse
import glob
import json
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = REPO / ".cache" / "smollm2-135m-instruct-float32"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.relpath(DEFAULT_TARGET), help="HF folder of the target (default: CPU default)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ckpt", default=None, help="drafter + head checkpoint directory")
    src.add_argument("--engine-dir", default=None, help="engine directory from convert/build_engine.py")
    p.add_argument("--draft-backend", default="torch", help="runner for --engine-dir (torch | onnxruntime)")
    p.add_argument("--untrained-seed", type=int, default=0, help="seed of the untrained drafter (default 0)")
    p.add_argument("--suite", default="gsm-symbolic", help="built-in suite or JSONL prompt file")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rules", default="lilicorr,argmax,ar", help="comma-separated decode rules")
    p.add_argument("--max-batch", type=int, default=8, help="rows per engine step (default 8)")
    p.add_argument("--repeats", type=int, default=1, help="runs of the whole workload per rule")
    p.add_argument("--warmup-tokens", type=int, default=8, help="warm-up generation length (0: none)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 on CPU: on shared cores more threads spin "
                        "against each other; leave the torch default with --threads 0)")
    p.add_argument("--nsys", action="store_true", help="also profile under nsys and compare the NVTX summary")
    p.add_argument("--nsys-bin", default="nsys", help="nsys executable (default: nsys on PATH)")
    p.add_argument("--keep-reports", default=None, help="keep the .nsys-rep / csv files in this folder")
    p.add_argument("--out", default=None, help="write the markdown report here")
    p.add_argument("--json", default=None, help="raw results (default: --out with .json)")
    p.add_argument("--note", default=None, help="machine note for the report (default: CPU count + load)")
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)   # internal: nsys child mode
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------- workload
def _dtype(name):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def build_engine(args):
    """-> (engine, description of the drafter)."""
    from lilicorr.engine import SpecEngine

    kw = dict(max_batch=args.max_batch, device=args.device, dtype=_dtype(args.dtype))
    if args.ckpt:
        return SpecEngine.from_paths(args.target, ckpt_dir=args.ckpt, **kw), f"checkpoint `{args.ckpt}`"
    if args.engine_dir:
        eng = SpecEngine.from_paths(args.target, engine_dir=args.engine_dir, draft_backend=args.draft_backend, **kw)
        return eng, f"engine directory `{args.engine_dir}` ({args.draft_backend} runner)"
    eng = SpecEngine.from_paths(args.target, untrained_seed=args.untrained_seed, **kw)
    return eng, (f"UNTRAINED (random init, `cpu` preset, seed {args.untrained_seed}: "
                 f"lilicorr.model.untrained_model(target)) - stage costs only, acceptance is meaningless")


def load_prompt_ids(target_dir, suite: str, n: int) -> list[list[int]]:
    from lilicorr.data.suites import load_prompts, to_messages
    from lilicorr.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(target_dir)
    return [tok.encode_chat(to_messages(item)) for item in load_prompts(suite, limit=n)]


def sibling_engine(args, engine):
    """Another engine on the same target and drafter weights, with its own caches."""
    from lilicorr.engine import SpecEngine

    runner = None
    if engine.runner is not None:
        if args.engine_dir:
            from lilicorr.engine_dir import make_runner
            runner = make_runner(Path(args.engine_dir), engine.target, num_slots=args.max_batch,
                                 backend=args.draft_backend, target_dir=args.target)
        else:
            from lilicorr.draft_runner import TorchDraftRunner
            runner = TorchDraftRunner(engine.runner.model, args.max_batch)
    return SpecEngine(engine.target, runner, max_batch=args.max_batch, max_seq_len=engine.max_seq_len)


class RuleRun:
    """One rule's workload on its own engine, advanced one engine step at a time (continuous
    batching as in SpecEngine.generate), timing every step under the rule's StageTimer."""

    def __init__(self, engine, prompts, rule: str, max_tokens: int):
        from lilicorr.profiling import StageTimer

        self.engine, self.rule, self.max_tokens = engine, rule, max_tokens
        self.timer = StageTimer(name=rule)
        self.prompts = prompts
        self.wall_s, self.tokens, self.steps, self.accepted = 0.0, 0, 0, 0
        self.queue: list = []
        self.rids: list = []

    def start(self) -> None:
        self.queue = list(self.prompts)
        self.rids = []

    @property
    def done(self) -> bool:
        return not self.queue and self.engine.num_active == 0

    def step(self) -> None:
        eng = self.engine
        t0 = time.perf_counter()
        with self.timer.active():
            while self.queue and eng.num_active < eng.max_batch:
                self.rids.append(eng.add_request(self.queue.pop(0), self.max_tokens, rule=self.rule))
            eng.step()
        self.wall_s += time.perf_counter() - t0
        if self.done:
            for rid in self.rids:
                r = eng.pop_result(rid)
                self.tokens += len(r.tokens)
                self.steps += r.num_steps
                self.accepted += r.accepted_tokens

    def summary(self) -> dict:
        wall = self.wall_s
        return {"rule": self.rule, "table": self.timer.snapshot(), "wall_s": wall, "tokens": self.tokens,
                "tokens_per_s": self.tokens / wall if wall > 0 else 0.0,
                "tau": self.accepted / max(self.steps, 1), "verify_steps": self.steps}


def run_workload(args, rules: list[str]) -> dict:
    import torch

    from lilicorr.profiling import profiling_enabled

    if args.threads is None and args.device == "cpu":
        torch.set_num_threads(1)
    elif args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engine, drafter = build_engine(args)
    engines = [engine] + [sibling_engine(args, engine) for _ in rules[1:]]
    prompts = load_prompt_ids(args.target, args.suite, args.num_prompts)
    load_s = time.perf_counter() - t0
    if args.warmup_tokens > 0:
        with profiling_enabled(False):     # no NVTX ranges either: nsys sees only the measured runs
            for eng, rule in zip(engines, rules):
                eng.generate(prompts[:1], args.warmup_tokens, rule=rule)
    runs = [RuleRun(eng, prompts, rule, args.max_tokens) for eng, rule in zip(engines, rules)]
    for _ in range(args.repeats):
        for r in runs:
            r.start()
        k = 0
        while not all(r.done for r in runs):
            # one engine step per rule in turn (rotating who goes first): every rule's blocks see
            # the same machine load, which on shared cores drifts within seconds
            for r in runs[k % len(runs):] + runs[:k % len(runs)]:
                if not r.done:
                    r.step()
            k += 1
    res = {r.rule: r.summary() for r in runs}
    for rule, v in res.items():
        print(f"[profile] {rule}: {v['table']['blocks']} blocks, {v['table']['per_block_wall_ms']:.1f} ms/block, "
              f"tau {v['tau']:.2f}, {v['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return {"drafter": drafter, "block_size": engine.block_size, "torch_threads": torch.get_num_threads(),
            "prompt_tokens": [len(p) for p in prompts], "load_s": load_s, "runs": res}


# ---------------------------------------------------------------------------------- nsys
def find_nsys(name: str) -> str | None:
    return shutil.which(name)


def nsys_nvtx_csv(nsys: str, rep: Path, out_prefix: Path) -> str:
    """`nsys stats` NVTX range summary of a report as CSV text (nvtx_sum; nvtxsum on older nsys)."""
    errors = []
    for report in ("nvtx_sum", "nvtxsum"):
        for f in glob.glob(f"{out_prefix}_*.csv"):
            os.remove(f)
        cmd = [nsys, "stats", "--report", report, "--format", "csv", "--force-export=true",
               "--output", str(out_prefix), str(rep)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        files = sorted(glob.glob(f"{out_prefix}_*nvtx*.csv"))
        if proc.returncode == 0 and files:
            return Path(files[0]).read_text()
        if proc.returncode == 0 and "Range" in proc.stdout:       # printed instead of written
            return proc.stdout
        errors.append(f"{' '.join(cmd)} -> rc {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}")
    raise RuntimeError("nsys stats produced no NVTX summary:\n" + "\n".join(errors))


def run_under_nsys(args, argv: list[str], rules: list[str], nsys: str, workdir: Path) -> dict:
    """One nsys child per rule (nvtx_sum cannot split a process by rule)."""
    from lilicorr.profiling import parse_nvtx_sum_csv, table_from_nvtx

    out = {"runs": {}, "nsys": {}}
    version = subprocess.run([nsys, "--version"], capture_output=True, text=True).stdout.strip()
    base = _strip_options(argv, {"--rules", "--out", "--json", "--nsys-bin", "--keep-reports", "--child-json"},
                          {"--nsys"})
    for rule in rules:
        rep = workdir / f"profile_{rule}"
        child_json = workdir / f"profile_{rule}.json"
        cmd = [nsys, "profile", "-t", "cuda,nvtx", "--force-overwrite=true", "-o", str(rep),
               sys.executable, str(Path(__file__).resolve()), *base, "--rules", rule, "--child-json", str(child_json)]
        print(f"[profile] {shlex.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            raise RuntimeError(f"nsys profile exited with {proc.returncode} for rule {rule}")
        child = json.loads(child_json.read_text())
        text = nsys_nvtx_csv(nsys, Path(f"{rep}.nsys-rep"), workdir / f"profile_{rule}")
        rows = parse_nvtx_sum_csv(text)
        out["runs"][rule] = child["runs"][rule]
        out["nsys"][rule] = {"table": table_from_nvtx(rows), "rows": rows}
        for key in ("drafter", "block_size", "torch_threads", "prompt_tokens"):
            out[key] = child[key]
    out["nsys_version"] = version
    return out


def _strip_options(argv: list[str], with_value: set, flags: set) -> list[str]:
    res, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            continue
        if name in with_value:
            skip = "=" not in a
            continue
        res.append(a)
    return res


# ---------------------------------------------------------------------------------- report
def machine_note(args) -> str:
    if args.note:
        return args.note
    try:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        load = "n/a"
    return (f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores visible, load average {load} at the end "
            f"of the run (shared machine: absolute ms are noise, compare columns within one run); "
            f"{platform.python_version()}, torch {__import__('torch').__version__}, device {args.device}")


def report(args, argv, result: dict, nsys_msg: str | None) -> str:
    from lilicorr.profiling import format_tables

    runs = result["runs"]
    cols = {r: runs[r]["table"] for r in runs}
    extra = {"tau (accepted incl. bonus / verify step)": {r: f"{runs[r]['tau']:.2f}" for r in runs},
             "Output tokens / s (incl. prefill)": {r: f"{runs[r]['tokens_per_s']:.2f}" for r in runs}}
    if "ar" in runs and runs["ar"]["tokens_per_s"] > 0:
        extra["Speedup over ar"] = {r: f"{runs[r]['tokens_per_s'] / runs['ar']['tokens_per_s']:.2f}x" for r in runs}
    cmd = "python deploy/stage_profile.py " + shlex.join(argv)
    lines = [f"# Stage breakdown ({args.device}, {', '.join(runs)})", "",
             "Command:", "", "```", cmd, "```", "",
             f"- Target: `{_rel(args.target)}` ({args.dtype})",
             f"- Drafter + head: {result['drafter']}",
             f"- Workload: {len(result['prompt_tokens'])} prompts of `{args.suite}` "
             f"(prompt tokens {min(result['prompt_tokens'])}-{max(result['prompt_tokens'])}, chat template), "
             f"{args.max_tokens} new tokens each (stop tokens ignored), greedy verification, "
             f"block size B={result['block_size']}, up to {args.max_batch} rows per engine step "
             f"(one block = one engine step over the running rows), torch threads {result['torch_threads']}, "
             f"warm-up {args.warmup_tokens} tokens with profiling off; " + (
                 "each rule in its own process under nsys" if result.get("nsys") else
                 "the rules run side by side on engines sharing the target and drafter weights, one "
                 "engine step each in turn") + f", {args.repeats} repeat(s)",
             f"- Machine: {machine_note(args)}", "",
             "## Stage timer (lilicorr.profiling.StageTimer, device-synchronised stage boundaries)", "",
             format_tables(cols, extra), ""]
    if result.get("nsys"):
        both = {}
        for r in runs:
            both[f"{r} timer"] = runs[r]["table"]
            both[f"{r} nsys"] = result["nsys"][r]["table"]
        lines += [f"## Stage timer vs nsys NVTX summary ({result.get('nsys_version', 'nsys')})", "",
                  format_tables(both), ""]
    elif nsys_msg:
        lines += [f"_nsys: {nsys_msg}_", ""]
    lines += ["Stages: Target verify = target forward over [anchor, drafts]; Draft backbone = drafter context "
              "update + drafter forward; LM-head projection = slot logits; Speculative head = top-K "
              "candidate extraction + confidence features + head pass + decode rule (argmax: top-K only); "
              "Accept and residual = acceptance, bookkeeping, KV rollback. Per-block wall is measured "
              "around the whole step; the sum of stages is shown to check coverage.", ""]
    return "\n".join(lines)


def _rel(p) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    rules = [r for r in args.rules.replace(" ", "").split(",") if r]
    if args.child_json:                                   # running under nsys: measure and hand back
        res = run_workload(args, rules)
        Path(args.child_json).write_text(json.dumps(res))
        return 0
    nsys_msg = None
    result = None
    if args.nsys:
        nsys = find_nsys(args.nsys_bin)
        if nsys is None:
            nsys_msg = (f"`{args.nsys_bin}` not found on PATH: no NVTX summary, stage-timer table only "
                        "(install Nsight Systems or pass --nsys-bin /path/to/nsys)")
            print(f"[profile] {nsys_msg}", file=sys.stderr)
        else:
            keep = Path(args.keep_reports) if args.keep_reports else None
            if keep:
                keep.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix="lilicorr-nsys-") as tmp:
                result = run_under_nsys(args, argv, rules, nsys, keep or Path(tmp))
    if result is None:
        result = run_workload(args, rules)
    text = report(args, argv, result, nsys_msg)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    jpath = args.json or (str(Path(args.out).with_suffix(".json")) if args.out else None)
    if jpath:
        raw = {"command": "python deploy/stage_profile.py " + shlex.join(argv), "machine": machine_note(args),
               "args": vars(args), **result}
        Path(jpath).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
