"""Build a serialized TensorRT / TensorRT-RTX engine from an ONNX file that contains the
lilicorr custom nodes, with the IPluginV3 plugins (``use_plugins=True``) or through the ONNX
local functions (``use_plugins=False``; attach them first with
``onnx_functions.add_local_functions``).

    info = build_engine_from_onnx("drafter.onnx", "drafter.plan", backend="tensorrt-rtx",
                                  use_plugins=True, compute_capabilities=["SM89"])
    info["plugin_layers"]       # [(layer name, plugin name), ...] from the parsed network
    info["plan_plugins"]        # lilicorr plugins found in the serialized plan bytes

TensorRT-RTX builds on a machine without a GPU, for SM80/86/89/120 (not SM90, not CURRENT);
the default there is all four. Its ONNX parser dlopens ``libtensorrt_rtx.so`` when it creates a
plugin; the wheel ships only ``libtensorrt_rtx.so.1``. Without a ``libtensorrt_rtx.so`` symlink
the process aborts (not an exception), so this module checks beforehand and raises
``RuntimeError`` (``fix_rtx_symlink=True`` creates the link when the folder is writable).
Standard TensorRT builds for the GPU present; ``compute_capabilities`` does not apply to it.
"""
from __future__ import annotations

import os
import pathlib
import time

from . import NAMESPACE, OP_NAMES, plan_plugins
from .trt_v3 import load_trt, register_v3_plugins, unregister_v3_plugins

__all__ = ["build_engine_from_onnx", "check_rtx_parser_library",
           "RTX_CPU_COMPUTE_CAPABILITIES"]

RTX_CPU_COMPUTE_CAPABILITIES = ("SM80", "SM86", "SM89", "SM120")


def _rtx_lib_dirs(trt=None) -> list:
    import importlib.util
    dirs = []
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec and spec.submodule_search_locations:
        dirs += [pathlib.Path(p) for p in spec.submodule_search_locations]
    if trt is not None:
        dirs += [pathlib.Path(p).parent / "tensorrt_rtx_libs" for p in (getattr(trt, "__path__", None) or [])]
    dirs += [pathlib.Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    return dirs


def check_rtx_parser_library(trt=None, fix: bool = False, search_dirs=None) -> str:
    """Make sure ``libtensorrt_rtx.so`` can be dlopened by TensorRT-RTX's ONNX parser.
    Returns the path that will be found; raises RuntimeError with the remedy otherwise.
    ``search_dirs`` replaces the default folders (the wheel's tensorrt_rtx_libs/ and
    LD_LIBRARY_PATH)."""
    dirs = [pathlib.Path(d) for d in search_dirs] if search_dirs is not None else _rtx_lib_dirs(trt)
    for d in dirs:
        if (d / "libtensorrt_rtx.so").exists():
            return str(d / "libtensorrt_rtx.so")
    for d in dirs:
        so1 = d / "libtensorrt_rtx.so.1"
        if so1.exists():
            if fix:
                try:
                    os.symlink(so1.name, d / "libtensorrt_rtx.so")
                    return str(d / "libtensorrt_rtx.so")
                except OSError as exc:
                    raise RuntimeError(f"could not create {d / 'libtensorrt_rtx.so'}: {exc}") from exc
            raise RuntimeError(
                "TensorRT-RTX's ONNX parser dlopens `libtensorrt_rtx.so`, but the wheel only ships "
                f"{so1}; without it the process aborts right after create_plugin. Fix: "
                f"`ln -s libtensorrt_rtx.so.1 {d / 'libtensorrt_rtx.so'}` (scripts/install.sh does "
                "this), or put a folder with that link on LD_LIBRARY_PATH before Python starts, or "
                "call build_engine_from_onnx(..., fix_rtx_symlink=True).")
    raise RuntimeError("libtensorrt_rtx.so.1 not found next to the tensorrt_rtx module; is "
                       "tensorrt-rtx-cu12 installed correctly?")


def _input_profile(trt, network, dynamic_dims, profiles) -> dict | None:
    """Optimization profile for inputs with dynamic dims: ``profiles[name] = (min, opt, max)``
    shapes, else each -1 becomes dynamic_dims = (min, opt, max)."""
    needed = False
    shapes = {}
    for i in range(network.num_inputs):
        t = network.get_input(i)
        dims = tuple(t.shape)
        if profiles and t.name in profiles:
            shapes[t.name] = tuple(tuple(int(x) for x in s) for s in profiles[t.name])
            needed = True
        elif any(d < 0 for d in dims):
            lo, opt, hi = dynamic_dims
            shapes[t.name] = (tuple(lo if d < 0 else d for d in dims),
                              tuple(opt if d < 0 else d for d in dims),
                              tuple(hi if d < 0 else d for d in dims))
            needed = True
    return shapes if needed else None


def build_engine_from_onnx(onnx_path, out_path=None, backend: str = "tensorrt",
                           use_plugins: bool = True, compute_capabilities=None, *,
                           fp16: bool = False, dynamic_dims=(1, 8, 32), profiles=None,
                           workspace_bytes: int | None = None, fix_rtx_symlink: bool = False,
                           log_level: str = "WARNING") -> dict:
    """Parse ``onnx_path`` and build a serialized engine (written to ``out_path`` if given).

    backend: 'tensorrt' | 'tensorrt-rtx'. use_plugins: register the lilicorr IPluginV3 creators
    (the parser then turns lilicorr nodes with plugin_namespace="lilicorr" into plugin layers);
    False deregisters them so the parser must use the model's local functions.
    compute_capabilities (TensorRT-RTX): names like "SM89" or trt.ComputeCapability values;
    default RTX_CPU_COMPUTE_CAPABILITIES. Returns an info dict.
    """
    trt = load_trt(backend)
    is_rtx = trt.__name__ == "tensorrt_rtx"
    if is_rtx:
        check_rtx_parser_library(trt, fix=fix_rtx_symlink)
    if use_plugins:
        register_v3_plugins(trt)
    else:
        unregister_v3_plugins(trt)

    logger = trt.Logger(getattr(trt.Logger, log_level))
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    t0 = time.perf_counter()
    ok = parser.parse_from_file(str(onnx_path))
    t_parse = time.perf_counter() - t0
    if not ok:
        errs = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"{backend}: ONNX parse of {onnx_path} failed:\n" + "\n".join(errs))

    layer_types: dict[str, int] = {}
    plugin_layers = []
    plugin_types = {getattr(trt.LayerType, n) for n in ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3")
                    if hasattr(trt.LayerType, n)}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        layer_types[layer.type.name] = layer_types.get(layer.type.name, 0) + 1
        if layer.type in plugin_types:
            pname = None
            if layer.type.name == "PLUGIN_V3" and hasattr(trt, "IPluginV3Layer"):
                try:  # the Python API's downcast idiom (as in polygraphy)
                    layer.__class__ = trt.IPluginV3Layer
                    core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
                    pname = getattr(core, "plugin_name", None)
                except Exception:
                    pname = None
            if pname is None:
                pname = next((op for op in OP_NAMES if op in layer.name), "?")
            plugin_layers.append((layer.name, pname))

    config = builder.create_builder_config()
    if workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    if fp16 and hasattr(trt.BuilderFlag, "FP16"):
        config.set_flag(trt.BuilderFlag.FP16)
    ccs = []
    if is_rtx:
        ccs = list(compute_capabilities or RTX_CPU_COMPUTE_CAPABILITIES)
        config.num_compute_capabilities = len(ccs)
        for i, cc in enumerate(ccs):
            val = getattr(trt.ComputeCapability, cc) if isinstance(cc, str) else cc
            if not config.set_compute_capability(val, i):
                raise ValueError(f"set_compute_capability({cc}) refused")
        ccs = [c if isinstance(c, str) else c.name for c in ccs]
    elif compute_capabilities:
        raise ValueError("compute_capabilities applies to backend='tensorrt-rtx' only; standard "
                         "TensorRT builds for the GPU it runs on")
    shapes = _input_profile(trt, network, dynamic_dims, profiles)
    if shapes:
        prof = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            prof.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(prof)

    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    t_build = time.perf_counter() - t0
    if plan is None:
        raise RuntimeError(f"{backend}: build_serialized_network returned None for {onnx_path} "
                           f"(layers: {layer_types})")
    data = bytes(plan)
    if out_path is not None:
        out_path = pathlib.Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_suffix(out_path.suffix + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, out_path)
    return {
        "backend": backend,
        "trt_version": getattr(trt, "__version__", "?"),
        "onnx_path": str(onnx_path),
        "out_path": str(out_path) if out_path is not None else None,
        "size_bytes": len(data),
        "use_plugins": use_plugins,
        "compute_capabilities": ccs,
        "num_layers": network.num_layers,
        "layer_types": layer_types,
        "plugin_layers": plugin_layers,
        "plan_plugins": plan_plugins(data),
        "plan_has_namespace": NAMESPACE.encode() in data,
        "optimization_profile": shapes or None,
        "parse_s": round(t_parse, 3),
        "build_s": round(t_build, 3),
    }
