"""Slot-pooled key/value cache with per-slot ragged lengths (DESIGN.md §5).

Storage is `k`, `v`: [num_layers, num_slots, num_kv_heads, capacity, head_dim], so a read is
already in the [N, h, S, D] layout that scaled_dot_product_attention wants. Each slot (one
sequence) has its own length; rejected tokens roll back by length (`truncate`), never by copying.
Capacity grows by doubling when a write would overflow. The class is shape-generic: the target
uses it with its own heads, the drafter's context cache with its own.

Typical use by a model forward over rows `rows` (slot ids) with `T` new tokens per row:

    start = cache.lengths[rows]                 # [N] keys already cached
    cache.reserve(rows, T)                      # grow once, before the layers
    idx = cache.row_index(rows)                 # slice when rows are consecutive (no gather copy)
    for layer ...:
        cache.write(layer, idx, k, v, start)    # k, v [N, T, h, D] at positions start + t
        k_all, v_all = cache.read(layer, idx, upto)   # [N, h, upto, D]
    cache.advance(rows, valid)                  # lengths[rows] += valid
"""
from __future__ import annotations

import heapq

import torch

__all__ = ["KVCache"]

RowIndex = torch.Tensor | slice


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 capacity: int = 256, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if min(num_layers, num_slots, num_kv_heads, head_dim, capacity) <= 0:
            raise ValueError("KVCache sizes must all be positive")
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, num_slots, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, slots, h, C, D]
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, slots, h, C, D]
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # [slots]
        self._free = list(range(num_slots))               # a min-heap: allocate() takes the lowest free slot

    # ---------------------------------------------------------------- slot pool
    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take the lowest free slot (its length is 0). Lowest first keeps the slots in use packed at
        the front: N running rows stepped in slot order are then usually slots 0..N-1, which
        `row_index` reads as views instead of gathered copies."""
        if not self._free:
            raise RuntimeError(f"KVCache: all {self.num_slots} slots are in use")
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Return a slot to the pool."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"KVCache: slot {slot} is not allocated")
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)

    def move(self, src: int) -> int:
        """Move slot `src`'s cached entries and length to the lowest free slot, free `src` and
        return the new slot. Only worth it when the new slot is lower: a row that finished between
        running rows leaves a gap, and the rows after it would be read as gathered copies at every
        layer of every step until a new row fills it (`row_index`)."""
        if not 0 <= src < self.num_slots or src in self._free:
            raise ValueError(f"KVCache: slot {src} is not allocated")
        dst = self.allocate()
        n = int(self.lengths[src])
        if n:
            for buf in (self.k, self.v):                     # [L, slots, h, C, D]
                buf[:, dst, :, :n] = buf[:, src, :, :n]
        self.lengths[dst] = n
        self.free(src)
        return dst

    # ---------------------------------------------------------------- lengths
    def truncate(self, rows: torch.Tensor, new_lengths: torch.Tensor | int) -> None:
        """Roll rows back to `new_lengths` ([N] long or int); never grows a row."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        new = torch.as_tensor(new_lengths, dtype=torch.long, device=self.device).expand(rows.shape)
        if bool((new < 0).any()) or bool((new > self.lengths[rows]).any()):
            raise ValueError(f"truncate: new lengths {new.tolist()} outside [0, {self.lengths[rows].tolist()}]")
        self.lengths[rows] = new

    def keep_paths(self, rows: torch.Tensor, start: torch.Tensor, offsets: list[list[int]]) -> None:
        """After a draft-tree verify: row i keeps the entries at start[i] + offsets[i][d], moved to
        start[i] + d (d = 0, 1, ...), and its length becomes start[i] + len(offsets[i]). Offsets of a
        row are increasing (a tree path in expansion order), so every move goes backwards."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        start = torch.as_tensor(start, dtype=torch.long, device=self.device)
        r, src, dst = [], [], []
        for i, offs in enumerate(offsets):
            if any(b <= a for a, b in zip(offs, offs[1:])) or (offs and offs[0] < 0):
                raise ValueError(f"keep_paths: offsets {offs} are not increasing from >= 0")
            b = int(start[i])
            for d, o in enumerate(offs):
                if o != d:
                    r.append(int(rows[i]))
                    src.append(b + o)
                    dst.append(b + d)
        new = start + torch.tensor([len(o) for o in offsets], dtype=torch.long, device=self.device)
        if bool((new > self.lengths[rows]).any()):
            raise ValueError(f"keep_paths: paths reach past the cached lengths {self.lengths[rows].tolist()}")
        if r:
            ri, si, di = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (r, src, dst))
            for buf in (self.k, self.v):                     # [L, slots, h, C, D]; the source is copied first
                buf[:, ri, :, di] = buf[:, ri, :, si]
        self.lengths[rows] = new

    def advance(self, rows: torch.Tensor, n: torch.Tensor | int) -> None:
        """lengths[rows] += n (after a write of n real tokens per row)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        self.lengths[rows] += torch.as_tensor(n, dtype=torch.long, device=self.device)

    def reserve(self, rows: torch.Tensor, extra: int) -> None:
        """Make room for `extra` more tokens in every row (doubling capacity as needed)."""
        needed = int(self.lengths[rows].max()) + extra if len(rows) else 0
        if needed > self.capacity:
            self._grow(needed)

    def _grow(self, needed: int) -> None:
        cap = self.capacity
        while cap < needed:
            cap *= 2
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.zeros(old.shape[:3] + (cap, old.shape[4]), dtype=self.dtype, device=self.device)
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)

    # ---------------------------------------------------------------- data
    @staticmethod
    def row_index(rows: torch.Tensor) -> RowIndex:
        """A slice when `rows` are consecutive ascending slots (reads are then views), else `rows`."""
        n = rows.numel()
        if n and rows.device.type == "cpu":
            first = int(rows[0])
            if bool((rows == torch.arange(first, first + n, device=rows.device)).all()):
                return slice(first, first + n)
        return rows

    def write_plan(self, rows: RowIndex, start: torch.Tensor, t: int,
                   valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Where `write` puts T new tokens per row, computed once for every layer of a forward
        (after `reserve`): flat indices [M * h] into one layer's k (or v) viewed as [slots * h * C,
        D], the kept (row, token) pairs ([N, T] bool, None: all) and the capacity they assume."""
        row_ids = _as_ids(rows, self.device)                                         # [N]
        h, cap = self.num_kv_heads, self.capacity
        pos = start.to(self.device)[:, None] + torch.arange(t, device=self.device)  # [N, T]
        base = row_ids[:, None] * h                                                  # [N, 1]
        keep = None
        if valid is not None:
            keep = torch.arange(t, device=self.device)[None, :] < valid.to(self.device)[:, None]  # [N, T]
            base, pos = base.expand_as(pos)[keep], pos[keep]                         # [M]
        heads = torch.arange(h, device=self.device)
        index = ((base[..., None] + heads) * cap + pos[..., None]).reshape(-1)      # [M * h] (token, head)
        return index, keep, cap

    def write(self, layer: int, rows: RowIndex, k: torch.Tensor, v: torch.Tensor,
              start: torch.Tensor | None = None, valid: torch.Tensor | None = None,
              plan: tuple[torch.Tensor, torch.Tensor | None, int] | None = None) -> None:
        """Store k, v [N, T, h, D] for rows at positions start[i] + t (start defaults to lengths[rows]).

        With `valid` ([N] long) only t < valid[i] is stored. Lengths are not changed (see `advance`):
        every layer of one forward writes at the same positions, so a forward may pass the
        `write_plan` it computed once (then `start` and `valid` are the plan's)."""
        if plan is None:
            t = k.shape[1]
            if start is None:
                start = self.lengths[_as_ids(rows, self.device)]
            if int(start.max()) + t > self.capacity:
                self._grow(int(start.max()) + t)
            plan = self.write_plan(rows, start, t, valid)
        index, keep, cap = plan
        if cap != self.capacity:
            raise RuntimeError("KVCache.write: the cache grew after its write plan was made")
        d = k.shape[-1]
        for buf, x in ((self.k[layer], k), (self.v[layer], v)):                     # [slots, h, C, D]
            x = x[keep] if keep is not None else x                                  # [M, h, D] or [N, T, h, D]
            buf.view(-1, d).index_copy_(0, index, x.reshape(-1, d).to(self.dtype))

    def read(self, layer: int, rows: RowIndex, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> k, v [N, h, upto, D]: the first `upto` cached positions of each row (a view for slices)."""
        return self.k[layer, rows, :, :upto], self.v[layer, rows, :, :upto]


def _as_ids(rows: RowIndex, device: torch.device) -> torch.Tensor:
    if isinstance(rows, slice):
        return torch.arange(rows.start, rows.stop, device=device)
    return rows
