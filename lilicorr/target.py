"""The frozen target: one plain-PyTorch decoder for the Llama, Qwen2 and Qwen3 families.

gpt-fast style: a config dataclass and one small module per concept. Differences between the
families are config flags: Qwen2 has q/k/v biases, Qwen3 normalizes each head's q and k (before
RoPE), embeddings are tied or not. q/k/v and gate/up projections are fused at load time (fewer,
larger matmuls for CPU serving). Attention is `scaled_dot_product_attention` with an explicit
boolean mask, so ragged rows and right padding work with or without a `KVCache`.

`capture` returns the outputs of chosen decoder layers: layer id k is the output of layer k
(0-based) = HF `hidden_states[k+1]` (DESIGN.md §4; the drafter's context features). As in HF, the
last id (L-1) gives the state after the final norm.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .batch_invariant import TreeKeys, invariant_attention, padded_keys
from .config import CPU_GEMM_PRECISIONS, PRECISIONS
from .kv_cache import KVCache
from .rope import RotaryEmbedding, apply_rotary, with_yarn

# precisions whose CPU target loads batch-invariant by default (`_make_batch_invariant`): bf16, and
# bf16-gemm, whose rounding of every GEMM input to bf16 turns a float32 reduction-order difference
# upstream (PyTorch's attention over 1 query against 8) into a whole bf16 step
BATCH_INVARIANT_PRECISIONS = ("bfloat16", "bf16-gemm")

__all__ = ["TargetConfig", "TargetModel", "TargetOutput", "load_target", "precision_variant", "resolve_dtype",
           "resolve_precision",
           "PRECISIONS", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass
class TargetConfig:
    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # q/k/v bias (Qwen2 always)
    o_bias: bool = False           # o_proj bias (Llama/Qwen3 with attention_bias)
    mlp_bias: bool = False         # Llama's mlp_bias
    qk_norm: bool = False          # Qwen3 per-head RMSNorm of q and k
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TargetConfig":
        """Build from an HF config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x
        `rope_parameters`)."""
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported target model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu / SwiGLU)")
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ValueError(f"config.json lacks {missing}")
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or {})
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or rope
        kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        scaling = None if kind == "default" else {k: v for k, v in scaling.items() if k != "rope_theta"}
        eos = d.get("eos_token_id")
        bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if mt == "qwen2" else bias,
            o_bias=False if mt == "qwen2" else bias,
            mlp_bias=bool(d.get("mlp_bias", False)) if mt == "llama" else False,
            qk_norm=mt == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            pad_token_id=d.get("pad_token_id"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "TargetConfig":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"{p} not found: a target directory needs an HF config.json "
                                    "(run train/prepare_target.py to make the default one)")
        return cls.from_dict(json.loads(p.read_text()))


@dataclass
class TargetOutput:
    """A forward's outputs. After a packed call (`Packing`) the logits stay packed until `logits`
    is read: a verify step needs only their argmax (`greedy`), and unpacking [M, V] into [N, T, V]
    writes the whole vocabulary for every padding token."""
    packed_logits: torch.Tensor | None  # [N, T, V] float32, or [1, M, V] with `packing`
    captured: torch.Tensor | None     # [N, T, n, H] outputs of the `capture` layers, in that order
    last_hidden: torch.Tensor         # [N, T, H] after the final norm
    packing: "Packing | None" = None

    @property
    def logits(self) -> torch.Tensor | None:
        """[N, T, V] float32 (zeros at a packed call's padding)."""
        if self.packing is not None and self.packed_logits is not None:
            self.packed_logits, self.packing = self.packing.unpack(self.packed_logits), None
        return self.packed_logits

    def greedy(self) -> torch.Tensor:
        """[N, T] long: the argmax of each token's logits (0 at a packed call's padding, as the
        argmax of its zeros), computed on the real tokens only."""
        if self.packing is None:
            return self.packed_logits.argmax(-1)
        p = self.packing
        out = torch.zeros(p.n * p.t, dtype=torch.long, device=self.packed_logits.device)
        out[p.index] = self.packed_logits[0].argmax(-1)
        return out.view(p.n, p.t)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q, kv = self.n_head * self.head_dim, self.n_kv * self.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias)  # fused q_proj|k_proj|v_proj
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.invariant_attention = False    # batch-invariant mode (lilicorr.batch_invariant)
        self.attention_kernel = None        # that mode's compiled attention (bf16_gemm.fused_attention), if any

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: "torch.Tensor | TreeKeys",
                cache: KVCache | None, layer: int, rows: Any, plan: Any, upto: int,
                packing: "Packing | None" = None) -> torch.Tensor:
        """x [N, T, H], or with `packing` only the real tokens [1, M, H] (the projections run on
        those; rotary, cache and attention on the padded [N, T] layout, padding as zeros). `mask`:
        additive [N|1, 1, T, S], or a draft tree's `TreeKeys` in batch-invariant mode."""
        qkv = self.wqkv(x)
        if packing is not None:
            qkv = packing.unpack(qkv)                                # [N, T, C], zeros at padding
        n, t, _ = qkv.shape
        q, k, v = qkv.split([self.n_head * self.head_dim, self.n_kv * self.head_dim,
                             self.n_kv * self.head_dim], dim=-1)
        q = q.view(n, t, self.n_head, self.head_dim)   # [N, T, hq, D]
        k = k.view(n, t, self.n_kv, self.head_dim)     # [N, T, hkv, D]
        v = v.view(n, t, self.n_kv, self.head_dim)     # [N, T, hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            k, v = k.transpose(1, 2), v.transpose(1, 2)          # [N, hkv, T, D]
        else:
            cache.write(layer, rows, k, v, plan=plan)
            k, v = cache.read(layer, rows, upto)                 # [N, hkv, S, D]
        if isinstance(mask, TreeKeys):   # a draft tree in batch-invariant mode: each query's own keys
            y = mask.attend(q.transpose(1, 2), k, v)                                    # [N, hq, T, D]
        elif self.invariant_attention:   # the compiled kernel skips a packed call's padding queries
            live = {"live": packing.valid} if packing is not None and self.attention_kernel is not None else {}
            y = (self.attention_kernel or invariant_attention)(q.transpose(1, 2), k, v, mask, **live)  # [N, hq, T, D]
        else:
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                               enable_gqa=self.n_kv != self.n_head)  # [N, hq, T, D]
        y = y.transpose(1, 2).reshape(n, t, self.n_head * self.head_dim)
        return self.o_proj(packing.pack(y) if packing is not None else y)


class Packing:
    """Which tokens of a padded [N, T] batch are real: row i's first valid[i]. The target's
    projections, MLPs, norms and head then run on the M real tokens only ([1, M, ...]), so a batch
    whose rows verify different numbers of tokens pays for the tokens it verifies, not for N x T.
    Each real token's values are what the padded forward gives it wherever every op computes a token
    on its own (the batch-invariant precisions: bf16-gemm, bf16 on AMX / CUDA)."""

    def __init__(self, valid: torch.Tensor, t: int):
        self.n, self.t, self.valid = int(valid.shape[0]), t, valid.long()
        real = torch.arange(t, device=valid.device)[None, :] < valid[:, None]      # [N, T]
        self.index = real.reshape(-1).nonzero().squeeze(1)                         # [M] flat token index

    @classmethod
    def of(cls, valid: torch.Tensor | None, t: int, device: torch.device | None = None) -> "Packing | None":
        """A packing (on `device`) where `valid` leaves padding in a multi-token call, else None."""
        if valid is None or t < 2 or bool((valid >= t).all()):
            return None
        return cls(valid.to(device) if device is not None else valid, t)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, T, ...] -> [1, M, ...] (the real tokens, in row-major order)."""
        return x.reshape(self.n * self.t, *x.shape[2:]).index_select(0, self.index)[None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, M, ...] -> [N, T, ...] with zeros at the padding."""
        out = x.new_zeros((self.n * self.t,) + tuple(x.shape[2:]))
        out.index_copy_(0, self.index, x[0])
        return out.view((self.n, self.t) + tuple(x.shape[2:]))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) with gate|up fused."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)  # [N, T, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.gemm_precision = ""            # set by load_target: a CPU_GEMM_PRECISIONS name, or "" (plain dtype)
        self.batch_invariant = False        # set by load_target: bf16 on a CPU, checked on this machine
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    # ------------------------------------------------------------------ helpers
    @property
    def precision(self) -> str:
        """Serving precision name (PRECISIONS): the weights' dtype, or fp16-weights / bf16-gemm."""
        return self.gemm_precision or str(self.embed_tokens.weight.dtype).removeprefix("torch.")

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Frozen input embedding: ids [...] -> [..., H]."""
        return self.embed_tokens(ids)

    def new_cache(self, num_slots: int, capacity: int = 256) -> KVCache:
        """A KVCache shaped for this model (dtype/device of its weights). In batch-invariant mode
        it holds float32 (what `invariant_attention` computes in) in whole blocks of KEY_BLOCK
        keys, so attention reads its keys and values as they are, without a converted copy."""
        c, w = self.config, self.embed_tokens.weight
        dtype = w.dtype
        if self.batch_invariant:
            dtype, capacity = torch.float32, padded_keys(capacity)
        return KVCache(c.num_hidden_layers, num_slots, c.num_key_value_heads, c.head_dim, capacity, dtype, w.device)

    def set_rope(self, rope_scaling: dict[str, Any] | None, max_position_embeddings: int | None = None) -> None:
        """Change rope scaling in place (e.g. YaRN at inference); the config is updated to match."""
        self.config.rope_scaling = rope_scaling
        if max_position_embeddings:
            self.config.max_position_embeddings = max_position_embeddings
        self.rotary.configure(self.config.rope_theta, rope_scaling, self.config.max_position_embeddings)

    def enable_yarn(self, factor: float, original_max: int | None = None) -> None:
        """Switch on YaRN (DESIGN.md §5) for inputs past the training length."""
        c = with_yarn(self.config, factor, original_max)
        self.set_rope(c.rope_scaling, c.max_position_embeddings)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None,
                rows: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                capture: Sequence[int] = (), logits: bool = True, tree: torch.Tensor | None = None) -> TargetOutput:
        """input_ids, positions [N, T] long. With `cache`, row i attends to its cached keys and is
        written at cache positions lengths[rows[i]] + t; afterwards lengths[rows] += valid (default T).
        Without `cache`: causal self-attention over the given tokens only. `tree` [N, T, T] bool
        (with a cache) replaces causal order among the new tokens: token t sees new token u iff
        tree[i, t, u] (a draft tree: itself and its ancestors; positions give each its depth).
        With a cache and `valid` [N] below T for some row, only each row's first valid[i] tokens are
        computed (`Packing`): the outputs at the padding are zeros."""
        n, t = input_ids.shape
        capture = list(capture)
        bad = [k for k in capture if not 0 <= k < len(self.layers)]
        if bad:
            raise ValueError(f"capture layer ids {bad} outside [0, {len(self.layers)})")
        x = self.embed_tokens(input_ids)                              # [N, T, H]
        cos, sin = self.rotary(positions, x.dtype)                    # [N, T, D]
        # rows with `valid` < T: every per-token op runs on the real tokens only ([1, M, H])
        packing = Packing.of(valid, t, x.device) if cache is not None else None
        if packing is not None:
            x = packing.pack(x)                                       # [1, M, H]
        start, idx, plan = None, None, None
        if cache is not None:
            if rows is None:
                raise ValueError("rows (cache slot of each row) are required with a cache")
            rows = rows.to(device=cache.device, dtype=torch.long)
            if rows.shape != (n,):
                raise ValueError(f"rows must have shape [{n}], got {tuple(rows.shape)}")
            start = cache.lengths[rows]                               # [N] keys already cached
            cache.reserve(rows, t)
            idx = cache.row_index(rows)
            plan = cache.write_plan(idx, start, t)                    # where every layer writes its keys
        if tree is not None and (cache is None or tree.shape != (n, t, t)):
            raise ValueError(f"tree must be [{n}, {t}, {t}] bool and needs a cache")
        width, mask_dtype = None, x.dtype
        if self.batch_invariant and cache is not None and cache.dtype == torch.float32:
            # read whole blocks of keys from the float32 cache (capacity: whole blocks, see new_cache)
            width = padded_keys(int(start.max()) + t)
            if width <= cache.capacity:
                mask_dtype = torch.float32
            else:
                width = None
        mask, upto = attention_mask(start, t, mask_dtype, input_ids.device, tree, width)
        if tree is not None and self.batch_invariant and self.layers[0].self_attn.attention_kernel is None:
            mask = TreeKeys(mask[:, 0] == 0)          # invariant_attention needs each query's keys as a prefix
        want = {k: None for k in capture}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i, idx, plan, width or upto, packing)
            if i in want:
                want[i] = x
        if cache is not None:
            cache.advance(rows, t if valid is None else valid.to(cache.device))
        h = self.norm(x)                                              # [N, T, H]
        if len(self.layers) - 1 in want:  # HF's last hidden_states entry is taken after the final norm
            want[len(self.layers) - 1] = h
        captured = torch.stack([want[k] for k in capture], dim=2) if capture else None  # [N, T, n, H]
        out = self.lm_head(h).float() if logits else None                 # [N, T, V] ([1, M, V] packed)
        if packing is not None:      # back to [N, T, ...], zeros at the padding (the logits when read)
            captured, h = (packing.unpack(z) if z is not None else None for z in (captured, h))
        return TargetOutput(out, captured, h, packing if out is not None else None)


def attention_mask(start: torch.Tensor | None, t: int, dtype: torch.dtype, device: torch.device,
                   tree: torch.Tensor | None = None, width: int | None = None) -> tuple[torch.Tensor, int]:
    """Additive mask for T new tokens per row. start=None: causal [T, T]. Else start [N] cached keys
    per row: query t of row i sees keys j <= start[i] + t -> [N, 1, T, S], S = max(start) + T (or
    `width` >= that: the keys past S are masked); with `tree` [N, T, T] bool it sees every cached
    key j < start[i] and new key start[i] + u iff tree[i, t, u]. Returns (mask, S)."""
    steps = torch.arange(t, device=device)
    if start is None:
        allowed, upto = steps[None, :] <= steps[:, None], t                          # [T, T]
    else:
        upto = int(start.max()) + t
        start = start.to(device)
        keys = torch.arange(width or upto, device=device)[None, None, :]              # [1, 1, S]
        limit = start[:, None] + steps[None, :]                                       # [N, T]
        allowed = keys <= limit[:, :, None]                                           # [N, T, S]
        if tree is not None:
            rel = keys - start[:, None, None]                                         # [N, 1, S] key - start
            new = (rel >= 0) & (rel < t)
            seen = tree.to(device).gather(2, rel.clamp(0, t - 1).expand(-1, t, -1))  # [N, T, S]
            allowed = (keys < start[:, None, None]) | (new & seen)
        allowed = allowed[:, None]                                                    # [N, 1, T, S]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf")), upto


# ---------------------------------------------------------------------- loading
def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(path / f)))
    return sd


def hf_to_native(sd: dict[str, torch.Tensor], cfg: TargetConfig) -> dict[str, torch.Tensor]:
    """Map an HF Llama/Qwen state dict to TargetModel's names (fusing q|k|v and gate|up)."""
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"checkpoint is missing tensor {key!r}")
        return sd.pop(key)

    out["embed_tokens.weight"] = take("embed_tokens.weight")
    out["norm.weight"] = take("norm.weight")
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + name] = take(p + name)
        out[a + "wqkv.weight"] = torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"])
        if cfg.attention_bias:
            out[a + "wqkv.bias"] = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"])
        out[a + "o_proj.weight"] = take(a + "o_proj.weight")
        if cfg.o_bias:
            out[a + "o_proj.bias"] = take(a + "o_proj.bias")
        if cfg.qk_norm:
            out[a + "q_norm.weight"], out[a + "k_norm.weight"] = take(a + "q_norm.weight"), take(a + "k_norm.weight")
        m = p + "mlp."
        out[m + "gate_up.weight"] = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        out[m + "down_proj.weight"] = take(m + "down_proj.weight")
        if cfg.mlp_bias:
            out[m + "gate_up.bias"] = torch.cat([take(m + "gate_proj.bias"), take(m + "up_proj.bias")])
            out[m + "down_proj.bias"] = take(m + "down_proj.bias")
    leftover = [k for k in sd if "rotary_emb" not in k]
    if leftover:
        raise KeyError(f"checkpoint has tensors this {cfg.model_type} target does not use: {leftover[:5]}")
    return out


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> tuple[str, ...]:
    """This CPU's feature flags (/proc/cpuinfo, read once; () where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    return tuple(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 or AMX-BF16). Without them PyTorch's
    bf16 matmuls run at a fraction of fp32 speed once more than one token is in flight
    (results/verify_cost_cpu.md), so bf16 only pays for the target where they exist."""
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles for bf16 (Sapphire Rapids and later Xeons): there an 8-token
    bf16 verify costs about 1.1 plain steps (results/verify_cost_amx.md)."""
    return "amx_bf16" in _cpu_flags()


def resolve_precision(precision: torch.dtype | str | None, device: str | torch.device = "cpu") -> str:
    """"auto" (or None) -> the serving precision here: bfloat16 on CUDA and on CPUs with AMX-BF16;
    on other CPUs bf16-gemm where the CPU has AVX512-BF16 and the kernel can be built (on a 2-core
    EPYC an 8-token verify costs about 1.3 plain steps against 1.9 in fp16-weights, and the plain
    step is no slower: results/serving_bf16_gemm_epyc/), else fp16-weights where fbgemm is
    available (half the bytes per step, fp32 arithmetic), else float32. On AMX an 8-token verify
    costs 1.09 plain steps in bf16 against 1.30 in fp16-weights (results/verify_cost_amx.md), so a
    served speculative request is faster in bf16 although a plain step is slower
    (results/serving_dtype_cpu: through Triton, `lilicorr` with prompt lookup in bf16 against
    fp16-weights, and `ar` at concurrency 4). bf16 and bf16-gemm on a CPU load batch-invariant
    (`load_target`), so both stay lossless; where this machine's kernels fail that check,
    `load_target` serves auto in the CPU's next precision instead. Names in PRECISIONS and torch
    dtypes pass through (as names)."""
    if precision is None or precision == "auto":
        return _auto_order(device)[0]
    if isinstance(precision, torch.dtype):
        precision = str(precision).removeprefix("torch.")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown dtype {precision!r}; choose auto, {', '.join(PRECISIONS)}")
    if precision in CPU_GEMM_PRECISIONS and str(device).startswith("cuda"):
        raise ValueError(f"{precision} is a CPU precision; use bfloat16 on CUDA")
    return precision


def _auto_order(device: str | torch.device = "cpu") -> list[str]:
    """What "auto" tries, in order, until a precision loads lossless (`load_target`): bfloat16 on
    CUDA; on a CPU bfloat16 where it has AMX-BF16, then `_cpu_fallbacks`' order."""
    if str(device).startswith("cuda"):
        return ["bfloat16"]
    head = ["bfloat16"] if cpu_has_amx_bf16() else []
    return head + _cpu_fallbacks()


def _cpu_fallbacks() -> list[str]:
    """A CPU's precisions without AMX, best first: bf16-gemm where the CPU has AVX512-BF16 and the
    kernel can be built, fp16-weights where fbgemm has it, and float32."""
    from .bf16_gemm import bf16_gemm_available
    from .fp16_linear import fbgemm_fp16_available
    return ((["bf16-gemm"] if bf16_gemm_available() else []) + (["fp16-weights"] if fbgemm_fp16_available() else [])
            + ["float32"])


def precision_variant(spec: str) -> tuple[str, bool | None]:
    """A precision as benchmark scripts write it -> (dtype for `load_target`, its batch_invariant):
    "NAME" keeps load_target's default, "NAME:plain" asks for PyTorch's own kernels (bf16 on a
    CPU is otherwise batch-invariant)."""
    name, _, variant = spec.partition(":")
    if variant not in ("", "plain"):
        raise ValueError(f"precision {spec!r}: the only variant is NAME:plain (PyTorch's own kernels)")
    return name, (False if variant else None)


def resolve_dtype(dtype: torch.dtype | str | None, device: str | torch.device = "cpu") -> torch.dtype:
    """The torch dtype of the target's activations (and non-matrix weights) under `resolve_precision`:
    fp16-weights and bf16-gemm compute in float32."""
    name = resolve_precision(dtype, device)
    return torch.float32 if name in CPU_GEMM_PRECISIONS else getattr(torch, name)


def load_target(path: str | os.PathLike, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                yarn_factor: float | None = None, batch_invariant: bool | None = None) -> TargetModel:
    """Load an HF folder (config.json + safetensors, single file or sharded) as a frozen TargetModel.
    dtype is a torch dtype, a name in PRECISIONS or "auto" (`resolve_precision`); the model's
    `precision` attribute records the resolved name. `batch_invariant` (default: bf16 and bf16-gemm
    on a CPU) switches on `lilicorr.batch_invariant`'s mode, so a k-token verify decides as k
    one-token steps would; it is checked on this machine's kernels first, and a target whose kernels
    fail the check keeps PyTorch's own (with a warning: greedy speculative output may then differ
    from plain greedy decoding on near-ties), except under "auto", which then loads the next
    precision of `_auto_order` (bf16 -> bf16-gemm -> fp16-weights -> float32 on a CPU) so that
    auto is always lossless."""
    if not (dtype is None or dtype == "auto"):
        return _load_precision(Path(path), resolve_precision(dtype, device), device, yarn_factor, batch_invariant)
    import warnings
    order = _auto_order(device)
    for name, after in zip(order, order[1:] + [None]):
        model = _load_precision(Path(path), name, device, yarn_factor, batch_invariant, warn=after is None)
        checked = batch_invariant is not False and name in BATCH_INVARIANT_PRECISIONS
        if after is None or not checked or model.batch_invariant:
            return model
        warnings.warn(f"{name} kernels on this machine are not batch-invariant: dtype auto serves {after}",
                      RuntimeWarning, stacklevel=2)
    raise AssertionError("unreachable: the last precision of the auto order is returned")


def _load_precision(path: Path, precision: str, device: str | torch.device, yarn_factor: float | None,
                    batch_invariant: bool | None, warn: bool = True) -> TargetModel:
    """`load_target` at one resolved precision name; `warn`: warn where batch-invariant mode fails."""
    cfg = TargetConfig.from_hf_dir(path)
    dtype = resolve_dtype(precision, device)
    sd = {k: v.to(dtype) for k, v in hf_to_native(_read_safetensors(path), cfg).items()}
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    with torch.device("meta"):  # no random init: every tensor comes from the checkpoint
        model = TargetModel(cfg)
    model.load_state_dict(sd, assign=True, strict=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(device)
    if yarn_factor:
        model.enable_yarn(yarn_factor)
    model.requires_grad_(False)
    if precision == "fp16-weights":
        from .fp16_linear import use_fp16_weights
        use_fp16_weights(model)
    elif precision == "bf16-gemm":
        from .bf16_gemm import use_bf16_gemm
        use_bf16_gemm(model)
    if precision in CPU_GEMM_PRECISIONS:
        model.gemm_precision = precision
    if batch_invariant is None:
        batch_invariant = precision in BATCH_INVARIANT_PRECISIONS and torch.device(device).type == "cpu"
    if batch_invariant:
        _make_batch_invariant(model, warn=warn)
    return model.eval()


def _use_fused_attention(model: TargetModel) -> bool:
    """Batch-invariant bf16 attends with bf16-gemm's compiled kernel (`bf16_gemm.fused_attention`:
    each query on its own over the keys its mask leaves, in key order) where this CPU can build it,
    instead of `invariant_attention`'s blocked GEMMs: on a 2-core AMX Xeon a plain step is 11%
    cheaper at 1 row and 14% at 8 with it (results/fused_attention_bf16_amx/), and a draft tree's
    queries need no keys copied into place (`TreeKeys`). Returns whether it did; bf16-gemm's target has the kernel already."""
    from .bf16_gemm import bf16_gemm_available, fused_attention
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if not attns or any(m.attention_kernel is not None for m in attns) or not bf16_gemm_available():
        return False
    for m in attns:
        m.attention_kernel = fused_attention
    return True


def use_blocked_attention(model: TargetModel) -> None:
    """A batch-invariant bf16 target back on `invariant_attention`'s blocked GEMMs (what it used
    before `_use_fused_attention`): for side-by-side benchmarks (`scripts/verify_cost.py`'s
    NAME:blocked). bf16-gemm's target keeps its kernel."""
    if not model.batch_invariant or getattr(model, "gemm_precision", None) == "bf16-gemm":
        raise ValueError("blocked attention is for a batch-invariant bf16 target")
    for m in model.modules():
        if isinstance(m, Attention):
            m.attention_kernel = None


def _make_batch_invariant(model: TargetModel, warn: bool = True) -> None:
    """Switch on batch-invariant mode where this machine's kernels pass the check; else keep
    PyTorch's kernels and warn (unless not `warn`: the caller decides). `model.batch_invariant`
    records which."""
    import warnings

    from .batch_invariant import check_batch_invariant, fit_single_rows, unpack, use_batch_invariant

    if model.embed_tokens.weight.device.type != "cpu":
        raise ValueError("batch-invariant mode is for CPU targets")
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    use_batch_invariant(model)
    fused = _use_fused_attention(model)
    fit_single_rows(model)
    failures = check_batch_invariant(model)
    if any(f.startswith("linear") for f in failures) and unpack(model):
        fit_single_rows(model)                            # oneDNN's prepacked kernel failed: F.linear
        failures = check_batch_invariant(model)
    model.batch_invariant = not failures
    if failures:
        for name, linear in linears.items():            # back to the plain modules and SDPA
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, linear)
        for m in model.modules():
            if isinstance(m, Attention):
                m.invariant_attention = False
                if fused:
                    m.attention_kernel = None
        if warn:
            warnings.warn(f"{model.precision} kernels on this machine are not batch-invariant ({failures[0]}"
                          f"{f' and {len(failures) - 1} more' if len(failures) > 1 else ''}): greedy speculative "
                          "output may differ from plain greedy decoding on near-ties; float32 or fp16-weights "
                          "keep it equal", RuntimeWarning, stacklevel=3)
