"""Checkpoint directories: appear whole or not at all.

Layout of a checkpoint directory:
    config.json        LiLiCorrConfig (drafter fields resolved for the target) + target fingerprint
    model.safetensors  drafter.* and head.* parameters (the frozen target is never stored)
    optimizer.pt       optimizer + scheduler + step + RNG state (training only; optional)
    meta.json          step, losses, data position; written last (its presence marks completeness)
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lilicorr.config import LiLiCorrConfig

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.pt"
META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or does not match what it is loaded into."""


def target_fingerprint(target_cfg) -> dict:
    """What a checkpoint must agree with in the target it is used with."""
    return {"model_type": target_cfg.model_type, "hidden_size": target_cfg.hidden_size,
            "num_hidden_layers": target_cfg.num_hidden_layers, "vocab_size": target_cfg.vocab_size}


def check_writable(path) -> None:
    """Refuse to overwrite something that is not a checkpoint directory (a save replaces `path`
    whole, so an existing non-empty folder of other files would be deleted)."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} exists and is not a directory")
    if any(path.iterdir()) and not ((path / META).is_file() or (path / CONFIG).is_file()):
        raise CheckpointError(f"refusing to write a checkpoint over {path}: it is a non-empty directory "
                              f"that does not hold a checkpoint ({CONFIG}/{META} missing)")


def atomic_dir(final: Path, fill, resume: Path | None = None) -> Path:
    """Create `final` by filling a sibling temp dir and renaming it into place (replacing an old one).
    With `resume` (a fixed sibling path), that dir is the temp dir and is kept when `fill` fails or is
    interrupted, so a rerun's `fill` can skip what it already holds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if resume is None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    else:
        tmp = Path(resume)
        tmp.mkdir(exist_ok=True)
    os.chmod(tmp, 0o755)                      # mkdtemp makes 0700; a result dir is a normal dir
    try:
        fill(tmp)
        if final.exists():
            # unique sibling name (a stale one from a crashed run must not block the rename)
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            try:
                os.replace(final, old)  # rename onto an empty directory is allowed on POSIX
            except BaseException:
                old.rmdir()
                raise
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)  # put the previous version back
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        if resume is None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def save_checkpoint(path, cfg: LiLiCorrConfig, state_dict: dict, target_cfg, meta: dict,
                    optimizer_state: dict | None = None) -> Path:
    """Write a checkpoint directory atomically. state_dict holds drafter.*/head.* tensors.
    Refuses (CheckpointError) to replace a non-empty directory that is not a checkpoint."""
    check_writable(path)

    def fill(tmp: Path):
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        doc = {"lilicorr": cfg.to_dict(), "target": target_fingerprint(target_cfg)}
        (tmp / CONFIG).write_text(json.dumps(doc, indent=2, sort_keys=True))
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER)
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True))
    return atomic_dir(Path(path), fill)


def read_config(path) -> tuple[LiLiCorrConfig, dict]:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    for name in (CONFIG, WEIGHTS, META):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    try:
        doc = json.loads((path / CONFIG).read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("lilicorr"), dict):
            raise ValueError("expected an object with a 'lilicorr' section")
        fingerprint = doc.get("target", {})
        if not isinstance(fingerprint, dict):
            raise ValueError("'target' is not an object")
        return LiLiCorrConfig.from_dict(doc["lilicorr"]), fingerprint
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path}: {CONFIG} is corrupt ({e})") from e


def check_target(path, fingerprint: dict, target_cfg) -> None:
    want = target_fingerprint(target_cfg)
    diff = {k: (fingerprint.get(k), v) for k, v in want.items() if fingerprint.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs target {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(f"checkpoint {path} was trained for another target ({detail})")


def load_state_dict(path, names=None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, or only those in `names` (a missing one is a CheckpointError)."""
    file = Path(path) / WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {WEIGHTS} is missing")
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
            missing = sorted(set(names or ()) - set(keys))
            if missing:
                raise CheckpointError(f"checkpoint {path} has no tensor {', '.join(missing)}")
            return {k: f.get_tensor(k) for k in (names or keys)}
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises several types for truncated / garbage files
        raise CheckpointError(f"checkpoint {path}: {WEIGHTS} is truncated or corrupt ({e})") from e


def load_into(module: torch.nn.Module, state: dict[str, torch.Tensor], path) -> None:
    """Strict load with an error that names missing, unexpected and mis-shaped tensors."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in set(own) & set(state) if own[k].shape != state[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append("shape mismatch " + "; ".join(sorted(shapes)[:5]))
        raise CheckpointError(f"checkpoint {path} does not match the model: " + ", ".join(parts))
    module.load_state_dict(state, strict=True)


def read_meta(path) -> dict:
    file = Path(path) / META
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {META} is missing")
    try:
        meta = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {META} is corrupt ({e})") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path}: {META} is corrupt (not an object)")
    return meta


@dataclass
class Checkpoint:
    cfg: LiLiCorrConfig
    state: dict[str, torch.Tensor]
    meta: dict
    target: dict                    # fingerprint of the target it was trained for


def load_checkpoint(path, target_cfg=None) -> Checkpoint:
    """Read a checkpoint directory (config, tensors, meta), checked against `target_cfg` if given.
    Every failure is a CheckpointError that names the directory and the problem."""
    cfg, fingerprint = read_config(path)
    if target_cfg is not None:
        check_target(path, fingerprint, target_cfg)
    return Checkpoint(cfg, load_state_dict(path), read_meta(path), fingerprint)


def file_sha256(path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
