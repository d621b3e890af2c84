"""deploy/gpu_check.py: the CPU dry-run (--small) completes and writes the JSON / markdown a GPU
run will produce, the optimised runs' proposals are checked against eager's before they are timed
(and a wrong optimised path is caught), and the guards (no CUDA, dry-run into results/) fail fast
with exit 2.

The dry-run takes about 30-75 s on 2 shared cores (Triton interpreter + five engine runs), so it
is marked slow.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spec_helpers import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "gpu_check.py"
STAGES = ("target_verify", "draft_backbone", "lm_head_projection", "speculative_head", "accept_residual")
RUNS = ("dflash", "lilicorr_eager", "lilicorr_triton", "lilicorr_compiled", "lilicorr_compiled_full",
        "tree_16", "tree_64")


def run(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA guard")
def test_cuda_requested_without_cuda_exits_2(tmp_path):
    p = run("--device", "cuda", "--out", str(tmp_path / "o"), timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "CUDA is not available" in p.stderr
    assert not (tmp_path / "o").exists()


def _snapshot(folder: Path) -> dict:
    return {str(f): f.stat().st_mtime_ns for f in folder.rglob("*")} if folder.exists() else {}


def test_dry_run_refuses_results_folder():
    folder = REPO / "results" / "gpu_h200"
    before = _snapshot(folder)
    p = run("--small", "--device", "cpu", "--out", str(folder), timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "results/" in p.stderr
    assert _snapshot(folder) == before          # nothing written or touched there


@pytest.mark.slow
def test_small_cpu_dry_run(tmp_path):
    out = tmp_path / "gpucheck"
    p = run("--small", "--device", "cpu", "--out", str(out), "--blocks", "2", "--warmup-blocks", "1",
            "--prompt-len", "32")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["ok"] is True and data["errors"] == []

    meta = data["meta"]
    assert meta["device"] == "cpu" and meta["small"] is True
    assert meta["gpu_numbers"] is False and meta["triton_interpret"] is True

    k = data["kernels"]
    assert k["ok"] is True and k["interpreter"] is True
    assert k["shape"]["B"] == 16 and k["shape"]["K"] == 8
    assert len(k["results"]) == len(k["batches"]) * len(k["dtypes"])
    for r in k["results"]:
        assert r["walk_equal"] and r["fused_walk_equal"] and r["scores_ok"]
        assert r["max_abs_err_pair"] <= r["score_tol"]
        for op in ("match", "walk", "match+walk", "fused"):
            for impl in ("torch", "triton"):
                t = r["time"][op][impl]
                assert t["median_ms"] > 0 and t["reps"] >= 1

    s = data["stages"]
    assert s["prompt_len"] == 32 and s["blocks"] == 2 and s["batch"] == 1
    assert s["target_finite"] is True
    assert set(s["paper_table3"]["lilicorr_eager"]) >= set(STAGES) | {"per_block_wall"}
    assert s["paper_table3"]["lilicorr_eager"]["speculative_head"] == 0.66
    assert s["paper_table3"]["lilicorr_optimized"]["per_block_wall"] == 10.15
    for name in RUNS:
        r = s["runs"][name]
        assert r["status"] == "ok", r
        t = r["table"]
        assert t["blocks"] == 2
        assert set(t["stages_ms"]) == set(STAGES)
        assert t["per_block_wall_ms"] > 0 and t["stages_ms"]["target_verify"] > 0
        assert t["stage_sum_ms"] <= t["per_block_wall_ms"] * 1.01
    assert s["runs"]["dflash"]["rule"] == "argmax"
    assert s["runs"]["lilicorr_eager"]["rule"] == "lilicorr"
    assert s["runs"]["tree_16"]["rule"] == s["runs"]["tree_64"]["rule"] == "tree"
    assert s["runs"]["lilicorr_compiled"]["compiled"]
    # the optimised runs were checked against eager before timing: same proposals at every block
    for name in ("lilicorr_triton", "lilicorr_compiled", "lilicorr_compiled_full"):
        pc = s["runs"][name]["proposal_check"]
        assert pc["equal"] is True and pc["blocks"] >= 3 and pc["slots"] == pc["blocks"] * 15, (name, pc)
        assert pc["token_mismatches"] == 0 and pc["pool_mismatches"] == 0
    assert "proposal_check" not in s["runs"]["dflash"] and "proposal_check" not in s["runs"]["lilicorr_eager"]

    cfg = data["config"]
    assert cfg["target"]["qk_norm"] is True and cfg["head"]["top_k"] == 8
    assert cfg["drafter"]["block_size"] == 16

    md = (out / "gpu_check.md").read_text()
    assert "DRY RUN" in md and "Paper LiLiCorr eager" in md and "| Speculative head |" in md
    assert "LiLiCorr tree, M=64" in md
    assert md.count("proposals equal to eager's over 3 blocks") == 3 and "≠ eager" not in md
    assert (out / "gpu_check.log").read_text()


def _gpu_check_module():
    return load_script(SCRIPT, "gpu_check")


@torch.no_grad()
def test_proposal_check_catches_a_wrong_optimised_path():
    """The check compares against the eager path on the same inputs: an optimised propose that
    walks differently (here: always the second candidate) is caught; the Triton path is not."""
    gc = _gpu_check_module()
    from lilicorr.model import LiLiCorrModel, Proposal

    target = gc.build_target(torch, gc.target_config(True), torch.device("cpu"), torch.float32)
    model = gc.build_lilicorr(torch, target, gc.lilicorr_config(True), torch.device("cpu"), torch.float32, 0)
    prompt = list(range(5, 37))
    eager = LiLiCorrModel.propose_from_logits.__get__(model)

    def second_best(slot_hidden, slot_logits, target_captured, rule):
        p = eager(slot_hidden, slot_logits, target_captured, rule)
        return Proposal(p.cand_ids[..., 1], p.cand_ids, p.anchor_scores, p.pair_scores)

    model.propose_from_logits = second_best
    bad = gc.proposal_check(torch, target, model, "lilicorr", prompt, 2)
    assert bad["equal"] is False and bad["token_mismatches"] > 0 and bad["first_mismatch_block"] == 0
    assert model.propose_from_logits is second_best          # the optimised path is restored after each block
    model.__dict__.pop("propose_from_logits")
    same = gc.proposal_check(torch, target, model, "lilicorr", prompt, 2)
    assert same["equal"] is True and same["blocks"] == 2
