"""LiLiCorr scoring head (paper §3.2, Appendix A).

Each of the (B-1) x K lattice candidates becomes a node of width W, the sum of four terms:
projected frozen target embedding of the token, projected drafter hidden state of its slot, a
2-layer MLP over five confidence scalars, and learned slot + rank tables. A 2-layer bidirectional
Transformer (RMSNorm, SiLU, per-head slot-distance and same-slot attention biases) attends over the
whole lattice; each node is then fused with the target state by concat[c, t, c*t] -> Linear -> SiLU,
and unit-norm out / in vectors of width d_e are emitted, plus the anchor's single out vector.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lilicorr.config import HeadConfig

NUM_CONF_FEATURES = 5


def confidence_features(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """The five confidence scalars of Appendix A, from the drafter's full-vocab distribution.

    topk_logprobs: [N, S, K] log-probabilities of the top-K candidates (sorted, rank 0 first)
    returns:       [N, S, K, 5] = (log p, p, log p - log p_top1, rank / (K-1), is_top1)
    """
    n, s, k = topk_logprobs.shape
    rank = torch.arange(k, device=topk_logprobs.device, dtype=topk_logprobs.dtype)
    rank = (rank / max(k - 1, 1)).expand(n, s, k)
    gap = topk_logprobs - topk_logprobs[..., :1]
    is_top = (rank == 0).to(topk_logprobs.dtype)
    return torch.stack([topk_logprobs, topk_logprobs.exp(), gap, rank, is_top], dim=-1)


def top_k_candidates(slot_logits: torch.Tensor, k: int,
                     id_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K candidates of each slot and their five confidence features.

    slot_logits: [N, S, V] drafter logits of the drafted slots (V = the draft vocabulary's N when
                 the drafter has one)
    id_map:      [V] long, target id of each draft-vocabulary entry, or None (ids are target ids)
    returns cand_ids [N, S, K] target ids (long, detached: pool membership is not differentiated, §3.4)
            cand_feats [N, S, K, 5] (carry gradients through the log-probabilities)
    """
    logprobs = torch.log_softmax(slot_logits.float(), dim=-1)        # [N, S, V]
    cand_idx = torch.topk(logprobs.detach(), k, dim=-1).indices      # [N, S, K]
    cand_logprobs = torch.gather(logprobs, -1, cand_idx)             # [N, S, K]
    cand_ids = cand_idx if id_map is None else id_map[cand_idx]
    return cand_ids, confidence_features(cand_logprobs)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LatticeAttention(nn.Module):
    """Bidirectional self-attention over the flattened lattice with two learned per-head biases:
    one indexed by the signed slot distance of a pair, one for pairs in the same slot."""

    def __init__(self, width: int, num_heads: int, num_slots: int):
        super().__init__()
        if width % num_heads:
            raise ValueError(f"head width {width} is not divisible by {num_heads} heads")
        self.num_heads, self.head_dim = num_heads, width // num_heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.slot_distance_bias = nn.Parameter(torch.zeros(num_heads, 2 * num_slots - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(num_heads))

    def bias(self, slot_of_node: torch.Tensor) -> torch.Tensor:
        """slot_of_node: [M] slot index of each flattened node -> additive bias [heads, M, M]."""
        num_slots = (self.slot_distance_bias.shape[1] + 1) // 2
        dist = slot_of_node[None, :] - slot_of_node[:, None] + num_slots - 1   # [M, M] in [0, 2S-2]
        same = (dist == num_slots - 1).to(self.same_slot_bias.dtype)           # [M, M]
        return self.slot_distance_bias[:, dist] + self.same_slot_bias[:, None, None] * same

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        n, m, w = x.shape                                                      # x: [N, M, W]
        q, k, v = self.qkv(x).view(n, m, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))  # [N, h, M, d]
        return self.proj(y.transpose(1, 2).reshape(n, m, w))


class LatticeBlock(nn.Module):
    def __init__(self, cfg: HeadConfig, num_slots: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.width, cfg.rms_norm_eps)
        self.attn = LatticeAttention(cfg.width, cfg.num_heads, num_slots)
        self.ffn_norm = RMSNorm(cfg.width, cfg.rms_norm_eps)
        self.ffn = nn.Sequential(nn.Linear(cfg.width, cfg.ffn_width), nn.SiLU(),
                                 nn.Linear(cfg.ffn_width, cfg.width))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.ffn(self.ffn_norm(x))


class LiLiCorrHead(nn.Module):
    """Appendix A. Frozen target embedding is shared (not a parameter of this module)."""

    def __init__(self, cfg: HeadConfig, target_hidden: int, num_captured: int, block_size: int,
                 embed: nn.Embedding):
        super().__init__()
        self.cfg = cfg
        self.num_slots = block_size - 1
        w, k = cfg.width, cfg.top_k
        object.__setattr__(self, "embed", embed)          # shared, frozen, not registered
        self.token_proj = nn.Linear(target_hidden, w, bias=False)
        self.hidden_proj = nn.Linear(target_hidden, w, bias=False)
        conf_hidden = cfg.conf_hidden or w
        self.conf_mlp = nn.Sequential(nn.Linear(NUM_CONF_FEATURES, conf_hidden), nn.SiLU(),
                                      nn.Linear(conf_hidden, w))
        self.slot_table = nn.Embedding(self.num_slots, w)
        self.rank_table = nn.Embedding(k, w)
        self.blocks = nn.ModuleList(LatticeBlock(cfg, self.num_slots) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(w, cfg.rms_norm_eps)
        # target state: learned weighted sum over captured layers -> RMSNorm -> projection
        self.layer_weights = nn.Parameter(torch.zeros(num_captured))
        self.target_norm = RMSNorm(target_hidden, cfg.rms_norm_eps)
        self.target_proj = nn.Linear(target_hidden, w, bias=False)
        self.fuse = nn.Linear(3 * w, w)
        self.out_head = nn.Linear(w, cfg.embed_dim, bias=False)
        self.in_head = nn.Linear(w, cfg.embed_dim, bias=False)
        self.anchor_head = nn.Linear(w, cfg.embed_dim, bias=False)
        self.register_buffer("slot_of_node", torch.arange(self.num_slots).repeat_interleave(k),
                             persistent=False)

    def target_state(self, captured: torch.Tensor) -> torch.Tensor:
        """captured: [N, n, H] target layers at the position that produced the anchor -> [N, W]."""
        weights = torch.softmax(self.layer_weights, dim=0).to(captured.dtype)   # [n]
        collapsed = torch.einsum("nlh,l->nh", captured, weights)               # [N, H]
        return self.target_proj(self.target_norm(collapsed))

    @torch.no_grad()
    def token_table(self) -> torch.Tensor:
        """[V, W] the token term of every target id: token_proj(embed), both frozen at inference.
        An exported graph gathers its candidates' rows instead of projecting their embeddings."""
        dtype = self.token_proj.weight.dtype
        return self.token_proj(self.embed.weight.to(dtype))

    def forward(self, cand_ids: torch.Tensor, cand_feats: torch.Tensor, slot_hidden: torch.Tensor,
                target_captured: torch.Tensor, token_table: torch.Tensor | None = None):
        """cand_ids [N, S, K] long, cand_feats [N, S, K, 5], slot_hidden [N, S, H] (drafter final
        hidden of slots 1..B-1), target_captured [N, n, H]; token_table [V, W] (`token_table()`)
        or None to project the candidates' embeddings.
        Returns out_vec [N, S, K, E], in_vec [N, S, K, E], anchor_out [N, E], all unit norm."""
        n, s, k = cand_ids.shape
        if s != self.num_slots or k != self.cfg.top_k:
            raise ValueError(f"lattice {s}x{k} does not match the head's {self.num_slots}x{self.cfg.top_k}")
        dtype = self.token_proj.weight.dtype
        if token_table is None:
            tok = self.token_proj(self.embed(cand_ids).to(dtype))               # [N, S, K, W]
        else:
            tok = token_table[cand_ids].to(dtype)                               # [N, S, K, W]
        hid = self.hidden_proj(slot_hidden.to(dtype))[:, :, None, :]            # [N, S, 1, W]
        conf = self.conf_mlp(cand_feats.to(dtype))                              # [N, S, K, W]
        pos = self.slot_table.weight[:, None, :] + self.rank_table.weight[None, :, :]  # [S, K, W]
        x = (tok + hid + conf + pos).reshape(n, s * k, -1)                      # [N, M, W]
        for block in self.blocks:
            x = block(x, block.attn.bias(self.slot_of_node))                    # bias [h, M, M]
        c = self.final_norm(x)                                                  # [N, M, W]
        t = self.target_state(target_captured.to(dtype))                        # [N, W]
        tb = t[:, None, :].expand_as(c)
        c = F.silu(self.fuse(torch.cat([c, tb, c * tb], dim=-1)))               # [N, M, W]
        out_vec = F.normalize(self.out_head(c), dim=-1).view(n, s, k, -1)
        in_vec = F.normalize(self.in_head(c), dim=-1).view(n, s, k, -1)
        anchor_out = F.normalize(self.anchor_head(t), dim=-1)                   # [N, E]
        return out_vec, in_vec, anchor_out
