"""Offline target features (SpecForge's "offline" mode): run the frozen target once over the
training data and store, per sequence, the captured layers and the final hidden state, so every
training run and epoch skips the target forward (on CPU it dominates a training step).

Layout of a feature directory (appears atomically):
    meta.json                 target fingerprint, capture layer ids, dtype, number of sequences
    shard-00000.safetensors   captured_<i> [T_i, n, H] and last_hidden_<i> [T_i, H] for i in the shard
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lilicorr.checkpoint import atomic_dir, target_fingerprint

SHARD = 64


def build_feature_store(target, sequences, capture: list[int], out_dir, batch_size: int = 4,
                        dtype: torch.dtype = torch.bfloat16, progress=None) -> Path:
    """Run the target teacher-forced over `sequences` (list of training.Sequence) and store features."""
    def fill(tmp: Path):
        shard: dict[str, torch.Tensor] = {}
        for lo in range(0, len(sequences), batch_size):
            chunk = sequences[lo:lo + batch_size]
            t = max(len(s.ids) for s in chunk)
            ids = torch.zeros(len(chunk), t, dtype=torch.long)
            for i, s in enumerate(chunk):
                ids[i, : len(s.ids)] = torch.tensor(s.ids)
            with torch.no_grad():
                out = target(ids, torch.arange(t).expand(len(chunk), t), capture=capture, logits=False)
            for i, s in enumerate(chunk):
                j = lo + i
                shard[f"captured_{j}"] = out.captured[i, : len(s.ids)].to(dtype).contiguous()
                shard[f"last_hidden_{j}"] = out.last_hidden[i, : len(s.ids)].to(dtype).contiguous()
                if (j + 1) % SHARD == 0 or j + 1 == len(sequences):
                    save_file(shard, str(tmp / f"shard-{j // SHARD:05d}.safetensors"))
                    shard = {}
            if progress is not None:
                progress(len(chunk))
        meta = {"target": target_fingerprint(target.config), "capture": list(capture),
                "num_sequences": len(sequences), "lengths": [len(s.ids) for s in sequences],
                "dtype": str(dtype).removeprefix("torch.")}
        (tmp / "meta.json").write_text(json.dumps(meta))
    return atomic_dir(Path(out_dir), fill)


class FeatureStore:
    """Read access to a feature directory, checked against the sequences and capture ids."""

    def __init__(self, path, target_cfg, capture: list[int], sequences):
        self.path = Path(path)
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            raise FileNotFoundError(f"feature store {self.path} is missing or incomplete (no meta.json)")
        meta = json.loads(meta_file.read_text())
        if meta["target"] != target_fingerprint(target_cfg):
            raise ValueError(f"feature store {self.path} was made with another target")
        if meta["capture"] != list(capture):
            raise ValueError(f"feature store {self.path} captured layers {meta['capture']}, "
                             f"the drafter needs {list(capture)}")
        if meta["lengths"] != [len(s.ids) for s in sequences]:
            raise ValueError(f"feature store {self.path} does not match the training data (lengths differ)")
        self._handles: dict[int, object] = {}

    def _shard(self, j: int):
        k = j // SHARD
        if k not in self._handles:
            self._handles[k] = safe_open(str(self.path / f"shard-{k:05d}.safetensors"), framework="pt")
        return self._handles[k]

    def batch(self, indices: list[int], pad_to: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> captured [N, T, n, H] and last_hidden [N, T, H] (float32, zero right padding)."""
        caps, lasts = [], []
        for j in indices:
            f = self._shard(j)
            caps.append(f.get_tensor(f"captured_{j}").float())
            lasts.append(f.get_tensor(f"last_hidden_{j}").float())
        n, (_, nl, h) = len(indices), caps[0].shape
        captured = torch.zeros(n, pad_to, nl, h)
        last = torch.zeros(n, pad_to, h)
        for i, (c, l) in enumerate(zip(caps, lasts)):
            captured[i, : len(c)] = c
            last[i, : len(l)] = l
        return captured, last
