"""What a checkpoint's vocabulary holds: the draft vocabulary (EAGLE-3 style LM head over the N most
frequent training tokens, ids mapped back to the target's) and the frozen mask-token row."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lilicorr.draft_vocab import build_draft_vocab, coverage, token_counts, unused_special_token
from lilicorr.engine import SpecEngine
from lilicorr.head import top_k_candidates
from lilicorr.model import load_model
from lilicorr.training import Sequence, training_forward
from spec_helpers import random_prompts, small_model, target_greedy, target_of

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return target_of(tiny_target_dir("llama"))


def draft_model(target, size: int, block_size: int = 5, seed: int = 0):
    """small_model with a draft vocabulary of `size` ids: every other target id from 6 upward,
    plus the eos id, so that some target tokens lie outside it."""
    import dataclasses

    from lilicorr.model import LiLiCorrModel

    base = small_model(target, block_size, seed=seed)
    cfg = dataclasses.replace(base.cfg, drafter=dataclasses.replace(base.cfg.drafter, draft_vocab_size=size))
    torch.manual_seed(seed)
    model = LiLiCorrModel(cfg, target)
    ids = sorted({2, *range(6, target.config.vocab_size, 2)})[:size]
    model.drafter.set_draft_vocab(ids)
    return model.eval().requires_grad_(False), torch.tensor(ids)


# -- building the vocabulary -------------------------------------------------------------------
def test_build_draft_vocab_takes_the_most_frequent_ids_with_ties_by_id():
    counts = torch.tensor([0, 5, 3, 3, 9, 0, 3, 1])
    ids = build_draft_vocab(counts, 3)
    assert ids.tolist() == [1, 2, 4]                        # 9, 5, then the smallest id among the 3s
    assert build_draft_vocab(counts, 3, always=[7]).tolist() == [1, 4, 7]
    assert coverage(counts, ids) == pytest.approx((9 + 5 + 3) / 24)
    assert coverage(counts, torch.arange(8)) == 1.0
    with pytest.raises(ValueError, match="size"):
        build_draft_vocab(counts, 9)
    with pytest.raises(ValueError, match="do not fit"):
        build_draft_vocab(counts, 1, always=[0, 1])


def test_token_counts_read_completion_tokens_only_by_default():
    seqs = [Sequence([1, 2, 3, 3], [0, 0, 1, 1]), Sequence([4, 3], [1, 0])]
    assert token_counts(seqs, 6).tolist() == [0, 0, 0, 2, 1, 0]
    assert token_counts(seqs, 6, completion_only=False).tolist() == [0, 1, 1, 3, 1, 0]


def test_mask_token_is_an_unused_special_row(tiny_target_dir):
    path = tiny_target_dir("llama")            # specials: <unk> <s> </s> <pad> <|im_start|> <|im_end|>
    counts = torch.zeros(96, dtype=torch.long)
    assert unused_special_token(path, counts, reserved=[1, 2, 3]) == 5
    counts[5] = 1                                                  # <|im_end|> occurs in the data
    assert unused_special_token(path, counts, reserved=[1, 2, 3]) == 4
    counts[[0, 4]] = 1
    assert unused_special_token(path, counts, reserved=[1, 2, 3]) is None


# -- the drafter's LM head over the draft vocabulary -------------------------------------------
def test_draft_logits_are_the_full_logits_at_the_mapped_rows(target):
    model, ids = draft_model(target, 24)
    hidden = torch.randn(2, 4, target.config.hidden_size)
    full = target.lm_head(hidden).float()
    torch.testing.assert_close(model.drafter.logits(hidden), full[..., ids])
    t2d = model.drafter.target_to_draft()
    assert t2d[ids].tolist() == list(range(24)) and int((t2d >= 0).sum()) == 24
    cand, feats = top_k_candidates(model.drafter.logits(hidden), 4, model.drafter.draft_to_target)
    want = ids[full[..., ids].topk(4, -1).indices]
    assert torch.equal(cand, want) and feats.shape == (2, 4, 4, 5)
    with pytest.raises(ValueError, match="distinct"):
        model.drafter.set_draft_vocab([6] * 24)


def test_training_forward_with_a_draft_vocabulary_skips_labels_outside_it(target):
    model, ids = draft_model(target, 24)
    model.train().requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(6, target.config.vocab_size, (2, 40), generator=g)
    mask = torch.ones_like(seq, dtype=torch.bool)
    mask[:, :4] = False
    anchors = torch.tensor([[5, 12, 20], [7, 15, 30]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    out = training_forward(model, target, seq, mask, anchors, valid)
    inside = torch.isin(seq, ids)
    # the DFlash weight only counts labelled slots whose label is in the draft vocabulary
    from lilicorr.losses import slot_decay

    w = slot_decay(4, model.cfg.loss.beta)
    want = sum(float(w[s]) for r in range(2) for a in anchors[r].tolist() for s in range(4)
               if inside[r, a + 1 + s])
    assert out.terms.dflash_weight.item() == pytest.approx(want, rel=1e-5)
    out.terms.dflash_sum.backward()
    assert model.drafter.fc.weight.grad is not None and model.drafter.fc.weight.grad.abs().sum() > 0


# -- serving: lossless, and the map survives a checkpoint --------------------------------------
@pytest.mark.parametrize("rule", ["lilicorr", "argmax"])
def test_greedy_output_with_a_draft_vocabulary_equals_ar(target, rule):
    from lilicorr.draft_runner import TorchDraftRunner

    model, _ = draft_model(target, 24, block_size=4)
    engine = SpecEngine(target, TorchDraftRunner(model, num_slots=3, capacity=128), max_batch=3,
                        max_seq_len=128)
    prompts = random_prompts([5, 9, 3], target.config.vocab_size, seed=1)
    outs = engine.generate(prompts, 20, rule=rule)
    for p, r in zip(prompts, outs):
        assert r.tokens == target_greedy(target, p, 20)


def test_checkpoint_keeps_the_map_in_bfloat16_and_reloads_it(target, tmp_path):
    from lilicorr import checkpoint as ckpt_io

    model, ids = draft_model(target, 24)
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    assert state["drafter.draft_to_target"].dtype == torch.long
    ckpt_io.save_checkpoint(tmp_path / "ck", model.cfg, state, target.config, {"step": 1}, None)
    loaded = load_model(tmp_path / "ck", target)
    assert torch.equal(loaded.drafter.draft_to_target, ids)
    assert loaded.cfg.drafter.draft_vocab_size == 24


def test_cli_trains_with_a_draft_vocabulary_and_mask_token(tiny_target_dir, tmp_path):
    """train.py --draft-vocab picks the most frequent training tokens, reports their coverage and
    stores the map; --mask-token auto picks an unused special row."""
    target_dir = tiny_target_dir("llama")
    g = torch.Generator().manual_seed(3)
    lines = []
    for i in range(8):
        c = torch.randint(6, 40, (30,), generator=g).tolist()     # tokens 6..39 only
        lines.append(json.dumps({"id": str(i), "prompt_ids": [1, 7, 8, 9], "completion_ids": c}))
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(REPO / "train" / "train.py"), "--target", str(target_dir),
                           "--data", str(data), "--out", str(out), "--steps", "2", "--global-batch", "4",
                           "--num-anchors", "4", "--drafter-layers", "1", "--draft-vocab", "40",
                           "--precision", "bf16"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocabulary"]["draft_vocab_size"] == 40
    assert meta["vocabulary"]["draft_coverage"] == 1.0             # 34 used ids + eos fit in 40
    assert meta["vocabulary"]["mask_token_id"] == 5                 # <|im_end|>: never in the data
    assert meta["precision"] == "bf16"
    model = load_model(out, target_of(target_dir))
    assert set(range(6, 40)) <= set(model.drafter.draft_to_target.tolist())
    assert model.cfg.drafter.mask_token_id == 5 and model.drafter.mask_embedding is None
