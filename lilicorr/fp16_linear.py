"""fp16-weight linear layers for CPU inference: weights stored as fp16, activations and
accumulation in fp32 (fbgemm's fp16-weight GEMM).

A decode step on a CPU is memory-bound: a plain SmolLM2-135M step reads ~540 MB of fp32 weights.
fbgemm packs each weight matrix once as fp16 and converts it on the fly inside an fp32 GEMM, so
every step reads half the bytes, and its small-M kernel keeps a k-token verify close to a 1-token
step (results/verify_cost_cpu.md: about 2x faster plain steps than fp32, and t(4)/t(1) ~1.1
instead of ~1.5 on an AVX2 machine without bf16 instructions).

The model this defines is exact and simple to state: every weight matrix (linears and embedding
tables) rounded to fp16 (10-bit mantissa: 8x finer than bf16), everything else in fp32. `FP16WeightLinear.weight` holds
the rounded values in fp32, so code that reads the weight (the drafter's draft-vocabulary rows,
a tied embedding) sees the same numbers the kernel multiplies with.

A GEMM over more than one token (a verify, a prefill, several rows) can run on more threads than
the rest of the model (`set_gemm_threads`, `PackedFP16`), with the same bits as on one.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

FP16_MAX = 65504.0


def fbgemm_fp16_available() -> bool:
    """Whether this PyTorch build has fbgemm's fp16-weight GEMM (x86 CPU builds)."""
    return hasattr(torch, "fbgemm_pack_gemm_matrix_fp16") and "fbgemm" in torch.backends.quantized.supported_engines


def pack_fp16(weight: torch.Tensor) -> torch.Tensor:
    """[O, I] weight -> fbgemm's packed fp16 matrix (an opaque CPU tensor)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fbgemm.*deprecated")
        return torch.fbgemm_pack_gemm_matrix_fp16(weight.detach().float().contiguous())


_linear_warned = False     # the op's deprecation warning is a warn-once in ATen: silence only the first call


def fp16_linear(x2: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x2 [M, I] float32, contiguous @ packed^T + bias -> float32 [M, O], on one thread."""
    global _linear_warned
    if _linear_warned:          # a catch_warnings block per call costs more than a small GEMM's setup
        return torch.fbgemm_linear_fp16_weight(x2, packed, bias)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fbgemm.*deprecated")
        y = torch.fbgemm_linear_fp16_weight(x2, packed, bias)
    _linear_warned = True
    return y


_gemm_threads = 0          # threads of a GEMM over more than one token; 0: torch's intra-op threads


def set_gemm_threads(n: int) -> None:
    """Threads for the fp16-weight GEMMs of more than one token (a verify, a prefill, several rows),
    and for bf16-gemm's GEMMs and attention of `bf16_gemm.PARALLEL_ROWS` tokens or more, whatever
    torch's own thread count: 0 follows `torch.get_num_threads()`. A 1-token GEMM cannot be split
    and always runs on one thread. A process-wide setting, like torch's thread count."""
    global _gemm_threads
    if n < 0:
        raise ValueError(f"GEMM threads {n}: must be >= 0 (0: torch's thread count)")
    _gemm_threads = int(n)


def gemm_threads() -> int:
    """The threads a multi-token fp16-weight GEMM runs on now."""
    return _gemm_threads or torch.get_num_threads()


_prefill_threads = 0       # the GEMM threads of a prefill; 0: gemm_threads()


def set_prefill_threads(n: int) -> None:
    """GEMM threads while the engine prefills new requests (`SpecEngine._prefill_group`): a prompt
    is the largest GEMM a server runs, and the only one that runs while no row waits for a verify;
    0 keeps `gemm_threads()`. A process-wide setting, like `set_gemm_threads`."""
    global _prefill_threads
    if n < 0:
        raise ValueError(f"prefill threads {n}: must be >= 0 (0: the GEMM threads)")
    _prefill_threads = int(n)


def prefill_threads() -> int:
    """The prefill's GEMM threads now (0: the GEMM threads)."""
    return _prefill_threads


@contextlib.contextmanager
def gemm_threads_for(n: int):
    """`set_gemm_threads(n)` for the block alone; n = 0 leaves the setting as it is."""
    global _gemm_threads
    before = _gemm_threads
    if n:
        _gemm_threads = int(n)
    try:
        yield
    finally:
        _gemm_threads = before


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to n for the block alone (a no-op where it already is)."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class PackedFP16:
    """One fp16-weight matrix packed for fbgemm, run on `gemm_threads()` threads.

    `torch.fbgemm_linear_fp16_weight` runs fbgemm's fp16 GEMM on one thread. The quantized-engine
    op `quantized::linear_dynamic_fp16` runs the same fbgemm kernel on the same packed layout,
    splitting the rows of x (the M tokens) across torch's intra-op threads: each output row is
    computed exactly as on one thread, so both give identical bits (tests/test_target.py). A
    1-token GEMM cannot be split, and a thread count of 1 has nothing to split it across: those take
    the one-thread op, the others the parallel one, with torch's thread count raised to
    `gemm_threads()` for the call alone (the rest of the model keeps its own). Each packing is made
    the first time it is used. On a 2-core EPYC, 2 GEMM threads took SmolLM2's 8-token forward from
    41.9 to 36.8 ms offline, but through Triton on those 2 cores the server was slower with them
    (results/gemm_threads_epyc/), so the engine's default is its torch thread count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight.detach()                     # [O, I], fp16-exact values
        self.out_features = int(weight.shape[0])
        self.bias = (bias.detach().float() if bias is not None else torch.zeros(self.out_features)).contiguous()
        self._single: torch.Tensor | None = None          # fbgemm packed matrix
        self._parallel = None                             # LinearPackedParamsBase (quantized engine)

    def single(self) -> torch.Tensor:
        """The one-thread op's packed matrix, packed on first use."""
        if self._single is None:
            self._single = pack_fp16(self.weight)
        return self._single

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., I] (any float dtype) -> float32 [..., O]."""
        shape = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).float().contiguous()              # [M, I]
        threads = gemm_threads()
        if threads == 1 or x2.shape[0] <= 1:
            return fp16_linear(x2, self.single(), self.bias).view(*shape, self.out_features)
        if self._parallel is None:
            self._parallel = torch.ops.quantized.linear_prepack_fp16(self.weight.float().contiguous(), self.bias)
        with torch_threads(threads):
            y = torch.ops.quantized.linear_dynamic_fp16(x2, self._parallel)      # [M, O]
        return y.view(*shape, self.out_features)


def fp16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` survives a round trip through fp16 unchanged."""
    w = weight.detach()
    return bool(torch.isfinite(w).all()) and bool(torch.equal(w.half().to(w.dtype), w))


class RoundedWeightLinear(nn.Module):
    """Inference stand-in for an `nn.Linear` on CPU whose weight is rounded to `ROUND_TO` once (in
    place, so a tied embedding shares the rounding) and multiplied by a packed kernel (`_pack(w,
    bias)`, not a buffer: it stays out of state_dict); forward takes and returns float32."""

    ROUND_TO: torch.dtype
    KERNEL = ""                    # for repr

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            w.copy_(w.to(self.ROUND_TO).to(w.dtype))      # the values the kernel multiplies with
        self.weight = w                                    # [O, I] float32, exact in ROUND_TO
        self.bias = linear.bias
        self._gemm = self._pack(w, linear.bias)

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None):
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.KERNEL}"


class FP16WeightLinear(RoundedWeightLinear):
    """`RoundedWeightLinear` in fp16, multiplied by fbgemm's fp16-weight GEMM (`PackedFP16`)."""

    ROUND_TO, KERNEL = torch.float16, "weights=fp16 (fbgemm)"

    def __init__(self, linear: nn.Linear):
        if linear.weight.device.type != "cpu":
            raise ValueError("fp16-weight linears run on CPU (fbgemm); use bfloat16 on CUDA")
        if not fbgemm_fp16_available():
            raise RuntimeError("this PyTorch build has no fbgemm fp16 GEMM; use --dtype float32")
        if float(linear.weight.detach().abs().max()) >= FP16_MAX:
            raise ValueError(f"a weight of {tuple(linear.weight.shape)} exceeds fp16's range; use --dtype float32")
        super().__init__(linear)

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> "PackedFP16":
        gemm = PackedFP16(weight, bias)
        gemm.single()                                      # pack the 1-token layout now, not mid-request
        return gemm


def use_fp16_weights(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` by an `FP16WeightLinear` and round every `nn.Embedding`
    table to fp16 values (in place; embeddings stay float32 tensors); returns the number of linears."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, FP16WeightLinear(child))
                count += 1
            elif isinstance(child, nn.Embedding):
                if float(child.weight.detach().abs().max()) >= FP16_MAX:
                    raise ValueError("an embedding value exceeds fp16's range; use --dtype float32")
                with torch.no_grad():
                    child.weight.copy_(child.weight.half().to(child.weight.dtype))
    return count
