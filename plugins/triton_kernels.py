"""Triton-language kernels for the lattice ops (must match ``lilicorr.lattice``).

Kernels (argument order is inputs, int32 scalars, outputs, then constexprs; that is the order a
TensorRT AOT plugin launch uses, see ``compile_ptx``):

    lattice_match_kernel      grid (N, S)  program (n, 0): anchor row; (n, s>0): pair table s-1
    greedy_walk_kernel        grid (N,)    sequential Eq. 8 walk over precomputed scores
    lattice_match_walk_kernel grid (N,)    fused: per slot only the committed candidate's row

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
    "lattice_match", "greedy_walk", "fused_match_walk", "block_sizes", "compile_ptx",
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
