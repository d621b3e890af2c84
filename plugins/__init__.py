"""Custom lattice ops for deployment: ``lilicorr.plugins`` (the folder ``plugins/``).

Importing this package needs nothing beyond the standard library; every submodule imports its
heavy dependency itself and says what is missing:

    lilicorr.plugins.triton_kernels   Triton-language kernels + launch wrappers + AOT PTX   (triton)
    lilicorr.plugins.onnx_functions   ONNX schemas + local functions for the custom nodes   (onnx)
    lilicorr.plugins.trt_v3           IPluginV3 classes for tensorrt / tensorrt_rtx         (tensorrt*, torch)
    lilicorr.plugins.trt_qdp          tensorrt.plugin (QDP) definitions, TensorRT >= 10.9    (tensorrt)
    lilicorr.plugins.trt_build        ONNX -> serialized engine                              (tensorrt*)

The ops (ONNX domain = plugin namespace ``lilicorr``, plugin version ``"1"``):

    LatticeMatch(anchor_out [N,E], out_vec [N,S,K,E], in_vec [N,S,K,E]; sigma: float)
        -> anchor_scores [N,K], pair_scores [N,S-1,K,K]
    GreedyWalk(anchor_scores [N,K], pair_scores [N,S-1,K,K]) -> idx [N,S] int64
    LatticeMatchWalk(anchor_out, out_vec, in_vec; sigma: float) -> idx [N,S] int64
    DraftTree(anchor_scores [N,K], pair_scores [N,S-1,K,K]; num_nodes: int)
        -> parent, depth, cand [N,M] int64, score [N,M] float32   (rule `tree`; M = min(num_nodes, sum_j K^j))
"""
from __future__ import annotations

import importlib
import re

NAMESPACE = "lilicorr"          # ONNX domain == TensorRT plugin namespace
PLUGIN_VERSION = "1"
OP_NAMES = ("LatticeMatch", "GreedyWalk", "LatticeMatchWalk", "DraftTree")
_SUBMODULES = ("triton_kernels", "onnx_functions", "trt_v3", "trt_qdp", "trt_build")

__all__ = ["NAMESPACE", "PLUGIN_VERSION", "OP_NAMES", "plan_plugins", "require", *_SUBMODULES]

_PLAN_NAME = re.compile(rb"(?<![A-Za-z0-9_(])(" + "|".join(OP_NAMES).encode() + rb")(?![A-Za-z0-9_)])")


def plan_plugins(plan: bytes) -> list[str]:
    """lilicorr plugins a serialized TensorRT plan carries, sorted: a plan with plugins stores the
    namespace ("lilicorr\\0") and each plugin's name, in the plugin-creator table ("<namespace>\\0
    <version>\\0<name>\\0...") or in the plugin layer's record (DraftTree, whose creator has an int
    field); layer names of an inlined local function ("... (LatticeMatch)]") do not count, and
    LatticeMatch is not counted for LatticeMatchWalk."""
    if NAMESPACE.encode() + b"\x00" not in plan:
        return []
    return sorted({m.group(1).decode() for m in _PLAN_NAME.finditer(plan)})


def require(module: str, purpose: str, hint: str = ""):
    """Import ``module`` or raise ImportError naming what is missing and what it is for."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        msg = f"{purpose} needs the Python module `{module}`, which is not importable ({exc})."
        if hint:
            msg += f" {hint}"
        raise ImportError(msg) from exc


def __getattr__(name: str):  # lazy submodules: `from lilicorr.plugins import onnx_functions`
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
