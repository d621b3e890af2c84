"""Draft runners: own the drafter's context cache and produce one proposal block per row.

The engine talks to a runner through two calls, so the PyTorch drafter and a built graph (ONNX
Runtime, TensorRT) are interchangeable:

    runner.allocate() -> slot / runner.free(slot)
    runner.append_context(slots, feats, positions)   # newly verified target features
    runner.draft(slots, anchors, anchor_pos, target_state, rules) -> Proposal
"""
from __future__ import annotations

import torch

from lilicorr.drafter import inference_attention_mask
from lilicorr.kv_cache import KVCache
from lilicorr.model import LiLiCorrModel, Proposal
from lilicorr.profiling import STAGE_DRAFT, STAGE_HEAD, STAGE_LM_HEAD, stage


def pad_ragged(chunks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """list of [T_i, ...] -> right-padded [N, T_max, ...] and lengths [N] long."""
    lengths = torch.tensor([c.shape[0] for c in chunks], dtype=torch.long, device=chunks[0].device)
    t = int(lengths.max()) if len(chunks) else 0
    out = chunks[0].new_zeros((len(chunks), t) + tuple(chunks[0].shape[1:]))
    for i, c in enumerate(chunks):
        out[i, : c.shape[0]] = c
    return out, lengths


class ContextCacheRunner:
    """What every draft runner shares: the drafter context cache (one slot per sequence)."""

    cache: KVCache

    def allocate(self) -> int:
        return self.cache.allocate()

    def free(self, slot: int) -> None:
        self.cache.free(slot)

    def context_length(self, slot: int) -> int:
        return int(self.cache.lengths[slot])

    def truncate(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        self.cache.truncate(slots, lengths)


class TorchDraftRunner(ContextCacheRunner):
    """PyTorch eager drafter + head (the reference path; also what training exports)."""

    def __init__(self, model: LiLiCorrModel, num_slots: int, capacity: int = 256):
        self.model = model.eval()
        cfg = model.cfg.drafter
        w = model.drafter.fc.weight
        self.cache = KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, capacity, w.dtype, w.device)

    @property
    def block_size(self) -> int:
        return self.model.block_size

    @property
    def has_head(self) -> bool:
        return self.model.head is not None

    @torch.no_grad()
    def append_context(self, slots: torch.Tensor, feats: list[torch.Tensor], start_pos: torch.Tensor) -> None:
        """slots [N]; feats[i] [T_i, n, H] target features at positions start_pos[i] + t."""
        drafter = self.model.drafter
        x, valid = pad_ragged(feats)                                            # [N, T, n, H]
        pos = start_pos[:, None] + torch.arange(x.shape[1], device=start_pos.device)[None, :]  # [N, T]
        kv = drafter.context_kv(drafter.project_context(x), pos)               # per layer [N, h, T, D]
        self.cache.reserve(slots, x.shape[1])
        start = self.cache.lengths[slots]
        for layer, (k, v) in enumerate(kv):
            self.cache.write(layer, slots, k.transpose(1, 2), v.transpose(1, 2), start, valid)
        self.cache.advance(slots, valid)

    @torch.no_grad()
    def draft(self, slots: torch.Tensor, anchors: torch.Tensor, anchor_pos: torch.Tensor,
              target_state: torch.Tensor, rules: list[str]) -> Proposal:
        """slots/anchors/anchor_pos [N]; target_state [N, n, H]; rules: one decode rule per row."""
        model, b = self.model, self.block_size
        with stage(STAGE_DRAFT):
            emb = model.drafter.block_embeddings(anchors[:, None], b)          # [N, B, H]
            pos = anchor_pos[:, None] + torch.arange(b, device=anchor_pos.device)[None, :]  # [N, B]
            lengths = self.cache.lengths[slots]
            upto = int(lengths.max())
            idx = self.cache.row_index(slots)
            ctx_kv = [self.cache.read(layer, idx, upto) for layer in range(self.cache.num_layers)]
            mask = inference_attention_mask(lengths, upto, b)
            hidden = model.drafter(emb, pos, ctx_kv, mask)                     # [N, B, H]
        with stage(STAGE_LM_HEAD):
            slot_hidden = hidden[:, 1:].contiguous()
            slot_logits = model.drafter.logits(slot_hidden)                   # [N, S, V]
        with stage(STAGE_HEAD):
            return _propose_mixed(model, slot_hidden, slot_logits, target_state, rules)


def _propose_mixed(model: LiLiCorrModel, slot_hidden, slot_logits, target_state, rules) -> Proposal:
    """Apply each row's decode rule; the head runs once for every row that needs it."""
    n, s = slot_logits.shape[:2]
    k = model.cfg.head.top_k
    tokens = torch.empty(n, s, dtype=torch.long, device=slot_logits.device)
    cand_ids = torch.topk(slot_logits, k, dim=-1).indices                      # [N, S, K]
    tokens[:] = cand_ids[..., 0]                                               # argmax rule
    need = [i for i, r in enumerate(rules) if r in ("lilicorr", "viterbi")]
    if need:
        if model.head is None:
            raise ValueError("decode rules lilicorr/viterbi need a LiLiCorr head; this checkpoint is vanilla DFlash")
        sel = torch.tensor(need, device=slot_logits.device)
        for rule in ("lilicorr", "viterbi"):
            rows = [j for j, i in enumerate(need) if rules[i] == rule]
            if not rows:
                continue
            r = sel[rows]
            prop = model.propose_from_logits(slot_hidden[r], slot_logits[r], target_state[r], rule)
            tokens[r] = prop.tokens
            cand_ids[r] = prop.cand_ids
    return Proposal(tokens=tokens, cand_ids=cand_ids)
