"""TensorRT side of the lattice ops: lazy imports, the libtensorrt_rtx.so check, AOT PTX for the
QDP plugins, the QDP definitions (against stand-ins where tensorrt.plugin is absent) and, marked
slow, real TensorRT-RTX engine builds on CPU with the IPluginV3 plugins and with the ONNX local
functions."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_py(code: str, timeout=600, env_drop=("TRITON_INTERPRET",)):
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, cwd=str(ROOT), env=env)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    return r.stdout


def test_plugins_package_imports_without_heavy_deps():
    out = run_py("""
        import sys, importlib.abc
        BLOCK = ("triton", "tensorrt", "tensorrt_rtx", "onnx", "onnxruntime", "onnxscript", "cupy")
        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCK:
                    raise ImportError(f"blocked {name}")
        sys.meta_path.insert(0, Blocker())
        import lilicorr.plugins as P
        from lilicorr.plugins import trt_v3, trt_qdp, trt_build
        assert P.NAMESPACE == "lilicorr" and P.OP_NAMES == ("LatticeMatch", "GreedyWalk", "LatticeMatchWalk", "DraftTree")
        msgs = []
        for fn in (lambda: trt_v3.load_trt("tensorrt"), lambda: trt_v3.load_trt("tensorrt-rtx"),
                   lambda: trt_qdp.register_qdp_plugins(), lambda: P.onnx_functions,
                   lambda: P.triton_kernels):
            try:
                fn()
            except ImportError as e:
                msgs.append(str(e))
        assert len(msgs) == 5, msgs
        assert "tensorrt" in msgs[0] and "tensorrt_rtx" in msgs[1] and "tensorrt" in msgs[2]
        assert "onnx" in msgs[3] and "triton" in msgs[4]
        assert trt_qdp.qdp_available() is False
        print("OK")
    """)
    assert "OK" in out


def test_rtx_symlink_check_detects_and_fixes(tmp_path):
    from lilicorr.plugins.trt_build import check_rtx_parser_library
    (tmp_path / "libtensorrt_rtx.so.1").write_bytes(b"")
    with pytest.raises(RuntimeError, match="libtensorrt_rtx.so"):
        check_rtx_parser_library(search_dirs=[tmp_path])
    p = check_rtx_parser_library(search_dirs=[tmp_path], fix=True)
    assert os.path.islink(p) and os.readlink(p) == "libtensorrt_rtx.so.1"
    assert check_rtx_parser_library(search_dirs=[tmp_path]) == p


def test_aot_ptx_compiles_and_assembles(tmp_path):
    pytest.importorskip("triton")
    out = run_py(f"""
        import json, os, re, subprocess, triton
        from lilicorr.plugins import triton_kernels as tk
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
        res = []
        for op, K, E in [("LatticeMatch", 8, 1024), ("GreedyWalk", 8, None),
                         ("LatticeMatchWalk", 8, 1024), ("LatticeMatch", 5, 96),
                         ("LatticeMatchWalk", 5, 96)]:
            ck = tk.compile_ptx(op, K=K, E=E, sigma=10.0, arch=90)
            entry = re.search(r"\\.entry\\s+(\\w+)\\s*\\((.*?)\\)", ck["ptx"], re.S)
            n_params = len([p for p in entry.group(2).split(",") if p.strip()])
            path = os.path.join({str(tmp_path)!r}, f"{{op}}_{{K}}.ptx")
            open(path, "w").write(ck["ptx"])
            arch = "sm_90a" if ".target sm_90a" in ck["ptx"] else "sm_90"
            r = subprocess.run([ptxas, f"-arch={{arch}}", path, "-o", path + ".cubin"],
                               capture_output=True, text=True)
            res.append(dict(op=op, name=ck["name"], n_params=n_params, expected=ck["num_params"],
                            ptxas=r.returncode, err=r.stderr[-500:], warps=ck["num_warps"]))
        print(json.dumps(res))
    """)
    res = json.loads(out.strip().splitlines()[-1])
    for r in res:
        assert r["ptxas"] == 0, r
        assert r["n_params"] == r["expected"], r   # hidden scratch pointers stripped
    assert {r["name"] for r in res} == {"lattice_match_kernel", "greedy_walk_kernel",
                                        "lattice_match_walk_kernel"}


def test_qdp_definitions_against_standins():
    """Runs register_qdp_plugins with stand-in trt / tensorrt.plugin modules: checks the
    registered names, QDP signature rules (TensorDesc args, then attributes, then outputs/stream
    or outputs/tactic), the output descriptors, and that aot_impl returns PTX + launch params."""
    pytest.importorskip("triton")
    out = run_py("""
        import inspect, json, types, typing
        from lilicorr.plugins import trt_qdp

        class Expr(int):
            is_fake = False
            is_constant = True
            def constant_value(self): return int(self)
            def __sub__(self, o): return Expr(int(self) - int(o))
            def __add__(self, o): return Expr(int(self) + int(o))

        class Desc:
            def __init__(self, shape, dtype="f32"):
                self.shape_expr = [Expr(s) for s in shape]
                self.dtype = dtype

        trt = types.ModuleType("tensorrt")
        trt.__dict__.update(float32="f32", float16="f16", int64="i64",
                            QuickPluginCreationRequest=object)
        reg = {}
        def deco(kind):
            def outer(name):
                def inner(fn):
                    reg[(kind, name)] = fn
                    return fn
                return inner
            return outer

        class KLP:
            grid_x = grid_y = grid_z = block_x = block_y = block_z = 1
            shared_mem = 0

        class SymIntExprs(list):
            @classmethod
            def from_tuple(cls, xs): return cls(xs)

        trtp = types.SimpleNamespace(
            register=deco("register"), impl=deco("impl"), aot_impl=deco("aot_impl"),
            autotune=deco("autotune"), TensorDesc=Desc, Tensor=object, SymExprs=list,
            KernelLaunchParams=KLP, SymInt32=int, SymIntExprs=SymIntExprs,
            AutoTuneCombination=lambda s: s,
            from_shape_expr=lambda shape, dtype: Desc([int(x) for x in shape], dtype))
        ops = trt_qdp.register_qdp_plugins(mode="both", trtp=trtp, trt=trt)
        assert ops == {"LatticeMatch", "GreedyWalk", "LatticeMatchWalk"}
        names = sorted(f"{k}:{n}" for k, n in reg)
        assert len(names) == 12, names

        def params(kind, op):
            return list(inspect.signature(reg[(kind, "lilicorr::" + op)]).parameters)
        report = {}
        for op, ins, attrs in [("LatticeMatch", ["anchor_out", "out_vec", "in_vec"], ["sigma"]),
                               ("GreedyWalk", ["anchor_scores", "pair_scores"], []),
                               ("LatticeMatchWalk", ["anchor_out", "out_vec", "in_vec"], ["sigma"])]:
            assert params("register", op) == ins + attrs
            assert params("impl", op) == ins + attrs + ["outputs", "stream"]
            assert params("aot_impl", op) == ins + attrs + ["outputs", "tactic"]
            assert params("autotune", op) == ins + ["outputs"]
            hints = typing.get_type_hints(reg[("register", "lilicorr::" + op)])
            assert all(hints[a] is float for a in attrs) and "return" in hints

        N, S, K, E = 2, 15, 8, 1024
        a, o, i = Desc([N, E]), Desc([N, S, K, E]), Desc([N, S, K, E])
        sa, sp = reg[("register", "lilicorr::LatticeMatch")](a, o, i, 10.0)
        assert sa.shape_expr == [N, K] and sp.shape_expr == [N, S - 1, K, K]
        idx = reg[("register", "lilicorr::GreedyWalk")](sa, sp)
        assert idx.shape_expr == [N, S] and idx.dtype == "i64"
        fidx = reg[("register", "lilicorr::LatticeMatchWalk")](a, o, i, 10.0)
        assert fidx.shape_expr == [N, S]

        name, ptx, lp, extra = reg[("aot_impl", "lilicorr::LatticeMatch")](a, o, i, 10.0, (sa, sp), 0)
        assert name == "lattice_match_kernel" and ".entry lattice_match_kernel" in ptx
        assert (lp.grid_x, lp.grid_y, lp.block_x) == (N, S, 128) and list(extra) == [N, S, K, E]
        name, ptx, lp, extra = reg[("aot_impl", "lilicorr::GreedyWalk")](sa, sp, (idx,), 0)
        assert (lp.grid_x, lp.block_x) == (N, 32) and list(extra) == [N, S, K]
        name, ptx, lp, extra = reg[("aot_impl", "lilicorr::LatticeMatchWalk")](a, o, i, 10.0, (fidx,), 0)
        assert name == "lattice_match_walk_kernel" and list(extra) == [N, S, K, E]
        print("OK")
    """)
    assert "OK" in out


# ------------------------------------------------------------------ real TensorRT-RTX (CPU)

def _rtx():
    try:
        import tensorrt_rtx
    except ImportError as exc:
        pytest.skip(f"tensorrt_rtx not installed ({exc}); pip install 'lilicorr[tensorrt-rtx]'")
    return tensorrt_rtx


def test_v3_plugin_objects():
    trt = _rtx()
    from lilicorr.plugins import trt_v3
    p = trt_v3.create_plugin(trt, "LatticeMatch", sigma=10.0)
    assert (p.plugin_name, p.plugin_namespace, p.plugin_version, p.num_outputs) == \
        ("LatticeMatch", "lilicorr", "1", 2)
    fields = p.get_fields_to_serialize()
    assert [f.name for f in fields] == ["sigma"]
    c = p.clone()
    assert c.sigma == 10.0 and c is not p
    w = trt_v3.create_plugin(trt, "GreedyWalk")
    assert w.num_outputs == 1 and len(w.get_fields_to_serialize()) == 0
    assert w.get_output_data_types([trt.DataType.FLOAT, trt.DataType.FLOAT]) == [trt.DataType.INT64]
    classes = trt_v3.plugin_classes(trt)
    creator = classes["LatticeMatch"][1]()
    assert creator.name == "LatticeMatch" and [f.name for f in creator.field_names] == ["sigma"]


def test_v3_plugin_launch_wiring_on_cpu():
    """The kernel launch each V3 plugin's enqueue makes (minus the CUDA pointer wrapping and the
    external stream), run on CPU tensors through the Triton interpreter."""
    _rtx()
    pytest.importorskip("triton")
    out = run_py("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch, tensorrt_rtx as trt
        from lilicorr import lattice as L
        from lilicorr.plugins import trt_v3, triton_kernels as tk
        g = torch.Generator().manual_seed(0)
        N, S, K, E = 2, 15, 5, 96
        f = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g), dim=-1)
        a, o, i = f(N, E), f(N, S, K, E), f(N, S, K, E)
        sa, sp = torch.empty(N, K), torch.empty(N, S - 1, K, K)
        trt_v3.create_plugin(trt, "LatticeMatch", sigma=10.0)._launch(tk, [a, o, i], [sa, sp])
        ra, rp = L.match_scores(a, o, i, 10.0)
        assert torch.allclose(sp, rp, atol=1e-5) and torch.allclose(sa, ra, atol=1e-5)
        idx = torch.empty(N, S, dtype=torch.int64)
        trt_v3.create_plugin(trt, "GreedyWalk")._launch(tk, [sa, sp], [idx])
        assert torch.equal(idx, L.greedy_walk(ra, rp))
        fidx = torch.empty(N, S, dtype=torch.int64)
        trt_v3.create_plugin(trt, "LatticeMatchWalk", sigma=10.0)._launch(tk, [a, o, i], [fidx])
        assert torch.equal(fidx, idx)
        print("OK")
    """, env_drop=())
    assert "OK" in out


@pytest.fixture(scope="module")
def lattice_onnx(tmp_path_factory):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    import onnx
    import torch

    from lilicorr import lattice as L
    from lilicorr.plugins import onnx_functions as OF

    class M(torch.nn.Module):
        def forward(self, anchor_out, out_vec, in_vec):
            sa, sp = L.match_scores(anchor_out, out_vec, in_vec, 10.0)
            return L.greedy_walk(sa, sp), L.fused_match_walk(anchor_out, out_vec, in_vec, 10.0)

    N, S, K, E = 2, 15, 8, 64
    args = (torch.randn(N, E), torch.randn(N, S, K, E), torch.randn(N, S, K, E))
    prog = torch.onnx.export(M().eval(), args, dynamo=True, verbose=False,
                             input_names=["anchor_out", "out_vec", "in_vec"],
                             output_names=["idx", "fused_idx"],
                             dynamic_shapes=({0: "N"}, {0: "N"}, {0: "N"}))
    m = OF.add_local_functions(prog.model_proto)
    path = tmp_path_factory.mktemp("onnx") / "lattice.onnx"
    onnx.save(m, str(path))
    return path


@pytest.mark.slow
def test_rtx_engine_with_v3_plugins_then_local_functions(lattice_onnx, tmp_path):
    trt = _rtx()
    from lilicorr.plugins import plan_plugins, trt_build, trt_v3

    info = trt_build.build_engine_from_onnx(lattice_onnx, tmp_path / "plugins.plan",
                                            backend="tensorrt-rtx", use_plugins=True,
                                            compute_capabilities=["SM80", "SM89"])
    assert info["size_bytes"] > 0 and (tmp_path / "plugins.plan").stat().st_size == info["size_bytes"]
    assert sorted(p for _, p in info["plugin_layers"]) == ["GreedyWalk", "LatticeMatch", "LatticeMatchWalk"]
    assert info["layer_types"] == {"PLUGIN_V3": 3}
    plan = (tmp_path / "plugins.plan").read_bytes()
    assert set(plan_plugins(plan)) == {"LatticeMatch", "GreedyWalk", "LatticeMatchWalk"}
    assert b"lilicorr" in plan

    info2 = trt_build.build_engine_from_onnx(lattice_onnx, tmp_path / "functions.plan",
                                             backend="tensorrt-rtx", use_plugins=False,
                                             compute_capabilities=["SM89"])
    assert info2["plugin_layers"] == [] and info2["size_bytes"] > 0
    assert "PLUGIN_V3" not in info2["layer_types"] and info2["layer_types"].get("TOPK", 0) > 0
    assert not info2["plan_has_namespace"]
    assert trt_v3.registered_creators(trt) == {}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorrt", "tensorrt-rtx"])
def test_network_api_add_plugin_v3(backend):
    """Network-API route (no ONNX). TensorRT-RTX has no add_plugin_v3, so there it skips."""
    from lilicorr.plugins import trt_v3
    try:
        trt = trt_v3.load_trt(backend)
    except ImportError as exc:
        pytest.skip(str(exc))
    if not hasattr(trt.INetworkDefinition, "add_plugin_v3"):
        pytest.skip(f"{trt.__name__} {trt.__version__} has no INetworkDefinition.add_plugin_v3 "
                    "(plugins reach TensorRT-RTX only through the ONNX parser)")
    trt_v3.register_v3_plugins(trt)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    net = builder.create_network(0)
    N, S, K, E = 2, 15, 5, 96
    a = net.add_input("anchor_out", trt.float32, (N, E))
    o = net.add_input("out_vec", trt.float32, (N, S, K, E))
    i = net.add_input("in_vec", trt.float32, (N, S, K, E))
    m = net.add_plugin_v3([a, o, i], [], trt_v3.create_plugin(trt, "LatticeMatch", sigma=10.0))
    assert tuple(m.get_output(0).shape) == (N, K) and tuple(m.get_output(1).shape) == (N, S - 1, K, K)
    w = net.add_plugin_v3([m.get_output(0), m.get_output(1)], [], trt_v3.create_plugin(trt, "GreedyWalk"))
    assert tuple(w.get_output(0).shape) == (N, S) and w.get_output(0).dtype == trt.int64
    net.mark_output(w.get_output(0))
    plan = builder.build_serialized_network(net, builder.create_builder_config())
    assert plan is not None and b"GreedyWalk" in bytes(plan)


def test_v3_draft_tree_plugin_on_cpu():
    """DraftTree's V3 plugin: its field, output types and the launch its enqueue makes (the
    Triton kernel, here on CPU tensors through the interpreter) against lattice.build_tree; and its
    creator's field check."""
    trt = _rtx()
    import numpy as np

    from lilicorr.plugins import trt_v3
    p = trt_v3.create_plugin(trt, "DraftTree", num_nodes=16)
    assert (p.plugin_name, p.num_outputs) == ("DraftTree", 4)
    assert [(f.name, int(np.asarray(f.data)[0])) for f in p.get_fields_to_serialize()] == [("num_nodes", 16)]
    assert p.clone().int_value == 16
    assert p.get_output_data_types([trt.DataType.HALF] * 2) == [trt.DataType.INT64] * 3 + [trt.DataType.FLOAT]
    pytest.importorskip("triton")
    out = run_py("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch, tensorrt_rtx as trt
        from lilicorr import lattice as L
        from lilicorr.plugins import trt_v3, triton_kernels as tk
        g = torch.Generator().manual_seed(0)
        a, s = torch.randn(3, 8, generator=g), torch.randn(3, 6, 8, 8, generator=g)
        outs = [torch.empty(3, 16, dtype=torch.int64) for _ in range(3)] + [torch.empty(3, 16)]
        trt_v3.create_plugin(trt, "DraftTree", num_nodes=16)._launch(tk, [a, s], outs)
        ref = L.build_tree(a, s, 16)
        for got, want in zip(outs, (ref.parent, ref.depth, ref.cand, ref.score)):
            assert torch.allclose(got, want) and got.dtype == want.dtype
        print("OK")
    """, env_drop=())
    assert "OK" in out
    creator = trt_v3.plugin_classes(trt)["DraftTree"][1]()
    assert [f.name for f in creator.field_names] == ["num_nodes"]
    with pytest.raises(ValueError, match="num_nodes"):
        creator.create_plugin("t", trt.PluginFieldCollection([]), trt.TensorRTPhase.BUILD)


@pytest.mark.slow
def test_rtx_engine_with_the_draft_tree_plugin_then_its_local_function(tmp_path):
    """An ONNX graph with lilicorr::DraftTree builds into a TensorRT-RTX engine with the V3
    plugin, and without it from the local function's body."""
    trt = _rtx()
    pytest.importorskip("onnxscript")
    import onnx
    import torch

    from lilicorr import lattice as L
    from lilicorr.plugins import onnx_functions as OF
    from lilicorr.plugins import plan_plugins, trt_build, trt_v3

    class Tree(torch.nn.Module):
        def forward(self, anchor_scores, pair_scores):
            t = L.build_tree(anchor_scores, pair_scores, 16)
            return t.parent, t.depth, t.cand, t.score

    args = (torch.randn(2, 8), torch.randn(2, 6, 8, 8))
    prog = torch.onnx.export(Tree().eval(), args, dynamo=True, input_names=["anchor_scores", "pair_scores"],
                             output_names=["parent", "depth", "cand", "score"],
                             dynamic_shapes=({0: "N"}, {0: "N"}))
    path = tmp_path / "tree.onnx"
    onnx.save(OF.add_local_functions(prog.model_proto), str(path))
    info = trt_build.build_engine_from_onnx(path, tmp_path / "plugin.plan", backend="tensorrt-rtx",
                                            use_plugins=True, compute_capabilities=["SM89"])
    assert [p for _, p in info["plugin_layers"]] == ["DraftTree"] and info["size_bytes"] > 0
    assert plan_plugins((tmp_path / "plugin.plan").read_bytes()) == ["DraftTree"]
    info2 = trt_build.build_engine_from_onnx(path, tmp_path / "function.plan", backend="tensorrt-rtx",
                                             use_plugins=False, compute_capabilities=["SM89"])
    assert info2["plugin_layers"] == [] and info2["layer_types"].get("TOPK", 0) > 0
    assert trt_v3.registered_creators(trt) == {}
