"""What a drafter checkpoint's vocabulary holds: the draft vocabulary (EAGLE-3 style) and the frozen
mask-token row, both chosen from the training data.

- Draft vocabulary: the N most frequent completion tokens of the training data (ties by id), plus
  the target's end-of-sequence ids, so the drafter's LM head scores N rows instead of V. Its
  coverage is the share of completion tokens that fall inside it.
- Mask token (DESIGN.md §4): a special token of the target that never occurs in the training data
  (prompts included), so its frozen embedding row is free to mean "slot to fill". DFlash uses an
  unused Qwen3 row; SmolLM2 has unused code-corpus specials. None where the vocabulary has none.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


def token_counts(sequences, vocab_size: int, completion_only: bool = True) -> torch.Tensor:
    """[V] long: occurrences of every token over `sequences` (training.Sequence), completion tokens
    only by default (what the drafter has to predict)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        ids = torch.tensor(s.ids, dtype=torch.long)
        if completion_only:
            ids = ids[torch.tensor(s.loss_mask, dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def build_draft_vocab(counts: torch.Tensor, size: int, always=()) -> torch.Tensor:
    """The `size` most frequent ids (ties broken by the smaller id), `always` ids included;
    returned sorted by id: [size] long."""
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab}], got {size}")
    always = sorted({int(t) for t in always})
    if len(always) > size:
        raise ValueError(f"{len(always)} required ids do not fit a draft vocabulary of {size}")
    # sort by (-count, id): a stable sort on -count keeps ids ascending within a tie
    order = torch.sort(-counts, stable=True).indices
    chosen = list(always)
    taken = set(always)
    for t in order.tolist():
        if len(chosen) == size:
            break
        if t not in taken:
            chosen.append(t)
            taken.add(t)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of the counted tokens that the draft vocabulary `ids` covers."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 1.0


def unused_special_token(tokenizer_dir, all_counts: torch.Tensor, reserved=()) -> int | None:
    """The highest-id special token of the target's tokenizer that never occurs in the training
    data (`all_counts`: prompt and completion tokens) and is not in `reserved` (bos/eos/pad), or None."""
    file = Path(tokenizer_dir) / "tokenizer.json"
    if not file.is_file():
        return None
    added = json.loads(file.read_text()).get("added_tokens", [])
    reserved = {int(t) for t in reserved if t is not None}
    free = [int(a["id"]) for a in added
            if a.get("special") and int(a["id"]) < all_counts.numel()
            and int(a["id"]) not in reserved and int(all_counts[int(a["id"])]) == 0]
    return max(free) if free else None
