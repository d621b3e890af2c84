#!/usr/bin/env python3
"""One prepared GPU check (issue 7): Triton lattice kernels natively vs the PyTorch reference, and
the paper's Table 3 stage decomposition at batch 1 on a Qwen3-8B-shaped target, eager and optimised.

    python deploy/gpu_check.py --device cuda --out results/gpu_h200          # H100 / H200, a few min
    python deploy/gpu_check.py --small --device cpu --out /tmp/gpucheck       # CPU dry-run, < 2 min

What it builds (random weights: timings only, acceptance lengths mean nothing):
  target   Qwen3-8B shape: 36 layers, hidden 4096, GQA 32/8, head_dim 128, intermediate 12288,
           vocab 151936, qk_norm, untied embeddings, bf16, init N(0, 0.02) (stays finite)
  drafter  `paper` preset (Table 4): 5 DFlash layers at the target's width, B=16, 5 captured layers
  head     width 1024, 8 heads, ffn 2048, 2 layers, K=8, d_e=1024, sigma=8
  --small  8 layers / hidden 256 / vocab 4096 target, 2 draft layers, head width 128, d_e 64
           (B=16, K=8 kept), 32-token prompt, 3 timed blocks: a dry-run of every code path

Parts (each guarded: a failure is recorded in the JSON and the rest still runs):
  1. kernels  plugins/triton_kernels.py (LatticeMatch, GreedyWalk, fused LatticeMatchWalk) vs
              lilicorr/lattice.py at B=16, K=8, E=1024, batch 1/8/32, fp32 and bf16: max abs error
              of the scores, exact walk indices, time (CUDA events, warmup, median over reps).
              On CPU the kernels run under TRITON_INTERPRET=1 (set here, before triton is imported).
  2. stages   SpecEngine + TorchDraftRunner at batch 1: a P-token prompt, then N speculative
              blocks under lilicorr.profiling.StageTimer (device-synchronised), for
                dflash               vanilla DFlash rule (argmax of each slot; Table 3 col. 1)
                lilicorr_eager       head + reference match/walk, PyTorch eager (Table 3 col. 2)
                lilicorr_triton      eager head + Triton fused LatticeMatchWalk kernel
                lilicorr_compiled    top-K + head + match + walk under torch.compile
                                     (mode reduce-overhead = CUDA graphs; Table 3 col. 3)
                lilicorr_compiled_full  the same + the drafter backbone compiled (dynamic shapes)
              Before an optimised run (triton, compiled, compiled_full) is timed, its proposals are
              compared with the eager path's on the same inputs at every block of a check run
              (tokens and top-K pools; "proposal_check" in the JSON); a difference is an error and
              its table column reads "≠ eager".
Outputs in --out: gpu_check.json (raw, rewritten after every part so a timeout keeps what ran),
gpu_check.md (tables beside the paper's Table 3), gpu_check.log (this run's log).
Exit status: 0 all parts ran and every equality check passed; 1 a part failed or a check did not
pass (see "errors" in the JSON); 2 bad invocation (e.g. --device cuda without CUDA).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Table 3 of the paper (ms / block, MT-Bench, single H100, Qwen3-8B target)
PAPER_TABLE3 = {
    "dflash":            {"target_verify": 7.48, "draft_backbone": 1.28, "lm_head_projection": 0.49,
                          "speculative_head": 0.05, "accept_residual": 0.57, "per_block_wall": 9.87},
    "lilicorr_eager":    {"target_verify": 7.52, "draft_backbone": 1.28, "lm_head_projection": 0.50,
                          "speculative_head": 0.66, "accept_residual": 0.57, "per_block_wall": 10.53},
    "lilicorr_optimized": {"target_verify": 7.51, "draft_backbone": 1.29, "lm_head_projection": 0.50,
                           "speculative_head": 0.28, "accept_residual": 0.57, "per_block_wall": 10.15},
    "domino_eager":      {"target_verify": 7.54, "draft_backbone": 1.29, "lm_head_projection": 0.49,
                          "speculative_head": 1.97, "accept_residual": 0.59, "per_block_wall": 11.88},
    "domino_optimized":  {"target_verify": 7.54, "draft_backbone": 1.29, "lm_head_projection": 0.49,
                          "speculative_head": 0.67, "accept_residual": 0.58, "per_block_wall": 10.57},
}
STAGE_KEYS = ("target_verify", "draft_backbone", "lm_head_projection", "speculative_head", "accept_residual")
STAGE_ROWS = {"target_verify": "Target verify", "draft_backbone": "Draft backbone",
              "lm_head_projection": "LM-head projection", "speculative_head": "Speculative head",
              "accept_residual": "Accept and residual"}
RUNS = ("dflash", "lilicorr_eager", "lilicorr_triton", "lilicorr_compiled", "lilicorr_compiled_full",
        "tree_16", "tree_64")        # tree_M: rule tree, M draft-tree nodes verified per block
# runs whose proposals are checked against the eager path's before they are timed
OPTIMISED_RUNS = ("lilicorr_triton", "lilicorr_compiled", "lilicorr_compiled_full")
# which paper column each of our runs is read beside
PAPER_COLUMN = {"dflash": "dflash", "lilicorr_eager": "lilicorr_eager", "lilicorr_triton": None,
                "lilicorr_compiled": "lilicorr_optimized", "lilicorr_compiled_full": "lilicorr_optimized",
                "tree_16": None, "tree_64": None}

# tolerances of the kernel checks: |triton - fp32 reference| of the scores. Unit vectors bound
# |score| by sigma = 8, where half a bf16 ulp is 2**-6 = 0.0156 (the kernel accumulates in fp32
# and rounds once on store)
SCORE_TOL = {"float32": 1e-4, "bfloat16": 2e-2}


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available, else cpu)")
    p.add_argument("--out", default=None,
                   help="output folder (default results/gpu_h200 for a full CUDA run, else /tmp/gpucheck); "
                        "dry-runs (--small or CPU) may not write under results/")
    p.add_argument("--small", action="store_true", help="shrink every model for a CPU dry-run")
    p.add_argument("--blocks", type=int, default=None, help="timed speculative blocks per run (64; small: 3)")
    p.add_argument("--warmup-blocks", type=int, default=None, help="untimed blocks first (8; small: 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (1024; small: 32)")
    p.add_argument("--dtype", default=None, help="bfloat16 | float32 (default bf16 on cuda, fp32 on cpu)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per kernel (200; cpu: 2)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"stage runs to do, comma-separated ({','.join(RUNS)})")
    p.add_argument("--compile-mode", default="reduce-overhead",
                   help="torch.compile mode for head+walk (reduce-overhead | max-autotune | default)")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor on cuda, eager on cpu)")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-stages", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def is_under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------

class Report:
    """The JSON document, rewritten after every part, plus a log file."""

    def __init__(self, out: Path):
        self.out = out
        self.data = {"meta": {}, "config": {}, "kernels": None, "stages": None, "errors": [], "ok": None}
        self.log_f = open(out / "gpu_check.log", "w")

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log_f.write(line + "\n")
        self.log_f.flush()

    def error(self, part: str, exc: BaseException) -> None:
        tb = traceback.format_exc()
        self.data["errors"].append({"part": part, "error": f"{type(exc).__name__}: {exc}", "traceback": tb})
        self.log(f"ERROR in {part}: {type(exc).__name__}: {exc}")
        self.log_f.write(tb + "\n")

    def save(self) -> None:
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.out / "gpu_check.json")


def import_triton_kernels():
    """lilicorr.plugins.triton_kernels, also when the project is not pip-installed (the folder
    plugins/ is mapped to lilicorr.plugins by pyproject; map it by hand otherwise)."""
    try:
        from lilicorr.plugins import triton_kernels
        return triton_kernels
    except ModuleNotFoundError as exc:
        if "lilicorr.plugins" not in str(exc):
            raise
    import lilicorr
    spec = importlib.util.spec_from_file_location("lilicorr.plugins", REPO / "plugins" / "__init__.py",
                                                  submodule_search_locations=[str(REPO / "plugins")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lilicorr.plugins"] = mod
    spec.loader.exec_module(mod)
    lilicorr.plugins = mod
    from lilicorr.plugins import triton_kernels
    return triton_kernels


def bench(torch, fn, device, warmup: int, reps: int) -> dict:
    """Median / min time of one call (CUDA events on GPU, perf_counter on CPU) and the mean time
    of `reps` back-to-back calls (launch overhead hidden where the GPU falls behind)."""
    for _ in range(warmup):
        fn()
    per = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            per.append(start.elapsed_time(end))
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        pipelined = start.elapsed_time(end) / reps
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            per.append(1e3 * (time.perf_counter() - t0))
        pipelined = sum(per) / len(per)
    per.sort()
    return {"median_ms": per[len(per) // 2], "min_ms": per[0], "pipelined_ms": pipelined, "reps": reps}


# ------------------------------------------------------------------------------------------------
# part 1: kernels
# ------------------------------------------------------------------------------------------------

def kernel_check(torch, rep: Report, device, small: bool, reps: int) -> dict:
    from lilicorr import lattice as L

    tk = import_triton_kernels()
    import triton

    B, K = 16, 8
    E = 64 if small else 1024
    S = B - 1
    sigma = 8.0
    batches = (1, 2) if small else (1, 8, 32)
    dtypes = ("float32", "bfloat16")
    warmup = 1 if device.type == "cpu" else 20
    res = {"shape": {"B": B, "S": S, "K": K, "E": E, "sigma": sigma}, "batches": list(batches),
           "dtypes": list(dtypes), "triton_version": triton.__version__,
           "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
           "timing": "CUDA events, median over reps after warmup" if device.type == "cuda"
           else "perf_counter (Triton interpreter: not a speed number)",
           "results": [], "ok": True}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False   # fp32 reference at full precision
    for dname in dtypes:
        for n in batches:
            try:
                entry = _kernel_entry(torch, L, tk, device, dname, n, S, K, E, sigma, warmup, reps)
            except Exception as exc:  # noqa: BLE001 - one configuration's failure must not stop the others
                rep.error(f"kernels/{dname}/N={n}", exc)
                entry = {"dtype": dname, "batch": n, "error": f"{type(exc).__name__}: {exc}"}
                res["ok"] = False
                res["results"].append(entry)
                continue
            ok = entry["scores_ok"] and entry["walk_equal"] and entry["fused_walk_equal"]
            res["ok"] = res["ok"] and ok
            res["results"].append(entry)
            t = entry["time"]
            rep.log(f"  kernels {dname} N={n}: err anchor {entry['max_abs_err_anchor']:.2e} pair "
                    f"{entry['max_abs_err_pair']:.2e} | walk equal {entry['walk_equal']} | fused equal "
                    f"{entry['fused_walk_equal']} | match {t['match']['triton']['median_ms']:.4f} ms (torch "
                    f"{t['match']['torch']['median_ms']:.4f}) | fused {t['fused']['triton']['median_ms']:.4f} ms "
                    f"(torch greedy(match) {t['match+walk']['torch']['median_ms']:.4f})")
    return res


def _kernel_entry(torch, L, tk, device, dname, n, S, K, E, sigma, warmup, reps) -> dict:
    """Equality and timing of the three kernels for one dtype and batch."""
    dt = getattr(torch, dname)
    g = torch.Generator().manual_seed(1000 * n + len(dname))

    def unit(*shape):
        return torch.nn.functional.normalize(torch.randn(*shape, generator=g), dim=-1)

    a32, o32, i32 = unit(n, E).to(device), unit(n, S, K, E).to(device), unit(n, S, K, E).to(device)
    a, o, i = a32.to(dt), o32.to(dt), i32.to(dt)
    # fp32 reference on exactly the values the kernel reads
    ref_a, ref_p = L.match_scores(a.float(), o.float(), i.float(), sigma)
    ref_walk = L.greedy_walk(ref_a, ref_p)
    ka, kp = tk.lattice_match(a, o, i, sigma)
    ta, tp = L.match_scores(a, o, i, sigma)            # torch in the storage dtype
    k_walk = tk.greedy_walk(ka, kp)
    t_walk_same = L.greedy_walk(ka, kp)                # torch walk on the kernel's scores
    fused = tk.fused_match_walk(a, o, i, sigma)
    err_a = float((ka.float() - ref_a).abs().max())
    err_p = float((kp.float() - ref_p).abs().max())
    torch_err = max(float((ta.float() - ref_a).abs().max()), float((tp.float() - ref_p).abs().max()))
    # decision margin of the fp32 reference walk (gap between best and second best)
    gaps = []
    za = ref_a.sort(dim=-1, descending=True).values
    gaps.append(za[:, 0] - za[:, 1])
    rows = torch.arange(n, device=device)
    for j in range(S - 1):
        z = ref_p[rows, j, ref_walk[:, j]].sort(dim=-1, descending=True).values
        gaps.append(z[:, 0] - z[:, 1])
    min_gap = float(torch.stack(gaps).min())
    walk_equal = bool(torch.equal(k_walk, t_walk_same))
    fused_equal = bool(torch.equal(fused, ref_walk))
    score_ok = max(err_a, err_p) <= SCORE_TOL[dname]
    entry = {
        "dtype": dname, "batch": n,
        "max_abs_err_anchor": err_a, "max_abs_err_pair": err_p, "score_tol": SCORE_TOL[dname],
        "torch_native_max_abs_err": torch_err, "scores_ok": score_ok,
        "walk_equal": walk_equal,             # Triton GreedyWalk == torch greedy_walk, same scores
        "fused_walk_equal": fused_equal,      # Triton LatticeMatchWalk == fp32 reference walk
        "fused_walk_mismatch_rows": int((fused != ref_walk).any(dim=1).sum()),
        "reference_min_decision_gap": min_gap,
        "time": {},
    }
    ops = {
        "match": (lambda: L.match_scores(a, o, i, sigma), lambda: tk.lattice_match(a, o, i, sigma)),
        "walk": (lambda: L.greedy_walk(ta, tp), lambda: tk.greedy_walk(ka, kp)),
        "match+walk": (lambda: L.greedy_walk(*L.match_scores(a, o, i, sigma)),
                       lambda: tk.greedy_walk(*tk.lattice_match(a, o, i, sigma))),
        "fused": (lambda: L.fused_match_walk(a, o, i, sigma), lambda: tk.fused_match_walk(a, o, i, sigma)),
    }
    for name, (f_torch, f_triton) in ops.items():
        t_t = bench(torch, f_torch, device, warmup, reps)
        t_k = bench(torch, f_triton, device, warmup, reps)
        entry["time"][name] = {"torch": t_t, "triton": t_k,
                               "speedup_median": t_t["median_ms"] / max(t_k["median_ms"], 1e-9)}
    return entry


# ------------------------------------------------------------------------------------------------
# part 2: models and stage decomposition
# ------------------------------------------------------------------------------------------------

def target_config(small: bool):
    from lilicorr.target import TargetConfig

    if small:
        return TargetConfig(model_type="qwen3", vocab_size=4096, hidden_size=256, intermediate_size=768,
                            num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                            tie_word_embeddings=False, qk_norm=True)
    # Qwen3-8B config.json
    return TargetConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                        tie_word_embeddings=False, qk_norm=True)


def lilicorr_config(small: bool):
    from lilicorr.config import HeadConfig, paper_preset

    cfg = paper_preset()                   # Table 4: B=16, K=8, d_e=1024, width 1024, 5 draft layers
    if small:
        cfg.drafter.num_layers = 2
        cfg.head = HeadConfig(top_k=8, width=128, num_layers=2, num_heads=4, ffn_width=256, embed_dim=64)
    return cfg


def build_target(torch, cfg, device, dtype, std: float = 0.02):
    """Random Qwen3-shaped target, allocated directly in `dtype` on `device` (no fp32 copy)."""
    from torch import nn

    from lilicorr.target import TargetModel

    with torch.device("meta"):
        model = TargetModel(cfg)
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            t = torch.empty(p.shape, dtype=dtype, device=device)
            if isinstance(m, (nn.Linear, nn.Embedding)) and name == "weight":
                t.normal_(0.0, std)
            elif name == "bias":
                t.zero_()
            else:                                   # RMSNorm weights
                t.fill_(1.0)
            m._parameters[name] = nn.Parameter(t, requires_grad=False)
    # the rotary table is a float32 buffer built on CPU; rebuild it on the device
    model.rotary.configure(cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, device=device)
    return model.eval().requires_grad_(False)


def build_lilicorr(torch, target, cfg, device, dtype, seed: int):
    from lilicorr.model import LiLiCorrModel

    cfg.drafter = cfg.drafter.for_target(target.config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LiLiCorrModel(cfg, target)
    return model.to(dtype).eval().requires_grad_(False)


def count_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def triton_propose(torch, model, tk):
    """propose_from_logits with the Triton fused LatticeMatchWalk kernel in place of the reference
    match + greedy walk (eager head)."""
    from lilicorr.head import top_k_candidates
    from lilicorr.model import LiLiCorrModel, Proposal

    orig = LiLiCorrModel.propose_from_logits.__get__(model)

    if getattr(model.drafter, "draft_to_target", None) is not None:
        raise ValueError("the Triton run expects a drafter over the full target vocabulary")

    def propose(slot_hidden, slot_logits, target_captured, rule):
        if rule != "lilicorr":
            return orig(slot_hidden, slot_logits, target_captured, rule)
        cand_ids, feats = top_k_candidates(slot_logits, model.cfg.head.top_k)
        out_vec, in_vec, anchor_out = model.head(cand_ids, feats, slot_hidden, target_captured)
        idx = tk.fused_match_walk(anchor_out, out_vec, in_vec, model.cfg.head.sigma)    # [N, S]
        tokens = torch.gather(cand_ids, -1, idx[..., None]).squeeze(-1)
        # the fused kernel returns the walk only, not the scores: NaN scores (the engine reads them
        # only for an adaptive draft length, which these runs do not use)
        n, s, k = cand_ids.shape
        nan = float("nan")
        return Proposal(tokens=tokens, cand_ids=cand_ids,
                        anchor_scores=torch.full((n, k), nan, device=tokens.device),
                        pair_scores=torch.full((n, s - 1, k, k), nan, device=tokens.device))

    return propose


def compiled_propose(torch, model, device, backend: str, mode: str | None):
    """top-K + confidence features + head + match + greedy walk as one torch.compile'd function
    (static shapes at a fixed batch; mode reduce-overhead records CUDA graphs)."""
    from lilicorr.model import LiLiCorrModel, Proposal

    orig = LiLiCorrModel.propose_from_logits.__get__(model)

    def core(slot_hidden, slot_logits, target_captured):
        prop = orig(slot_hidden, slot_logits, target_captured, "lilicorr")
        return prop.tokens, prop.cand_ids, prop.anchor_scores, prop.pair_scores

    kw = {"backend": backend, "dynamic": False}
    if backend == "inductor" and mode and mode != "default":
        kw["mode"] = mode
    fn = torch.compile(core, **kw)
    graphs = device.type == "cuda" and backend == "inductor" and mode in ("reduce-overhead", "max-autotune")

    def propose(slot_hidden, slot_logits, target_captured, rule):
        if rule != "lilicorr":
            return orig(slot_hidden, slot_logits, target_captured, rule)
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        outs = [t.clone() for t in fn(slot_hidden, slot_logits, target_captured)]  # outlive the next replay
        return Proposal(*outs)

    return propose


class eager_path:
    """Context manager: `model` runs its eager reference path inside (no propose override, the
    drafter uncompiled), and the optimised one again on exit."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.propose = self.model.__dict__.pop("propose_from_logits", None)
        self.compiled = getattr(self.model.drafter, "_compiled_call_impl", None)
        if self.compiled is not None:
            self.model.drafter._compiled_call_impl = None
        return self.model

    def __exit__(self, *exc):
        if self.propose is not None:
            self.model.propose_from_logits = self.propose
        if self.compiled is not None:
            self.model.drafter._compiled_call_impl = self.compiled
        return False


def proposal_check(torch, target, model, rule: str, prompt: list[int], blocks: int) -> dict:
    """The optimised path proposes what the eager path proposes. Runs `blocks` engine steps with the
    optimised path; at every drafted block the eager path (eager head, match and walk, uncompiled
    drafter) drafts from the same state (drafter context, anchor, target features) and the two
    proposals are compared: the drafted tokens and the top-K pools, element by element. Draft
    calls read the state without changing it, so both see the same inputs; this also warms up
    (compiles) the optimised path before it is timed."""
    from lilicorr.draft_runner import TorchDraftRunner
    from lilicorr.engine import SpecEngine

    b = model.block_size
    max_tokens = (blocks + 1) * b
    runner = TorchDraftRunner(model, num_slots=1, capacity=len(prompt) + max_tokens + 2 * b)
    engine = SpecEngine(target, runner, max_batch=1, max_seq_len=len(prompt) + max_tokens + 2 * b + 8)
    optimised = runner.draft
    rec = {"blocks": 0, "slots": 0, "token_mismatches": 0, "pool_mismatches": 0, "first_mismatch_block": None}

    def checked_draft(*args, **kwargs):
        prop = optimised(*args, **kwargs)
        with eager_path(model):
            ref = optimised(*args, **kwargs)
        bad_tokens = int((prop.tokens.cpu() != ref.tokens.cpu()).sum())
        bad_pools = int((prop.cand_ids.cpu() != ref.cand_ids.cpu()).any(-1).sum())
        if (bad_tokens or bad_pools) and rec["first_mismatch_block"] is None:
            rec["first_mismatch_block"] = rec["blocks"]
        rec["blocks"] += 1
        rec["slots"] += int(prop.tokens.numel())
        rec["token_mismatches"] += bad_tokens
        rec["pool_mismatches"] += bad_pools
        return prop

    runner.draft = checked_draft
    rid = engine.add_request(prompt, max_tokens=max_tokens, rule=rule)
    engine.step()                                       # prefill
    for _ in range(blocks):
        if any(ev.finished for ev in engine.step()):
            break
    engine.cancel(rid)
    rec["equal"] = rec["blocks"] > 0 and rec["token_mismatches"] == 0 and rec["pool_mismatches"] == 0
    return rec


def run_blocks(torch, target, model, rule: str, prompt: list[int], warmup: int, blocks: int,
               tree_nodes: int | None = None) -> dict:
    """Prefill `prompt`, then `warmup` untimed and `blocks` timed engine steps (one block each);
    rule tree verifies `tree_nodes` draft-tree nodes per block (default: DEFAULT_TREE_NODES)."""
    from lilicorr.config import DEFAULT_TREE_NODES
    from lilicorr.draft_runner import TorchDraftRunner
    from lilicorr.engine import SpecEngine
    from lilicorr.profiling import StageTimer

    b = model.block_size
    max_tokens = (warmup + blocks + 1) * b
    runner = TorchDraftRunner(model, num_slots=1, capacity=len(prompt) + max_tokens + 2 * b)
    engine = SpecEngine(target, runner, max_batch=1, max_seq_len=len(prompt) + max_tokens + 2 * b + 8,
                        tree_nodes=tree_nodes or DEFAULT_TREE_NODES)
    rid = engine.add_request(prompt, max_tokens=max_tokens, rule=rule)
    t0 = time.perf_counter()
    engine.step()                                       # prefill (not a block)
    sync = torch.cuda.synchronize if target.embed_tokens.weight.is_cuda else (lambda: None)
    sync()
    prefill_s = time.perf_counter() - t0
    timer = StageTimer()
    with timer.active():
        t0 = time.perf_counter()
        for _ in range(warmup):
            engine.step()
        sync()
        warm_s = time.perf_counter() - t0
        timer.reset()
        t0 = time.perf_counter()
        for _ in range(blocks):
            if any(ev.finished for ev in engine.step()):
                break
        sync()
        timed_s = time.perf_counter() - t0
    res = engine.result(rid)
    engine.cancel(rid)
    table = timer.table()
    return {"rule": rule, "table": table, "prefill_s": prefill_s, "warmup_s": warm_s,
            "timed_s": timed_s, "tau": res.tau, "steps": res.num_steps,
            "tokens": len(res.tokens)}


def stage_check(torch, rep: Report, args, device, dtype) -> dict:
    small = args.small
    prompt_len = args.prompt_len or (32 if small else 1024)
    blocks = args.blocks or (3 if small else 64)
    warmup = args.warmup_blocks if args.warmup_blocks is not None else (1 if small else 8)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise ValueError(f"unknown runs {unknown}; choose from {RUNS}")
    backend = args.compile_backend or ("inductor" if device.type == "cuda" else "eager")
    out = {"prompt_len": prompt_len, "blocks": blocks, "warmup_blocks": warmup, "batch": 1,
           "dtype": str(dtype).replace("torch.", ""), "compile_backend": backend,
           "compile_mode": args.compile_mode, "runs": {}, "paper_table3": PAPER_TABLE3,
           "note": "random weights: stage costs are real, acceptance (tau) is not"}
    rep.data["stages"] = out

    t0 = time.perf_counter()
    tcfg = target_config(small)
    target = build_target(torch, tcfg, device, dtype)
    cfg = lilicorr_config(small)
    model = build_lilicorr(torch, target, cfg, device, dtype, args.seed)
    if device.type == "cuda":
        torch.cuda.synchronize()
    out["build_s"] = time.perf_counter() - t0
    rep.data["config"] = {
        "target": {k: getattr(tcfg, k) for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                                  "num_hidden_layers", "num_attention_heads",
                                                  "num_key_value_heads", "head_dim", "qk_norm",
                                                  "tie_word_embeddings")},
        "target_params": count_params(target),
        "drafter": {k: getattr(model.cfg.drafter, k) for k in ("num_layers", "block_size", "hidden_size",
                                                                "intermediate_size", "num_heads", "num_kv_heads",
                                                                "target_layer_ids")},
        "drafter_params": count_params(model.drafter),
        "head": dict(vars(model.cfg.head)),
        "head_params": count_params(model.head),
        "init_std": 0.02,
    }
    rep.log(f"built target ({count_params(target) / 1e9:.3f} B params), drafter "
            f"({count_params(model.drafter) / 1e6:.1f} M), head ({count_params(model.head) / 1e6:.2f} M) "
            f"in {out['build_s']:.1f} s")
    if device.type == "cuda":
        out["memory_allocated_gb_after_build"] = torch.cuda.memory_allocated() / 2**30

    g = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, tcfg.vocab_size, (prompt_len,), generator=g).tolist()

    # the random target must stay finite over a realistic context
    with torch.no_grad():
        ids = torch.tensor([prompt], device=device)
        pos = torch.arange(prompt_len, device=device)[None]
        o = target(ids, pos, capture=model.cfg.drafter.target_layer_ids, logits=False)
        last = target.lm_head(o.last_hidden[:, -1]).float()
        finite = bool(torch.isfinite(o.last_hidden).all() and torch.isfinite(o.captured).all()
                      and torch.isfinite(last).all())
        out["target_finite"] = finite
        out["target_last_logit_std"] = float(last.std())
        del o, last
    rep.log(f"target forward over the {prompt_len}-token prompt finite: {finite}")
    if not finite:
        rep.data["errors"].append({"part": "stages/target_finite", "error": "non-finite target activations"})
    rep.save()

    tk = None
    for name in runs:
        rep.log(f"stage run {name} ...")
        model.__dict__.pop("propose_from_logits", None)         # back to the eager reference
        entry = {"status": "error"}
        out["runs"][name] = entry
        try:
            t0 = time.perf_counter()
            nodes = 16
            if name == "dflash":
                rule = "argmax"
            elif name.startswith("tree_"):
                rule, nodes = "tree", int(name.split("_")[1])
            else:
                rule = "lilicorr"
                if name == "lilicorr_triton":
                    tk = tk or import_triton_kernels()
                    model.propose_from_logits = triton_propose(torch, model, tk)
                elif name in ("lilicorr_compiled", "lilicorr_compiled_full"):
                    model.propose_from_logits = compiled_propose(torch, model, device, backend, args.compile_mode)
                    entry["compiled"] = ["top-K + head + match + greedy walk "
                                         f"(backend {backend}, mode {args.compile_mode if backend == 'inductor' else '-'})"]
                    if name == "lilicorr_compiled_full":
                        model.drafter.compile(backend=backend, dynamic=True)
                        entry["compiled"].append(f"drafter backbone (backend {backend}, dynamic shapes)")
            if name in OPTIMISED_RUNS:
                # before timing: the optimised proposals must equal eager's on the same inputs
                check = proposal_check(torch, target, model, rule, prompt, warmup + blocks)
                entry["proposal_check"] = check
                rep.log(f"  {name}: proposals vs eager over {check['blocks']} blocks ({check['slots']} slots): "
                        f"{'equal' if check['equal'] else 'DIFFERENT'} ({check['token_mismatches']} token / "
                        f"{check['pool_mismatches']} pool mismatches)")
                if not check["equal"]:
                    rep.data["errors"].append({
                        "part": f"stages/{name}",
                        "error": f"proposals differ from eager ({check['token_mismatches']} of {check['slots']} "
                                 f"drafted tokens, {check['pool_mismatches']} pools, first at block "
                                 f"{check['first_mismatch_block']}): its timing is not of the same computation"})
            r = run_blocks(torch, target, model, rule, prompt, warmup, blocks, tree_nodes=nodes)
            entry.update(r)
            entry["status"] = "ok"
            entry["total_s"] = time.perf_counter() - t0
            t = r["table"]
            rep.log(f"  {name}: wall {t['per_block_wall_ms']:.3f} ms/block | " + " | ".join(
                f"{k} {v:.3f}" for k, v in t["stages_ms"].items()) + f" | head share {t['head_share_pct']:.1f}% "
                f"| warmup {r['warmup_s']:.1f} s | tau {r['tau']:.2f}")
        except Exception as exc:  # noqa: BLE001 - one run's failure must not stop the others
            rep.error(f"stages/{name}", exc)
            entry["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if name == "lilicorr_compiled_full":
                model.drafter._compiled_call_impl = None         # uncompile
            model.__dict__.pop("propose_from_logits", None)
        rep.save()
    return out


# ------------------------------------------------------------------------------------------------
# markdown
# ------------------------------------------------------------------------------------------------

def _f(x, nd=3):
    return "" if x is None else f"{x:.{nd}f}"


def markdown(data: dict) -> str:
    m = data["meta"]
    real = m.get("gpu_numbers")
    lines = [f"# gpu_check: {m.get('device_name', m.get('device'))}", ""]
    if not real:
        lines += ["**DRY RUN: not GPU numbers** (CPU and/or `--small`; only proves every code path runs).", ""]
    lines += [f"- date {m.get('date')}, torch {m.get('torch')}, triton {m.get('triton')}, cuda {m.get('cuda')}, "
              f"python {m.get('python')}, small={m.get('small')}, elapsed {m.get('elapsed_s', 0):.0f} s", ""]
    k = data.get("kernels")
    if k and k.get("results"):
        sh = k["shape"]
        lines += [f"## Lattice kernels: Triton vs PyTorch reference (B={sh['B']}, K={sh['K']}, E={sh['E']}, "
                  f"sigma={sh['sigma']})", "",
                  f"Timing: {k['timing']}. Errors are against an fp32 reference on the same inputs.", "",
                  "| dtype | N | max abs err (anchor / pair) | walk equal | fused walk equal | "
                  "match torch / triton (ms) | walk torch / triton (ms) | match+walk torch / triton 2-kernel / "
                  "triton fused (ms) |",
                  "|---|---:|---|---|---|---|---|---|"]
        for r in k["results"]:
            if "error" in r:
                lines.append(f"| {r['dtype']} | {r['batch']} | FAILED: {r['error']} | | | | | |")
                continue
            t = r["time"]
            lines.append(
                f"| {r['dtype']} | {r['batch']} | {r['max_abs_err_anchor']:.1e} / {r['max_abs_err_pair']:.1e} | "
                f"{r['walk_equal']} | {r['fused_walk_equal']} | "
                f"{_f(t['match']['torch']['median_ms'], 4)} / {_f(t['match']['triton']['median_ms'], 4)} | "
                f"{_f(t['walk']['torch']['median_ms'], 4)} / {_f(t['walk']['triton']['median_ms'], 4)} | "
                f"{_f(t['match+walk']['torch']['median_ms'], 4)} / {_f(t['match+walk']['triton']['median_ms'], 4)}"
                f" / {_f(t['fused']['triton']['median_ms'], 4)} |")
        lines.append("")
    elif k and k.get("error"):
        lines += ["## Lattice kernels", "", f"FAILED: {k['error']}", ""]
    s = data.get("stages")
    if s:
        runs = s.get("runs", {})
        lines += [f"## Table 3 stage decomposition (ms / block, batch 1, {s['prompt_len']}-token prompt, "
                  f"{s['blocks']} timed blocks after {s['warmup_blocks']} warm-up, {s['dtype']})", "",
                  "Paper: MT-Bench, single H100, trained Qwen3-8B drafter. Here: random weights "
                  "(stage costs only).", ""]
        cols = [("Paper DFlash", PAPER_TABLE3["dflash"]), ("DFlash", runs.get("dflash")),
                ("Paper LiLiCorr eager", PAPER_TABLE3["lilicorr_eager"]), ("LiLiCorr eager", runs.get("lilicorr_eager")),
                ("LiLiCorr eager + Triton walk", runs.get("lilicorr_triton")),
                ("Paper LiLiCorr optimized", PAPER_TABLE3["lilicorr_optimized"]),
                ("LiLiCorr compiled head", runs.get("lilicorr_compiled")),
                ("LiLiCorr compiled head + drafter", runs.get("lilicorr_compiled_full")),
                ("LiLiCorr tree, M=16", runs.get("tree_16")), ("LiLiCorr tree, M=64", runs.get("tree_64"))]

        def cell(c, key):
            if c is None:
                return "n/a"
            if "table" not in c:
                return "failed" if c.get("status") == "error" else _f(c.get(key), 2)
            if not c.get("proposal_check", {}).get("equal", True):
                return "≠ eager"               # the proposals differ: not the same computation
            t = c["table"]
            if key == "per_block_wall":
                return _f(t["per_block_wall_ms"])
            if key == "stage_sum":
                return _f(t["stage_sum_ms"])
            if key == "head_share":
                return f"{t['head_share_pct']:.1f}%"
            return _f(t["stages_ms"][key])

        def paper_extra(c, key):
            if key == "stage_sum":
                return _f(sum(c[k] for k in STAGE_KEYS), 2)
            if key == "head_share":
                return f"{100 * c['speculative_head'] / c['per_block_wall']:.1f}%"
            return _f(c.get(key), 2)

        lines.append("| Stage (ms / block) | " + " | ".join(n for n, _ in cols) + " |")
        lines.append("|---|" + "---:|" * len(cols))
        for key, title in list(STAGE_ROWS.items()) + [("per_block_wall", "Per-block wall"),
                                                       ("stage_sum", "Sum of stages"),
                                                       ("head_share", "Head share")]:
            row = []
            for n, c in cols:
                row.append(paper_extra(c, key) if n.startswith("Paper") else cell(c, key))
            lines.append(f"| {title} | " + " | ".join(row) + " |")
        lines.append("")
        extra = []
        for n in RUNS:
            c = runs.get(n)
            if c and c.get("status") == "ok":
                pc = c.get("proposal_check")
                check = "" if pc is None else (
                    f", proposals equal to eager's over {pc['blocks']} blocks ({pc['slots']} drafted tokens)"
                    if pc["equal"] else f", **proposals differ from eager's** ({pc['token_mismatches']} of "
                                        f"{pc['slots']} tokens, {pc['pool_mismatches']} pools): timing not comparable")
                extra.append(f"- {n}: rule {c['rule']}, warm-up (incl. compile) {c['warmup_s']:.1f} s, "
                             f"prefill {c['prefill_s']:.2f} s, tau {c['tau']:.2f}" + check
                             + (f", compiled: {'; '.join(c['compiled'])}" if c.get("compiled") else ""))
            elif c:
                extra.append(f"- {n}: FAILED {c.get('error')}")
        lines += extra + [""]
    if data.get("errors"):
        lines += ["## Errors", ""] + [f"- {e['part']}: {e['error']}" for e in data["errors"]] + [""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    want = args.device
    if want is not None and want not in ("cuda", "cpu") and not want.startswith("cuda:"):
        print(f"gpu_check: --device must be cuda or cpu, got {want!r}", file=sys.stderr)
        return 2
    # TRITON_INTERPRET must be decided before triton (or anything importing it) is imported
    if want == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.pop("TRITON_INTERPRET", None):
        print("gpu_check: TRITON_INTERPRET unset for a GPU run (kernels must run natively)", file=sys.stderr)

    import torch

    if want is None:
        want = "cuda" if torch.cuda.is_available() else "cpu"
        if want == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"
    if want.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: --device {want} was requested but CUDA is not available (torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda}). Run it on a GPU machine, or "
              "`--small --device cpu --out /tmp/gpucheck` for a dry-run.", file=sys.stderr)
        return 2
    device = torch.device(want)
    if device.type == "cpu" and not args.small:
        print("gpu_check: the full shapes (8 B-parameter target) need a GPU; on CPU run the dry-run "
              "`--small --device cpu --out /tmp/gpucheck`", file=sys.stderr)
        return 2
    real = device.type == "cuda" and not args.small
    out = Path(args.out) if args.out else (REPO / "results" / "gpu_h200" if real else Path("/tmp/gpucheck"))
    if not real and is_under(out, REPO / "results"):
        print(f"gpu_check: {out} is under results/, which holds real GPU numbers only; a dry-run "
              "(--small or CPU) must write elsewhere, e.g. --out /tmp/gpucheck", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)

    try:
        import lilicorr  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO))          # not pip-installed: run from the checkout

    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    rep = Report(out)
    t_start = time.perf_counter()
    try:
        import triton
        triton_v = triton.__version__
    except Exception:  # noqa: BLE001
        triton_v = None
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": str(device), "small": args.small,
            "gpu_numbers": real, "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
            "triton": triton_v, "cuda": torch.version.cuda, "python": platform.python_version(),
            "host": platform.node(), "argv": sys.argv[1:] if argv is None else list(argv),
            "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        meta.update(device_name=p.name, capability=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                    memory_gb=p.total_memory / 2**30)
    else:
        meta.update(device_name=f"CPU ({platform.processor() or platform.machine()}, "
                                f"{torch.get_num_threads()} threads)")
    rep.data["meta"] = meta
    rep.log(f"gpu_check on {meta['device_name']} | torch {torch.__version__} | triton {triton_v} | "
            f"small={args.small} | dtype {meta['dtype']} | out {out}")
    rep.save()
    torch.manual_seed(args.seed)

    if not args.skip_kernels:
        rep.log("part 1: Triton lattice kernels vs PyTorch reference")
        try:
            reps = args.reps or (2 if device.type == "cpu" else 200)
            with torch.no_grad():
                rep.data["kernels"] = kernel_check(torch, rep, device, args.small, reps)
            if not rep.data["kernels"]["ok"]:
                rep.data["errors"].append({"part": "kernels", "error": "an equality check failed (see kernels.results)"})
        except Exception as exc:  # noqa: BLE001
            rep.error("kernels", exc)
            rep.data["kernels"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "results": []}
        rep.save()

    if not args.skip_stages:
        rep.log("part 2: Table 3 stage decomposition at batch 1")
        try:
            with torch.no_grad():
                stage_check(torch, rep, args, device, dtype)
        except Exception as exc:  # noqa: BLE001
            rep.error("stages", exc)
            if rep.data["stages"] is None:
                rep.data["stages"] = {"error": f"{type(exc).__name__}: {exc}", "runs": {}}
        if device.type == "cuda":
            rep.data["meta"]["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30

    rep.data["meta"]["elapsed_s"] = time.perf_counter() - t_start
    rep.data["ok"] = not rep.data["errors"]
    rep.save()
    md = markdown(rep.data)
    (out / "gpu_check.md").write_text(md + "\n")
    print()
    print(md, flush=True)
    rep.log(f"done in {rep.data['meta']['elapsed_s']:.0f} s; ok={rep.data['ok']}; wrote {out}/gpu_check.json, "
            "gpu_check.md, gpu_check.log")
    rep.log_f.close()
    return 0 if rep.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
