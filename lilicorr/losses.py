"""Training objectives: Eq. 6 (DFlash block CE), Eq. 3 (oracle-prefix CE), Eqs. 4-5 (target-weighted
distractor penalty), Eq. 13 (margin hinge), combined as Eq. 7 / Appendix G; and lattice distillation
from a teacher head (not in the paper).

Every term is returned as a (sum, count) pair so the trainer can normalise by the *global* count
across data-parallel ranks (token-pooled, like SpecForge), which makes a 2-process run equal a
1-process run with the same global batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lilicorr.config import LossConfig


@dataclass
class LossTerms:
    """Sums and counts of each term for one micro-batch (divide by global counts to get means)."""

    dflash_sum: torch.Tensor       # sum_s w_s * CE_s                 (Eq. 6 numerator)
    dflash_weight: torch.Tensor    # sum_s w_s
    ce_sum: torch.Tensor           # Eq. 3 numerator over oracle-prefix slots
    dist_sum: torch.Tensor         # Eq. 5 numerator
    margin_sum: torch.Tensor       # Eq. 13 numerator
    num_supervised: torch.Tensor   # |S|: oracle-prefix slots
    kd_sum: torch.Tensor | None = None     # lattice distillation numerator (None: no teacher)
    kd_rows: torch.Tensor | None = None    # its rows: blocks x (1 + (S-1) K)


def slot_decay(num_slots: int, beta: float, device=None) -> torch.Tensor:
    """w_s = exp(-(s-1)/beta) for s = 1..S (Eq. 6). beta <= 0 disables the decay."""
    s = torch.arange(num_slots, device=device, dtype=torch.float32)
    return torch.exp(-s / beta) if beta > 0 else torch.ones_like(s)


DFLASH_NORMS = ("token_mean", "sum")


def dflash_terms(slot_logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor,
                 beta: float, norm: str = "token_mean", soft_logprobs: torch.Tensor | None = None,
                 distill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6. slot_logits [N, S, V], labels [N, S] long (indices into V), label_mask [N, S] bool
    -> (sum, normaliser); the loss is sum / normaliser after the global all-reduce.

    Self-logit distillation: with soft_logprobs [N, S, V] (the target's log-distribution over the
    same V at each slot's position) and distill = a in (0, 1], a slot's CE is
    (1 - a) CE(label) + a H(p_target, p_draft), the cross-entropy against the soft labels.

    norm "token_mean" (SpecForge): normaliser = sum of the weights w_s over labelled slots, so the
    loss is a weighted mean per slot. norm "sum" (Eq. 6 as written): normaliser = number of blocks
    with a labelled slot, so the loss is the weighted sum over a block's slots, averaged over blocks.
    """
    if norm not in DFLASH_NORMS:
        raise ValueError(f"unknown L_DFlash normalisation {norm!r}; choose from {DFLASH_NORMS}")
    w = slot_decay(labels.shape[1], beta, labels.device)[None, :] * label_mask.float()   # [N, S]
    if not 0.0 <= distill <= 1.0:
        raise ValueError(f"distill must be in [0, 1], got {distill}")
    ce = F.cross_entropy(slot_logits.float().flatten(0, 1), labels.clamp_min(0).flatten(),
                         reduction="none").view_as(w)                                    # [N, S]
    if distill > 0:
        if soft_logprobs is None or soft_logprobs.shape != slot_logits.shape:
            raise ValueError("distill > 0 needs soft_logprobs shaped like slot_logits")
        logp = torch.log_softmax(slot_logits.float(), dim=-1)                            # [N, S, V]
        soft = -(soft_logprobs.float().exp() * logp).sum(-1)                             # [N, S]
        ce = (1 - distill) * ce + distill * soft
    normaliser = w.sum() if norm == "token_mean" else label_mask.any(1).float().sum()
    return (w * ce).sum(), normaliser


def oracle_prefix(cand_ids: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor):
    """The oracle prefix of §3.3: the leading run of slots whose ground truth is in the pool.

    cand_ids [N, S, K], labels [N, S], label_mask [N, S] bool
    returns prefix [N, S] bool, gt_index [N, S] long (index of the label in the pool, 0 if absent)
    """
    hit = cand_ids == labels[..., None]                                  # [N, S, K]
    covered = hit.any(-1) & label_mask                                   # [N, S]
    prefix = covered.long().cumprod(dim=1).bool()                        # [N, S]
    return prefix, hit.long().argmax(-1)


def teacher_forced_scores(anchor_scores: torch.Tensor, pair_scores: torch.Tensor,
                          gt_index: torch.Tensor) -> torch.Tensor:
    """z_s[k] = phi(s-1, g_{s-1}, k) (Eq. 2) with the ground-truth predecessor.

    anchor_scores [N, K], pair_scores [N, S-1, K, K], gt_index [N, S] -> z [N, S, K]
    """
    prev = gt_index[:, :-1, None, None].expand(-1, -1, 1, pair_scores.shape[-1])  # [N, S-1, 1, K]
    rows = torch.gather(pair_scores, 2, prev).squeeze(2)                           # [N, S-1, K]
    return torch.cat([anchor_scores[:, None, :], rows], dim=1)                     # [N, S, K]


def reranker_terms(z: torch.Tensor, gt_index: torch.Tensor, prefix: torch.Tensor,
                   cand_target_logq: torch.Tensor, rho: float):
    """Eq. 3, Eqs. 4-5 and Eq. 13 summed over the oracle prefix.

    z [N, S, K] teacher-forced scores, gt_index [N, S], prefix [N, S] bool,
    cand_target_logq [N, S, K] target log-probabilities of the candidates (teacher-forced pass).
    """
    mask = prefix.float()                                                       # [N, S]
    logp = torch.log_softmax(z.float(), dim=-1)                                 # [N, S, K]
    g = gt_index[..., None]                                                     # [N, S, 1]
    ce = -torch.gather(logp, -1, g).squeeze(-1)                                 # Eq. 3 [N, S]
    logq = cand_target_logq.float().detach()
    cost = F.relu(torch.gather(logq, -1, g) - logq)                             # relu(log q_g - log q_k)
    omega = (logp.exp() * cost).sum(-1)                                         # Eq. 4 [N, S]
    z_g = torch.gather(z.float(), -1, g).squeeze(-1)
    others = z.float().masked_fill(F.one_hot(gt_index, z.shape[-1]).bool(), float("-inf"))
    gap = z_g - others.max(-1).values                                           # Delta_s
    hinge = F.relu(rho - gap)                                                   # Eq. 13 [N, S]
    return (ce * mask).sum(), (omega * mask).sum(), (hinge * mask).sum(), mask.sum()


def lattice_distill_terms(anchor_scores: torch.Tensor, pair_scores: torch.Tensor,
                          teacher_anchor: torch.Tensor, teacher_pair: torch.Tensor,
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(teacher || student) of every row of the lattice's score distributions, T^2-scaled (Hinton).

    A row is the softmax over K candidates of one slot given where the walk stands: the anchor's
    row (Eq. 1 against the anchor vector) and, for each slot s < S and candidate k there, the row of
    phi(s, k, .) over slot s+1's candidates; the greedy walk reads one row per slot.
    anchor_scores / teacher_anchor [N, K], pair_scores / teacher_pair [N, S-1, K, K]
    -> (sum over rows, number of rows = N (1 + (S-1) K)).
    """
    if temperature <= 0:
        raise ValueError(f"distillation temperature must be > 0, got {temperature}")
    if anchor_scores.shape != teacher_anchor.shape or pair_scores.shape != teacher_pair.shape:
        raise ValueError(f"teacher lattice {tuple(teacher_pair.shape)} does not match the head's "
                         f"{tuple(pair_scores.shape)}")
    student = torch.cat([anchor_scores[:, None, :], pair_scores.flatten(1, 2)], 1).float()   # [N, R, K]
    teacher = torch.cat([teacher_anchor[:, None, :], teacher_pair.flatten(1, 2)], 1).float()
    logp_s = torch.log_softmax(student / temperature, -1)
    logp_t = torch.log_softmax(teacher.detach() / temperature, -1)
    kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)                                        # [N, R]
    return kl.sum() * temperature ** 2, kl.new_tensor(float(kl.numel()))


def combine(terms: LossTerms, cfg: LossConfig, counts: dict | None = None, vanilla: bool = False):
    """Eq. 7 (Appendix G with mu > 0): L_DFlash + gamma[(1-mu) L_CE + lambda L_dist + mu L_margin],
    plus gamma kappa L_KD inside the bracket when the terms carry lattice distillation.

    counts: optional global {'dflash_weight', 'num_supervised', 'kd_rows'} to normalise by (data parallel).
    Returns (loss, parts) with parts as floats for logging.
    """
    dw = (counts or {}).get("dflash_weight", terms.dflash_weight).clamp_min(1e-9)
    ns = (counts or {}).get("num_supervised", terms.num_supervised).clamp_min(1.0)
    l_dflash = terms.dflash_sum / dw
    parts = {"dflash": l_dflash}
    loss = l_dflash
    if not vanilla:
        l_ce, l_dist, l_margin = terms.ce_sum / ns, terms.dist_sum / ns, terms.margin_sum / ns
        if cfg.distractor:
            rerank = (1 - cfg.mu) * l_ce + cfg.lam * l_dist + cfg.mu * l_margin
        else:   # Appendix C ablation: lambda's share goes to the CE, the reranker's total weight stays
            rerank = (1 - cfg.mu + cfg.lam) * l_ce + cfg.mu * l_margin
        parts.update(ce=l_ce, dist=l_dist, margin=l_margin)
        if terms.kd_sum is not None:
            rows = (counts or {}).get("kd_rows", terms.kd_rows).clamp_min(1.0)
            parts["kd"] = l_kd = terms.kd_sum / rows
            rerank = rerank + cfg.head_distill * l_kd
        loss = loss + cfg.gamma * rerank
    parts["total"] = loss
    return loss, {k: float(v.detach()) for k, v in parts.items()}
