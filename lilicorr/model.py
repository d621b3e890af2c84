"""Drafter + head as one module, and the draft pass shared by the engine and the ONNX export.

    draft pass: block hidden states -> slot logits -> top-K + five confidence features
                -> head (out/in/anchor vectors) -> lattice scores (Eq. 1) -> decode rule
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lilicorr import lattice
from lilicorr.config import LiLiCorrConfig
from lilicorr.drafter import DFlashDrafter
from lilicorr.head import LiLiCorrHead, top_k_candidates

RULES = ("lilicorr", "viterbi", "argmax", "ar", "tree")


@dataclass
class Proposal:
    """One drafted block per row."""

    tokens: torch.Tensor          # [N, S] long, the committed draft (decode rule applied)
    cand_ids: torch.Tensor        # [N, S, K] long, top-K pool per slot (rank order)
    anchor_scores: torch.Tensor | None = None   # [N, K]
    pair_scores: torch.Tensor | None = None     # [N, S-1, K, K]
    tree: "lattice.DraftTree | None" = None     # rule `tree`'s draft tree, when the draft graph builds it


class LiLiCorrModel(nn.Module):
    """Trainable part of the system: `drafter.*` and `head.*` (the head is absent for --vanilla)."""

    def __init__(self, cfg: LiLiCorrConfig, target):
        super().__init__()
        if cfg.head.top_k < 1:
            raise ValueError("top_k must be >= 1")
        self.cfg = cfg
        self.drafter = DFlashDrafter(cfg.drafter, target.embed_tokens, target.lm_head, target.rotary)
        self.head = None if cfg.vanilla else LiLiCorrHead(
            cfg.head, target_hidden=cfg.drafter.hidden_size,
            num_captured=cfg.drafter.num_target_layers_captured,
            block_size=cfg.drafter.block_size, embed=target.embed_tokens)

    @property
    def block_size(self) -> int:
        return self.cfg.drafter.block_size

    def score_lattice(self, slot_hidden: torch.Tensor, slot_logits: torch.Tensor,
                      target_captured: torch.Tensor):
        """slot_hidden [N, S, H], slot_logits [N, S, V], target_captured [N, n, H]
        -> cand_ids [N, S, K], anchor_scores [N, K], pair_scores [N, S-1, K, K]."""
        cand_ids, cand_feats = top_k_candidates(slot_logits, self.cfg.head.top_k, self.drafter.draft_to_target)
        out_vec, in_vec, anchor_out = self.head(cand_ids, cand_feats, slot_hidden, target_captured)
        anchor_scores, pair_scores = lattice.match_scores(anchor_out, out_vec, in_vec, self.cfg.head.sigma)
        return cand_ids, anchor_scores, pair_scores

    def propose(self, slot_hidden: torch.Tensor, target_captured: torch.Tensor, rule: str) -> Proposal:
        """Decode rule on one block per row. slot_hidden [N, S, H], target_captured [N, n, H]."""
        return self.propose_from_logits(slot_hidden, self.drafter.logits(slot_hidden), target_captured, rule)

    def propose_from_logits(self, slot_hidden: torch.Tensor, slot_logits: torch.Tensor,
                            target_captured: torch.Tensor, rule: str) -> Proposal:
        """slot_hidden [N, S, H], slot_logits [N, S, V] (V: the draft vocabulary's size when the
        drafter has one), target_captured [N, n, H] -> Proposal with target ids."""
        if rule not in ("lilicorr", "viterbi", "argmax"):
            raise ValueError(f"unknown decode rule {rule!r}; choose from lilicorr, viterbi, argmax")
        if rule == "argmax":
            cand_ids = torch.topk(slot_logits, self.cfg.head.top_k, dim=-1).indices  # [N, S, K]
            if self.drafter.draft_to_target is not None:
                cand_ids = self.drafter.draft_to_target[cand_ids]                   # target ids
            return Proposal(tokens=cand_ids[..., 0], cand_ids=cand_ids)
        if self.head is None:
            raise ValueError(f"rule {rule!r} needs a LiLiCorr head; this checkpoint is vanilla DFlash")
        cand_ids, anchor_scores, pair_scores = self.score_lattice(slot_hidden, slot_logits, target_captured)
        walk = lattice.greedy_walk if rule == "lilicorr" else lattice.viterbi
        idx = walk(anchor_scores, pair_scores)                                  # [N, S]
        tokens = torch.gather(cand_ids, -1, idx[..., None]).squeeze(-1)         # [N, S]
        return Proposal(tokens=tokens, cand_ids=cand_ids, anchor_scores=anchor_scores,
                        pair_scores=pair_scores)


def load_model(ckpt_dir, target, dtype: torch.dtype | None = None) -> LiLiCorrModel:
    """Drafter + head from a checkpoint directory, checked against the target; eval mode."""
    from lilicorr import checkpoint as ckpt_io

    cfg, fingerprint = ckpt_io.read_config(ckpt_dir)
    ckpt_io.check_target(ckpt_dir, fingerprint, target.config)
    model = LiLiCorrModel(cfg, target)
    state = ckpt_io.load_state_dict(ckpt_dir)
    dtype = dtype or target.embed_tokens.weight.dtype
    ckpt_io.load_into(model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()},
                      ckpt_dir)
    return model.to(dtype).eval().requires_grad_(False)


def untrained_model(target, preset_name: str = "cpu", seed: int = 0, vanilla: bool = False,
                    block_size: int | None = None) -> LiLiCorrModel:
    """A randomly initialised drafter + head for `target` (tests, lossless checks)."""
    from lilicorr.config import preset

    cfg = preset(preset_name)
    if block_size:
        cfg.drafter.block_size = block_size
    cfg.vanilla = vanilla
    cfg.drafter = cfg.drafter.for_target(target.config)
    torch.manual_seed(seed)
    model = LiLiCorrModel(cfg, target)
    return model.to(target.embed_tokens.weight.dtype).eval().requires_grad_(False)


def load_teacher_head(ckpt_dir, cfg: LiLiCorrConfig, target) -> LiLiCorrHead:
    """The LiLiCorr head of checkpoint `ckpt_dir`, frozen in float32, to distil into a head trained
    under `cfg` (lattice distillation). Its lattice must be the trained model's: the same block size
    and K (it scores the same candidates) and the same captured target layers (it reads the same
    target state); its width and depth may differ."""
    from lilicorr import checkpoint as ckpt_io

    teacher_cfg, fingerprint = ckpt_io.read_config(ckpt_dir)
    ckpt_io.check_target(ckpt_dir, fingerprint, target.config)
    if teacher_cfg.vanilla:
        raise ValueError(f"teacher {ckpt_dir} is a vanilla DFlash checkpoint: it has no head to distil")
    td, d = teacher_cfg.drafter, cfg.drafter
    mine = (d.block_size, cfg.head.top_k, d.num_target_layers_captured, d.hidden_size)
    theirs = (td.block_size, teacher_cfg.head.top_k, td.num_target_layers_captured, td.hidden_size)
    if mine != theirs:
        raise ValueError(f"teacher {ckpt_dir} scores another lattice: (block size, K, captured layers, hidden) "
                         f"{theirs} against this model's {mine}")
    head = LiLiCorrHead(teacher_cfg.head, target_hidden=td.hidden_size, num_captured=td.num_target_layers_captured,
                        block_size=td.block_size, embed=target.embed_tokens)
    prefix = "head."
    state = {k[len(prefix):]: v.float() for k, v in ckpt_io.load_state_dict(ckpt_dir).items() if k.startswith(prefix)}
    ckpt_io.load_into(head, state, ckpt_dir)
    return head.to(target.embed_tokens.weight.device).eval().requires_grad_(False)
