"""ONNX export of the lattice ops (dynamo exporter -> lilicorr custom nodes), local functions,
schemas, and ONNX Runtime vs torch."""
import numpy as np
import pytest
import torch

from lilicorr import lattice as L

onnx = pytest.importorskip("onnx", reason="onnx not installed (pip install 'lilicorr[onnx]')")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime not installed")
pytest.importorskip("onnxscript", reason="the dynamo ONNX exporter needs onnxscript")
from lilicorr.plugins import onnx_functions as OF  # noqa: E402

SIGMA = 10.0


class LatticeModule(torch.nn.Module):
    """What the converter's drafter+head graph ends with: match_scores -> greedy_walk
    (+ the fused op)."""

    def __init__(self, sigma=SIGMA, fused=True):
        super().__init__()
        self.sigma = sigma
        self.fused = fused

    def forward(self, anchor_out, out_vec, in_vec):
        anchor_scores, pair_scores = L.match_scores(anchor_out, out_vec, in_vec, self.sigma)
        idx = L.greedy_walk(anchor_scores, pair_scores)
        if not self.fused:
            return anchor_scores, pair_scores, idx
        return anchor_scores, pair_scores, idx, L.fused_match_walk(anchor_out, out_vec, in_vec, self.sigma)


def vectors(N, S, K, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g), dim=-1)  # noqa: E731
    return f(N, E), f(N, S, K, E), f(N, S, K, E)


def export(module, N=2, S=7, K=5, E=24, dynamic=True):
    args = vectors(N, S, K, E)
    names = ["anchor_scores", "pair_scores", "idx", "fused_idx"][: 4 if module.fused else 3]
    prog = torch.onnx.export(
        module.eval(), args, dynamo=True, input_names=["anchor_out", "out_vec", "in_vec"],
        output_names=names, verbose=False,
        dynamic_shapes=({0: "N"}, {0: "N"}, {0: "N"}) if dynamic else None)
    return prog.model_proto


@pytest.fixture(scope="module")
def exported():
    return export(LatticeModule())


def run_ort(model, args):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = dict(zip(["anchor_out", "out_vec", "in_vec"], (t.numpy() for t in args)))
    return sess.run(None, feeds)


def test_export_emits_custom_nodes(exported):
    nodes = OF.lilicorr_nodes(exported)
    assert [n.op_type for n in nodes] == ["LatticeMatch", "GreedyWalk", "LatticeMatchWalk"]
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["plugin_namespace"] == b"lilicorr" and attrs["plugin_version"] == b"1"
        if n.op_type != "GreedyWalk":
            assert attrs["sigma"] == pytest.approx(SIGMA)
            assert n.attribute[[a.name for a in n.attribute].index("sigma")].type == onnx.AttributeProto.FLOAT
    assert len(nodes[0].output) == 2
    assert any(i.domain == "lilicorr" and i.version == 1 for i in exported.opset_import)


@pytest.mark.parametrize("walk", ["auto", "unrolled", "loop"])
def test_local_functions_run_in_onnxruntime(exported, walk):
    m = onnx.ModelProto()
    m.CopyFrom(exported)
    OF.add_local_functions(m, walk=walk, num_slots=7 if walk == "unrolled" else None)
    assert {f.name for f in m.functions} == {"LatticeMatch", "GreedyWalk", "LatticeMatchWalk"}
    onnx.checker.check_model(m, full_check=True)
    module = LatticeModule()
    for N, seed in [(3, 1), (1, 2), (5, 3)]:          # dynamic batch
        args = vectors(N, 7, 5, 24, seed=seed)
        got = run_ort(m, args)
        ref = [t.numpy() for t in module(*args)]
        np.testing.assert_allclose(got[0], ref[0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(got[1], ref[1], atol=1e-5, rtol=1e-5)
        assert got[2].dtype == np.int64 and np.array_equal(got[2], ref[2])
        assert np.array_equal(got[3], ref[3])


@pytest.mark.parametrize("S,K,E", [(15, 8, 64), (1, 4, 8), (2, 3, 5)])
def test_onnxruntime_other_shapes(S, K, E):
    m = export(LatticeModule(sigma=-4.0), N=2, S=S, K=K, E=E, dynamic=False)
    OF.add_local_functions(m)
    args = vectors(2, S, K, E, seed=S + K)
    got = run_ort(m, args)
    ref = [t.numpy() for t in LatticeModule(sigma=-4.0)(*args)]
    np.testing.assert_allclose(got[1], ref[1], atol=1e-5, rtol=1e-5)
    assert np.array_equal(got[2], ref[2]) and np.array_equal(got[3], ref[3])


def test_infer_num_slots_and_unknown_s(exported):
    gw = OF.lilicorr_nodes(exported, ["GreedyWalk"])[0]
    assert OF.infer_num_slots(exported, gw) == 7
    m = onnx.ModelProto()
    m.CopyFrom(exported)
    del m.graph.value_info[:]
    for vi in list(m.graph.output):   # forget every recorded shape: auto falls back to Loop
        vi.type.tensor_type.ClearField("shape")
    for vi in list(m.graph.input):
        vi.type.tensor_type.ClearField("shape")
    assert OF.infer_num_slots(m, OF.lilicorr_nodes(m, ["GreedyWalk"])[0]) is None
    OF.add_local_functions(m)
    ops = {f.name: {n.op_type for n in f.node} for f in m.functions}
    assert "Loop" in ops["GreedyWalk"] and "Loop" in ops["LatticeMatchWalk"]
    with pytest.raises(ValueError):
        OF.greedy_walk_function(None, walk="unrolled")


def test_set_node_attributes_and_sigma_rewrite(exported):
    m = onnx.ModelProto()
    m.CopyFrom(exported)
    assert OF.set_node_attributes(m, ["LatticeMatch", "LatticeMatchWalk"], sigma=2) == 2
    assert OF.set_node_attributes(m, ["GreedyWalk"], remove=["plugin_namespace"]) == 1
    gw = OF.lilicorr_nodes(m, ["GreedyWalk"])[0]
    assert "plugin_namespace" not in [a.name for a in gw.attribute]
    OF.add_local_functions(m)
    args = vectors(2, 7, 5, 24, seed=8)
    got = run_ort(m, args)
    ref = [t.numpy() for t in LatticeModule(sigma=2.0)(*args)]
    np.testing.assert_allclose(got[1], ref[1], atol=1e-5, rtol=1e-5)
    assert np.array_equal(got[3], ref[3])


def test_schemas_registered():
    OF.register_schemas()
    OF.register_schemas()  # idempotent
    s = onnx.defs.get_schema("LatticeMatch", 1, "lilicorr")
    assert [i.name for i in s.inputs] == ["anchor_out", "out_vec", "in_vec"]
    assert len(s.outputs) == 2 and "sigma" in s.attributes
    assert onnx.defs.get_schema("GreedyWalk", 1, "lilicorr").outputs[0].type_str == "tensor(int64)"


def test_no_custom_nodes_outside_export():
    args = vectors(2, 4, 3, 8)
    a, p, idx, fidx = LatticeModule()(*args)
    assert idx.dtype == torch.long and torch.equal(idx, fidx)


class TreeModule(torch.nn.Module):
    """Rule `tree`'s construction as a graph: lilicorr::DraftTree."""

    def __init__(self, num_nodes):
        super().__init__()
        self.num_nodes = num_nodes

    def forward(self, anchor_scores, pair_scores):
        t = L.build_tree(anchor_scores, pair_scores, self.num_nodes)
        return t.parent, t.depth, t.cand, t.score


def export_tree(num_nodes, N=2, S=7, K=8):
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(N, K, generator=g), torch.randn(N, S - 1, K, K, generator=g))
    prog = torch.onnx.export(TreeModule(num_nodes).eval(), args, dynamo=True,
                             input_names=["anchor_scores", "pair_scores"],
                             output_names=["parent", "depth", "cand", "score"], dynamic_shapes=({0: "N"}, {0: "N"}))
    return prog.model_proto


@pytest.mark.parametrize("S,K,M", [(7, 8, 16), (7, 8, 64), (3, 2, 100), (4, 5, 1)])
def test_draft_tree_node_runs_in_onnxruntime_as_the_reference(S, K, M):
    m = export_tree(M, S=S, K=K)
    nodes = OF.lilicorr_nodes(m)
    assert [n.op_type for n in nodes] == ["DraftTree"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["num_nodes"] == M and attrs["plugin_namespace"] == b"lilicorr"
    assert OF.infer_num_slots(m, nodes[0]) == S
    OF.add_local_functions(m)
    onnx.checker.check_model(m, full_check=True)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for n, seed in [(3, 1), (1, 2)]:                            # dynamic batch
        g = torch.Generator().manual_seed(seed)
        a, p = 3 * torch.randn(n, K, generator=g), 3 * torch.randn(n, S - 1, K, K, generator=g)
        cases = [(a, p), (torch.zeros_like(a), torch.zeros_like(p)),       # all ties
                 (a.round(), p.round().clamp(-1, 1))]                      # many ties
        for a_, p_ in cases:
            got = sess.run(None, {"anchor_scores": a_.numpy(), "pair_scores": p_.numpy()})
            ref = TreeModule(M)(a_, p_)
            for name, x, y in zip(("parent", "depth", "cand"), got[:3], ref[:3]):
                assert x.dtype == np.int64 and np.array_equal(x, y.numpy()), name
            np.testing.assert_allclose(got[3], ref[3].numpy(), atol=1e-5)


def test_draft_tree_function_needs_a_static_slot_count():
    with pytest.raises(ValueError, match="static number of slots"):
        OF.draft_tree_function(None)
