"""DFlash block drafter (DESIGN.md §4, reference/dflash-facts.md).

Context = captured target layers -> Linear(n*H -> H) -> RMSNorm, injected as extra keys/values in
every draft layer (each layer's own k_proj/v_proj + k_norm + RoPE at the context positions; never
queries, never in the residual stream). The block is [anchor, mask x (B-1)] at positions p..p+B-1,
attention inside the block is non-causal and context keys are strictly before the anchor. Slot k
predicts the token at its own position p+k (no label shift). Token embeddings and the LM head are
the target's, frozen and shared; the final norm is the drafter's own.

Draft vocabulary (EAGLE-3 style, `DrafterConfig.draft_vocab_size` N > 0): the LM head covers only the
rows `draft_to_target` [N] of the target's (frozen) head, the N most frequent tokens of the training
data; `logits` returns [..., N] and candidate ids are mapped back to target ids by the caller
(`head.top_k_candidates(..., id_map=drafter.draft_to_target)`). The map is a checkpoint buffer; the
weight rows are gathered from the target at run time, so a checkpoint stays small.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lilicorr.config import DrafterConfig
from lilicorr.head import RMSNorm

# rotary(positions [N, T]) -> (cos [N, T, D], sin [N, T, D]); shared with the target (same theta/YaRN)
Rotary = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, h, T, D], cos/sin [N, T, D] (neox / rotate-half style)."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + rotate_half(x) * sin


class DrafterLayer(nn.Module):
    """Qwen3-style pre-norm block whose attention also reads the injected context K/V."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, T, H] (context features or normed block states) -> k, v [N, h_kv, T, D]."""
        n, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(n, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """h [N, Q, H] block states, cos/sin [N, Q, D] at block positions,
        ctx_k/ctx_v [N, h_kv, C, D], mask [N, 1, Q, C+Q] bool (True = may attend)."""
        n, q_len, _ = h.shape
        x = self.input_layernorm(h)
        q = self.q_norm(self.q_proj(x).view(n, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)                                      # [N, h, Q, D]
        k_blk, v_blk = self.kv(x, cos, sin)                              # [N, h_kv, Q, D]
        k = torch.cat([ctx_k.to(q.dtype), k_blk], dim=2)                 # [N, h_kv, C+Q, D]
        v = torch.cat([ctx_v.to(q.dtype), v_blk], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        # rows with no visible key (padding blocks) come out NaN; zero them
        y = torch.nan_to_num(y, nan=0.0)
        h = h + self.o_proj(y.transpose(1, 2).reshape(n, q_len, -1))
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed: nn.Embedding, lm_head: nn.Module, rotary: Rotary):
        super().__init__()
        if not cfg.hidden_size:
            raise ValueError("DrafterConfig is not resolved for a target; call cfg.for_target(...)")
        self.cfg = cfg
        # shared frozen target modules and the target's rotary table: not parameters of the drafter
        object.__setattr__(self, "embed", embed)
        object.__setattr__(self, "lm_head", lm_head)
        object.__setattr__(self, "rotary", rotary)
        n_ctx = cfg.num_target_layers_captured
        self.fc = nn.Linear(n_ctx * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.mask_token_id is None:
            self.mask_embedding = nn.Parameter(embed.weight.detach().float().mean(0).clone())
        else:
            if not 0 <= cfg.mask_token_id < cfg.vocab_size:
                raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the vocabulary [0, {cfg.vocab_size})")
            self.mask_embedding = None
        if cfg.draft_vocab_size:
            # placeholder until set_draft_vocab() or a checkpoint fills it
            self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size))
        else:
            self.draft_to_target = None
        self._draft_weight_cache: tuple | None = None
        self.reset_parameters()

    def reset_parameters(self):
        std = self.cfg.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)

    # -- context ---------------------------------------------------------------------------
    def project_context(self, captured: torch.Tensor) -> torch.Tensor:
        """captured [N, C, n, H] target layer outputs -> context features [N, C, H]."""
        n, c = captured.shape[:2]
        return self.hidden_norm(self.fc(captured.reshape(n, c, -1).to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ctx [N, C, H] at positions [N, C] -> per layer (k, v), each [N, h_kv, C, D]."""
        cos, sin = self.rotary(positions, torch.float32)
        return [layer.kv(ctx, cos, sin) for layer in self.layers]

    # -- block -----------------------------------------------------------------------------
    def block_embeddings(self, anchor_ids: torch.Tensor, block_size: int) -> torch.Tensor:
        """anchor_ids [N, A] -> block input embeddings [N, A*B, H]: [anchor, mask x (B-1)] per block."""
        n, a = anchor_ids.shape
        anchor = self.embed(anchor_ids).to(self.fc.weight.dtype)                      # [N, A, H]
        if self.mask_embedding is not None:
            mask = self.mask_embedding.to(anchor.dtype)
        else:
            mask = self.embed.weight[self.cfg.mask_token_id].to(anchor.dtype)
        blocks = mask.expand(n, a, block_size, mask.shape[-1]).clone()
        blocks[:, :, 0] = anchor
        return blocks.reshape(n, a * block_size, -1)

    def forward(self, block_emb: torch.Tensor, block_pos: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> torch.Tensor:
        """block_emb [N, Q, H], block_pos [N, Q], ctx_kv per layer (k, v) [N, h_kv, C, D],
        mask [N, 1, Q, C+Q] bool -> final-normed hidden states [N, Q, H]."""
        cos, sin = self.rotary(block_pos, torch.float32)
        h = block_emb
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, mask)
        return self.norm(h)

    def set_draft_vocab(self, token_ids) -> None:
        """Fill the draft vocabulary map with N distinct target ids (N = cfg.draft_vocab_size)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if self.draft_to_target is None or ids.shape != self.draft_to_target.shape:
            raise ValueError(f"draft vocabulary of {tuple(ids.shape)} ids does not match draft_vocab_size="
                             f"{self.cfg.draft_vocab_size}")
        if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError("draft vocabulary ids must be distinct target ids")
        self.draft_to_target.copy_(ids.to(self.draft_to_target.device))

    def target_to_draft(self) -> torch.Tensor:
        """[V] long: the draft-vocabulary index of every target id, -1 where it has none."""
        d2t = self.draft_to_target
        t2d = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=d2t.device)
        t2d[d2t] = torch.arange(len(d2t), device=d2t.device)
        return t2d

    def lm_weight(self) -> torch.Tensor:
        """The LM-head rows the drafter scores: [V, H] (full) or [N, H] (draft vocabulary, gathered
        once from the frozen target head and cached until the map or the head changes)."""
        w = self.lm_head.weight
        d2t = self.draft_to_target
        if d2t is None:
            return w
        if torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export():
            return w[d2t]                          # traced graphs (ONNX, torch.export): a plain gather
        try:
            key = (d2t.data_ptr(), d2t._version, w.data_ptr(), w._version, w.dtype, w.device)
        except RuntimeError:                       # tensors without storage (fake / functional)
            return w[d2t]
        if self._draft_weight_cache is None or self._draft_weight_cache[0] != key:
            self._draft_weight_cache = (key, w.detach()[d2t].contiguous())
        return self._draft_weight_cache[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] (or [..., N] over the draft vocabulary) through the
        frozen target LM head, float32."""
        w = self.lm_weight()
        return F.linear(hidden.to(w.dtype), w).float()


def block_attention_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int,
                         block_size: int) -> torch.Tensor:
    """Training mask for A blocks per sequence over [context (C) ; all blocks (A*B)] keys.

    anchors [N, A] anchor positions, valid [N, A] bool (padding blocks see nothing).
    A query of block b sees context j iff j < anchors[b], and every slot of its own block.
    returns [N, 1, A*B, C + A*B] bool
    """
    n, a = anchors.shape
    q_block = torch.arange(a * block_size, device=anchors.device) // block_size          # [Q]
    ctx_ok = torch.arange(ctx_len, device=anchors.device)[None, None, :] < anchors[:, :, None]  # [N, A, C]
    ctx_ok = ctx_ok[:, q_block]                                                           # [N, Q, C]
    same = (q_block[:, None] == q_block[None, :]).expand(n, -1, -1)                       # [N, Q, Q]
    mask = torch.cat([ctx_ok, same], dim=-1) & valid[:, q_block][:, :, None]
    return mask[:, None]


def inference_attention_mask(ctx_lengths: torch.Tensor, ctx_capacity: int, block_size: int) -> torch.Tensor:
    """Mask for one block per row over [cached context (capacity C) ; block (B)].

    ctx_lengths [N]: number of valid context entries of each row -> [N, 1, B, C+B] bool
    """
    n = ctx_lengths.shape[0]
    ctx_ok = torch.arange(ctx_capacity, device=ctx_lengths.device)[None, :] < ctx_lengths[:, None]  # [N, C]
    blk = torch.ones(n, block_size, dtype=torch.bool, device=ctx_lengths.device)
    return torch.cat([ctx_ok, blk], dim=-1)[:, None, None, :].expand(n, 1, block_size, -1)
