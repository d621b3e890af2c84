"""Configuration dataclasses. `PRESETS["paper"]` is the paper's Table 4; `PRESETS["cpu"]` trains in
minutes on a 2-core machine with the SmolLM2-135M target.

Drafter shapes that must agree with the target (hidden width, heads, vocabulary) are filled in from
the target's config by `DrafterConfig.for_target`; the preset only fixes what is the drafter's own.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TREE_NODES = 16     # rule `tree`'s draft-tree node budget M wherever none is given


@dataclass
class DrafterConfig:
    """DFlash block drafter (DESIGN.md §4). Width and heads default to the target's."""

    num_layers: int = 5
    block_size: int = 16                 # B: anchor + B-1 drafted slots
    num_target_layers_captured: int = 5  # n: captured target layers, evenly spaced 1..L-3
    # filled from the target by for_target()
    hidden_size: int = 0
    intermediate_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    vocab_size: int = 0
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int | None = None     # frozen target row used as mask embedding; None -> learned
    draft_vocab_size: int = 0            # N > 0: LM head over the N most frequent training tokens
                                         # (EAGLE-3 style, ids mapped back to the target's); 0 -> full
    initializer_range: float = 0.02

    def for_target(self, target_cfg: Any, mask_token_id: int | None = None) -> "DrafterConfig":
        """Return a copy with the target-dependent fields set from a TargetConfig."""
        ids = self.target_layer_ids or build_target_layer_ids(
            target_cfg.num_hidden_layers, self.num_target_layers_captured)
        return dataclasses.replace(
            self,
            hidden_size=target_cfg.hidden_size,
            intermediate_size=self.intermediate_size or target_cfg.intermediate_size,
            num_heads=self.num_heads or target_cfg.num_attention_heads,
            num_kv_heads=self.num_kv_heads or target_cfg.num_key_value_heads,
            head_dim=self.head_dim or target_cfg.head_dim,
            rms_norm_eps=target_cfg.rms_norm_eps,
            rope_theta=target_cfg.rope_theta,
            vocab_size=target_cfg.vocab_size,
            target_layer_ids=list(ids),
            num_target_layers_captured=len(ids),
            mask_token_id=mask_token_id if mask_token_id is not None else self.mask_token_id,
            draft_vocab_size=self.draft_vocab_size if 0 < self.draft_vocab_size < target_cfg.vocab_size else 0,
        )


def build_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """DFlash's rule: n ids evenly spaced from 1 to L-3 (Python round), one id -> L//2.

    Id k is the *output* of decoder layer k (0-based), i.e. HF hidden_states[k+1].
    Qwen3-8B (L=36, n=5) -> [1, 9, 17, 25, 33].
    """
    if n <= 0:
        raise ValueError(f"need at least one captured layer, got n={n}")
    if n == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(f"target has {num_target_layers} layers; spacing 1..L-3 needs L >= 4")
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


@dataclass
class HeadConfig:
    """LiLiCorr scoring head (Appendix A)."""

    top_k: int = 8              # K candidates per slot
    width: int = 1024           # hidden width of the lattice Transformer
    num_layers: int = 2
    num_heads: int = 8
    ffn_width: int = 2048
    embed_dim: int = 1024       # d_e, width of the unit in/out vectors
    sigma: float = 8.0          # cosine scale of Eq. 1 (Table 4)
    rms_norm_eps: float = 1e-6
    conf_hidden: int = 0        # hidden width of the confidence MLP; 0 -> width


@dataclass
class LossConfig:
    """Eq. 6, 7 and 13 weights (Table 4, Appendix G)."""

    beta: float = 7.0           # decay of the DFlash CE, Eq. 6
    # normalisation of L_DFlash: "token_mean" divides the weighted sum by the summed weights
    # (SpecForge, the default); "sum" is Eq. 6 as written, a plain sum over the slots of a block,
    # averaged over blocks (about (sum_s w_s)x larger, which shifts gamma's effective balance)
    dflash_norm: str = "token_mean"
    # self-logit distillation: the share of L_DFlash's per-slot CE taken against the target's own
    # distribution at that position (soft labels, temperature 1) instead of its greedy token;
    # 0 = hard labels only (DFlash), 1 = soft labels only
    distill: float = 0.0
    gamma: float = 0.25         # weight of the reranker objective, Eq. 7
    lam: float = 1.0            # distractor weight lambda, Eq. 7
    distractor: bool = True     # False -> Appendix C ablation (CE + DFlash only)
    mu: float = 0.0             # margin blend, Appendix G (0 = off, paper's "+ margin" uses 0.5)
    rho: float = 2.0            # hinge margin, Eq. 13
    # lattice distillation (not in the paper): weight kappa, inside gamma beside the reranker's
    # terms, of the KL from a teacher head's score distributions to this head's, over every row of
    # the lattice (the anchor's K scores and each candidate's K successor scores); 0 = off
    head_distill: float = 0.0
    head_distill_temperature: float = 1.0   # softmax temperature of both heads' rows (KL scaled by T^2)


@dataclass
class TrainConfig:
    lr_drafter: float = 6e-4
    lr_head: float = 1.5e-4
    weight_decay_drafter: float = 0.0
    weight_decay_head: float = 0.01
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    global_batch: int = 64
    seq_len: int = 3072
    epochs: int = 6
    num_anchors: int = 512
    max_steps: int = 0          # 0 -> epochs * len(data) / global_batch
    freeze_drafter: bool = False  # train the head alone on a fixed drafter (L_DFlash then has no gradient)
    seed: int = 42
    log_every: int = 10
    save_every: int = 0         # 0 -> only at the end


@dataclass
class LiLiCorrConfig:
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    vanilla: bool = False       # DFlash only: no head, no reranker loss

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "LiLiCorrConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config sections: {sorted(unknown)}")
        return cls(
            drafter=_build(DrafterConfig, d.get("drafter", {})),
            head=_build(HeadConfig, d.get("head", {})),
            loss=_build(LossConfig, d.get("loss", {})),
            train=_build(TrainConfig, d.get("train", {})),
            vanilla=bool(d.get("vanilla", False)),
        )


def _build(klass, d: dict):
    known = {f.name for f in dataclasses.fields(klass)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown {klass.__name__} fields: {sorted(unknown)}")
    return klass(**d)


# Serving precisions of the target. "fp16-weights": weight matrices rounded to fp16 and multiplied
# by fbgemm's fp16-weight GEMM, activations and everything else in float32 (CPU only;
# lilicorr/fp16_linear.py). "bf16-gemm": weight matrices and every GEMM input rounded to bf16, fp32
# accumulation (AVX512-BF16), everything else in float32 (CPU only; lilicorr/bf16_gemm.py). The
# others are plain torch dtypes for every tensor. Command lines accept "auto" besides these.
PRECISIONS = ("float32", "bfloat16", "float16", "fp16-weights", "bf16-gemm")
CPU_GEMM_PRECISIONS = ("fp16-weights", "bf16-gemm")   # float32 models whose linears run a packed CPU kernel
DTYPE_CHOICES = ("auto",) + PRECISIONS

def paper_preset() -> LiLiCorrConfig:
    """Table 4 exactly (Qwen3-8B target: 5 draft layers, B=16, K=8, d_e=1024, sigma=8)."""
    return LiLiCorrConfig()


def cpu_preset() -> LiLiCorrConfig:
    """Trains on 2 CPU cores with SmolLM2-135M (hidden 576, 30 layers) in bf16 autocast.

    Recipe as DFlash trains at B=8: 5 captured layers, decay 4 (Eq. 6) and dense anchors
    (seq_len/B). The draft vocabulary is chosen from the training data, so it is set by
    `train/train.py --draft-vocab N` rather than here."""
    return LiLiCorrConfig(
        drafter=DrafterConfig(num_layers=2, block_size=8, num_target_layers_captured=5),
        head=HeadConfig(top_k=8, width=256, num_layers=2, num_heads=4, ffn_width=512, embed_dim=128),
        loss=LossConfig(beta=4.0),
        train=TrainConfig(lr_drafter=1e-3, lr_head=5e-4, global_batch=8, seq_len=512, epochs=1,
                          num_anchors=64, log_every=5),
    )


PRESETS = {"paper": paper_preset, "cpu": cpu_preset}


def preset(name: str) -> LiLiCorrConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
