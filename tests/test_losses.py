"""Loss properties (paper §3.3-3.4, Appendices D and G; issue 2).

Eq. 9 (distractor penalty shares its gradient with a target cross-entropy over the pool when the
ground truth is the target's top candidate), the rectifier, oracle-prefix masking, Eq. 6 decay,
Eq. 13 hinge, Eq. 7 / Appendix G blend, and the stop-gradient through the top-K indices while the
reranker terms still reach the drafter.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lilicorr import lattice
from lilicorr.config import DrafterConfig, HeadConfig, LiLiCorrConfig, LossConfig, TrainConfig
from lilicorr.head import top_k_candidates
from lilicorr.losses import (LossTerms, combine, dflash_terms, lattice_distill_terms, oracle_prefix,
                             reranker_terms, slot_decay, teacher_forced_scores)


def _logq_with_gt_on_top(n, s, k, gt_index, gen):
    """Target log-probabilities of the pool where the ground truth is the most likely candidate."""
    logq = torch.log_softmax(torch.randn(n, s, k, generator=gen) * 2.0, dim=-1) - 1.0
    top = logq.max(-1, keepdim=True).values
    return logq.scatter(-1, gt_index[..., None], top + 0.5)


# -- Eq. 9 / Appendix D ------------------------------------------------------------------------
def test_eq9_gradient_identity_when_ground_truth_is_target_top():
    gen = torch.Generator().manual_seed(0)
    n, s, k = 3, 4, 6
    z = (torch.randn(n, s, k, generator=gen) * 3).requires_grad_(True)
    gt = torch.randint(0, k, (n, s), generator=gen)
    logq = _logq_with_gt_on_top(n, s, k, gt, gen)
    prefix = torch.ones(n, s, dtype=torch.bool)

    _, dist_sum, _, count = reranker_terms(z, gt, prefix, logq, rho=2.0)
    (g_omega,) = torch.autograd.grad(dist_sum, z)

    p = torch.softmax(z, -1)
    cost = -logq                                                     # c_k = -log q_k
    h = (p * cost).sum(-1)                                           # H(P_theta, q) per slot
    (g_h,) = torch.autograd.grad(h.sum(), z)

    assert count.item() == n * s
    torch.testing.assert_close(g_omega, g_h, rtol=1e-5, atol=1e-6)
    # and Omega = H - c_g exactly (the rectifier is inactive)
    c_g = torch.gather(cost, -1, gt[..., None]).squeeze(-1)
    torch.testing.assert_close(dist_sum.detach(), (h - c_g).sum().detach(), rtol=1e-5, atol=1e-5)
    # Appendix D: only cost differences matter, so renormalising q over the pool changes nothing
    logq_pool = torch.log_softmax(logq, -1)
    _, dist_pool, _, _ = reranker_terms(z, gt, prefix, logq_pool, rho=2.0)
    torch.testing.assert_close(dist_pool, dist_sum, rtol=1e-5, atol=1e-5)


def test_rectifier_clips_candidates_the_target_ranks_above_ground_truth():
    gen = torch.Generator().manual_seed(1)
    k = 5
    z = torch.randn(1, 1, k, generator=gen).requires_grad_(True)
    gt = torch.tensor([[2]])
    #          cand:   0     1     2(g)   3     4
    logq = torch.tensor([[[-0.5, -3.0, -1.0, -0.2, -4.0]]])          # 0 and 3 are above g
    prefix = torch.ones(1, 1, dtype=torch.bool)
    _, omega, _, _ = reranker_terms(z, gt, prefix, logq, rho=2.0)
    (g_omega,) = torch.autograd.grad(omega, z)

    p = torch.softmax(z.detach(), -1)[0, 0]
    w = torch.tensor([0.0, 2.0, 0.0, 0.0, 3.0])                      # relu(log q_g - log q_k)
    assert omega.item() >= 0.0
    assert omega.item() == pytest.approx(float((p * w).sum()), rel=1e-6)

    # the unclipped form H - c_g would reward candidates 0 and 3 (negative costs): different value
    # and different gradient
    zz = z.detach().clone().requires_grad_(True)
    unclipped = (torch.softmax(zz, -1) * (logq[..., 2:3] - logq)).sum()
    (g_unclipped,) = torch.autograd.grad(unclipped, zz)
    assert unclipped.item() < omega.item()
    assert not torch.allclose(g_omega, g_unclipped, atol=1e-4)

    # zero cost above g: raising the target's preference for them further changes nothing
    logq2 = logq.clone()
    logq2[..., 0], logq2[..., 3] = -0.01, -0.05
    _, omega2, _, _ = reranker_terms(z, gt, prefix, logq2, rho=2.0)
    assert omega2.item() == pytest.approx(omega.item(), rel=1e-6)

    # Eq. 10 and Eq. 11 on the ground-truth logit
    ce, _, _, _ = reranker_terms(z, gt, prefix, logq, rho=2.0)
    (g_ce,) = torch.autograd.grad(ce, z)
    assert g_ce[0, 0, 2].item() == pytest.approx(p[2].item() - 1.0, abs=1e-6)
    assert g_omega[0, 0, 2].item() == pytest.approx(-p[2].item() * float((p * w).sum()), abs=1e-6)


def test_omega_is_nonnegative_and_zero_at_a_committed_ground_truth():
    gen = torch.Generator().manual_seed(2)
    n, s, k = 4, 3, 5
    gt = torch.randint(0, k, (n, s), generator=gen)
    logq = torch.log_softmax(torch.randn(n, s, k, generator=gen), -1)   # g not necessarily on top
    prefix = torch.ones(n, s, dtype=torch.bool)
    for _ in range(5):
        z = torch.randn(n, s, k, generator=gen) * 4
        _, omega, _, _ = reranker_terms(z, gt, prefix, logq, rho=2.0)
        assert omega.item() >= 0.0
    # all mass on g: no cost at all (the minimising vertex of the linear objective)
    z = F.one_hot(gt, k).float() * 1e4
    _, omega, _, _ = reranker_terms(z, gt, prefix, logq, rho=2.0)
    assert omega.item() == pytest.approx(0.0, abs=1e-6)


# -- oracle prefix -----------------------------------------------------------------------------
def _prefix_case():
    # 3 blocks, S = 4 slots, K = 3 candidates
    cand = torch.tensor([
        [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2, 3]],                 # block 0: slot 1 misses
        [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2, 3]],                 # block 1: hit hit miss hit
        [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 2, 3]],                 # block 2: hit hit hit (masked)
    ])
    labels = torch.tensor([[9, 4, 7, 1], [3, 5, 1, 2], [2, 6, 8, 3]])
    label_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    return cand, labels, label_mask


def test_oracle_prefix_is_leading_run_of_covered_slots():
    cand, labels, label_mask = _prefix_case()
    prefix, gt = oracle_prefix(cand, labels, label_mask)
    assert prefix.tolist() == [[False] * 4, [True, True, False, False], [True, True, True, False]]
    assert gt[1, :2].tolist() == [2, 1] and gt[2, :3].tolist() == [1, 2, 1]
    assert prefix.dtype == torch.bool


def test_oracle_prefix_masks_ce_distractor_and_margin():
    cand, labels, label_mask = _prefix_case()
    prefix, gt = oracle_prefix(cand, labels, label_mask)
    gen = torch.Generator().manual_seed(3)
    z = (torch.randn(3, 4, 3, generator=gen) * 3).requires_grad_(True)
    logq = torch.log_softmax(torch.randn(3, 4, 3, generator=gen) * 3, -1)

    ce, dist, margin, count = reranker_terms(z, gt, prefix, logq, rho=50.0)   # hinge active everywhere
    assert count.item() == 2 + 3
    g = torch.autograd.grad(ce + dist + margin, z)[0]
    assert torch.all(g[0] == 0)                           # first slot missed: whole block contributes 0
    assert torch.all(g[1, 2:] == 0)                       # after the first miss: nothing
    assert torch.all(g[2, 3:] == 0)                       # label_mask False counts as a miss
    assert g[1, :2].abs().sum() > 0 and g[2, :3].abs().sum() > 0

    # block 0 alone contributes exactly zero to all three terms and to |S|
    terms0 = reranker_terms(z[:1], gt[:1], prefix[:1], logq[:1], rho=50.0)
    assert all(t.item() == 0.0 for t in terms0)
    # changing scores outside the prefix changes nothing
    z2 = z.detach().clone()
    z2[0] += 5 * torch.randn(4, 3, generator=gen)
    z2[1, 2:] -= 7.0
    z2[2, 3] += 11.0
    again = reranker_terms(z2, gt, prefix, logq, rho=50.0)
    for a, b in zip(again, (ce, dist, margin, count)):
        assert a.item() == pytest.approx(b.item(), rel=1e-6)
    # the per-slot CE on the supervised slots is Eq. 3
    logp = torch.log_softmax(z.detach(), -1)
    want = -sum(logp[b, s, gt[b, s]] for b, s in [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2)])
    assert ce.item() == pytest.approx(want.item(), rel=1e-5)


def test_combine_with_no_supervised_slot_is_the_dflash_loss():
    terms = LossTerms(torch.tensor(3.0), torch.tensor(2.0), torch.tensor(0.0), torch.tensor(0.0),
                      torch.tensor(0.0), torch.tensor(0.0))
    loss, parts = combine(terms, LossConfig())
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(1.5)
    assert parts["ce"] == parts["dist"] == parts["margin"] == 0.0


def test_lattice_distillation_is_the_kl_of_every_row():
    gen = torch.Generator().manual_seed(6)
    n, s, k = 3, 4, 5
    anchor, pair = torch.randn(n, k, generator=gen), torch.randn(n, s - 1, k, k, generator=gen)
    t_anchor, t_pair = torch.randn(n, k, generator=gen), torch.randn(n, s - 1, k, k, generator=gen)
    total, rows = lattice_distill_terms(anchor, pair, t_anchor, t_pair)
    assert rows.item() == n * (1 + (s - 1) * k)

    def kl(student_row, teacher_row, temp=1.0):
        p = torch.softmax(teacher_row / temp, -1)
        return (p * (torch.log_softmax(teacher_row / temp, -1) - torch.log_softmax(student_row / temp, -1))).sum()

    want = sum(kl(anchor[b], t_anchor[b]) for b in range(n)) + sum(
        kl(pair[b, j, i], t_pair[b, j, i]) for b in range(n) for j in range(s - 1) for i in range(k))
    assert total.item() == pytest.approx(want.item(), rel=1e-5)
    hot, _ = lattice_distill_terms(anchor, pair, t_anchor, t_pair, temperature=2.0)     # T^2 scaled
    want2 = 4 * (sum(kl(anchor[b], t_anchor[b], 2.0) for b in range(n)) + sum(
        kl(pair[b, j, i], t_pair[b, j, i], 2.0) for b in range(n) for j in range(s - 1) for i in range(k)))
    assert hot.item() == pytest.approx(want2.item(), rel=1e-5)
    # zero against itself, and a shift of a row (softmax-invariant) changes nothing
    same, _ = lattice_distill_terms(t_anchor + 3.0, t_pair - 1.5, t_anchor, t_pair)
    assert abs(same.item()) < 1e-5
    # the gradient reaches the student only, and a step along it lowers the KL
    a, p = anchor.clone().requires_grad_(), pair.clone().requires_grad_()
    ta = t_anchor.clone().requires_grad_()
    loss, _ = lattice_distill_terms(a, p, ta, t_pair)
    loss.backward()
    assert ta.grad is None and a.grad.abs().sum() > 0 and p.grad.abs().sum() > 0
    after, _ = lattice_distill_terms(a - 0.1 * a.grad, p - 0.1 * p.grad, t_anchor, t_pair)
    assert after.item() < loss.item()
    with pytest.raises(ValueError, match="does not match"):
        lattice_distill_terms(anchor, pair[:, :, :, :-1], t_anchor, t_pair)
    with pytest.raises(ValueError, match="temperature"):
        lattice_distill_terms(anchor, pair, t_anchor, t_pair, temperature=0.0)


def test_combine_adds_lattice_distillation_inside_gamma():
    base = [torch.tensor(3.0), torch.tensor(2.0), torch.tensor(4.0), torch.tensor(2.0), torch.tensor(0.0),
            torch.tensor(2.0)]
    cfg = LossConfig(gamma=0.5, lam=1.0, head_distill=3.0)
    without, _ = combine(LossTerms(*base), cfg)
    loss, parts = combine(LossTerms(*base, kd_sum=torch.tensor(6.0), kd_rows=torch.tensor(12.0)), cfg)
    assert parts["kd"] == pytest.approx(0.5)
    assert loss.item() == pytest.approx(without.item() + 0.5 * 3.0 * 0.5)
    # the global row count (data parallel) normalises instead of the local one
    loss2, parts2 = combine(LossTerms(*base, kd_sum=torch.tensor(6.0), kd_rows=torch.tensor(12.0)), cfg,
                            {"dflash_weight": torch.tensor(2.0), "num_supervised": torch.tensor(2.0),
                             "kd_rows": torch.tensor(24.0)})
    assert parts2["kd"] == pytest.approx(0.25)


def test_teacher_forced_scores_condition_on_ground_truth_predecessor():
    gen = torch.Generator().manual_seed(4)
    n, s, k = 2, 4, 3
    anchor = torch.randn(n, k, generator=gen)
    pair = torch.randn(n, s - 1, k, k, generator=gen)
    gt = torch.randint(0, k, (n, s), generator=gen)
    z = teacher_forced_scores(anchor, pair, gt)
    assert z.shape == (n, s, k)
    torch.testing.assert_close(z[:, 0], anchor)
    for b in range(n):
        for j in range(1, s):
            torch.testing.assert_close(z[b, j], pair[b, j - 1, gt[b, j - 1]])


# -- Eq. 6 -------------------------------------------------------------------------------------
def test_eq6_decay_weights():
    w = slot_decay(15, 7.0)
    want = torch.tensor([math.exp(-(s - 1) / 7.0) for s in range(1, 16)])
    torch.testing.assert_close(w, want)
    assert w[0].item() == 1.0 and torch.all(w[1:] < w[:-1])
    assert torch.equal(slot_decay(4, 0.0), torch.ones(4))            # beta <= 0: no decay

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 4), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    total, weight = dflash_terms(logits, labels, mask, beta=2.0)
    ws = [math.exp(-s / 2.0) for s in range(4)]
    logp = torch.log_softmax(logits, -1)
    want = sum(-ws[s] * logp[b, s, labels[b, s]] for b in range(2) for s in range(4) if mask[b, s])
    assert total.item() == pytest.approx(float(want), rel=1e-5)
    assert weight.item() == pytest.approx(sum(ws) + ws[0] + ws[1], rel=1e-6)
    # Eq. 6 as written: the same weighted sum, normalised by the number of labelled blocks
    total_sum, blocks = dflash_terms(logits, labels, mask, beta=2.0, norm="sum")
    assert total_sum.item() == pytest.approx(total.item()) and blocks.item() == 2.0
    labels_none = torch.zeros(1, 4, dtype=torch.bool)
    assert dflash_terms(logits[:1], labels[:1], labels_none, 2.0, "sum")[1].item() == 0.0
    with pytest.raises(ValueError, match="normalisation"):
        dflash_terms(logits, labels, mask, beta=2.0, norm="mean")


def test_self_distillation_blends_soft_labels_into_the_dflash_ce():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 4, 11, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (2, 4), generator=gen)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    hard, weight = dflash_terms(logits, labels, mask, beta=2.0)
    # one-hot soft labels are the hard labels
    one_hot = torch.log(torch.nn.functional.one_hot(labels, 11).float())
    same, same_w = dflash_terms(logits, labels, mask, 2.0, soft_logprobs=one_hot, distill=1.0)
    assert same.item() == pytest.approx(hard.item(), rel=1e-6) and same_w.item() == weight.item()
    # a blend is (1 - a) hard + a soft, slot by slot under the same decay weights
    target_logp = torch.log_softmax(torch.randn(2, 4, 11, generator=gen), -1)
    soft_only, _ = dflash_terms(logits, labels, mask, 2.0, soft_logprobs=target_logp, distill=1.0)
    blend, _ = dflash_terms(logits, labels, mask, 2.0, soft_logprobs=target_logp, distill=0.25)
    assert blend.item() == pytest.approx(0.75 * hard.item() + 0.25 * soft_only.item(), rel=1e-5)
    ws = [math.exp(-s / 2.0) for s in range(4)]
    logp = torch.log_softmax(logits.detach(), -1)
    want = sum(-ws[s] * (target_logp[b, s].exp() * logp[b, s]).sum() for b in range(2) for s in range(4) if mask[b, s])
    assert soft_only.item() == pytest.approx(float(want), rel=1e-5)
    # the soft CE is smallest where the draft's distribution is the target's: zero gradient there
    matched = logits.detach().clone().requires_grad_(True)
    loss, _ = dflash_terms(matched, labels, mask, 2.0, soft_logprobs=torch.log_softmax(matched.detach(), -1),
                           distill=1.0)
    (grad,) = torch.autograd.grad(loss, matched)
    assert grad.abs().max().item() < 1e-6
    with pytest.raises(ValueError, match="soft_logprobs"):
        dflash_terms(logits, labels, mask, 2.0, distill=0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dflash_terms(logits, labels, mask, 2.0, soft_logprobs=target_logp, distill=1.5)


# -- Eq. 13 ------------------------------------------------------------------------------------
def test_eq13_hinge_inactive_once_gap_clears_rho():
    gt = torch.tensor([[0, 1]])
    prefix = torch.ones(1, 2, dtype=torch.bool)
    logq = torch.zeros(1, 2, 3)
    # slot 1: gap 3 > rho = 2 (inactive); slot 2: gap 0.5 (active, 1.5)
    z = torch.tensor([[[4.0, 1.0, 0.5], [0.0, 1.0, 0.5]]], requires_grad=True)
    _, _, margin, _ = reranker_terms(z, gt, prefix, logq, rho=2.0)
    assert margin.item() == pytest.approx(1.5)
    (g,) = torch.autograd.grad(margin, z)
    assert torch.all(g[0, 0] == 0)                                   # settled slot: no gradient
    assert g[0, 1].tolist() == pytest.approx([0.0, -1.0, 1.0])       # on z_g and the runner-up
    z_far = torch.tensor([[[9.0, 1.0, 0.5], [0.0, 5.0, 0.5]]], requires_grad=True)
    _, _, margin, _ = reranker_terms(z_far, gt, prefix, logq, rho=2.0)
    assert margin.item() == 0.0
    assert torch.all(torch.autograd.grad(margin, z_far)[0] == 0)


# -- Eq. 7 / Appendix G ------------------------------------------------------------------------
def _terms():
    t = lambda v: torch.tensor(float(v))  # noqa: E731
    return LossTerms(dflash_sum=t(6.0), dflash_weight=t(3.0), ce_sum=t(8.0), dist_sum=t(4.0),
                     margin_sum=t(12.0), num_supervised=t(4.0))


def test_combine_matches_eq7_and_appendix_g():
    d, ce, dist, margin = 2.0, 2.0, 1.0, 3.0
    loss, parts = combine(_terms(), LossConfig(gamma=0.25, lam=1.0, mu=0.0))
    assert loss.item() == pytest.approx(d + 0.25 * (ce + 1.0 * dist))            # Eq. 7
    assert parts == pytest.approx({"dflash": d, "ce": ce, "dist": dist, "margin": margin,
                                   "total": loss.item()})
    loss, _ = combine(_terms(), LossConfig(gamma=0.5, lam=0.7, mu=0.0))
    assert loss.item() == pytest.approx(d + 0.5 * (ce + 0.7 * dist))
    loss, _ = combine(_terms(), LossConfig(gamma=0.25, lam=1.0, mu=0.5, rho=2.0))   # Appendix G
    assert loss.item() == pytest.approx(d + 0.25 * (0.5 * ce + 1.0 * dist + 0.5 * margin))
    # Appendix C: L_dist dropped, its weight lambda moves to the CE (the reranker keeps its total)
    loss, _ = combine(_terms(), LossConfig(gamma=0.25, lam=1.0, distractor=False))
    assert loss.item() == pytest.approx(d + 0.25 * (1.0 + 1.0) * ce)
    loss, _ = combine(_terms(), LossConfig(gamma=0.25, lam=0.7, mu=0.5, distractor=False))
    assert loss.item() == pytest.approx(d + 0.25 * ((0.5 + 0.7) * ce + 0.5 * margin))
    loss, parts = combine(_terms(), LossConfig(), vanilla=True)
    assert loss.item() == pytest.approx(d) and set(parts) == {"dflash", "total"}
    # global normalisation: counts from all ranks replace the local ones
    loss, _ = combine(_terms(), LossConfig(gamma=0.25),
                      {"dflash_weight": torch.tensor(6.0), "num_supervised": torch.tensor(8.0)})
    assert loss.item() == pytest.approx(1.0 + 0.25 * (1.0 + 0.5))


# -- stop-gradient through top-K, gradients into the drafter -----------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    from lilicorr.model import LiLiCorrModel
    from lilicorr.target import load_target

    target = load_target(tiny_target_dir("llama"))
    cfg = LiLiCorrConfig(
        drafter=DrafterConfig(num_layers=1, block_size=5, target_layer_ids=[0, 2]),
        # a wide pool (48 of 96 tokens) so an untrained drafter covers the first slots of most blocks
        head=HeadConfig(top_k=48, width=32, num_layers=1, num_heads=2, ffn_width=64, embed_dim=16),
        loss=LossConfig(mu=0.5), train=TrainConfig(num_anchors=6))
    cfg.drafter = cfg.drafter.for_target(target.config)
    torch.manual_seed(0)
    return target, LiLiCorrModel(cfg, target)


def test_reranker_terms_alone_reach_the_drafter(tiny):
    from lilicorr.training import sample_anchors, training_forward

    target, model = tiny
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(4, target.config.vocab_size, (2, 24), generator=gen)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :3] = False
    anchors, valid = sample_anchors(mask, 6, [torch.Generator().manual_seed(i) for i in range(2)])
    model.zero_grad(set_to_none=True)
    out = training_forward(model, target, ids, mask, anchors, valid)
    t = out.terms
    assert t.num_supervised.item() > 0
    (t.ce_sum + t.dist_sum + t.margin_sum).backward()                 # no DFlash term at all
    drafter_grads = {n: p.grad for n, p in model.drafter.named_parameters()}
    for name in ("fc.weight", "norm.weight", "layers.0.q_proj.weight", "layers.0.down_proj.weight"):
        assert drafter_grads[name] is not None and drafter_grads[name].abs().sum() > 0, name
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for n, p in model.head.named_parameters() if n.startswith(("out_head", "in_head", "fuse")))
    # the frozen target got nothing
    assert all(p.grad is None for p in target.parameters())


def test_topk_indices_are_detached_and_both_paths_carry_gradient(tiny):
    target, model = tiny
    head, drafter = model.head, model.drafter
    gen = torch.Generator().manual_seed(7)
    n, s, h = 3, 4, target.config.hidden_size
    slot_hidden = torch.randn(n, s, h, generator=gen).requires_grad_(True)
    state = torch.randn(n, 2, h, generator=gen)

    def loss_from(feats, hid, cand):
        out_vec, in_vec, anchor_out = head(cand, feats, hid, state)
        a, p = lattice.match_scores(anchor_out, out_vec, in_vec, model.cfg.head.sigma)
        gt_index = torch.zeros(n, s, dtype=torch.long)           # supervise rank 1 everywhere
        z = teacher_forced_scores(a, p, gt_index)
        logq = torch.log_softmax(torch.randn(n, s, cand.shape[-1], generator=gen), -1)
        ce, dist, margin, _ = reranker_terms(z, gt_index, torch.ones(n, s, dtype=torch.bool), logq, 2.0)
        return ce + dist + margin

    logits = drafter.logits(slot_hidden)
    cand_ids, feats = top_k_candidates(logits, model.cfg.head.top_k)
    assert cand_ids.dtype == torch.long and not cand_ids.requires_grad
    assert torch.equal(cand_ids, torch.topk(logits.detach(), model.cfg.head.top_k, -1).indices)
    assert feats.requires_grad and feats.shape == (n, s, model.cfg.head.top_k, 5)

    # path 1: through the candidates' log-probabilities only (hidden states detached at the head)
    (g1,) = torch.autograd.grad(loss_from(feats, slot_hidden.detach(), cand_ids), slot_hidden)
    assert g1.abs().sum() > 0
    # path 2: through the slot hidden states only (confidence features detached)
    logits = drafter.logits(slot_hidden)
    cand_ids, feats = top_k_candidates(logits, model.cfg.head.top_k)
    (g2,) = torch.autograd.grad(loss_from(feats.detach(), slot_hidden, cand_ids), slot_hidden)
    assert g2.abs().sum() > 0
    # nothing else: with both detached the loss does not depend on slot_hidden at all
    loss = loss_from(feats.detach(), slot_hidden.detach(), cand_ids)
    assert not loss.requires_grad or torch.autograd.grad(loss, slot_hidden, allow_unused=True)[0] is None
