"""Joint training forward pass (paper §3.3-3.4, DESIGN.md §4): data, anchors, losses, metrics.

One pass per batch of sequences: the frozen target runs teacher-forced once (captured layers +
final hidden), `num_anchors` random anchor blocks per sequence are drafted together under a block
attention mask (SpecForge style), and every loss term is computed on the same pass.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lilicorr import lattice
from lilicorr.drafter import block_attention_mask
from lilicorr.head import top_k_candidates
from lilicorr.losses import (LossTerms, dflash_terms, lattice_distill_terms, oracle_prefix, reranker_terms,
                             teacher_forced_scores)
from lilicorr.model import LiLiCorrModel


# -- data ----------------------------------------------------------------------------------------
@dataclass
class Sequence:
    ids: list[int]          # prompt + completion
    loss_mask: list[int]    # 1 on completion tokens


def load_sequences(paths, seq_len: int) -> list[Sequence]:
    """Read regenerated JSONL (`prompt_ids`, `completion_ids`), truncated to seq_len. `paths` is one
    file or a list of files (e.g. one per regen shard), concatenated in order."""
    paths = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    out = []
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"training data {path} does not exist (make it with train/regen.py)")
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    p, c = list(rec["prompt_ids"]), list(rec["completion_ids"])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{lineno}: not a regenerated record ({e})") from e
                ids = (p + c)[:seq_len]
                mask = ([0] * len(p) + [1] * len(c))[:seq_len]
                if sum(mask) >= 2:
                    out.append(Sequence(ids, mask))
    if not out:
        raise ValueError(f"{', '.join(map(str, paths))} hold no sequence with at least 2 completion tokens")
    return out


def collate(seqs: list[Sequence], pad_id: int):
    """Right-pad -> ids [N, T] long, loss_mask [N, T] bool, lengths [N] long."""
    t = max(len(s.ids) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s.ids)] = torch.tensor(s.ids)
        mask[i, : len(s.ids)] = torch.tensor(s.loss_mask, dtype=torch.bool)
    return ids, mask, torch.tensor([len(s.ids) for s in seqs])


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generators: list[torch.Generator]):
    """Anchors p with loss_mask[p] and loss_mask[p+1] and p >= 1 (the head reads the target state
    at p-1), drawn uniformly without replacement per row, sorted.

    loss_mask [N, T] bool -> anchors [N, A] long, valid [N, A] bool (A = min(num_anchors, max count))
    """
    n, t = loss_mask.shape
    ok = torch.zeros_like(loss_mask)
    ok[:, 1:-1] = loss_mask[:, 1:-1] & loss_mask[:, 2:]
    width = max(1, min(num_anchors, int(ok.sum(1).max())))
    anchors = torch.zeros(n, width, dtype=torch.long)
    valid = torch.zeros(n, width, dtype=torch.bool)
    for i in range(n):
        cand = ok[i].nonzero().flatten()
        if len(cand) == 0:
            continue
        pick = cand[torch.randperm(len(cand), generator=generators[i])[:width]].sort().values
        anchors[i, : len(pick)] = pick
        valid[i, : len(pick)] = True
    return anchors, valid


# -- forward -------------------------------------------------------------------------------------
@dataclass
class StepOutput:
    terms: LossTerms
    metrics: dict[str, torch.Tensor]   # sums to all-reduce: see `summarize_metrics`


def training_forward(model: LiLiCorrModel, target, ids: torch.Tensor, loss_mask: torch.Tensor,
                     anchors: torch.Tensor, valid: torch.Tensor,
                     features: tuple[torch.Tensor, ...] | None = None,
                     teacher_head=None) -> StepOutput:
    """ids/loss_mask [N, T], anchors/valid [N, A] -> loss terms and metric sums.

    teacher_head: a frozen LiLiCorrHead (`model.load_teacher_head`) whose lattice scores the head is
    distilled towards (cfg.loss.head_distill); it reads the same candidates and states.

    features: precomputed (captured [N, T, n, H], last_hidden [N, T, H][, target_lse [N, T]]) from a
    FeatureStore; None runs the frozen target here. With target_lse (the log-normaliser of the
    target's logits) q_k needs K dot products instead of the full-vocabulary LM head. Inputs must be
    on the model's device (the trainer moves them)."""
    cfg = model.cfg
    dev = ids.device
    b, s, k = cfg.drafter.block_size, cfg.drafter.block_size - 1, cfg.head.top_k
    n, t = ids.shape
    a = anchors.shape[1]
    positions = torch.arange(t, device=dev).expand(n, t)
    if features is None:
        with torch.no_grad():
            tout = target(ids, positions, capture=cfg.drafter.target_layer_ids, logits=False)
        features = (tout.captured, tout.last_hidden)
    captured, last_hidden = features[:2]                                 # [N, T, n, H], [N, T, H]
    target_lse = features[2] if len(features) > 2 else None              # [N, T] or None

    drafter = model.drafter
    ctx_kv = drafter.context_kv(drafter.project_context(captured), positions)
    block_emb = drafter.block_embeddings(ids.gather(1, anchors), b)      # [N, A*B, H]
    offs = torch.arange(b, device=dev)
    block_pos = (anchors[:, :, None] + offs).reshape(n, a * b)           # [N, A*B]
    mask = block_attention_mask(anchors, valid, t, b)
    hidden = drafter(block_emb, block_pos, ctx_kv, mask)                 # [N, A*B, H]

    sel = valid.flatten()                                                # keep real blocks only
    hidden = hidden.view(n * a, b, -1)[sel]                              # [M, B, H]
    rows = torch.arange(n, device=dev)[:, None].expand(n, a).flatten()[sel]  # [M] sequence of each block
    anc = anchors.flatten()[sel]                                         # [M]
    label_pos = anc[:, None] + offs[None, 1:]                            # [M, S] positions a+1..a+S
    in_range = label_pos < t
    label_pos = label_pos.clamp_max(t - 1)
    labels = ids[rows[:, None], label_pos]                               # [M, S]
    label_mask = in_range & loss_mask[rows[:, None], label_pos]          # [M, S]

    slot_hidden = hidden[:, 1:].contiguous()                             # [M, S, H]
    slot_logits = drafter.logits(slot_hidden)                            # [M, S, V] (V: draft vocab)
    if drafter.draft_to_target is None:
        draft_labels, draft_mask = labels, label_mask
    else:                                  # labels outside the draft vocabulary carry no CE (EAGLE-3)
        draft_labels = drafter.target_to_draft()[labels]                 # [M, S], -1 if absent
        draft_mask = label_mask & (draft_labels >= 0)
    h_prev = None                                # [M, S, H] the target's state before each label
    if cfg.loss.distill > 0 or model.head is not None:
        h_prev = last_hidden[rows[:, None], label_pos - 1].detach()
    soft = None
    if cfg.loss.distill > 0:                     # the target's own distribution over the same rows
        with torch.no_grad():
            w = drafter.lm_weight()
            soft = torch.log_softmax(F.linear(h_prev.to(w.dtype), w).float(), -1)  # [M, S, V]
    dflash_sum, dflash_w = dflash_terms(slot_logits, draft_labels, draft_mask, cfg.loss.beta,
                                        cfg.loss.dflash_norm, soft, cfg.loss.distill)

    cand_ids, cand_feats = top_k_candidates(slot_logits, k, drafter.draft_to_target)  # target ids
    prefix, gt_index = oracle_prefix(cand_ids, labels, label_mask)       # [M, S]
    zero = slot_logits.new_zeros(())
    ce_sum = dist_sum = margin_sum = zero
    kd_sum = kd_rows = None
    metrics = {
        "blocks": torch.tensor(float(len(anc)), device=dev),
        "label_slots": label_mask.float().sum(0),                                    # [S]
        "top1_hits": ((cand_ids[..., 0] == labels) & label_mask).float().sum(0),     # [S]
        "topk_hits": ((cand_ids == labels[..., None]).any(-1) & label_mask).float().sum(0),
        "oracle_prefix_len": prefix.float().sum(),
        "argmax_accept": _accepted_prefix(cand_ids[..., 0], labels, label_mask).float().sum(),
    }
    if model.head is not None:
        out_vec, in_vec, anchor_out = model.head(cand_ids, cand_feats, slot_hidden,
                                                 captured[rows, anc - 1])          # state at p-1
        anchor_scores, pair_scores = lattice.match_scores(anchor_out, out_vec, in_vec, cfg.head.sigma)
        z = teacher_forced_scores(anchor_scores, pair_scores, gt_index)           # [M, S, K]
        with torch.no_grad():                                            # q_k of Eq. 4: target logits
            if target_lse is None:
                tgt_logits = target.lm_head(h_prev).float()                   # [M, S, V]
                cand_logq = torch.gather(torch.log_softmax(tgt_logits, -1), -1, cand_ids)  # [M, S, K]
            else:                                                        # log q_k = w_k . h - logsumexp
                w = target.lm_head.weight[cand_ids].float()                  # [M, S, K, H]
                cand_logq = (torch.einsum("mskh,msh->msk", w, h_prev.float())
                             - target_lse[rows[:, None], label_pos - 1][..., None])        # [M, S, K]
        ce_sum, dist_sum, margin_sum, _ = reranker_terms(z, gt_index, prefix, cand_logq, cfg.loss.rho)
        if teacher_head is not None:
            with torch.no_grad():
                t_out, t_in, t_anchor = teacher_head(cand_ids, cand_feats, slot_hidden, captured[rows, anc - 1])
                t_anchor_scores, t_pair_scores = lattice.match_scores(t_anchor, t_out, t_in,
                                                                      teacher_head.cfg.sigma)
            kd_sum, kd_rows = lattice_distill_terms(anchor_scores, pair_scores, t_anchor_scores, t_pair_scores,
                                                    cfg.loss.head_distill_temperature)
        with torch.no_grad():
            walk = lattice.greedy_walk(anchor_scores, pair_scores)
            drafted = torch.gather(cand_ids, -1, walk[..., None]).squeeze(-1)
            metrics["lilicorr_accept"] = _accepted_prefix(drafted, labels, label_mask).float().sum()
    terms = LossTerms(dflash_sum, dflash_w, ce_sum, dist_sum, margin_sum, prefix.float().sum(), kd_sum, kd_rows)
    return StepOutput(terms, metrics)


def _accepted_prefix(drafted: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """Length of the leading run where the draft equals the label, per block: [M]."""
    return ((drafted == labels) & label_mask).long().cumprod(1).sum(1)


def summarize_metrics(m: dict[str, torch.Tensor]) -> dict:
    """Turn (all-reduced) metric sums into readable rates."""
    blocks = max(float(m["blocks"]), 1.0)
    slots = m["label_slots"].clamp_min(1.0)
    out = {
        "oracle_coverage": float(m["oracle_prefix_len"]) / blocks,       # mean oracle prefix length
        "tau_argmax": 1.0 + float(m["argmax_accept"]) / blocks,          # teacher-forced estimate
        "top1_acc": (m["top1_hits"] / slots).tolist(),
        "topk_acc": (m["topk_hits"] / slots).tolist(),
    }
    if "lilicorr_accept" in m:
        out["tau_lilicorr"] = 1.0 + float(m["lilicorr_accept"]) / blocks
    return out
