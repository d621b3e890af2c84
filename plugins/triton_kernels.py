"""Triton-language kernels for the lattice ops (must match ``lilicorr.lattice``).

Kernels (argument order is inputs, int32 scalars, outputs, then constexprs; that is the order a
TensorRT AOT plugin launch uses, see ``compile_ptx``):

    lattice_match_kernel      grid (N, S)  program (n, 0): anchor row; (n, s>0): pair table s-1
    greedy_walk_kernel        grid (N,)    sequential Eq. 8 walk over precomputed scores
    lattice_match_walk_kernel grid (N,)    fused: per slot only the committed candidate's row
    draft_tree_kernel         grid (N,)    rule `tree`'s best-first tree (lattice.build_tree): per
                                           slot one sort of packed (log-prob, index) keys

K and E need not be powers of two (BLOCK_K / BLOCK_E are padded and masked). Accumulation is
fp32 whatever the storage dtype (fp32 / fp16 / bf16). Inputs are assumed contiguous (the
wrappers make them so). Ties break to the lowest index (tl.argmax tie_break_left=True).

On CPU set ``TRITON_INTERPRET=1`` in the environment before importing triton; the wrappers
then run the kernels on CPU tensors through the interpreter. On a GPU they run on CUDA tensors
on torch's current stream (TensorRT plugins wrap the enqueue stream with
``torch.cuda.ExternalStream``).
"""
from __future__ import annotations

import re

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    raise ImportError(
        "lilicorr.plugins.triton_kernels needs the `triton` package (pip install "
        "'lilicorr[kernels]', triton==3.7.1); on CPU also set TRITON_INTERPRET=1 before "
        "importing it") from exc

__all__ = [
    "lattice_match_kernel", "greedy_walk_kernel", "lattice_match_walk_kernel",
    "draft_tree_kernel", "lattice_match", "greedy_walk", "fused_match_walk", "draft_tree", "block_sizes", "compile_ptx",
    "strip_unused_params",
]


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def lattice_match_kernel(anchor_ptr, out_ptr, in_ptr,          # [N,E], [N,S,K,E], [N,S,K,E]
                         N, S, K, E,                            # int32 sizes
                         anchor_scores_ptr, pair_scores_ptr,    # [N,K], [N,S-1,K,K]
                         SIGMA: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    rk = tl.arange(0, BLOCK_K)                       # source rows k (out vectors)
    ck = tl.arange(0, BLOCK_K)                       # target columns k' (in vectors of slot s)
    col_ok = ck < K
    in_base = in_ptr + (n * S + s) * K * E           # i[n, s, :, :]
    if s == 0:
        src = anchor_ptr + n * E                     # o_0[n]: a single row (K_0 = 1)
        row_stride = 0
        n_rows = 1
    else:
        src = out_ptr + (n * S + (s - 1)) * K * E    # o[n, s-1, :, :]
        row_stride = E
        n_rows = K
    row_ok = rk < n_rows
    acc = tl.zeros((BLOCK_K, BLOCK_K), dtype=tl.float32)
    for e0 in range(0, E, BLOCK_E):
        re_ = e0 + tl.arange(0, BLOCK_E)
        e_ok = re_ < E
        o = tl.load(src + rk[:, None] * row_stride + re_[None, :],
                    mask=row_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)   # [BK, BE]
        i = tl.load(in_base + ck[:, None] * E + re_[None, :],
                    mask=col_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)   # [BK, BE]
        acc += tl.sum(o[:, None, :] * i[None, :, :], axis=2)                           # [BK, BK]
    acc = acc * SIGMA
    if s == 0:
        row0 = tl.sum(tl.where(rk[:, None] == 0, acc, 0.0), axis=0)                    # [BK]
        tl.store(anchor_scores_ptr + n * K + ck,
                 row0.to(anchor_scores_ptr.dtype.element_ty), mask=col_ok)
    else:
        base = pair_scores_ptr + (n * (S - 1) + (s - 1)) * K * K
        tl.store(base + rk[:, None] * K + ck[None, :],
                 acc.to(pair_scores_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def greedy_walk_kernel(anchor_scores_ptr, pair_scores_ptr,    # [N,K], [N,S-1,K,K]
                       N, S, K,                               # int32 sizes
                       idx_ptr,                               # [N,S] int64
                       BLOCK_K: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    ck = tl.arange(0, BLOCK_K)
    ok = ck < K
    z = tl.load(anchor_scores_ptr + n * K + ck, mask=ok, other=float("-inf")).to(tl.float32)
    c = tl.argmax(z, axis=0, tie_break_left=True)
    tl.store(idx_ptr + n * S, c.to(tl.int64))
    for j in range(0, S - 1):
        row = pair_scores_ptr + ((n * (S - 1) + j) * K + c) * K       # pair[n, j, c, :]
        z = tl.load(row + ck, mask=ok, other=float("-inf")).to(tl.float32)
        c = tl.argmax(z, axis=0, tie_break_left=True)
        tl.store(idx_ptr + n * S + j + 1, c.to(tl.int64))


@triton.jit
def _row_scores(src, in_base, K, E, SIGMA: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_E: tl.constexpr):
    """sigma * <src[:E], in_base[k', :E]> for k' < K; -inf in the padding. -> [BLOCK_K] fp32"""
    ck = tl.arange(0, BLOCK_K)
    ok = ck < K
    z = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for e0 in range(0, E, BLOCK_E):
        re_ = e0 + tl.arange(0, BLOCK_E)
        e_ok = re_ < E
        o = tl.load(src + re_, mask=e_ok, other=0.0).to(tl.float32)                    # [BE]
        i = tl.load(in_base + ck[:, None] * E + re_[None, :],
                    mask=ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)         # [BK, BE]
        z += tl.sum(i * o[None, :], axis=1)
    z = z * SIGMA
    return tl.where(ok, z, float("-inf"))


@triton.jit
def lattice_match_walk_kernel(anchor_ptr, out_ptr, in_ptr,     # [N,E], [N,S,K,E], [N,S,K,E]
                              N, S, K, E,                       # int32 sizes
                              idx_ptr,                          # [N,S] int64
                              SIGMA: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_E: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    z = _row_scores(anchor_ptr + n * E, in_ptr + n * S * K * E, K, E, SIGMA, BLOCK_K, BLOCK_E)
    c = tl.argmax(z, axis=0, tie_break_left=True)
    tl.store(idx_ptr + n * S, c.to(tl.int64))
    for j in range(1, S):
        src = out_ptr + ((n * S + (j - 1)) * K + c) * E                 # o[n, j-1, c, :]
        z = _row_scores(src, in_ptr + (n * S + j) * K * E, K, E, SIGMA, BLOCK_K, BLOCK_E)
        c = tl.argmax(z, axis=0, tie_break_left=True)
        tl.store(idx_ptr + n * S + j, c.to(tl.int64))


_INVALID_KEY: tl.constexpr = -9223372036854775808   # int64 min: sorts after every real key


@triton.jit
def _sort_key(val, idx):
    """fp32 value, integer index -> int64 key: descending keys = descending values, then
    ascending indices (the reference's tie order). The float's bits become an order-preserving
    int32 (negative floats have their magnitude bits flipped) in the high half."""
    bits = val.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - idx.to(tl.int64))


@triton.jit
def _unkey(key):
    """_sort_key's inverse -> (fp32 value, int64 index)."""
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 0xFFFFFFFF - (key & 0xFFFFFFFF)


@triton.jit
def draft_tree_kernel(anchor_scores_ptr, pair_scores_ptr,       # [N,K], [N,S-1,K,K]
                      N, S, K, M,                               # int32 sizes; M output nodes
                      parent_ptr, depth_ptr, cand_ptr, score_ptr,   # [N,M] i64, i64, i64, f32
                      work_ptr, kept_val_ptr,                   # scratch [N, WORK] i64, [N, S*BLOCK_M] f32
                      BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                      SORT: tl.constexpr):
    """lattice.build_tree for one row per program: per slot the best min(M, width x K) children
    of the kept paths (one sort of packed (log-prob, index) keys), then the best M of all kept
    paths, parents renumbered through a node-of scratch map. Kept path (slot j, rank r) lives at
    g = j * BLOCK_M + r; scratch per row: [sort buffer (SORT) | cand | parent g | node of g]."""
    n = tl.program_id(0).to(tl.int64)
    work = work_ptr + n * (SORT + 3 * S * BLOCK_M)
    kept_cand = work + SORT
    kept_par = kept_cand + S * BLOCK_M
    node_of = kept_par + S * BLOCK_M
    kept_val = kept_val_ptr + n * S * BLOCK_M
    ck = tl.arange(0, BLOCK_K)
    k_ok = ck < K
    rm = tl.arange(0, BLOCK_M)
    # slot 0: the root's children, log softmax of the anchor scores
    a = tl.load(anchor_scores_ptr + n * K + ck, mask=k_ok, other=float("-inf")).to(tl.float32)
    a_max = tl.max(a, axis=0)
    lp = a - (a_max + tl.log(tl.sum(tl.exp(a - a_max), axis=0)))
    keys = tl.sort(tl.where(k_ok, _sort_key(lp, ck), _INVALID_KEY), descending=True)
    tl.store(work + ck, keys)
    tl.debug_barrier()
    width = tl.minimum(M, K)
    keep = rm < width
    val, c = _unkey(tl.load(work + rm, mask=keep, other=_INVALID_KEY))
    tl.store(kept_val + rm, tl.where(keep, val, float("-inf")))
    tl.store(kept_cand + rm, c)
    tl.store(kept_par + rm, tl.full((BLOCK_M,), -1, tl.int64))
    for j in range(1, S):
        tl.debug_barrier()
        p_ok = rm < width
        pv = tl.load(kept_val + (j - 1) * BLOCK_M + rm)                             # [BM]
        pc = tl.load(kept_cand + (j - 1) * BLOCK_M + rm, mask=p_ok, other=0)         # [BM]
        row = pair_scores_ptr + ((n * (S - 1) + (j - 1)) * K + pc[:, None]) * K + ck[None, :]
        ok2 = p_ok[:, None] & k_ok[None, :]
        z = tl.load(row, mask=ok2, other=float("-inf")).to(tl.float32)              # [BM, BK]
        z_max = tl.where(p_ok, tl.max(z, axis=1), 0.0)
        lse = z_max + tl.log(tl.where(p_ok, tl.sum(tl.exp(z - z_max[:, None]), axis=1), 1.0))
        ext = tl.where(ok2, tl.where(p_ok, pv, 0.0)[:, None] + z - lse[:, None], 0.0)   # [BM, BK]
        flat = rm[:, None] * K + ck[None, :]
        key2 = tl.where(ok2, _sort_key(ext, flat), _INVALID_KEY)
        keys = tl.sort(tl.reshape(key2, (BLOCK_M * BLOCK_K,)), descending=True)
        tl.store(work + tl.arange(0, BLOCK_M * BLOCK_K), keys)
        tl.debug_barrier()
        width = tl.minimum(M, width * K)
        keep = rm < width
        val, f = _unkey(tl.load(work + rm, mask=keep, other=_INVALID_KEY))
        tl.store(kept_val + j * BLOCK_M + rm, tl.where(keep, val, float("-inf")))
        tl.store(kept_cand + j * BLOCK_M + rm, f % K)
        tl.store(kept_par + j * BLOCK_M + rm, tl.where(keep, (j - 1) * BLOCK_M + f // K, -1))
    # the best M of all kept paths, by score, then slot, then rank
    tl.debug_barrier()
    rp = tl.arange(0, BLOCK_P)
    p_ok = rp < S * BLOCK_M
    v = tl.load(kept_val + rp, mask=p_ok, other=float("-inf"))
    keys = tl.sort(tl.where(p_ok & (v > float("-inf")), _sort_key(v, rp), _INVALID_KEY), descending=True)
    tl.store(work + rp, keys)
    tl.debug_barrier()
    out_ok = rm < M
    score, g = _unkey(tl.load(work + rm, mask=out_ok, other=_INVALID_KEY))
    g = tl.where(out_ok, g, 0)
    tl.store(node_of + g, rm.to(tl.int64), mask=out_ok)
    tl.debug_barrier()
    par = tl.load(kept_par + g, mask=out_ok, other=-1)
    parent = tl.where(par >= 0, tl.load(node_of + tl.maximum(par, 0), mask=out_ok & (par >= 0), other=-1), -1)
    tl.store(parent_ptr + n * M + rm, parent, mask=out_ok)
    tl.store(depth_ptr + n * M + rm, g // BLOCK_M, mask=out_ok)
    tl.store(cand_ptr + n * M + rm, tl.load(kept_cand + g, mask=out_ok, other=0), mask=out_ok)
    tl.store(score_ptr + n * M + rm, score, mask=out_ok)


# --------------------------------------------------------------------------------------------
# launch wrappers (torch tensors in, torch tensors out; CPU under TRITON_INTERPRET=1, or CUDA)
# --------------------------------------------------------------------------------------------

def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def block_sizes(K: int, E: int, block_e: int | None = None) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_E): BLOCK_K >= K padded to a power of two (>= 2); BLOCK_E keeps the
    [BLOCK_K, BLOCK_K, BLOCK_E] product of the match kernel near 8K elements."""
    bk = max(2, _next_pow2(K))
    if block_e is None:
        block_e = max(16, min(_next_pow2(E), max(16, 8192 // (bk * bk))))
    return bk, int(block_e)


def _sigma_constexpr(sigma) -> float:
    return float(sigma.item() if torch.is_tensor(sigma) else sigma)


def _check(anchor_out, out_vec, in_vec):
    if anchor_out.dim() != 2 or out_vec.dim() != 4 or in_vec.shape != out_vec.shape:
        raise ValueError(f"bad shapes {tuple(anchor_out.shape)}, {tuple(out_vec.shape)}, "
                         f"{tuple(in_vec.shape)}")
    return out_vec.shape


def lattice_match(anchor_out: torch.Tensor, out_vec: torch.Tensor, in_vec: torch.Tensor,
                  sigma: float, *, anchor_scores: torch.Tensor | None = None,
                  pair_scores: torch.Tensor | None = None, block_e: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """anchor_out [N,E], out_vec/in_vec [N,S,K,E] -> anchor_scores [N,K], pair_scores [N,S-1,K,K]
    (dtype of out_vec). Pass contiguous ``anchor_scores`` / ``pair_scores`` to write in place."""
    N, S, K, E = _check(anchor_out, out_vec, in_vec)
    anchor_out, out_vec, in_vec = (t.contiguous() for t in (anchor_out, out_vec, in_vec))
    if anchor_scores is None:
        anchor_scores = torch.empty((N, K), dtype=out_vec.dtype, device=out_vec.device)
    if pair_scores is None:
        pair_scores = torch.empty((N, max(S - 1, 0), K, K), dtype=out_vec.dtype,
                                  device=out_vec.device)
    if N == 0 or S == 0:
        return anchor_scores, pair_scores
    bk, be = block_sizes(K, E, block_e)
    lattice_match_kernel[(N, S)](anchor_out, out_vec, in_vec, N, S, K, E,
                                 anchor_scores, pair_scores,
                                 SIGMA=_sigma_constexpr(sigma), BLOCK_K=bk, BLOCK_E=be)
    return anchor_scores, pair_scores


def greedy_walk(anchor_scores: torch.Tensor, pair_scores: torch.Tensor, *,
                idx: torch.Tensor | None = None) -> torch.Tensor:
    """anchor_scores [N,K], pair_scores [N,S-1,K,K] -> idx [N,S] int64 (Eq. 8)."""
    N, K = anchor_scores.shape
    S = pair_scores.shape[1] + 1
    anchor_scores, pair_scores = anchor_scores.contiguous(), pair_scores.contiguous()
    if idx is None:
        idx = torch.empty((N, S), dtype=torch.int64, device=anchor_scores.device)
    if N == 0:
        return idx
    bk, _ = block_sizes(K, 1)
    greedy_walk_kernel[(N,)](anchor_scores, pair_scores, N, S, K, idx, BLOCK_K=bk, num_warps=1)
    return idx


def fused_match_walk(anchor_out: torch.Tensor, out_vec: torch.Tensor, in_vec: torch.Tensor,
                     sigma: float, *, idx: torch.Tensor | None = None,
                     block_e: int | None = None) -> torch.Tensor:
    """Fused LatticeMatch + GreedyWalk: -> idx [N,S] int64; no K x K table is built."""
    N, S, K, E = _check(anchor_out, out_vec, in_vec)
    anchor_out, out_vec, in_vec = (t.contiguous() for t in (anchor_out, out_vec, in_vec))
    if idx is None:
        idx = torch.empty((N, S), dtype=torch.int64, device=out_vec.device)
    if N == 0 or S == 0:
        return idx
    bk = max(2, _next_pow2(K))
    be = block_e or max(16, min(_next_pow2(E), max(16, 4096 // bk)))
    lattice_match_walk_kernel[(N,)](anchor_out, out_vec, in_vec, N, S, K, E, idx,
                                    SIGMA=_sigma_constexpr(sigma), BLOCK_K=bk, BLOCK_E=be)
    return idx


def draft_tree(anchor_scores: torch.Tensor, pair_scores: torch.Tensor, num_nodes: int, *,
               parent: torch.Tensor | None = None, depth: torch.Tensor | None = None,
               cand: torch.Tensor | None = None, score: torch.Tensor | None = None):
    """anchor_scores [N,K], pair_scores [N,S-1,K,K] -> (parent, depth, cand [N,M] int64,
    score [N,M] fp32), M = min(num_nodes, sum_j K^j): lattice.build_tree (rule `tree`). Scores
    must be finite. Pass contiguous outputs to write in place."""
    from lilicorr.lattice import tree_size

    N, K = anchor_scores.shape
    S = pair_scores.shape[1] + 1
    if num_nodes < 1:
        raise ValueError(f"a draft tree needs at least one node, got {num_nodes}")
    M = min(int(num_nodes), tree_size(K, S))
    dev = anchor_scores.device
    parent, depth, cand = (x if x is not None else torch.empty((N, M), dtype=torch.int64, device=dev)
                           for x in (parent, depth, cand))
    if score is None:
        score = torch.empty((N, M), dtype=torch.float32, device=dev)
    if N == 0:
        return parent, depth, cand, score
    bk, bm = max(2, _next_pow2(K)), max(2, _next_pow2(M))
    bp = _next_pow2(S * bm)
    sort = max(bm * bk, bp)
    work = torch.empty((N, sort + 3 * S * bm), dtype=torch.int64, device=dev)
    kept_val = torch.empty((N, S * bm), dtype=torch.float32, device=dev)
    draft_tree_kernel[(N,)](anchor_scores.contiguous(), pair_scores.contiguous(), N, S, K, M,
                            parent, depth, cand, score, work, kept_val,
                            BLOCK_K=bk, BLOCK_M=bm, BLOCK_P=bp, SORT=sort)
    return parent, depth, cand, score


# --------------------------------------------------------------------------------------------
# ahead-of-time compilation to PTX (TensorRT QDP @trtp.aot_impl); works without a GPU
# --------------------------------------------------------------------------------------------

_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def strip_unused_params(ptx: str, name: str, keep: int) -> str:
    """Drop kernel parameters ``name_param_{keep..}`` from the .entry signature of ``ptx`` when
    the body never reads them. Triton >= 3.3 appends hidden ``global_scratch`` /
    ``profile_scratch`` pointers; a TensorRT AOT launch passes only inputs, extra scalars and
    outputs, so those trailing parameters must go (they are unused when the kernel's
    global_scratch_size / profile_scratch_size are 0). Raises if a dropped parameter is read."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, flags=re.S)
    if m is None:
        raise ValueError(f"kernel .entry {name} not found in PTX")
    params = [p.strip() for p in m.group(1).split(",") if p.strip()]
    body = ptx[m.end():]
    for p in params[keep:]:
        pname = p.split()[-1]
        if re.search(r"\b" + re.escape(pname) + r"\b", body):
            raise ValueError(f"PTX parameter {pname} is used by the kernel; cannot strip it")
    new_sig = ",\n".join("\t" + p for p in params[:keep])
    return ptx[:m.start(1)] + "\n" + new_sig + "\n" + ptx[m.end(1):]


def compile_ptx(op: str, *, K: int, E: int | None = None, sigma: float = 1.0,
                dtype: torch.dtype = torch.float32, arch: int = 90,
                block_e: int | None = None, num_warps: int = 4) -> dict:
    """Compile one lattice kernel to PTX for ``sm_<arch>`` (no GPU needed).

    op: "LatticeMatch" | "GreedyWalk" | "LatticeMatchWalk". K (and E for the matching kernels)
    and sigma are baked in as compile-time block sizes / constant. Returns dict(name, ptx,
    num_warps, shared, block_k, block_e, grid) where grid names the launch grid in terms of
    N and S. Kernel arguments at launch: input pointers, int32 N, S, K[, E], output pointers.
    """
    from triton.backends.compiler import GPUTarget

    ty = _TRITON_DTYPES[dtype]
    if op == "LatticeMatch":
        bk, be = block_sizes(K, E, block_e)
        fn = lattice_match_kernel
        sig = {"anchor_ptr": f"*{ty}", "out_ptr": f"*{ty}", "in_ptr": f"*{ty}", "N": "i32",
               "S": "i32", "K": "i32", "E": "i32", "anchor_scores_ptr": f"*{ty}",
               "pair_scores_ptr": f"*{ty}"}
        consts = {"SIGMA": float(sigma), "BLOCK_K": bk, "BLOCK_E": be}
        grid = ("N", "S")
    elif op == "GreedyWalk":
        bk, be = max(2, _next_pow2(K)), None
        fn = greedy_walk_kernel
        sig = {"anchor_scores_ptr": f"*{ty}", "pair_scores_ptr": f"*{ty}", "N": "i32",
               "S": "i32", "K": "i32", "idx_ptr": "*i64"}
        consts = {"BLOCK_K": bk}
        grid = ("N",)
    elif op == "LatticeMatchWalk":
        bk = max(2, _next_pow2(K))
        be = block_e or max(16, min(_next_pow2(E), max(16, 4096 // bk)))
        fn = lattice_match_walk_kernel
        sig = {"anchor_ptr": f"*{ty}", "out_ptr": f"*{ty}", "in_ptr": f"*{ty}", "N": "i32",
               "S": "i32", "K": "i32", "E": "i32", "idx_ptr": "*i64"}
        consts = {"SIGMA": float(sigma), "BLOCK_K": bk, "BLOCK_E": be}
        grid = ("N",)
    else:
        raise ValueError(f"unknown op {op!r}")
    signature = dict(sig)
    signature.update({k: "constexpr" for k in consts})
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=consts)
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                        options={"num_warps": num_warps})
    md = ck.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise RuntimeError(f"{op}: kernel needs global/profile scratch memory; cannot AOT-launch")
    ptx = strip_unused_params(ck.asm["ptx"], md.name, keep=len(sig))
    return {"name": md.name, "ptx": ptx, "num_warps": md.num_warps, "shared": md.shared,
            "block_k": bk, "block_e": be, "grid": grid, "num_params": len(sig)}
