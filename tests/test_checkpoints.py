"""The committed SmolLM2 checkpoints (checkpoints/*) load against the real target and draft."""
from __future__ import annotations

from pathlib import Path

import pytest
from lilicorr import checkpoint as ckpt_io
from lilicorr.engine import SpecEngine

REPO = Path(__file__).resolve().parents[1]
COMMITTED = sorted(p for p in (REPO / "checkpoints").glob("*") if (p / ckpt_io.CONFIG).is_file())


def test_committed_checkpoints_are_small_and_complete():
    names = [p.name for p in COMMITTED]
    assert any("lilicorr" in n for n in names) and any("vanilla" in n for n in names), names
    for p in COMMITTED:
        assert (p / ckpt_io.WEIGHTS).stat().st_size <= 30 * 2**20, p
        cfg, fingerprint = ckpt_io.read_config(p)
        assert cfg.vanilla == ("vanilla" in p.name)
        assert fingerprint["model_type"] == "llama" and fingerprint["hidden_size"] == 576


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_checkpoint_is_lossless_on_smollm2(ckpt, smollm2_dir):
    engine = SpecEngine.from_paths(smollm2_dir, ckpt_dir=ckpt, max_batch=2)
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646], [1, 4093, 198, 10024, 260, 3403]]
    rules = ("argmax",) if "vanilla" in ckpt.name else ("lilicorr", "viterbi", "argmax")
    ref = [r.tokens for r in engine.generate(prompts, 24, rule="ar")]
    for rule in rules:
        out = engine.generate(prompts, 24, rule=rule)
        assert [r.tokens for r in out] == ref, rule
        for r in out:
            # the step bookkeeping adds up: every verify step commits 1..B tokens, the prefill one
            assert sum(r.accept_hist) == r.num_steps
            assert sum(k * c for k, c in enumerate(r.accept_hist)) == r.accepted_tokens
            assert r.accepted_tokens + 1 >= len(r.tokens) > r.num_steps
        # a trained drafter is accepted: multi-token steps happen, so the rule needs fewer verify
        # steps than `ar` (one per token after the first)
        steps = sum(r.num_steps for r in out)
        assert sum(sum(r.accept_hist[2:]) for r in out) > 0 and steps < sum(len(t) - 1 for t in ref), rule
