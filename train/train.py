"""Joint training of the DFlash drafter and the LiLiCorr head against a frozen target.

    python train/train.py --preset cpu --target DIR --data FILE.jsonl --out DIR [--vanilla] [--margin]
    torchrun --nproc-per-node 2 train/train.py ...           # data parallel (gloo on CPU, nccl on GPU)

Resumes from --out when it holds a checkpoint of the same config. Checkpoints appear atomically.
`--init CKPT` starts a new run from another checkpoint's weights (its model config, draft vocabulary
and mask token; a fresh optimizer and schedule), e.g. to train a drafter on further on new data.
With a head shape flag (`--head-width` ...) that differs from the checkpoint's head, only its drafter
is loaded and the head starts fresh; `--freeze-drafter` then trains that head alone on it.
`--distill-head CKPT` adds lattice distillation: the head also learns the score distributions of
CKPT's head (e.g. a narrow head from the wide head it replaces) on every row of the same lattices.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from lilicorr import checkpoint as ckpt_io
from lilicorr.config import preset
from lilicorr.model import load_teacher_head
from lilicorr.target import load_target
from lilicorr.trainer import Trainer, init_distributed
from lilicorr.training import load_sequences


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu", choices=["cpu", "paper"])
    p.add_argument("--target", required=True, help="HF folder of the frozen target")
    p.add_argument("--data", required=True, nargs="+",
                   help="JSONL file(s) from train/regen.py (several: e.g. one per regen shard, in order)")
    p.add_argument("--out", required=True, help="checkpoint directory (resumed if present)")
    p.add_argument("--vanilla", action="store_true", help="DFlash loss only, no LiLiCorr head")
    p.add_argument("--margin", action="store_true", help="LiLiCorr + margin (Appendix G: mu=0.5, rho=2)")
    p.add_argument("--no-distractor", action="store_true", help="Appendix C ablation: drop L_dist")
    p.add_argument("--steps", type=int, default=0, help="override the number of optimizer steps")
    p.add_argument("--epochs", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=0)
    p.add_argument("--micro-batch", type=int, default=0, help="per-rank micro batch (grad accumulation)")
    p.add_argument("--num-anchors", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=0)
    p.add_argument("--drafter-layers", type=int, default=0)
    p.add_argument("--block-size", type=int, default=0)
    p.add_argument("--captured-layers", type=int, default=0, help="n captured target layers (preset: 5)")
    p.add_argument("--beta", type=float, default=0.0, help="decay of the DFlash CE, Eq. 6 (preset: 4 at B=8)")
    p.add_argument("--dflash-norm", choices=["token_mean", "sum"], default=None,
                   help="L_DFlash normalisation: token_mean (SpecForge, default) or sum (Eq. 6 as written)")
    p.add_argument("--self-distill", type=float, default=0.0, metavar="A",
                   help="share A in (0, 1] of L_DFlash's CE against the target's soft labels (self-logit "
                        "distillation; preset: 0, hard labels)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="draft vocabulary of the N most frequent training tokens (0: full vocabulary)")
    p.add_argument("--mask-token", default="auto",
                   help="mask embedding: auto (an unused special row of the target, else learned), "
                        "learned, or a token id")
    p.add_argument("--head-width", type=int, default=0, help="LiLiCorr head width W (preset: 256)")
    p.add_argument("--head-ffn", type=int, default=0, help="the head's FFN width (preset: 512)")
    p.add_argument("--head-embed", type=int, default=0, help="d_e, width of the in/out vectors (preset: 128)")
    p.add_argument("--head-layers", type=int, default=0, help="lattice Transformer layers (preset: 2)")
    p.add_argument("--head-heads", type=int, default=0, help="attention heads of the head (preset: 4)")
    p.add_argument("--top-k", type=int, default=0, help="K candidates per slot (preset: 8)")
    p.add_argument("--freeze-drafter", action="store_true",
                   help="train the head alone; the drafter (from --init) stays as it is")
    p.add_argument("--distill-head", default=None, metavar="CKPT",
                   help="distil the head towards CKPT's head: the KL between their score distributions on "
                        "every row of the lattice, inside gamma with weight --distill-weight")
    p.add_argument("--distill-weight", type=float, default=1.0, metavar="KAPPA",
                   help="weight of the lattice distillation beside the reranker's CE (default 1)")
    p.add_argument("--distill-temperature", type=float, default=1.0, metavar="T",
                   help="softmax temperature of both heads' rows in the distillation (default 1)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="bf16: autocast with fp32 master weights (Table 4); fp32: full precision; auto: bf16 "
                        "on CUDA and on CPUs with native bf16 matmuls (AVX512-BF16/AMX), fp32 elsewhere")
    p.add_argument("--lr-drafter", type=float, default=0.0)
    p.add_argument("--lr-head", type=float, default=0.0)
    p.add_argument("--weight-decay-drafter", type=float, default=None, metavar="WD",
                   help="AdamW weight decay of the drafter's parameters (preset: Table 4's 0)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end)")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="also keep a weights-only copy every N steps in OUT.snapshots/step-NNNNN (tau vs steps; "
                        "NNNNN counts the --init checkpoint's steps too)")
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the final weights (optimizer state always float32)")
    p.add_argument("--features", default=None,
                   help="feature directory of precomputed target features (built on first use)")
    p.add_argument("--device", default=None,
                   help="cpu | cuda (default: cuda when available; each torchrun rank uses cuda:LOCAL_RANK)")
    p.add_argument("--log", default=None, help="JSONL log of every step (default OUT.log.jsonl)")
    p.add_argument("--init", default=None, metavar="CKPT",
                   help="start from this checkpoint's weights (its model config, draft vocabulary and mask "
                        "token; a fresh optimizer and schedule); ignored when --out resumes")
    return p.parse_args(argv)


def build_config(args, target_cfg):
    cfg = preset(args.preset)
    tc, dc, lc = cfg.train, cfg.drafter, cfg.loss
    overrides = ((tc, "max_steps", args.steps), (tc, "epochs", args.epochs), (tc, "global_batch", args.global_batch),
                 (tc, "num_anchors", args.num_anchors), (tc, "seq_len", args.seq_len),
                 (tc, "lr_drafter", args.lr_drafter), (tc, "lr_head", args.lr_head),
                 (tc, "save_every", args.save_every), (dc, "num_layers", args.drafter_layers),
                 (dc, "block_size", args.block_size), (dc, "num_target_layers_captured", args.captured_layers),
                 (dc, "draft_vocab_size", args.draft_vocab), (lc, "beta", args.beta),
                 (lc, "dflash_norm", args.dflash_norm), (lc, "distill", args.self_distill))
    for section, name, value in overrides:       # unset flags (0 / None) keep the preset's value
        if value:
            setattr(section, name, value)
    if not 0.0 <= args.self_distill <= 1.0:
        raise ValueError(f"--self-distill {args.self_distill}: the soft labels' share must be in [0, 1]")
    if args.weight_decay_drafter is not None:      # 0 is a real choice here, so None means unset
        if args.weight_decay_drafter < 0:
            raise ValueError(f"--weight-decay-drafter {args.weight_decay_drafter}: must be >= 0")
        tc.weight_decay_drafter = args.weight_decay_drafter
    if args.seed is not None:
        tc.seed = args.seed
    cfg.vanilla = args.vanilla
    if args.margin:
        cfg.loss.mu, cfg.loss.rho = 0.5, 2.0
    if args.no_distractor:
        cfg.loss.distractor = False
    cfg.drafter = cfg.drafter.for_target(target_cfg)
    cfg.train.freeze_drafter = args.freeze_drafter
    if args.distill_head:
        if args.vanilla:
            raise ValueError("--distill-head distils into a LiLiCorr head; --vanilla has none")
        if args.distill_weight <= 0 or args.distill_temperature <= 0:
            raise ValueError(f"--distill-weight {args.distill_weight} and --distill-temperature "
                             f"{args.distill_temperature} must be > 0")
        cfg.loss.head_distill, cfg.loss.head_distill_temperature = args.distill_weight, args.distill_temperature
    return cfg


HEAD_SHAPE_FLAGS = (("head_width", "width"), ("head_ffn", "ffn_width"), ("head_embed", "embed_dim"),
                    ("head_layers", "num_layers"), ("head_heads", "num_heads"), ("top_k", "top_k"))


def apply_head_shape(args, cfg) -> None:
    """The head shape flags that are set, over cfg.head (the preset's or the --init checkpoint's)."""
    for flag, name in HEAD_SHAPE_FLAGS:
        value = getattr(args, flag)
        if value < 0:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: must be positive")
        if value:
            setattr(cfg.head, name, value)
    if cfg.head.width % cfg.head.num_heads:
        raise ValueError(f"head width {cfg.head.width} is not divisible by {cfg.head.num_heads} heads")


def _fail(message: str) -> int:
    print(f"train.py: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    # cheap input checks first, before the target is loaded or a process group is formed
    for path in args.data:
        if not Path(path).is_file():
            return _fail(f"--data {path}: no such file (make it with train/regen.py)")
    if not Path(args.target).is_dir():
        return _fail(f"--target {args.target}: no such directory (an HF folder with config.json)")
    try:
        ckpt_io.check_writable(args.out)
    except ckpt_io.CheckpointError as e:
        return _fail(str(e))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dist_info = init_distributed(device)
    if torch.device(device).type == "cuda" and torch.device(device).index is None:
        device = f"cuda:{torch.cuda.current_device()}"          # set to LOCAL_RANK by init_distributed
    torch.set_num_threads(max(1, torch.get_num_threads() // dist_info.world))
    try:
        target = load_target(args.target, dtype=torch.float32, device=device)
        cfg = build_config(args, target.config)
        seqs = load_sequences(args.data, cfg.train.seq_len)
        init_head = _init_config(args.init, cfg, target) if args.init else None
        apply_head_shape(args, cfg)                   # over the preset's head or the --init checkpoint's
        fresh_head = init_head is not None and not cfg.vanilla and cfg.head != init_head
        if args.init:
            vocab_info = _init_vocabulary(args.init, cfg, seqs)
        else:
            if args.freeze_drafter:
                raise ValueError("--freeze-drafter needs --init: the drafter to train a head on")
            vocab_info = _choose_vocabulary(args, cfg, target, seqs)
        pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
        if args.precision == "auto":
            from lilicorr.target import cpu_has_native_bf16
            native = str(device).startswith("cuda") or cpu_has_native_bf16()
            args.precision = "bf16" if native else "fp32"
        bf16 = args.precision == "bf16"
        teacher = load_teacher_head(args.distill_head, cfg, target) if args.distill_head else None
        features = _feature_store(args.features, target, cfg, seqs, dist_info, bf16) if args.features else None
        trainer = Trainer(cfg, target, seqs, args.out, pad_id=pad, dist_info=dist_info,
                          micro_batch=args.micro_batch, features=features, autocast_bf16=bf16,
                          teacher_head=teacher)
        if args.distill_head:
            trainer.extra_meta["distill_head"] = str(args.distill_head)
        if vocab_info.get("draft_ids") is not None:
            trainer.model.drafter.set_draft_vocab(vocab_info.pop("draft_ids"))
        trainer.extra_meta["vocabulary"] = vocab_info
        trainer.extra_meta["precision"] = args.precision
        resumed = trainer.resume(args.out)
        if args.init:
            if not resumed:
                trainer.load_weights(args.init, drafter_only=fresh_head)
            trainer.extra_meta["init"] = str(args.init)
            if fresh_head:
                trainer.extra_meta["init_parts"] = "drafter"     # the head started fresh
            # steps the initial weights had, counting the runs they came from (--init chains):
            # snapshots are named by total steps (init's + this run's)
            init_meta = ckpt_io.read_meta(args.init)
            trainer.extra_meta["init_step"] = int(init_meta.get("step", 0)) + int(init_meta.get("init_step", 0))
    except (FileNotFoundError, ValueError, KeyError, ckpt_io.CheckpointError) as e:
        if dist_info.enabled:
            torch.distributed.destroy_process_group()
        return _fail(str(e))
    log_path = Path(args.log or f"{args.out.rstrip('/')}.log.jsonl")
    is_main = dist_info.rank == 0
    if is_main:
        print(f"{'resumed at step ' + str(trainer.state.step) if resumed else 'fresh run'}: "
              f"{len(seqs)} sequences, {trainer.total_steps} steps, global batch {cfg.train.global_batch}, "
              f"{dist_info.world} rank(s), {'vanilla DFlash' if cfg.vanilla else 'LiLiCorr'}, {args.precision}, "
              f"mask token {cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None else 'learned'}"
              + (", a fresh head on the drafter of --init" if fresh_head else "")
              + (", drafter frozen" if cfg.train.freeze_drafter else "")
              + (f", distilling the head of {args.distill_head}" if args.distill_head else "")
              + (f", draft vocabulary {cfg.drafter.draft_vocab_size} ({100 * vocab_info['draft_coverage']:.2f}% "
                 f"of training tokens)" if cfg.drafter.draft_vocab_size else ""), flush=True)
    progress = _progress(trainer.total_steps, trainer.state.step, is_main)
    with progress as bar:
        task = bar.add_task("train", total=trainer.total_steps, completed=trainer.state.step, info="") if bar else None
        while trainer.state.step < trainer.total_steps:
            rec = trainer.train_step()
            if is_main:
                with log_path.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                info = f"loss {rec['total']:.3f} dflash {rec['dflash']:.3f} cov {rec['oracle_coverage']:.2f}"
                if "tau_lilicorr" in rec:
                    info += f" tau~ {rec['tau_argmax']:.2f}/{rec['tau_lilicorr']:.2f}"
                bar.update(task, completed=trainer.state.step, info=info)
            every = cfg.train.save_every
            if every and trainer.state.step % every == 0 and trainer.state.step < trainer.total_steps:
                trainer.save()
            _snapshot(args, trainer)
    save_dtype = torch.bfloat16 if args.save_dtype == "bfloat16" else None
    trainer.save(save_dtype=save_dtype)
    if is_main:
        print(f"checkpoint written to {args.out}", flush=True)
    if dist_info.enabled:
        torch.distributed.destroy_process_group()
    return 0


def snapshot_dir(out, step: int) -> Path:
    """Where `--snapshot-every` keeps the weights of step `step`."""
    return Path(f"{str(out).rstrip('/')}.snapshots") / f"step-{step:05d}"


def _snapshot(args, trainer) -> None:
    """A weights-only checkpoint (no optimizer state) every --snapshot-every steps, kept; named by
    total steps when the run started from --init (the initial weights' steps + this run's)."""
    step = trainer.state.step
    path = snapshot_dir(args.out, trainer.extra_meta.get("init_step", 0) + step)
    if args.snapshot_every and step % args.snapshot_every == 0 and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        trainer.save(path, save_dtype=torch.bfloat16, with_optimizer=False)


def _init_config(path, cfg, target):
    """Make `cfg` the model of checkpoint `path` (--init): its drafter (layers, block size, captured
    layers, draft vocabulary, mask token) and head; the vanilla flag must agree with the run's.
    Returns the checkpoint's head config (a copy: the head shape flags may change cfg.head after)."""
    init_cfg, fingerprint = ckpt_io.read_config(path)
    ckpt_io.check_target(path, fingerprint, target.config)
    if init_cfg.vanilla != cfg.vanilla:
        kind = "vanilla DFlash" if init_cfg.vanilla else "LiLiCorr"
        raise ValueError(f"--init {path} holds a {kind} model: train it with{'' if init_cfg.vanilla else 'out'} --vanilla")
    cfg.drafter, cfg.head = init_cfg.drafter, init_cfg.head
    return dataclasses.replace(init_cfg.head)


def _init_vocabulary(path, cfg, seqs) -> dict:
    """What the checkpoint's meta records when the draft vocabulary and mask token come from --init
    (the draft ids are in its weights); the coverage is over this run's data."""
    from lilicorr.draft_vocab import coverage, token_counts

    info: dict = {"mask_token_id": cfg.drafter.mask_token_id}
    if cfg.drafter.draft_vocab_size:
        ids = "drafter.draft_to_target"              # only this tensor: the weights load later
        counts = token_counts(seqs, cfg.drafter.vocab_size)
        info.update(draft_vocab_size=cfg.drafter.draft_vocab_size,
                    draft_coverage=coverage(counts, ckpt_io.load_state_dict(path, [ids])[ids]))
    return info


def _choose_vocabulary(args, cfg, target, seqs) -> dict:
    """Set cfg.drafter's mask token and draft vocabulary size from the flags and the training data;
    returns what the checkpoint's meta records (and the draft ids to load into the drafter)."""
    from lilicorr.draft_vocab import build_draft_vocab, coverage, token_counts, unused_special_token

    tc = target.config
    info: dict = {}
    if args.mask_token == "learned":
        cfg.drafter.mask_token_id = None
    elif args.mask_token == "auto":
        reserved = [tc.bos_token_id, tc.pad_token_id, *tc.eos_token_ids]
        cfg.drafter.mask_token_id = unused_special_token(
            args.target, token_counts(seqs, tc.vocab_size, completion_only=False), reserved)
    else:
        try:
            cfg.drafter.mask_token_id = int(args.mask_token)
        except ValueError:
            raise ValueError(f"--mask-token {args.mask_token!r}: use auto, learned or a token id") from None
        if not 0 <= cfg.drafter.mask_token_id < tc.vocab_size:
            raise ValueError(f"--mask-token {cfg.drafter.mask_token_id} is outside the vocabulary [0, {tc.vocab_size})")
    info["mask_token_id"] = cfg.drafter.mask_token_id
    n = cfg.drafter.draft_vocab_size
    if n and n >= tc.vocab_size:
        cfg.drafter.draft_vocab_size = n = 0          # as large as the target's: the full head
    if n:
        counts = token_counts(seqs, tc.vocab_size)
        ids = build_draft_vocab(counts, n, always=tc.eos_token_ids)
        info.update(draft_vocab_size=n, draft_coverage=coverage(counts, ids), draft_ids=ids)
    return info


def _feature_store(path, target, cfg, seqs, dist_info, bf16: bool = False):
    """Open the offline feature store, building it first (rank 0) when it does not exist
    (under bf16 autocast when training in bf16, like the target that serves)."""
    from lilicorr.features import FeatureStore, build_feature_store

    if not (Path(path) / "meta.json").exists() and dist_info.rank == 0:
        from tqdm import tqdm

        with tqdm(total=len(seqs), desc="target features", unit="seq") as bar, \
                torch.autocast(target.embed_tokens.weight.device.type, torch.bfloat16, enabled=bf16):
            build_feature_store(target, seqs, cfg.drafter.target_layer_ids, path, progress=bar.update)
    if dist_info.enabled:
        torch.distributed.barrier()
    return FeatureStore(path, target.config, cfg.drafter.target_layer_ids, seqs)


def _progress(total: int, done: int, enabled: bool):
    import contextlib

    if not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), TextColumn("{task.fields[info]}"))


if __name__ == "__main__":
    sys.exit(main())
