"""Training loop: AdamW with the two learning rates / weight decays of Table 4, cosine schedule
with warmup, gradient clipping, data parallelism over torch.distributed (gloo on CPU, nccl on GPU),
atomic checkpoints with resume.

Data parallelism is plain gradient all-reduce with *global* loss normalisation: each rank sums its
loss terms, the counts (DFlash weights, supervised slots) are all-reduced before the division, and
gradients are summed across ranks. A W-process run therefore follows the same trajectory as a
1-process run with the same global batch (up to floating-point summation order).
"""
from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from lilicorr import checkpoint as ckpt_io
from lilicorr.config import LiLiCorrConfig
from lilicorr.losses import combine
from lilicorr.model import LiLiCorrModel
from lilicorr.profiling import nvtx_range
from lilicorr.training import collate, sample_anchors, summarize_metrics, training_forward


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1

    @property
    def enabled(self) -> bool:
        return self.world > 1


def init_distributed(device: str | torch.device | None = None) -> DistInfo:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; nccl when training on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size())


def param_groups(model: LiLiCorrModel, cfg: LiLiCorrConfig):
    tc = cfg.train
    groups = [{"params": [p for p in model.drafter.parameters() if p.requires_grad],
               "lr": tc.lr_drafter, "weight_decay": tc.weight_decay_drafter, "name": "drafter"}]
    if model.head is not None:
        groups.append({"params": list(model.head.parameters()), "lr": tc.lr_head,
                       "weight_decay": tc.weight_decay_head, "name": "head"})
    return groups


def cosine_with_warmup(step: int, total: int, warmup_ratio: float) -> float:
    warm = max(1, int(round(total * warmup_ratio)))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class TrainState:
    step: int = 0
    history: list = field(default_factory=list)


class Trainer:
    def __init__(self, cfg: LiLiCorrConfig, target, sequences, out_dir, pad_id: int,
                 dist_info: DistInfo | None = None, micro_batch: int = 0, autocast_bf16: bool = False,
                 features=None, teacher_head=None):
        self.cfg, self.target, self.sequences = cfg, target, sequences
        self.out_dir, self.pad_id = Path(out_dir), pad_id
        self.dist = dist_info or DistInfo()
        tc = cfg.train
        if tc.global_batch % self.dist.world:
            raise ValueError(f"global batch {tc.global_batch} is not divisible by {self.dist.world} ranks")
        if len(sequences) < self.dist.world:
            raise ValueError(f"{len(sequences)} training sequence(s) cannot feed {self.dist.world} ranks")
        self.device = target.embed_tokens.weight.device        # train where the target lives
        self.per_rank = tc.global_batch // self.dist.world
        self.micro_batch = micro_batch or self.per_rank
        torch.manual_seed(tc.seed)                               # identical init on every rank
        self.model = LiLiCorrModel(cfg, target).to(self.device)
        if tc.freeze_drafter:
            if self.model.head is None:
                raise ValueError("a frozen drafter leaves nothing to train without a LiLiCorr head (--vanilla)")
            self.model.drafter.requires_grad_(False)   # no graph through it: the head's pass alone
        self.optimizer = torch.optim.AdamW(param_groups(self.model, cfg), betas=(0.9, 0.95), eps=1e-8)
        steps_per_epoch = max(1, len(sequences) // tc.global_batch)
        self.total_steps = tc.max_steps or steps_per_epoch * tc.epochs
        self.steps_per_epoch = steps_per_epoch
        self.state = TrainState()
        self.autocast_bf16 = autocast_bf16
        self.features = features          # optional FeatureStore: skips the target forward
        self.extra_meta: dict = {}        # recorded in every checkpoint's meta (vocabulary, precision)
        if (teacher_head is None) != (cfg.loss.head_distill <= 0):
            raise ValueError("lattice distillation needs both a teacher head and a weight head_distill > 0")
        if teacher_head is not None and self.model.head is None:
            raise ValueError("lattice distillation needs a LiLiCorr head to train (not --vanilla)")
        self.teacher_head = teacher_head  # frozen LiLiCorrHead distilled into the head, or None

    # -- data order: a function of (seed, epoch) only, so resume and world size don't change it --
    def batch_indices(self, step: int) -> list[int]:
        tc = self.cfg.train
        epoch, within = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.sequences)))
        random.Random(tc.seed * 1000003 + epoch).shuffle(order)
        return order[within * tc.global_batch:(within + 1) * tc.global_batch]

    def anchor_generators(self, step: int, indices: list[int]) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(self.cfg.train.seed * 7919 + step * 100003 + i) for i in indices]

    # -- one optimizer step ------------------------------------------------------------------
    def train_step(self) -> dict:
        step = self.state.step
        idx = self.batch_indices(step)
        mine = idx[self.dist.rank * self.per_rank:(self.dist.rank + 1) * self.per_rank]
        self.optimizer.zero_grad(set_to_none=True)
        outs = []
        for lo in range(0, len(mine), self.micro_batch):
            chunk = mine[lo:lo + self.micro_batch]
            ids, mask, _ = collate([self.sequences[i] for i in chunk], self.pad_id)
            anchors, valid = sample_anchors(mask, self.cfg.train.num_anchors, self.anchor_generators(step, chunk))
            ids, mask, anchors, valid = (x.to(self.device) for x in (ids, mask, anchors, valid))
            feats = None
            if self.features is not None:
                feats = tuple(f.to(self.device) for f in self.features.batch(chunk, ids.shape[1]))
            with nvtx_range("train/forward"), torch.autocast(self.device.type, torch.bfloat16,
                                                             enabled=self.autocast_bf16):
                outs.append(training_forward(self.model, self.target, ids, mask, anchors, valid, feats,
                                             self.teacher_head))
        counts = self._global_counts(outs)
        parts_sum: dict[str, float] = {}
        with nvtx_range("train/backward"):
            for out in outs:
                loss, parts = combine(out.terms, self.cfg.loss, counts, vanilla=self.cfg.vanilla)
                loss.backward()
                for k2, v in parts.items():
                    parts_sum[k2] = parts_sum.get(k2, 0.0) + v
        with nvtx_range("train/optimizer"):
            self._all_reduce_grads()
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip)
            scale = cosine_with_warmup(step, self.total_steps, self.cfg.train.warmup_ratio)
            for g in self.optimizer.param_groups:
                g["lr"] = g.setdefault("base_lr", g["lr"]) * scale
            self.optimizer.step()
        metrics = self._reduce_metrics([o.metrics for o in outs])
        self.state.step += 1
        record = {"step": self.state.step, **{k2: self._all_sum(v) for k2, v in parts_sum.items()},
                  "grad_norm": float(grad_norm), "lr_scale": scale, **summarize_metrics(metrics)}
        self.state.history.append(record)
        return record

    def _global_counts(self, outs) -> dict:
        dw = sum(o.terms.dflash_weight.detach() for o in outs)
        ns = sum(o.terms.num_supervised.detach() for o in outs)
        kd = sum(o.terms.kd_rows.detach() if o.terms.kd_rows is not None else 0.0 for o in outs)
        counts = torch.stack([torch.as_tensor(x, dtype=torch.float32, device=self.device) for x in (dw, ns, kd)])
        if self.dist.enabled:
            dist.all_reduce(counts)
        return {"dflash_weight": counts[0], "num_supervised": counts[1], "kd_rows": counts[2]}

    def _all_reduce_grads(self):
        if not self.dist.enabled:
            return
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)

    def _all_sum(self, value: float) -> float:
        if not self.dist.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t)

    def _reduce_metrics(self, ms: list[dict]) -> dict:
        total = {k: sum(m[k] for m in ms) for k in ms[0]}
        if self.dist.enabled:
            for v in total.values():
                dist.all_reduce(v)
        return total

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path=None, save_dtype: torch.dtype | None = None, with_optimizer: bool = True):
        if self.dist.rank != 0:
            return None
        state = self.model.state_dict()
        if save_dtype is not None:
            state = {k: v.to(save_dtype) if v.is_floating_point() else v for k, v in state.items()}
        opt = None
        if with_optimizer:
            opt = {"optimizer": self.optimizer.state_dict(), "step": self.state.step,
                   "rng": torch.get_rng_state()}
        meta = {"step": self.state.step, "total_steps": self.total_steps, "history": self.state.history,
                "time": time.time(), **self.extra_meta}
        return ckpt_io.save_checkpoint(path or self.out_dir, self.cfg, state, self.target.config, meta, opt)

    def load_weights(self, path, drafter_only: bool = False) -> None:
        """The model's weights from checkpoint `path`, as float32 master weights (no optimizer state).
        drafter_only: load the drafter's tensors alone and keep the head as initialised (a head of
        another shape trained on that drafter)."""
        state = ckpt_io.load_state_dict(path)
        state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        if drafter_only:
            prefix = "drafter."
            ckpt_io.load_into(self.model.drafter, {k[len(prefix):]: v for k, v in state.items()
                                                   if k.startswith(prefix)}, path)
        else:
            ckpt_io.load_into(self.model, state, path)

    def resume(self, path) -> bool:
        """Continue from a checkpoint written by `save` (same config); False if there is none."""
        path = Path(path)
        if not (path / ckpt_io.META).exists():
            return False
        cfg, fingerprint = ckpt_io.read_config(path)
        ckpt_io.check_target(path, fingerprint, self.target.config)
        if cfg.to_dict()["drafter"] != self.cfg.to_dict()["drafter"] or cfg.vanilla != self.cfg.vanilla \
                or cfg.head != self.cfg.head:
            raise ckpt_io.CheckpointError(f"checkpoint {path} has a different model config; use another --out")
        self.load_weights(path)
        opt_file = path / ckpt_io.OPTIMIZER
        if not opt_file.exists():
            raise ckpt_io.CheckpointError(f"checkpoint {path} has no optimizer state; cannot resume")
        try:
            opt = torch.load(opt_file, map_location="cpu", weights_only=False)
            self.optimizer.load_state_dict(opt["optimizer"])
            rng, step = opt["rng"], int(opt["step"])
        except Exception as e:
            raise ckpt_io.CheckpointError(f"checkpoint {path}: {ckpt_io.OPTIMIZER} is corrupt ({e})") from e
        torch.set_rng_state(rng)
        self.state = TrainState(step=step, history=ckpt_io.read_meta(path).get("history", []))
        return True
