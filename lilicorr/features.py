"""Offline target features (SpecForge's "offline" mode): run the frozen target once over the
training data and store, per sequence, the captured layers and the final hidden state, so every
training run and epoch skips the target forward (on CPU it dominates a training step).

A build is resumable: it fills the sibling `.<name>.partial/` (with the planned meta in plan.json),
each finished shard appears whole, and a rerun over the same plan keeps the finished shards; the
directory is renamed into place when every shard is there.

Layout of a feature directory (appears atomically):
    meta.json                 target fingerprint, capture layer ids, dtype, number of sequences
    shard-00000.safetensors   captured_<i> [T_i, n, H], last_hidden_<i> [T_i, H] and target_lse_<i> [T_i]
                              (logsumexp of the target's logits, float32) for i in the shard
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lilicorr.checkpoint import atomic_dir, target_fingerprint

SHARD = 64


def _fill_shards(target, sequences, capture, tmp: Path, shard_ids, batch_size: int, dtype, done) -> None:
    """Write shard-<k>.safetensors for every k in shard_ids; done(n) after each batch of n sequences."""
    for k in shard_ids:
        shard: dict[str, torch.Tensor] = {}
        # batches of similar lengths: in the data's order, each batch pads to its longest sequence
        order = sorted(range(k * SHARD, min((k + 1) * SHARD, len(sequences))), key=lambda j: len(sequences[j].ids))
        for lo in range(0, len(order), batch_size):
            chunk = order[lo:lo + batch_size]                                  # sequence indices
            t = max(len(sequences[j].ids) for j in chunk)
            ids = torch.zeros(len(chunk), t, dtype=torch.long)                # [n, T] right-padded
            for i, j in enumerate(chunk):
                ids[i, : len(sequences[j].ids)] = torch.tensor(sequences[j].ids)
            with torch.no_grad():
                out = target(ids, torch.arange(t).expand(len(chunk), t), capture=capture, logits=False)
            for i, j in enumerate(chunk):
                n = len(sequences[j].ids)
                last = out.last_hidden[i, :n].to(dtype).contiguous()              # [T_i, H]
                shard[f"captured_{j}"] = out.captured[i, :n].to(dtype).contiguous()
                shard[f"last_hidden_{j}"] = last
                with torch.no_grad():   # log-normaliser of the target's logits (from the stored states)
                    lse = torch.logsumexp(target.lm_head(last.to(target.lm_head.weight.dtype)).float(), -1)
                shard[f"target_lse_{j}"] = lse.contiguous()                       # [T_i] float32
            done(len(chunk))
        path = tmp / _shard_name(k)
        save_file(shard, str(path.with_suffix(".partial")))
        os.replace(path.with_suffix(".partial"), path)     # a shard appears whole (resumable builds)


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def _finished_shards(tmp: Path, meta: dict, num_shards: int) -> list[int]:
    """Shards a previous build over the same plan left complete in `tmp`; anything else is removed."""
    plan = tmp / "plan.json"
    if not plan.is_file() or json.loads(plan.read_text()) != meta:
        for f in tmp.iterdir():
            f.unlink()
        plan.write_text(json.dumps(meta))
        return []
    finished = []
    for k in range(num_shards):
        path = tmp / _shard_name(k)
        if not path.is_file():
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                n = len(list(f.keys()))
        except Exception:                                      # truncated by an older, non-atomic write
            n = -1
        want = 3 * (min((k + 1) * SHARD, meta["num_sequences"]) - k * SHARD)
        if n == want:
            finished.append(k)
    keep = {"plan.json", *(_shard_name(k) for k in finished)}
    for f in tmp.iterdir():                                    # half-written and stale pieces
        if f.name not in keep:
            f.unlink()
    return finished


def _worker(counter, *args) -> None:
    def done(n):
        with counter.get_lock():
            counter.value += n
    _fill_shards(*args, done=done)


def build_feature_store(target, sequences, capture: list[int], out_dir, batch_size: int = 4,
                        dtype: torch.dtype = torch.bfloat16, progress=None, workers: int = 1) -> Path:
    """Run the target teacher-forced over `sequences` (list of training.Sequence) and store features.
    ``workers`` > 1 forks that many processes (one per core, each on its own shards). An interrupted
    build resumes from its finished shards when rerun with the same target, capture, data and dtype."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    done = progress if progress is not None else (lambda n: None)
    meta = {"target": target_fingerprint(target.config), "capture": list(capture),
            "num_sequences": len(sequences), "lengths": [len(s.ids) for s in sequences],
            "dtype": str(dtype).removeprefix("torch."), "target_lse": True}
    num_shards = (len(sequences) + SHARD - 1) // SHARD

    def fill(tmp: Path):
        finished = set(_finished_shards(tmp, meta, num_shards))
        done(sum(min((k + 1) * SHARD, len(sequences)) - k * SHARD for k in finished))
        todo = [k for k in range(num_shards) if k not in finished]
        if workers == 1:
            _fill_shards(target, sequences, capture, tmp, todo, batch_size, dtype, done)
        else:
            _fill_in_processes(tmp, todo)
        (tmp / "plan.json").unlink()
        (tmp / "meta.json").write_text(json.dumps(meta))

    def _fill_in_processes(tmp: Path, shard_ids: list[int]):
        import multiprocessing as mp
        import time

        ctx = mp.get_context("fork")            # children share the loaded target copy-on-write
        counter = ctx.Value("l", 0)
        procs = [ctx.Process(target=_worker, args=(counter, target, sequences, capture, tmp,
                                                   shard_ids[w::workers], batch_size, dtype), daemon=True)
                 for w in range(workers)]
        for p in procs:
            p.start()
        seen = 0
        try:
            while any(p.is_alive() for p in procs):
                time.sleep(0.5)
                now = counter.value
                done(now - seen)
                seen = now
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join()
        done(counter.value - seen)
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"feature worker(s) failed with exit code(s) {bad}")

    out_dir = Path(out_dir)
    return atomic_dir(out_dir, fill, resume=out_dir.parent / f".{out_dir.name}.partial")


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
        self.has_lse = bool(meta.get("target_lse"))    # stores from before it was kept lack it
        self._handles: dict[int, object] = {}

    def _shard(self, j: int):
        k = j // SHARD
        if k not in self._handles:
            self._handles[k] = safe_open(str(self.path / f"shard-{k:05d}.safetensors"), framework="pt")
        return self._handles[k]

    def batch(self, indices: list[int], pad_to: int) -> tuple[torch.Tensor, ...]:
        """-> captured [N, T, n, H], last_hidden [N, T, H] and, when stored, target_lse [N, T]
        (float32, zero right padding)."""
        n = len(indices)
        captured = last = lse = None
        for i, j in enumerate(indices):
            f = self._shard(j)
            c, l = f.get_tensor(f"captured_{j}"), f.get_tensor(f"last_hidden_{j}")
            if captured is None:
                captured = torch.zeros(n, pad_to, *c.shape[1:])
                last = torch.zeros(n, pad_to, l.shape[-1])
                lse = torch.zeros(n, pad_to) if self.has_lse else None
            captured[i, : len(c)] = c.float()
            last[i, : len(l)] = l.float()
            if lse is not None:
                lse[i, : len(l)] = f.get_tensor(f"target_lse_{j}")
        return (captured, last) if lse is None else (captured, last, lse)
