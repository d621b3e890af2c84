"""LiLiCorr head (paper §3.2, Appendix A): shapes, unit norm, attention biases, permutation
behaviour, dependence on the target state and on the whole lattice, the five confidence features."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lilicorr import lattice
from lilicorr.config import HeadConfig
from lilicorr.head import NUM_CONF_FEATURES, LiLiCorrHead, confidence_features, top_k_candidates

V, H, NCAP, B, K = 50, 24, 3, 6, 4          # vocab, target hidden, captured layers, block, candidates
S = B - 1


def make_head(seed: int = 0, **over) -> LiLiCorrHead:
    torch.manual_seed(seed)
    embed = nn.Embedding(V, H).requires_grad_(False)
    cfg = HeadConfig(top_k=K, width=32, num_layers=2, num_heads=4, ffn_width=48, embed_dim=16, **over)
    head = LiLiCorrHead(cfg, target_hidden=H, num_captured=NCAP, block_size=B, embed=embed)
    with torch.no_grad():   # non-zero biases and layer weights so every path matters
        for blk in head.blocks:
            blk.attn.slot_distance_bias.normal_(0, 0.5)
            blk.attn.same_slot_bias.normal_(0, 0.5)
        head.layer_weights.normal_(0, 0.5)
    return head.eval()


def inputs(n: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, S, V, generator=g) * 2
    cand_ids, feats = top_k_candidates(logits, K)
    hidden = torch.randn(n, S, H, generator=g)
    state = torch.randn(n, NCAP, H, generator=g)
    return cand_ids, feats, hidden, state


def test_output_shapes_and_unit_norm():
    head = make_head()
    out_vec, in_vec, anchor_out = head(*inputs(3))
    assert out_vec.shape == (3, S, K, 16) and in_vec.shape == (3, S, K, 16) and anchor_out.shape == (3, 16)
    for v in (out_vec, in_vec, anchor_out):
        torch.testing.assert_close(v.norm(dim=-1), torch.ones(v.shape[:-1]), rtol=0, atol=1e-5)
    a, p = lattice.match_scores(anchor_out, out_vec, in_vec, head.cfg.sigma)
    assert a.shape == (3, K) and p.shape == (3, S - 1, K, K)
    assert a.abs().max() <= head.cfg.sigma + 1e-4 and p.abs().max() <= head.cfg.sigma + 1e-4  # cosine bound


def test_frozen_embedding_is_shared_not_a_parameter():
    head = make_head()
    assert not any(k.startswith("embed") for k in head.state_dict())
    assert "slot_of_node" not in head.state_dict()                  # non-persistent buffer
    assert head.slot_table.weight.shape == (S, 32) and head.rank_table.weight.shape == (K, 32)


def test_folded_token_table_gives_the_same_vectors():
    """token_table() (what an exported graph gathers from) is token_proj of every embedding row:
    the head's outputs with it equal those that project the candidates' embeddings, and a
    different table changes them (the table is really used)."""
    head = make_head()
    table = head.token_table()
    assert table.shape == (V, 32)
    args = inputs(3)
    for got, want in zip(head(*args, token_table=table), head(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    other = head(*args, token_table=torch.roll(table, 1, dims=0))
    assert not torch.allclose(other[0], head(*args)[0], atol=1e-3)


def test_rejects_a_lattice_of_the_wrong_size():
    head = make_head()
    cand_ids, feats, hidden, state = inputs(2)
    with pytest.raises(ValueError, match="lattice"):
        head(cand_ids[:, :, :K - 1], feats[:, :, :K - 1], hidden, state)
    with pytest.raises(ValueError, match="lattice"):
        head(cand_ids[:, :S - 1], feats[:, :S - 1], hidden[:, :S - 1], state)


def test_slot_distance_and_same_slot_bias():
    head = make_head()
    attn = head.blocks[0].attn
    assert attn.slot_distance_bias.shape == (4, 2 * S - 1) and attn.same_slot_bias.shape == (4,)
    with torch.no_grad():
        attn.slot_distance_bias.copy_(torch.arange(4 * (2 * S - 1), dtype=torch.float32).view(4, -1))
        attn.same_slot_bias.copy_(torch.tensor([100.0, 200.0, 300.0, 400.0]))
    slot = head.slot_of_node
    assert slot.tolist() == [s for s in range(S) for _ in range(K)]
    bias = attn.bias(slot)
    m = S * K
    assert bias.shape == (4, m, m)
    for h in range(4):
        for i in (0, 3, 7, m - 1):
            for j in (0, 5, 9, m - 1):
                d = int(slot[j] - slot[i])                      # signed slot distance
                want = attn.slot_distance_bias[h, d + S - 1] + (attn.same_slot_bias[h] if d == 0 else 0)
                assert bias[h, i, j].item() == pytest.approx(want.item()), (h, i, j)
    # the bias is asymmetric in the sign of the distance
    assert bias[0, 0, K].item() != bias[0, K, 0].item()


def test_scores_depend_on_the_target_state():
    head = make_head()
    cand_ids, feats, hidden, state = inputs(2)
    o1, i1, a1 = head(cand_ids, feats, hidden, state)
    o2, i2, a2 = head(cand_ids, feats, hidden, state + torch.randn_like(state))
    assert (o1 - o2).abs().max() > 1e-3 and (i1 - i2).abs().max() > 1e-3 and (a1 - a2).abs().max() > 1e-3
    s1 = lattice.match_scores(a1, o1, i1, 8.0)[1]
    s2 = lattice.match_scores(a2, o2, i2, 8.0)[1]
    assert (s1 - s2).abs().max() > 1e-2
    # the anchor vector depends on the target state only
    _, _, a3 = head(cand_ids.flip(-1), feats, hidden * 3, state)
    torch.testing.assert_close(a1, a3)


def test_target_state_is_a_learned_weighted_sum_of_captured_layers():
    head = make_head()
    state = torch.randn(2, NCAP, H)
    w = torch.softmax(head.layer_weights.detach(), 0)
    collapsed = (state * w[None, :, None]).sum(1)
    want = head.target_proj(head.target_norm(collapsed))
    torch.testing.assert_close(head.target_state(state), want)


def test_batch_rows_are_independent_and_permutation_equivariant():
    head = make_head()
    cand_ids, feats, hidden, state = inputs(4)
    outs = head(cand_ids, feats, hidden, state)
    perm = torch.tensor([2, 0, 3, 1])
    pouts = head(cand_ids[perm], feats[perm], hidden[perm], state[perm])
    for a, b in zip(outs, pouts):
        torch.testing.assert_close(a[perm], b, rtol=1e-5, atol=1e-5)


def test_permuting_candidates_within_a_slot_permutes_their_vectors_once_rank_is_neutral():
    """Attention is permutation-equivariant inside a slot (biases depend on slots only); the rank
    table and rank features are what break the symmetry. Neutralise them and a within-slot
    permutation must permute the out/in vectors the same way."""
    head = make_head()
    with torch.no_grad():
        head.rank_table.weight.copy_(head.rank_table.weight[:1].expand(K, -1))
    cand_ids, feats, hidden, state = inputs(2)
    feats = feats.clone()
    feats[..., 3] = 0.0                                                 # normalised rank
    feats[..., 4] = 0.0                                                 # is-top-1
    o, i, a = head(cand_ids, feats, hidden, state)
    perm = torch.tensor([2, 0, 3, 1])
    slot = 1
    cand_p, feats_p = cand_ids.clone(), feats.clone()
    cand_p[:, slot], feats_p[:, slot] = cand_ids[:, slot, perm], feats[:, slot, perm]
    op, ip, ap = head(cand_p, feats_p, hidden, state)
    torch.testing.assert_close(op[:, slot], o[:, slot, perm], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ip[:, slot], i[:, slot, perm], rtol=1e-5, atol=1e-5)
    others = [s for s in range(S) if s != slot]
    torch.testing.assert_close(op[:, others], o[:, others], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ap, a)
    # with the learned rank table the same permutation is *not* a pure relabelling
    head2 = make_head()
    o2, _, _ = head2(cand_ids, feats, hidden, state)
    o2p, _, _ = head2(cand_p, feats_p, hidden, state)
    assert (o2p[:, slot] - o2[:, slot, perm]).abs().max() > 1e-4


def test_every_vector_sees_the_whole_lattice():
    head = make_head()
    cand_ids, feats, hidden, state = inputs(1)
    o, i, _ = head(cand_ids, feats, hidden, state)
    cand2 = cand_ids.clone()
    cand2[:, S - 1] = (cand2[:, S - 1] + 7) % V                         # change only the last slot
    o2, i2, _ = head(cand2, feats, hidden, state)
    assert (o[:, 0] - o2[:, 0]).abs().max() > 1e-4                      # first slot moved too
    assert (i[:, 0] - i2[:, 0]).abs().max() > 1e-4


def test_five_confidence_features():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 20, generator=g) * 3
    logp_full = torch.log_softmax(logits, -1)
    cand_ids, feats = top_k_candidates(logits, 5)
    assert feats.shape == (2, 3, 5, NUM_CONF_FEATURES)
    lp = torch.gather(logp_full, -1, cand_ids)
    assert torch.all(lp[..., :-1] >= lp[..., 1:])                      # rank order
    torch.testing.assert_close(feats[..., 0], lp)                        # log p (full vocabulary)
    torch.testing.assert_close(feats[..., 1], lp.exp())                  # p
    torch.testing.assert_close(feats[..., 2], lp - logp_full.max(-1, keepdim=True).values)  # gap to top-1
    assert feats[..., 3].tolist() == [[[0.0, 0.25, 0.5, 0.75, 1.0]] * 3] * 2        # rank / (K-1)
    assert feats[..., 4].tolist() == [[[1.0, 0.0, 0.0, 0.0, 0.0]] * 3] * 2          # is top-1
    assert torch.all(feats[..., 1].sum(-1) <= 1.0 + 1e-6)
    # direct call, K = 1 edge case (rank normalised to 0, no division by zero)
    f1 = confidence_features(torch.tensor([[[-0.1]]]))
    assert f1[0, 0, 0].tolist() == pytest.approx([-0.1, math.exp(-0.1), 0.0, 0.0, 1.0])


def test_confidence_features_carry_gradient_to_the_logits():
    logits = torch.randn(1, 2, 10, requires_grad=True)
    cand_ids, feats = top_k_candidates(logits, 3)
    assert not cand_ids.requires_grad
    feats[..., :3].sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
