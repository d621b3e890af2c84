"""TensorRT ``IPluginV3`` Python plugins for the lattice ops, for ``tensorrt`` (TensorRT 10.x)
and ``tensorrt_rtx`` (TensorRT for RTX) alike: the classes are built against the module passed
in, so the same code serves both.

    trt = lilicorr.plugins.trt_v3.load_trt("tensorrt-rtx")     # or: import tensorrt_rtx as trt
    register_v3_plugins(trt)        # creators LatticeMatch / GreedyWalk / LatticeMatchWalk / DraftTree,
                                    # namespace "lilicorr", version "1"
    # ONNX nodes with op_type = plugin name and attribute plugin_namespace="lilicorr" now parse
    # into IPluginV3 layers; or add one by hand:
    layer = network.add_plugin_v3([a, o, i], [], create_plugin(trt, "LatticeMatch", sigma=10.0))

Plugin fields: ``sigma`` (FLOAT32) for LatticeMatch / LatticeMatchWalk; none for GreedyWalk;
``num_nodes`` (INT32) for DraftTree. I/O: fp32 / fp16 / bf16 vectors and scores (one type per
plugin), int64 indices, DraftTree's path scores fp32, linear format.
``enqueue`` wraps TensorRT's device pointers as torch CUDA tensors (no copy), and launches the
Triton kernels of ``lilicorr.plugins.triton_kernels`` on TensorRT's stream through
``torch.cuda.ExternalStream``. DraftTree needs K and S fixed at build time: they size its
outputs, [N, min(num_nodes, sum_j K^j)]. Engines that contain these plugins need this module imported and
``register_v3_plugins`` called before deserialization (the Python classes run at enqueue).
"""
from __future__ import annotations

import importlib

import numpy as np

from . import NAMESPACE, OP_NAMES, PLUGIN_VERSION

__all__ = ["load_trt", "register_v3_plugins", "unregister_v3_plugins", "create_plugin",
           "plugin_classes", "registered_creators"]

_BACKENDS = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx", "tensorrt_rtx": "tensorrt_rtx"}


def load_trt(backend: str = "tensorrt"):
    """Import the TensorRT Python module for ``backend`` ('tensorrt' | 'tensorrt-rtx')."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}; got {backend!r}")
    mod = _BACKENDS[backend]
    try:
        return importlib.import_module(mod)
    except ImportError as exc:
        hint = ("TensorRT comes from NVIDIA's containers / index (pypi.nvidia.com), not from PyPI here."
                if mod == "tensorrt" else
                "Install it with pip install 'lilicorr[tensorrt-rtx]' (tensorrt-rtx-cu12).")
        raise ImportError(f"backend {backend!r} needs the Python module `{mod}`, which is not "
                          f"importable ({exc}). {hint}") from exc


# --------------------------------------------------------------------------------------------
# torch views of TensorRT device buffers
# --------------------------------------------------------------------------------------------

class _CudaBuffer:
    """Minimal ``__cuda_array_interface__`` (v3) over a raw device pointer."""

    def __init__(self, ptr: int, shape: tuple, typestr: str):
        self.__cuda_array_interface__ = {
            "shape": tuple(int(d) for d in shape), "typestr": typestr,
            "data": (int(ptr), False), "version": 3, "strides": None, "stream": None}


def _torch_view(trt, ptr: int, desc):
    import torch
    shape = tuple(int(d) for d in desc.dims)
    t = desc.type
    if t == trt.DataType.FLOAT:
        return torch.as_tensor(_CudaBuffer(ptr, shape, "<f4"), device="cuda")
    if t == trt.DataType.HALF:
        return torch.as_tensor(_CudaBuffer(ptr, shape, "<f2"), device="cuda")
    if t == trt.DataType.BF16:   # no typestr for bf16: view the bits
        return torch.as_tensor(_CudaBuffer(ptr, shape, "<i2"), device="cuda").view(torch.bfloat16)
    if t == trt.DataType.INT64:
        return torch.as_tensor(_CudaBuffer(ptr, shape, "<i8"), device="cuda")
    if t == trt.DataType.INT32:
        return torch.as_tensor(_CudaBuffer(ptr, shape, "<i4"), device="cuda")
    raise TypeError(f"lilicorr plugin: unsupported TensorRT data type {t}")


# --------------------------------------------------------------------------------------------
# class factory (one set of classes per TensorRT module)
# --------------------------------------------------------------------------------------------

_CLASSES: dict[str, dict] = {}
_REGISTERED: dict[str, dict] = {}   # module name -> {op: creator} (kept alive: TRT holds raw refs)
_RETIRED: list = []                  # deregistered creators, never freed while the process lives


def plugin_classes(trt) -> dict:
    """{op_name: (plugin_class, creator_class)} built against the TensorRT module ``trt``."""
    key = trt.__name__
    if key in _CLASSES:
        return _CLASSES[key]
    for need in ("IPluginV3", "IPluginV3OneCore", "IPluginV3OneBuild", "IPluginV3OneRuntime",
                 "IPluginCreatorV3One"):
        if not hasattr(trt, need):
            raise ImportError(f"`{key}` has no {need}; the lilicorr V3 plugins need TensorRT >= 10.0 "
                              "or TensorRT-RTX")

    float_types = {trt.DataType.FLOAT, trt.DataType.HALF, trt.DataType.BF16}

    class _LatticePlugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild,
                         trt.IPluginV3OneRuntime):
        OP = ""
        N_IN = 3
        N_OUT = 1
        HAS_SIGMA = True
        INT_OUT = True     # outputs are int64 indices (else: same float type as the inputs)
        INT_FIELD = ""     # name of an INT32 plugin field (DraftTree: num_nodes)

        def __init__(self, sigma: float = 1.0, phase=None, int_value: int = 0):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.plugin_name = self.OP
            self.plugin_namespace = NAMESPACE
            self.plugin_version = PLUGIN_VERSION
            self.num_outputs = self.N_OUT
            self.timing_cache_id = ""
            self.sigma = float(sigma)
            self.phase = phase
            self.int_value = int(int_value)

        # ---- core
        def get_capability_interface(self, type):
            return self

        def clone(self):
            c = type(self)(self.sigma, self.phase, self.int_value)
            c.__dict__.update(self.__dict__)
            return c

        # ---- build
        def output_types(self, input_type):
            if self.INT_OUT:
                return [trt.DataType.INT64] * self.N_OUT
            return [input_type] * self.N_OUT

        def get_output_data_types(self, input_types):
            return self.output_types(input_types[0])

        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR:
                return False
            if pos >= num_inputs:
                return desc.type == self.output_types(in_out[0].desc.type)[pos - num_inputs]
            if desc.type not in float_types:
                return False
            return pos == 0 or desc.type == in_out[0].desc.type

        def configure_plugin(self, inp, out):
            pass

        def get_valid_tactics(self):
            return []

        # ---- runtime
        def on_shape_change(self, inp, out):
            pass

        def set_tactic(self, tactic):
            pass

        def attach_to_context(self, context):
            return self.clone()

        def get_fields_to_serialize(self):
            fields = []
            if self.HAS_SIGMA:
                fields.append(trt.PluginField("sigma", np.array([self.sigma], dtype=np.float32),
                                              trt.PluginFieldType.FLOAT32))
            if self.INT_FIELD:
                fields.append(trt.PluginField(self.INT_FIELD, np.array([self.int_value], dtype=np.int32),
                                              trt.PluginFieldType.INT32))
            return trt.PluginFieldCollection(fields)

        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            import torch
            from . import triton_kernels as tk
            with torch.cuda.stream(torch.cuda.ExternalStream(int(stream))):
                ins = [_torch_view(trt, p, d) for p, d in zip(inputs, input_desc)]
                outs = [_torch_view(trt, p, d) for p, d in zip(outputs, output_desc)]
                self._launch(tk, ins, outs)

    class LatticeMatchPlugin(_LatticePlugin):
        OP, N_IN, N_OUT, HAS_SIGMA, INT_OUT = "LatticeMatch", 3, 2, True, False

        def get_output_shapes(self, inputs, shape_inputs, eb):
            v = inputs[1]                                    # out_vec [N, S, K, E]
            s1 = eb.operation(trt.DimensionOperation.SUB, v[1], eb.constant(1))
            return [trt.DimsExprs([v[0], v[2]]), trt.DimsExprs([v[0], s1, v[2], v[2]])]

        def _launch(self, tk, ins, outs):
            tk.lattice_match(*ins, self.sigma, anchor_scores=outs[0], pair_scores=outs[1])

    class GreedyWalkPlugin(_LatticePlugin):
        OP, N_IN, N_OUT, HAS_SIGMA, INT_OUT = "GreedyWalk", 2, 1, False, True

        def get_output_shapes(self, inputs, shape_inputs, eb):
            p = inputs[1]                                    # pair_scores [N, S-1, K, K]
            s = eb.operation(trt.DimensionOperation.SUM, p[1], eb.constant(1))
            return [trt.DimsExprs([p[0], s])]

        def _launch(self, tk, ins, outs):
            tk.greedy_walk(*ins, idx=outs[0])

    class LatticeMatchWalkPlugin(_LatticePlugin):
        OP, N_IN, N_OUT, HAS_SIGMA, INT_OUT = "LatticeMatchWalk", 3, 1, True, True

        def get_output_shapes(self, inputs, shape_inputs, eb):
            v = inputs[1]                                    # out_vec [N, S, K, E]
            return [trt.DimsExprs([v[0], v[1]])]

        def _launch(self, tk, ins, outs):
            tk.fused_match_walk(*ins, self.sigma, idx=outs[0])

    class DraftTreePlugin(_LatticePlugin):
        OP, N_IN, N_OUT, HAS_SIGMA, INT_OUT, INT_FIELD = "DraftTree", 2, 4, False, False, "num_nodes"

        def output_types(self, input_type):
            return [trt.DataType.INT64] * 3 + [trt.DataType.FLOAT]

        def get_output_shapes(self, inputs, shape_inputs, eb):
            from lilicorr.lattice import tree_size
            a, p = inputs                                    # [N, K], [N, S-1, K, K]
            if not (a[1].is_constant() and p[1].is_constant()):
                raise ValueError("lilicorr::DraftTree needs K and S fixed at build time (they size its outputs)")
            m = min(self.int_value, tree_size(a[1].get_constant_value(), p[1].get_constant_value() + 1))
            return [trt.DimsExprs([a[0], eb.constant(m)])] * 4

        def _launch(self, tk, ins, outs):
            tk.draft_tree(*ins, self.int_value, parent=outs[0], depth=outs[1], cand=outs[2], score=outs[3])

    def make_creator_class(plugin_cls):
        class _Creator(trt.IPluginCreatorV3One):
            def __init__(self):
                trt.IPluginCreatorV3One.__init__(self)
                self.name = plugin_cls.OP
                self.plugin_namespace = NAMESPACE
                self.plugin_version = PLUGIN_VERSION
                fields = []
                if plugin_cls.HAS_SIGMA:
                    fields.append(trt.PluginField("sigma", np.array([], dtype=np.float32),
                                                  trt.PluginFieldType.FLOAT32))
                if plugin_cls.INT_FIELD:
                    fields.append(trt.PluginField(plugin_cls.INT_FIELD, np.array([], dtype=np.int32),
                                                  trt.PluginFieldType.INT32))
                self.field_names = trt.PluginFieldCollection(fields)

            def create_plugin(self, name, fc, phase):
                sigma = value = None
                for f in fc:
                    if f.name == "sigma":
                        sigma = float(np.asarray(f.data, dtype=np.float64).reshape(-1)[0])
                    elif plugin_cls.INT_FIELD and f.name == plugin_cls.INT_FIELD:
                        value = int(np.asarray(f.data).reshape(-1)[0])
                if plugin_cls.HAS_SIGMA and sigma is None:
                    raise ValueError(f"lilicorr::{plugin_cls.OP}: missing plugin field 'sigma' "
                                     "(the ONNX node needs a float attribute sigma)")
                if plugin_cls.INT_FIELD and (value is None or value < 1):
                    raise ValueError(f"lilicorr::{plugin_cls.OP}: plugin field '{plugin_cls.INT_FIELD}' must be "
                                     f"a positive integer (the ONNX node's int attribute), got {value}")
                return plugin_cls(1.0 if sigma is None else sigma, phase, value or 0)

        _Creator.__name__ = _Creator.__qualname__ = f"{plugin_cls.OP}Creator"
        return _Creator

    classes = {}
    for cls in (LatticeMatchPlugin, GreedyWalkPlugin, LatticeMatchWalkPlugin, DraftTreePlugin):
        classes[cls.OP] = (cls, make_creator_class(cls))
    _CLASSES[key] = classes
    return classes


def create_plugin(trt, op: str, sigma: float = 1.0, phase=None, num_nodes: int = 0):
    """A plugin instance for ``network.add_plugin_v3(inputs, [], plugin)`` (num_nodes: DraftTree's M)."""
    plugin_cls, _ = plugin_classes(trt)[op]
    return plugin_cls(sigma, trt.TensorRTPhase.BUILD if phase is None else phase, num_nodes)


def registered_creators(trt) -> dict:
    return dict(_REGISTERED.get(trt.__name__, {}))


def register_v3_plugins(trt=None, ops=OP_NAMES) -> dict:
    """Register the creators with ``trt.get_plugin_registry()`` under namespace ``lilicorr``.
    ``trt``: the TensorRT module (tensorrt or tensorrt_rtx) or a backend name; default: tensorrt,
    else tensorrt_rtx. Idempotent per module; returns {op: creator}."""
    if trt is None:
        try:
            trt = load_trt("tensorrt")
        except ImportError:
            trt = load_trt("tensorrt-rtx")
    elif isinstance(trt, str):
        trt = load_trt(trt)
    try:  # a QDP registration of the same (name, version, namespace) would clash
        from . import trt_qdp
        if trt_qdp.registered_ops():
            raise RuntimeError("lilicorr QDP plugins are already registered in this process; "
                               "use either the V3 classes or tensorrt.plugin definitions, not both")
    except ImportError:
        pass
    reg = trt.get_plugin_registry()
    done = _REGISTERED.setdefault(trt.__name__, {})
    classes = plugin_classes(trt)
    for op in ops:
        if op in done:
            continue
        creator = classes[op][1]()
        ok = reg.register_creator(creator, NAMESPACE)
        if ok is False:
            raise RuntimeError(f"{trt.__name__}: register_creator failed for lilicorr::{op} "
                               "(already registered by someone else?)")
        done[op] = creator
    return dict(done)


def unregister_v3_plugins(trt) -> int:
    """Deregister the creators registered by this module (so the ONNX parser falls back to the
    local functions). Returns how many were removed."""
    done = _REGISTERED.get(trt.__name__, {})
    reg = trt.get_plugin_registry()
    n = 0
    for op, creator in list(done.items()):
        reg.deregister_creator(creator)
        _RETIRED.append(done.pop(op))
        n += 1
    return n
