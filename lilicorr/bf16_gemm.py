"""bf16-GEMM linear layers for CPU inference on AVX512-BF16: weights and GEMM inputs rounded to
bf16, products summed in fp32 (VDPBF16PS), everything else of the model in fp32.

A speculative verify multiplies every weight matrix by 2-16 tokens. fbgemm's fp16-weight GEMM
(`fp16_linear.py`) runs fp32 FMAs, so past a few tokens it is compute-bound: on a 2-core
AVX512-BF16 EPYC an 8-token SmolLM2 forward costs ~1.8 plain steps in fp16-weights. One VDPBF16PS
does twice the multiply-adds of an fp32 FMA, and the kernel in `csrc/bf16_gemm.cpp` keeps a group
of weight columns in registers and cache over every token of the call, so a k-token GEMM costs
little more than the 1-token step's one pass over the weights (`scripts/verify_cost.py --dtypes
bf16-gemm`).

The model this defines: every weight matrix (linears and embedding tables) rounded to bf16 once,
every GEMM input rounded to bf16, fp32 accumulation in ascending k-pairs, fp32 everywhere else.
Each output row's bits do not depend on the other rows of the call or on the thread count (the
kernel's summation order is fixed). Rounding GEMM inputs to bf16 turns any float32 difference
upstream into a whole bf16 step where a value sits on a rounding boundary, so the attention must
not depend on the call either: PyTorch's SDPA computes a query differently beside 7 others than
alone, and through Triton that flipped served outputs away from `ar`'s. A bf16-gemm target
therefore loads batch-invariant (`lilicorr.batch_invariant`, checked at load) with the same
extension's attention (`fused_attention`: every query on its own, over the keys its mask leaves,
in key order), which is also faster than SDPA at these sizes. Together: a k-token verify decides
exactly as k one-token steps, and greedy speculative output equals greedy `ar` of the same
precision.

The kernel is compiled on first use (`torch.utils.cpp_extension`, cached under
TORCH_EXTENSIONS_DIR, about a minute once); `bf16_gemm_available()` says whether this CPU and
toolchain can run it.
"""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch
from torch import nn

from .fp16_linear import RoundedWeightLinear, gemm_threads, torch_threads

_SOURCE = Path(__file__).with_name("csrc") / "bf16_gemm.cpp"
_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
PARALLEL_ROWS = 32      # csrc kParallelRows: calls of fewer rows (GEMM) or queries (attention) run on one thread


def _missing() -> str:
    """Why the kernel cannot run here ('' when it can)."""
    from .target import _cpu_flags
    flags = _cpu_flags()
    lacking = [f for f in _FLAGS if f not in flags]
    if lacking:
        return f"this CPU lacks {', '.join(lacking)}"
    if not _SOURCE.is_file():
        return f"the kernel source {_SOURCE.name} is missing from the installed package"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++ or g++) on PATH to build the kernel"
    if _ninja_dir() is None:
        return "ninja is not installed (pip install ninja) to build the kernel"
    return ""


def _ninja_dir() -> str | None:
    """The folder of a ninja binary: PATH's, else the pip package's (a server process's PATH may
    not hold the virtual environment's bin/)."""
    found = shutil.which("ninja")
    if found:
        return str(Path(found).parent)
    try:
        import ninja
    except ImportError:
        return None
    return getattr(ninja, "BIN_DIR", None)


def bf16_gemm_available() -> bool:
    """Whether this CPU has AVX512-BF16 and a toolchain to build the kernel."""
    return not _missing()


@functools.lru_cache(maxsize=1)
def kernels():
    """The compiled extension (built on first call, then loaded from the build cache)."""
    why = _missing()
    if why:
        raise RuntimeError(f"bf16-gemm precision unavailable: {why}; use --dtype fp16-weights or float32")
    import os
    from torch.utils.cpp_extension import load
    ninja_dir = _ninja_dir()
    if shutil.which("ninja") is None and ninja_dir:
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    # -fopenmp: at::parallel_for is inline and runs serially in code built without OpenMP; with it,
    # it runs on torch's own OpenMP runtime (the process has loaded torch's libgomp.so.1 already)
    return load(name="lilicorr_bf16_gemm", sources=[str(_SOURCE)], verbose=False,
                extra_cflags=["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
                extra_ldflags=["-fopenmp"])


def _run(rows: int, op, *args):
    """`op(*args)`, a kernel call over `rows` rows (or queries): from PARALLEL_ROWS on it runs on
    `gemm_threads()` threads (`lilicorr.fp16_linear.set_gemm_threads`, 0: torch's), with torch's
    count set to that for the call alone; smaller calls run on one thread whatever the count (the
    kernel's own rule), and go straight to the op (this is every linear of a decode step). Outputs
    are the same bits on any number of threads."""
    if rows >= PARALLEL_ROWS:
        with torch_threads(gemm_threads()):
            return op(*args)
    return op(*args)


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` survives a round trip through bf16 unchanged."""
    w = weight.detach()
    return bool(torch.isfinite(w).all()) and bool(torch.equal(w.bfloat16().to(w.dtype), w))


class PackedBF16:
    """One weight matrix rounded to bf16 and packed for the kernel; calls take float x [..., I] and
    return float32 [..., O]. A call of PARALLEL_ROWS rows or more (a prefill, many rows at once) is
    split over output columns on `gemm_threads()` threads; smaller ones run on one thread, where a
    fork and join cost more than the split saves. On a 2-core EPYC, 8 rows x 8 tokens took 95 ms on
    2 threads against 164 ms on 1 (results/gemm_threads_bf16_gemm_epyc/)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.out_features = int(weight.shape[0])
        self.packed = kernels().pack(weight.detach().float())           # [groups, I/2, 384] bf16 bits
        self.bias = bias.detach().float().contiguous() if bias is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _run(x.numel() // max(x.shape[-1], 1), kernels().linear, x, self.packed, self.out_features, self.bias)


class BF16GemmLinear(RoundedWeightLinear):
    """`RoundedWeightLinear` in bf16, multiplied by this module's kernel (`PackedBF16`), which also
    rounds its inputs to bf16."""

    ROUND_TO, KERNEL = torch.bfloat16, "weights and inputs=bf16 (VDPBF16PS)"

    def __init__(self, linear: nn.Linear):
        if linear.weight.device.type != "cpu":
            raise ValueError("bf16-gemm linears run on CPU; use bfloat16 on CUDA")
        w = linear.weight.detach()
        if not bool(torch.isfinite(w).all()) or float(w.abs().max()) >= BF16_MAX:
            raise ValueError(f"a weight of {tuple(w.shape)} is not finite in bf16; use --dtype float32")
        super().__init__(linear)

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedBF16:
        return PackedBF16(weight, bias)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    live: torch.Tensor | None = None) -> torch.Tensor:
    """`lilicorr.batch_invariant.invariant_attention`'s contract in one compiled loop per query:
    q [N, hq, T, D], k/v [N, hkv, S, D] (hq a multiple of hkv), additive mask [N|1, 1, T, S] or
    [T, S] -> softmax(q k^T / sqrt(D) + mask) v [N, hq, T, D] in q's dtype, in float32. Each query
    is computed on its own over the keys its mask leaves (in key order), so its bits depend neither
    on the other queries nor on how many keys the call reads; the target's float32 cache views are
    read in place. `live` [N]: row n's queries from live[n] on are padding (a packed verify,
    `lilicorr.target.Packing`), skipped, with zeros out."""
    if mask.dim() == 2:
        mask = mask[None, None]
    out = _run(q.shape[0] * q.shape[2],                              # N * T queries (per head)
               kernels().attention, q.float(), k.float(), v.float(), mask.float(), q.shape[-1] ** -0.5, live)
    return out.to(q.dtype)


def use_bf16_gemm(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` by a `BF16GemmLinear`, round every `nn.Embedding` table
    to bf16 values (in place; embeddings stay float32 tensors), and give every target attention
    layer `fused_attention` for batch-invariant mode; returns the number of linears."""
    count = 0
    for module in list(model.modules()):
        if hasattr(module, "attention_kernel"):
            module.attention_kernel = fused_attention
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, BF16GemmLinear(child))
                count += 1
            elif isinstance(child, nn.Embedding):
                with torch.no_grad():
                    child.weight.copy_(child.weight.bfloat16().to(child.weight.dtype))
    return count
