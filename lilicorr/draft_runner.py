"""Draft runners: own the drafter's context cache and produce one proposal block per row.

The engine talks to a runner through two calls, so the PyTorch drafter and a built graph (ONNX
Runtime, TensorRT) are interchangeable:

    runner.allocate() -> slot / runner.free(slot)
    runner.append_context(slots, feats, positions)   # newly verified target features
    runner.draft(slots, anchors, anchor_pos, target_state, rules, tree=False) -> Proposal
"""
from __future__ import annotations

import torch

from lilicorr.bf16_gemm import BF16GemmLinear, use_bf16_gemm
from lilicorr.drafter import inference_attention_mask
from lilicorr.fp16_linear import (FP16_MAX, FP16WeightLinear, PackedFP16, fbgemm_fp16_available, fp16_exact,
                                  use_fp16_weights)
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


class DraftLMHead:
    """The drafter's LM-head projection (slot hidden [N, S, H] -> float32 logits [N, S, V']) at
    inference, on the fastest CPU kernel that keeps the weights' values.

    PyTorch's CPU bf16 matmul without native bf16 instructions (AVX2, and AVX-512 without BF16) runs
    the [S, H] x [H, 49k] projection row by row at compute speed: ~6 ms per slot for SmolLM2, 40-70 ms
    per block of 7 slots, more than the whole target step. Weights whose values are exact in fp16
    (bf16 and fp16 weights, and a target loaded as fp16-weights) are packed once for fbgemm's
    fp16-weight GEMM under `kernel="auto"` (one memory pass over half-size weights, fp32
    accumulation): same values, 3-5x faster. Other fp32 weights keep the native kernel under "auto"
    (fp16 would round them); `kernel="fp16"` packs them anyway.

    The packed weight is derived from `drafter.logits` itself: the target LM head's weight, gathered
    through `drafter.draft_to_target` when the drafter has a draft vocabulary. A probe checks that it
    reproduces `drafter.logits`; if not (a drafter with its own head), the runner keeps `drafter.logits`.
    """

    def __init__(self, drafter, kernel: str = "auto"):
        if kernel not in ("auto", "fp16", "native"):
            raise ValueError(f"unknown LM-head kernel {kernel!r}; choose auto, fp16 or native")
        self.drafter = drafter
        self.kernel = "native"
        self._gemm = None
        w = getattr(drafter.lm_head, "weight", None)
        if kernel == "native" or w is None or w.device.type != "cpu" or not fbgemm_fp16_available():
            return
        if getattr(drafter.lm_head, "bias", None) is not None:
            return
        w = drafter.lm_weight()                        # [V', H]: draft-vocabulary rows where it has one
        if not bool(torch.isfinite(w).all()) or float(w.abs().max()) >= FP16_MAX:
            return
        if kernel == "auto" and not fp16_exact(w):
            return
        gemm = PackedFP16(w, None)
        probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
        with torch.no_grad():
            want = drafter.logits(probe)
            have = gemm(probe)
        if want.shape != have.shape or not torch.allclose(want, have, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
            return
        self.kernel, self._gemm = "fp16", gemm

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._gemm is None:
            return self.drafter.logits(hidden)
        return self._gemm(hidden)


class TorchDraftRunner(ContextCacheRunner):
    """PyTorch eager drafter + head (the reference path; also what training exports)."""

    def __init__(self, model: LiLiCorrModel, num_slots: int, capacity: int = 256, lm_head_kernel: str = "auto"):
        self.model = model.eval()
        # the target was loaded as fp16-weights or bf16-gemm (its LM head is the drafter's): the drafter
        # and head follow (their drafts are verified: lossless)
        if isinstance(model.drafter.lm_head, FP16WeightLinear):
            use_fp16_weights(model)
        elif isinstance(model.drafter.lm_head, BF16GemmLinear):
            use_bf16_gemm(model)
        cfg = model.cfg.drafter
        w = model.drafter.fc.weight
        self.cache = KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, capacity, w.dtype, w.device)
        self.lm_head = DraftLMHead(model.drafter, lm_head_kernel)

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
        plan = self.cache.write_plan(slots, self.cache.lengths[slots], x.shape[1], valid)
        for layer, (k, v) in enumerate(kv):
            self.cache.write(layer, slots, k.transpose(1, 2), v.transpose(1, 2), plan=plan)
        self.cache.advance(slots, valid)

    @torch.no_grad()
    def draft(self, slots: torch.Tensor, anchors: torch.Tensor, anchor_pos: torch.Tensor,
              target_state: torch.Tensor, rules: list[str], tree: bool = False) -> Proposal:
        """slots/anchors/anchor_pos [N]; target_state [N, n, H]; rules: one decode rule per row.
        tree: rule `tree` wants a draft tree; this runner builds none (the engine builds it from
        the proposal's lattice scores, `lilicorr.lattice.build_tree`)."""
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
            slot_logits = self.lm_head(slot_hidden)                           # [N, S, V] float32
        with stage(STAGE_HEAD):
            return _propose_mixed(model, slot_hidden, slot_logits, target_state, rules)


def _propose_mixed(model: LiLiCorrModel, slot_hidden, slot_logits, target_state, rules) -> Proposal:
    """Apply each row's decode rule; the head runs once for every row that needs it."""
    n, s = slot_logits.shape[:2]
    k = model.cfg.head.top_k
    need = [i for i, r in enumerate(rules) if r in ("lilicorr", "viterbi")]
    if len(need) < n:                    # argmax rows: top-K of the logits (the head rows redo it)
        cand_ids = torch.topk(slot_logits, k, dim=-1).indices                  # [N, S, K]
        ids_map = model.drafter.draft_to_target
        if ids_map is not None:
            cand_ids = ids_map[cand_ids]
    else:
        cand_ids = torch.empty(n, s, k, dtype=torch.long, device=slot_logits.device)
    tokens = cand_ids[..., 0].clone()                                          # argmax rule
    anchor_scores = pair_scores = None
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
            if anchor_scores is None:         # rows without head scores stay NaN
                anchor_scores = prop.anchor_scores.new_full((n,) + prop.anchor_scores.shape[1:], float("nan"))
                pair_scores = prop.pair_scores.new_full((n,) + prop.pair_scores.shape[1:], float("nan"))
            anchor_scores[r] = prop.anchor_scores
            pair_scores[r] = prop.pair_scores
    return Proposal(tokens=tokens, cand_ids=cand_ids, anchor_scores=anchor_scores, pair_scores=pair_scores)
