"""lilicorr.onnx_fusions: the RMSNorm chain of the exported graphs -> one ONNX Runtime kernel."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from lilicorr.onnx_fusions import RMS_NORM_OP, fuse_rms_norm

EPS = 1e-5


def _rms_norm_graph(width: int = 64, share_mean: bool = False) -> onnx.ModelProto:
    """x [N, W] -> w * (x * 1 / sqrt(mean(x^2, -1) + eps)) -> MatMul, as the exporter writes it;
    `share_mean`: the mean of squares is also a graph output (then the chain must stay)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array([-1], np.int64), "axes"),
             numpy_helper.from_array(np.array(EPS, np.float32), "eps"),
             numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((width, 8)).astype(np.float32), "proj")]
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["ms_eps"]),
             helper.make_node("Sqrt", ["ms_eps"], ["rms"]),
             helper.make_node("Reciprocal", ["rms"], ["inv"]),
             helper.make_node("Mul", ["x", "inv"], ["normed"]),
             helper.make_node("Mul", ["w", "normed"], ["scaled"]),
             helper.make_node("MatMul", ["scaled", "proj"], ["y"])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])]
    if share_mean:
        outs.append(helper.make_tensor_value_info("ms", TensorProto.FLOAT, ["N", 1]))
    graph = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                              outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], {"x": x})[0]


def test_rms_norm_chain_becomes_one_kernel_with_the_same_values():
    model = _rms_norm_graph()
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32) * 3
    want = _run(model, x)
    assert fuse_rms_norm(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert ops == [RMS_NORM_OP, "MatMul"]
    (norm,) = [n for n in model.graph.node if n.op_type == RMS_NORM_OP]
    assert list(norm.input) == ["x", "w"] and list(norm.output) == ["scaled"]
    assert helper.get_attribute_value(norm.attribute[[a.name for a in norm.attribute].index("epsilon")]) \
        == pytest.approx(EPS)
    np.testing.assert_allclose(_run(model, x), want, rtol=1e-5, atol=1e-5)


def test_chain_whose_inner_tensor_is_read_elsewhere_stays():
    model = _rms_norm_graph(share_mean=True)
    assert fuse_rms_norm(model) == 0
    assert [n.op_type for n in model.graph.node][:2] == ["Pow", "ReduceMean"]
