"""Batch-invariant bf16 for the target on CPUs: a token's logits do not depend on how many tokens
share its forward, so a k-token verify decides exactly as k one-token steps would.

Why: greedy speculative decoding is lossless only if the verify forward over [anchor, drafts]
picks the same argmax at each position as plain decoding, one token per forward, would. In float32
and fp16-weights the two differ by float32 rounding (no near-tie flipped in our checks); in bf16 on
a CPU with AMX they did not agree (results/greedy_equality_cpu.md: 6 of 8 prompts), because
PyTorch's CPU kernels are not batch-invariant:

* `scaled_dot_product_attention` gives a query a different result when it shares the call with
  other queries (its blocking over queries and keys changes the order of the sums);
* the GEMMs switch kernels with the number of rows M: on an AMX Xeon every row of a bf16
  [M, K] x [K, N] product equals that row computed alone for M <= 32, and not for M >= 48; an fp32
  product gives the same rows for every M >= 2, and M = 1 (a matrix-vector kernel) differs. On an
  AVX512-BF16 EPYC (no AMX) oneDNN's bf16 kernel differs at M = 1 for some weight shapes and
  agrees for 2..32, and float32 products agree for M >= 4.

So in this mode (`use_batch_invariant`):

* every linear layer multiplies at most `ROWS` rows at a time (rows of a longer input go through in
  chunks of `ROWS`; each chunk's rows equal the rows computed alone); where this machine's kernel
  computes a single row differently from 2..ROWS rows (a matrix-vector path: oneDNN's bf16 kernel
  on an AVX512-BF16 EPYC, for some shapes), that linear multiplies a lone row as two, the row and
  a zero row (`fit_single_rows`, measured per weight shape at load);
* attention is written out (`invariant_attention`) in float32 (bf16 products are exact there):
  scores q k^T, softmax, and the product with V as a sum over blocks of `KEY_BLOCK` keys at fixed
  key offsets, added in block order. A GEMM's reduction order depends on its inner size, and a
  query verified with others sees its row's keys padded to the longest query's: within the block
  holding its last key the padding has probability exactly 0, and later blocks add exactly 0, so
  its sums are those of the query alone. The query heads that share a key/value head are rows of
  one GEMM (grouped-query attention without copying K/V), at least `ATTENTION_MIN_ROWS` (zero rows
  added) and at most `ROWS` of them.

Everything else in the target (RMSNorm, RoPE, SwiGLU, residual adds) is elementwise per token.
Whether the kernels of *this* machine keep the property is measured, not assumed:
`check_batch_invariant(model)` runs the model's own linear layers and the attention on random
inputs at every row count up to `ROWS` and compares each row with the row computed alone;
where it fails, `load_target` keeps PyTorch's kernels and warns. The mode costs about 10% of a
bf16 step (results/verify_cost_amx.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROWS = 32        # rows per GEMM in batch-invariant mode (the check covers 1..ROWS)
KEY_BLOCK = 128  # keys per block of the attention's product with V (blocks at fixed key offsets)
# float32 attention GEMMs take at least this many rows: an AMX Xeon gives every row the same
# result for M >= 2 rows, an AVX512 EPYC (Zen) for M >= 4 (fewer rows take other kernels)
ATTENTION_MIN_ROWS = 4


def pack_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """[O, I] bf16 CPU weight -> oneDNN's prepacked copy for `_linear_pointwise` (an opaque
    tensor), or None where this PyTorch build has no oneDNN linear."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
    except (AttributeError, RuntimeError):
        return None


class InvariantLinear(nn.Module):
    """An `nn.Linear` (same parameters, shared) that multiplies at most `ROWS` rows per GEMM.

    With `packed=True` a bf16 weight is also kept prepacked for oneDNN (`pack_bf16`): PyTorch's
    bf16 `F.linear` on a CPU does not keep the weight in its kernel's layout between calls, and in
    a torch.profiler trace of a 1-token SmolLM2 step its bf16 GEMMs took as long as float32's; the
    prepacked kernel gives the same numbers (each row equals `F.linear` of that row alone, checked
    at load) in about 0.7x the GEMM time: a whole bf16 step 76 ms against 83 ms with PyTorch's
    kernels (results/verify_cost_amx.md). The packed copy (as many bytes again as the weights) is
    taken once: the weight must not change afterwards (a frozen target), and inputs that need a
    gradient take `F.linear`."""

    def __init__(self, linear: nn.Linear, packed: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight                      # [O, I], shared (a tied embedding stays tied)
        self.bias = linear.bias
        self._packed = pack_bf16(self.weight) if packed else None   # not a buffer: out of state_dict
        self.pad_single_row = False     # a lone row goes through as two (see fit_single_rows)

    def _packed_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [m <= ROWS, I] bf16 -> [m, O] with the prepacked weight."""
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def _plain_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [m <= ROWS, I] -> [m, O]."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])                                      # [M, I]
        packed = self._packed is not None and x.dtype == torch.bfloat16 and not (
            torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        gemm = self._packed_gemm if packed else self._plain_gemm
        if flat.shape[0] == 1 and self.pad_single_row:
            y = gemm(_min_rows(flat, 2))[:1]
        elif flat.shape[0] <= ROWS:
            y = gemm(flat)
        else:
            y = torch.cat([gemm(flat[i:i + ROWS]) for i in range(0, flat.shape[0], ROWS)])
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        packed = ", prepacked (oneDNN)" if self._packed is not None else ""
        single = ", a lone row as two" if self.pad_single_row else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, rows per GEMM<={ROWS}{packed}{single}"


def _min_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [..., M, K]: with M < rows, zero rows appended up to `rows` (GEMMs of fewer rows take
    kernels that round differently); else x."""
    short = rows - x.shape[-2]
    if short <= 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[:-2] + (short, x.shape[-1]))], dim=-2)


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [N, hq, T, D], k/v [N, hkv, S, D] (hq a multiple of hkv), additive mask [N|1, 1, T, S] or
    [T, S] -> softmax(q k^T / sqrt(D) + mask) v [N, hq, T, D] in q's dtype, in float32 throughout:
    the rep query heads that share a key/value head times a chunk of queries are the rows of one
    GEMM (at least `ATTENTION_MIN_ROWS`, at most `ROWS`); keys are padded to whole blocks of
    `KEY_BLOCK` (masked), and the product with V is a sum over those blocks in block order, so a
    query's sums never depend on how many keys its row was padded to. Inputs that are already
    whole blocks in float32 (the target's float32 cache read `padded_keys` deep, a float32 mask)
    are used as they are: keys past a query's own may hold anything finite, since the mask gives
    them probability exactly 0."""
    n, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    rep = hq // hkv
    if mask.dim() == 2:
        mask = mask[None, None]
    padded = padded_keys(s)
    blocks = padded // KEY_BLOCK
    if padded == s and k.dtype == v.dtype == torch.float32:
        k32, v32 = k, v                      # already whole blocks in float32 (the target's cache views)
    else:
        k32 = k.new_zeros((n, hkv, padded, d), dtype=torch.float32)
        v32 = torch.zeros_like(k32)
        k32[:, :, :s], v32[:, :, :s] = k, v
    kt = k32.transpose(-1, -2)                                            # [N, hkv, D, S']
    vb = v32.view(n, hkv, blocks, KEY_BLOCK, d)                           # [N, hkv, B, blk, D]
    if padded == s and mask.dtype == torch.float32:
        bias = mask                                                       # [N|1, 1, T, S']
    else:
        bias = mask.new_full(mask.shape[:-1] + (padded,), float("-inf"), dtype=torch.float32)
        bias[..., :s] = mask                                              # [N|1, 1, T, S']
    scale = d ** -0.5
    step = max(1, ROWS // rep)                       # queries per GEMM
    out = []
    for i in range(0, t, step):
        ti = min(step, t - i)
        m = rep * ti
        rows = _min_rows(q[:, :, i:i + ti].reshape(n, hkv, m, d).float(), ATTENTION_MIN_ROWS)  # [N, hkv, M', D]
        scores = torch.matmul(rows, kt)[:, :, :m].view(n, hkv, rep, ti, padded)
        p = torch.softmax(scores * scale + bias[:, :, None, i:i + ti], dim=-1)      # [N, hkv, rep, t', S']
        pb = _min_rows(p.view(n, hkv, m, blocks, KEY_BLOCK).transpose(2, 3), ATTENTION_MIN_ROWS)  # [N, hkv, B, M', blk]
        parts = torch.matmul(pb, vb)                                                # [N, hkv, B, M', D]
        acc = parts[:, :, 0, :m]
        for b in range(1, blocks):                   # in block order: trailing masked blocks add 0
            acc = acc + parts[:, :, b, :m]
        out.append(acc.to(q.dtype).reshape(n, hq, ti, d))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


class TreeKeys:
    """A draft-tree verify's attention in batch-invariant mode with `invariant_attention` (the
    compiled kernel, `bf16_gemm.fused_attention`, skips masked keys by itself and needs none of
    this). A tree query's visible keys (the cached ones, then its ancestors among the new tokens)
    are not a prefix of the row's keys: its siblings' keys sit between them, masked. The probabilities are still exactly 0 there, but the GEMM
    reductions over a block of keys then place the visible terms in other lanes than the causal
    step that decodes the same path, and round differently; served tree outputs then left `ar`'s.
    So every query gets its own copy of its visible keys moved to a prefix, in key order, and runs
    as a one-query row of `invariant_attention`: exactly the keys, order and padding of the
    causal step at the same depth, so the same bits.

    allowed [N, T, S] bool: query t of row i sees key j. Built once per forward, used by every layer."""

    def __init__(self, allowed: torch.Tensor):
        n, t, s = allowed.shape
        self.order = torch.argsort((~allowed).to(torch.int8), dim=-1, stable=True)   # [N, T, S] visible first
        seen = allowed.sum(-1)                                                           # [N, T]
        keys = torch.arange(s, device=allowed.device)
        self.mask = torch.zeros(n * t, 1, 1, s, device=allowed.device).masked_fill_(
            keys >= seen.reshape(-1, 1, 1, 1), float("-inf"))                            # [N*T, 1, 1, S]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, hq, T, D], k/v [N, hkv, S, D] (S = the keys `allowed` was built over) -> [N, hq, T, D]."""
        n, hq, t, d = q.shape
        hkv, s = k.shape[1], self.order.shape[-1]
        if k.shape[2] != s:
            raise ValueError(f"tree keys were built over {s} keys, attention reads {k.shape[2]}")
        rows = torch.arange(n, device=q.device)[:, None, None]

        def gather(x: torch.Tensor) -> torch.Tensor:       # [N, hkv, S, D] -> [N*T, hkv, S, D]
            return x[rows, :, self.order].permute(0, 1, 3, 2, 4).reshape(n * t, hkv, s, d)

        y = invariant_attention(q.transpose(1, 2).reshape(n * t, hq, 1, d), gather(k), gather(v),
                                self.mask)                                                    # [N*T, hq, 1, D]
        return y.reshape(n, t, hq, d).transpose(1, 2)


def padded_keys(upto: int) -> int:
    """Keys an attention over `upto` keys reads in batch-invariant mode: whole blocks of KEY_BLOCK."""
    return -(-upto // KEY_BLOCK) * KEY_BLOCK


def use_batch_invariant(model: nn.Module, packed: bool = True) -> int:
    """Switch a TargetModel to batch-invariant mode in place: every `nn.Linear` becomes an
    `InvariantLinear` (same parameters; bf16 weights prepacked for oneDNN where `packed` and the
    build allows) and attention uses `invariant_attention`. Returns the number of linears replaced."""
    count = 0
    for module in list(model.modules()):
        if hasattr(module, "invariant_attention"):
            module.invariant_attention = True
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, InvariantLinear(child, packed=packed))
                count += 1
    return count


@torch.no_grad()
def fit_single_rows(model: nn.Module, seed: int = 0) -> int:
    """For each distinct weight shape of the model's `InvariantLinear`s: where one row computed alone
    differs from the same row computed among 2..ROWS rows while every 2..ROWS-row call agrees with
    the 2-row one, switch that shape's linears to `pad_single_row`. Returns how many linears
    switched. (The remaining mismatches, if any, are `check_batch_invariant`'s to report.)"""
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    linears: dict[tuple[int, int], list[InvariantLinear]] = {}
    for m in model.modules():
        if isinstance(m, InvariantLinear):
            linears.setdefault((m.in_features, m.out_features), []).append(m)
    switched = 0
    for same_shape in linears.values():
        m = same_shape[0]
        x = torch.randn(ROWS, m.in_features, generator=g).to(dtype)
        if _rows_alone_equal(m, x):
            continue
        pairs = torch.cat([m(x[i:i + 2])[:1] for i in range(ROWS - 1)] + [m(x[ROWS - 2:])[1:]])
        if all(torch.equal(m(x[:k]), pairs[:k]) for k in range(2, ROWS + 1)):
            for each in same_shape:
                each.pad_single_row = True
            switched += len(same_shape)
    return switched


def unpack(model: nn.Module) -> int:
    """Drop the prepacked weights of every `InvariantLinear` (they take `F.linear` again); returns
    how many were packed."""
    count = 0
    for m in model.modules():
        if isinstance(m, InvariantLinear) and m._packed is not None:
            m._packed = None
            count += 1
    return count


def _rows_alone_equal(fn, x: torch.Tensor) -> bool:
    """fn(x[:m]) row by row equals fn(x[i:i+1]) for every m <= len(x)."""
    alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
    return all(torch.equal(fn(x[:m]), alone[:m]) for m in range(2, x.shape[0] + 1))


def _cached_attention(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """An attention `fn` (`invariant_attention` or a model's own kernel) as the target calls it:
    q [1, hq, T, D]; k, v [1, hkv, C, D] float32 caches read `padded_keys` deep (views); query t
    sees keys < seen[t] (a float32 mask)."""
    width = padded_keys(int(seen.max()))
    mask = torch.zeros(len(seen), width).masked_fill_(torch.arange(width)[None, :] >= seen[:, None], float("-inf"))
    return fn(q, k[:, :, :width], v[:, :, :width], mask)


@torch.no_grad()
def check_batch_invariant(model: nn.Module, seed: int = 0) -> list[str]:
    """What breaks batch invariance on this machine for `model` in its dtype (empty: nothing):
    each distinct linear shape (its own weights) at 1..ROWS rows, and the attention of its head
    layout with 1..ROWS//rep queries over several key lengths, each query against itself alone."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    failures, seen = [], set()
    for name, m in model.named_modules():
        if isinstance(m, InvariantLinear) and (m.in_features, m.out_features) not in seen:
            seen.add((m.in_features, m.out_features))
            x = torch.randn(ROWS, m.in_features, generator=g).to(dtype)
            if not _rows_alone_equal(m, x):
                failures.append(f"linear {name} [{m.in_features} -> {m.out_features}]")
    cfg = model.config
    attend = next((m.attention_kernel for m in model.modules() if getattr(m, "attention_kernel", None)),
                  invariant_attention)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    t_max = max(1, ROWS // (hq // hkv))
    for cached in (5, 37, 130, 511):
        s = cached + t_max
        q = torch.randn(1, hq, t_max, d, generator=g).to(dtype)
        # the target's float32 cache: keys past a row's own hold stale (finite) values
        cap = padded_keys(s) + KEY_BLOCK
        k, v = (torch.randn(1, hkv, cap, d, generator=g).to(dtype).float() for _ in range(2))
        for t in range(1, t_max + 1):
            together = _cached_attention(attend, q[:, :, :t], k, v, cached + 1 + torch.arange(t))
            for j in range(t):               # query j alone, over only the keys it may see
                alone = _cached_attention(attend, q[:, :, j:j + 1], k, v, torch.tensor([cached + j + 1]))
                if not torch.equal(alone, together[:, :, j:j + 1]):
                    failures.append(f"attention: query {j} of {t} over {cached} cached keys")
                    break
            if failures and failures[-1].startswith("attention"):
                break
    return failures
