"""TensorRT "quickly deployable plugin" (QDP, ``tensorrt.plugin``) definitions of the lattice ops,
for TensorRT >= 10.6 (JIT ``@trtp.impl``) / >= 10.9 (AOT ``@trtp.aot_impl``: the Triton kernels
are compiled to PTX at build time and baked into the engine, so the engine runs without Python).

    from lilicorr.plugins import trt_qdp
    trt_qdp.register_qdp_plugins(mode="aot")   # "aot" | "jit" | "both"

Only importable where ``tensorrt.plugin`` exists (not in TensorRT-RTX): every TensorRT import
happens inside ``register_qdp_plugins`` and fails with a message naming what is missing.
Do not register these and the ``trt_v3`` classes in the same process: both claim
(name, "1", "lilicorr").

ONNX nodes map to these plugins by op_type + ``plugin_namespace="lilicorr"`` (the exporter
writes both). With mode="both" the choice is made per node by an integer ``aot`` attribute
(``onnx_functions.set_node_attributes(model, aot=1)``) or by the network flags
``PREFER_AOT_PYTHON_PLUGINS`` / ``PREFER_JIT_PYTHON_PLUGINS``; otherwise TensorRT raises.

AOT notes: K and E must be build-time constants (they size the kernel blocks); sigma is baked
into the PTX as a constant (``extra_args`` can only carry int32 scalars); the hidden Triton
scratch parameters are stripped from the PTX (see ``triton_kernels.strip_unused_params``). The
PTX targets the build GPU's compute capability (env ``LILICORR_AOT_ARCH`` overrides, e.g. 90)
and Triton 3.7.1 emits PTX ISA 8.7, which the driver must support (CUDA >= 12.8 drivers).
Attributes are not serialized with AOT; sigma lives in the PTX.
"""
# NB: no `from __future__ import annotations` here: tensorrt.plugin validates real annotations.
import os
from typing import List, Tuple, Union

from . import NAMESPACE

__all__ = ["register_qdp_plugins", "registered_ops", "qdp_available"]

_REGISTERED: set = set()


def registered_ops() -> set:
    return set(_REGISTERED)


def _import_trtp():
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise ImportError(
            "lilicorr QDP plugins need the `tensorrt` Python module (TensorRT >= 10.6; NVIDIA "
            f"containers / pypi.nvidia.com), which is not importable ({exc}). TensorRT-RTX has no "
            "tensorrt.plugin: use lilicorr.plugins.trt_v3.register_v3_plugins instead.") from exc
    try:
        import tensorrt.plugin as trtp
    except ImportError as exc:
        raise ImportError(
            f"lilicorr QDP plugins need `tensorrt.plugin` (TensorRT >= 10.6); this TensorRT "
            f"{getattr(trt, '__version__', '?')} has none ({exc}). Use lilicorr.plugins.trt_v3 "
            "(IPluginV3 classes) instead.") from exc
    return trt, trtp


def qdp_available(aot: bool = False) -> bool:
    try:
        trt, trtp = _import_trtp()
    except ImportError:
        return False
    return (not aot) or (hasattr(trt, "QuickPluginCreationRequest") and hasattr(trtp, "aot_impl"))


def _const(expr, what: str) -> int:
    if getattr(expr, "is_fake", False) or not getattr(expr, "is_constant", False):
        raise ValueError(f"lilicorr AOT plugin: {what} must be a build-time constant dimension")
    return int(expr.constant_value())


def _aot_arch() -> int:
    if os.environ.get("LILICORR_AOT_ARCH"):
        return int(os.environ["LILICORR_AOT_ARCH"])
    import torch
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor
    return 90


def register_qdp_plugins(mode: str = "aot", trtp=None, trt=None) -> set:
    """Define the QDP plugins lilicorr::{LatticeMatch, GreedyWalk, LatticeMatchWalk}.

    mode: "aot" (aot_impl only; TensorRT >= 10.9), "jit" (impl only) or "both".
    ``trt`` / ``trtp`` may be passed in (tests use stand-ins); by default they are imported.
    Idempotent; returns the set of registered op names."""
    if mode not in ("aot", "jit", "both"):
        raise ValueError(f"mode must be 'aot', 'jit' or 'both'; got {mode!r}")
    if _REGISTERED:
        return set(_REGISTERED)
    if trtp is None or trt is None:
        trt, trtp = _import_trtp()
    if mode in ("aot", "both") and not hasattr(trtp, "aot_impl"):
        raise ImportError(f"tensorrt.plugin.aot_impl needs TensorRT >= 10.9 (found "
                          f"{getattr(trt, '__version__', '?')}); use mode='jit'")
    from . import trt_v3
    if trt_v3.registered_creators(trt):
        raise RuntimeError("lilicorr V3 plugin creators are already registered for this TensorRT "
                           "module; use either trt_v3 or trt_qdp in one process")

    def torch_dtype(trt_dtype):
        import torch
        table = {trt.float32: torch.float32, trt.float16: torch.float16}
        if hasattr(trt, "bfloat16"):
            table[trt.bfloat16] = torch.bfloat16
        return table[trt_dtype]

    def as_torch(t):
        import torch
        return torch.as_tensor(t, device="cuda")

    # ---------------------------------------------------------------- LatticeMatch
    @trtp.register(f"{NAMESPACE}::LatticeMatch")
    def lattice_match_desc(anchor_out: trtp.TensorDesc, out_vec: trtp.TensorDesc,
                           in_vec: trtp.TensorDesc, sigma: float
                           ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        n, s, k = out_vec.shape_expr[0], out_vec.shape_expr[1], out_vec.shape_expr[2]
        anchor_scores = trtp.from_shape_expr((n, k), dtype=out_vec.dtype)
        pair_scores = trtp.from_shape_expr((n, s - 1, k, k), dtype=out_vec.dtype)
        return anchor_scores, pair_scores

    @trtp.autotune(f"{NAMESPACE}::LatticeMatch")
    def lattice_match_autotune(anchor_out: trtp.TensorDesc, out_vec: trtp.TensorDesc,
                               in_vec: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc]
                               ) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination("FP32|FP16, FP32|FP16, FP32|FP16, FP32|FP16, FP32|FP16")]

    # ---------------------------------------------------------------- GreedyWalk
    @trtp.register(f"{NAMESPACE}::GreedyWalk")
    def greedy_walk_desc(anchor_scores: trtp.TensorDesc, pair_scores: trtp.TensorDesc
                         ) -> trtp.TensorDesc:
        n, s1 = pair_scores.shape_expr[0], pair_scores.shape_expr[1]
        return trtp.from_shape_expr((n, s1 + 1), dtype=trt.int64)

    @trtp.autotune(f"{NAMESPACE}::GreedyWalk")
    def greedy_walk_autotune(anchor_scores: trtp.TensorDesc, pair_scores: trtp.TensorDesc,
                             outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination("FP32|FP16, FP32|FP16, INT64")]

    # ---------------------------------------------------------------- LatticeMatchWalk
    @trtp.register(f"{NAMESPACE}::LatticeMatchWalk")
    def lattice_match_walk_desc(anchor_out: trtp.TensorDesc, out_vec: trtp.TensorDesc,
                                in_vec: trtp.TensorDesc, sigma: float) -> trtp.TensorDesc:
        n, s = out_vec.shape_expr[0], out_vec.shape_expr[1]
        return trtp.from_shape_expr((n, s), dtype=trt.int64)

    @trtp.autotune(f"{NAMESPACE}::LatticeMatchWalk")
    def lattice_match_walk_autotune(anchor_out: trtp.TensorDesc, out_vec: trtp.TensorDesc,
                                    in_vec: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc]
                                    ) -> List[trtp.AutoTuneCombination]:
        return [trtp.AutoTuneCombination("FP32|FP16, FP32|FP16, FP32|FP16, INT64")]

    # ---------------------------------------------------------------- JIT implementations
    if mode in ("jit", "both"):
        @trtp.impl(f"{NAMESPACE}::LatticeMatch")
        def lattice_match_impl(anchor_out: trtp.Tensor, out_vec: trtp.Tensor, in_vec: trtp.Tensor,
                               sigma: float, outputs: Tuple[trtp.Tensor], stream: int) -> None:
            import torch
            from . import triton_kernels as tk
            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                tk.lattice_match(as_torch(anchor_out), as_torch(out_vec), as_torch(in_vec), sigma,
                                 anchor_scores=as_torch(outputs[0]),
                                 pair_scores=as_torch(outputs[1]))

        @trtp.impl(f"{NAMESPACE}::GreedyWalk")
        def greedy_walk_impl(anchor_scores: trtp.Tensor, pair_scores: trtp.Tensor,
                             outputs: Tuple[trtp.Tensor], stream: int) -> None:
            import torch
            from . import triton_kernels as tk
            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                tk.greedy_walk(as_torch(anchor_scores), as_torch(pair_scores),
                               idx=as_torch(outputs[0]))

        @trtp.impl(f"{NAMESPACE}::LatticeMatchWalk")
        def lattice_match_walk_impl(anchor_out: trtp.Tensor, out_vec: trtp.Tensor,
                                    in_vec: trtp.Tensor, sigma: float,
                                    outputs: Tuple[trtp.Tensor], stream: int) -> None:
            import torch
            from . import triton_kernels as tk
            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                tk.fused_match_walk(as_torch(anchor_out), as_torch(out_vec), as_torch(in_vec),
                                    sigma, idx=as_torch(outputs[0]))

    # ---------------------------------------------------------------- AOT implementations
    if mode in ("aot", "both"):
        def sym(values):
            return trtp.SymIntExprs.from_tuple([trtp.SymInt32(v) for v in values])

        def launch(ck, grid):
            lp = trtp.KernelLaunchParams()
            lp.grid_x = grid[0]
            if len(grid) > 1:
                lp.grid_y = grid[1]
            lp.block_x = ck["num_warps"] * 32
            lp.shared_mem = ck["shared"]
            return lp

        @trtp.aot_impl(f"{NAMESPACE}::LatticeMatch")
        def lattice_match_aot(anchor_out: trtp.TensorDesc, out_vec: trtp.TensorDesc,
                              in_vec: trtp.TensorDesc, sigma: float,
                              outputs: Tuple[trtp.TensorDesc], tactic: int
                              ) -> Tuple[Union[str, bytes], Union[str, bytes],
                                         trtp.KernelLaunchParams, trtp.SymExprs]:
            from . import triton_kernels as tk
            n, s, k, e = (out_vec.shape_expr[i] for i in range(4))
            ck = tk.compile_ptx("LatticeMatch", K=_const(k, "K"), E=_const(e, "E"),
                                sigma=float(sigma), dtype=torch_dtype(out_vec.dtype),
                                arch=_aot_arch())
            return ck["name"], ck["ptx"], launch(ck, (n, s)), sym((n, s, k, e))

        @trtp.aot_impl(f"{NAMESPACE}::GreedyWalk")
        def greedy_walk_aot(anchor_scores: trtp.TensorDesc, pair_scores: trtp.TensorDesc,
                            outputs: Tuple[trtp.TensorDesc], tactic: int
                            ) -> Tuple[Union[str, bytes], Union[str, bytes],
                                       trtp.KernelLaunchParams, trtp.SymExprs]:
            from . import triton_kernels as tk
            n, k = anchor_scores.shape_expr[0], anchor_scores.shape_expr[1]
            s = outputs[0].shape_expr[1]
            ck = tk.compile_ptx("GreedyWalk", K=_const(k, "K"),
                                dtype=torch_dtype(anchor_scores.dtype), arch=_aot_arch(),
                                num_warps=1)
            return ck["name"], ck["ptx"], launch(ck, (n,)), sym((n, s, k))

        @trtp.aot_impl(f"{NAMESPACE}::LatticeMatchWalk")
        def lattice_match_walk_aot(anchor_out: trtp.TensorDesc, out_vec: trtp.TensorDesc,
                                   in_vec: trtp.TensorDesc, sigma: float,
                                   outputs: Tuple[trtp.TensorDesc], tactic: int
                                   ) -> Tuple[Union[str, bytes], Union[str, bytes],
                                              trtp.KernelLaunchParams, trtp.SymExprs]:
            from . import triton_kernels as tk
            n, s, k, e = (out_vec.shape_expr[i] for i in range(4))
            ck = tk.compile_ptx("LatticeMatchWalk", K=_const(k, "K"), E=_const(e, "E"),
                                sigma=float(sigma), dtype=torch_dtype(out_vec.dtype),
                                arch=_aot_arch())
            return ck["name"], ck["ptx"], launch(ck, (n,)), sym((n, s, k, e))

    _REGISTERED.update({"LatticeMatch", "GreedyWalk", "LatticeMatchWalk"})
    return set(_REGISTERED)
