"""ONNX side of the lattice ops: operator schemas in the ``lilicorr`` domain and ONNX local
functions built from standard ops with the semantics of ``lilicorr.lattice``.

A model exported with ``torch.onnx.export(..., dynamo=True)`` from code that calls
``lilicorr.lattice.match_scores`` / ``greedy_walk`` / ``fused_match_walk`` / ``build_tree`` contains
custom nodes ``lilicorr::LatticeMatch`` / ``GreedyWalk`` / ``LatticeMatchWalk`` / ``DraftTree``. ``add_local_functions(model)``
attaches one FunctionProto per op used, so that:

* ONNX Runtime runs the model as is (it expands the local functions);
* TensorRT's ONNX parser imports the function body when no plugin is registered, and the
  registered plugin (op_type + ``plugin_namespace`` attribute) when there is one.

Function bodies (opset = the model's default-domain opset, >= 15 for CastLike):

    LatticeMatch      Gather/Unsqueeze/MatMul/Squeeze for the anchor row, Slice/Transpose/MatMul
                      for the pair tables, both times CastLike(sigma) * scores.
    GreedyWalk        walk="unrolled" (default): ArgMax, then per slot Gather(slot) ->
                      GatherND(batch_dims=1, row c_j) -> ArgMax, Concat; needs the static S.
                      walk="loop": the same body in an ONNX Loop over S-1 iterations (S dynamic).
    LatticeMatchWalk  same walk, but each slot computes only the committed row:
                      GatherND(out_vec[:, j-1], c) -> MatMul with in_vec[:, j] -> ArgMax.
    DraftTree         LogSoftmax, per slot TopK over the kept paths' children, TopK over all kept
                      paths, ScatterElements to renumber parents (``draft_tree_function``); needs
                      the static S.

ArgMax uses select_last_index=0: ties go to the lowest index, as in the reference.
"""
from __future__ import annotations

from typing import Iterable

from . import NAMESPACE, OP_NAMES, PLUGIN_VERSION, require

onnx = require("onnx", "lilicorr.plugins.onnx_functions", "Install the `onnx` extra: pip install 'lilicorr[onnx]'.")
from onnx import AttributeProto, TensorProto, helper  # noqa: E402

__all__ = [
    "register_schemas", "lattice_match_function", "greedy_walk_function",
    "lattice_match_walk_function", "draft_tree_function", "add_local_functions", "set_node_attributes",
    "lilicorr_nodes", "infer_num_slots", "default_opset",
]

_INT64_MAX = 2 ** 63 - 1
_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]

# --------------------------------------------------------------------------------------------
# schemas
# --------------------------------------------------------------------------------------------

_SCHEMAS_REGISTERED = False


def register_schemas() -> None:
    """Register OpSchemas for LatticeMatch / GreedyWalk / LatticeMatchWalk (domain ``lilicorr``,
    since_version 1) with ``onnx.defs`` so that the checker validates arity, types and
    attributes of the custom nodes. Idempotent."""
    global _SCHEMAS_REGISTERED
    if _SCHEMAS_REGISTERED:
        return
    from onnx import defs
    OpSchema = defs.OpSchema
    FP = OpSchema.FormalParameter

    def plugin_attrs():
        return [
            OpSchema.Attribute("plugin_namespace", helper.make_attribute("plugin_namespace", NAMESPACE),
                               "TensorRT plugin namespace (the parser maps the node to a plugin)"),
            OpSchema.Attribute("plugin_version", helper.make_attribute("plugin_version", PLUGIN_VERSION),
                               "TensorRT plugin version"),
        ]

    sigma = OpSchema.Attribute("sigma", OpSchema.AttrType.FLOAT, "Eq. 1 scale", required=True)
    vecs = [FP("anchor_out", "T", "[N, E] unit-norm anchor out vector"),
            FP("out_vec", "T", "[N, S, K, E] unit-norm out vectors"),
            FP("in_vec", "T", "[N, S, K, E] unit-norm in vectors")]
    tc = [("T", _FLOAT_TYPES, "float storage type")]
    schemas = [
        OpSchema("LatticeMatch", NAMESPACE, 1,
                 "Eq. 1 matching scores: anchor_scores = sigma*<o_0, i_1k'>, "
                 "pair_scores[:, s] = sigma*<o_{s,k}, i_{s+1,k'}>",
                 inputs=vecs,
                 outputs=[FP("anchor_scores", "T", "[N, K]"), FP("pair_scores", "T", "[N, S-1, K, K]")],
                 type_constraints=tc, attributes=[sigma] + plugin_attrs()),
        OpSchema("GreedyWalk", NAMESPACE, 1,
                 "Eq. 8 greedy walk: c_0 = argmax anchor_scores, c_{s+1} = argmax pair_scores[:, s, c_s]",
                 inputs=[FP("anchor_scores", "T", "[N, K]"), FP("pair_scores", "T", "[N, S-1, K, K]")],
                 outputs=[FP("idx", "tensor(int64)", "[N, S]")],
                 type_constraints=tc, attributes=plugin_attrs()),
        OpSchema("LatticeMatchWalk", NAMESPACE, 1,
                 "GreedyWalk(LatticeMatch(...)) without materialising the K x K tables",
                 inputs=vecs, outputs=[FP("idx", "tensor(int64)", "[N, S]")],
                 type_constraints=tc,
                 attributes=[OpSchema.Attribute("sigma", OpSchema.AttrType.FLOAT, "Eq. 1 scale",
                                                required=True)] + plugin_attrs()),
    ]
    schemas.append(OpSchema(
        "DraftTree", NAMESPACE, 1,
        "Best-first draft tree of rule `tree` (lilicorr.lattice.build_tree): the M = min(num_nodes, "
        "sum_j K^j) paths with the highest summed log-conditionals (log-softmax of the Eq. 2 scores), "
        "in expansion order",
        inputs=[FP("anchor_scores", "T", "[N, K]"), FP("pair_scores", "T", "[N, S-1, K, K]")],
        outputs=[FP("parent", "tensor(int64)", "[N, M] parent node, -1 for a child of the anchor"),
                 FP("depth", "tensor(int64)", "[N, M] slot of the node"),
                 FP("cand", "tensor(int64)", "[N, M] candidate index in the slot's pool"),
                 FP("score", "tensor(float)", "[N, M] summed log-conditionals of the node's path")],
        type_constraints=tc,
        attributes=[OpSchema.Attribute("num_nodes", OpSchema.AttrType.INT, "tree budget M", required=True)]
        + plugin_attrs()))
    for s in schemas:
        try:
            defs.register_schema(s)
        except Exception as exc:  # already registered by another copy of this module
            if "already" not in str(exc).lower():
                raise
    _SCHEMAS_REGISTERED = True


# --------------------------------------------------------------------------------------------
# function builders
# --------------------------------------------------------------------------------------------

class _Body:
    """Tiny node-list builder with unique value names."""

    def __init__(self):
        self.nodes = []
        self._n = 0

    def name(self, hint: str) -> str:
        self._n += 1
        return f"_{hint}_{self._n}"

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, n_out: int = 1,
           outputs: list[str] | None = None, **attrs) -> str | list[str]:
        if outputs is None:
            outputs = [self.name(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def ints(self, values, hint="c") -> str:
        return self.op("Constant", [], hint, value=helper.make_tensor(
            self.name(hint + "_t"), TensorProto.INT64, [len(values)], list(values)))

    def scalar_int(self, value: int, hint="i") -> str:
        return self.op("Constant", [], hint, value=helper.make_tensor(
            self.name(hint + "_t"), TensorProto.INT64, [], [int(value)]))

    def sigma(self, like: str) -> str:
        """CastLike(sigma attribute, like): the function attribute referenced by the Constant."""
        ref = AttributeProto()
        ref.name = "value_float"
        ref.ref_attr_name = "sigma"
        ref.type = AttributeProto.FLOAT
        node = helper.make_node("Constant", [], [self.name("sigma_f32")])
        node.attribute.append(ref)
        self.nodes.append(node)
        return self.op("CastLike", [node.output[0], like], "sigma")

    def row_scores(self, vecs_nke: str, vec_ne: str, sig: str | None) -> str:
        """[N,K,E] x [N,E] -> sigma * [N,K]"""
        v = self.op("Unsqueeze", [vec_ne, self.ints([-1])], "vcol")          # [N,E,1]
        z = self.op("MatMul", [vecs_nke, v], "z3")                           # [N,K,1]
        z = self.op("Squeeze", [z, self.ints([-1])], "z")                    # [N,K]
        if sig is None:
            sig = self.sigma(z)
        return self.op("Mul", [z, sig], "zs"), sig

    def argmax(self, z: str) -> str:
        return self.op("ArgMax", [z], "c", axis=1, keepdims=1, select_last_index=0)  # [N,1] int64


def default_opset(model=None) -> int:
    """The default-domain opset a function must import: the model's, else 20."""
    if model is not None:
        for imp in model.opset_import:
            if imp.domain in ("", "ai.onnx"):
                return int(imp.version)
    return 20


def _plugin_attr_protos():
    return [helper.make_attribute("plugin_namespace", NAMESPACE),
            helper.make_attribute("plugin_version", PLUGIN_VERSION)]


def _make(fname, inputs, outputs, body: _Body, opset: int, with_sigma: bool):
    if opset < 15:
        raise ValueError(f"the lilicorr local functions need default-domain opset >= 15 (CastLike); got {opset}")
    return helper.make_function(
        NAMESPACE, fname, inputs, outputs, body.nodes,
        [helper.make_opsetid("", opset)],
        attributes=["sigma"] if with_sigma else [],
        attribute_protos=_plugin_attr_protos(),
        doc_string=f"lilicorr::{fname} (reference: lilicorr.lattice)")


def lattice_match_function(opset: int = 20):
    """FunctionProto lilicorr::LatticeMatch(anchor_out, out_vec, in_vec; sigma)
    -> (anchor_scores, pair_scores)."""
    b = _Body()
    in0 = b.op("Gather", ["in_vec", b.scalar_int(0)], "in0", axis=1)         # [N,K,E]
    b_anchor, sig = b.row_scores(in0, "anchor_out", None)                     # [N,K]
    b.op("Identity", [b_anchor], outputs=["anchor_scores"])
    o_head = b.op("Slice", ["out_vec", b.ints([0]), b.ints([-1]), b.ints([1])], "o_head")        # [N,S-1,K,E]
    i_tail = b.op("Slice", ["in_vec", b.ints([1]), b.ints([_INT64_MAX]), b.ints([1])], "i_tail")  # [N,S-1,K,E]
    i_t = b.op("Transpose", [i_tail], "i_t", perm=[0, 1, 3, 2])              # [N,S-1,E,K]
    p = b.op("MatMul", [o_head, i_t], "p")                                   # [N,S-1,K,K]
    b.op("Mul", [p, sig], outputs=["pair_scores"])
    return _make("LatticeMatch", ["anchor_out", "out_vec", "in_vec"],
                 ["anchor_scores", "pair_scores"], b, opset, with_sigma=True)


def _loop_walk(b: _Body, c0: str, trip_source: str, trip_axis: int, step) -> str:
    """ONNX Loop over trip = shape(trip_source)[trip_axis] iterations. ``step(bb, it, c_in)``
    adds body nodes to ``bb`` and returns c_out [N,1]. Returns idx [N, 1+trip]."""
    shape = b.op("Shape", [trip_source], "shape")
    trip = b.op("Gather", [shape, b.scalar_int(trip_axis)], "trip", axis=0)   # scalar int64
    cond = b.op("Constant", [], "cond", value=helper.make_tensor(b.name("true"), TensorProto.BOOL, [], [True]))
    bb = _Body()
    bb._n = b._n + 1000
    it, cond_in, c_in = "_it", "_cond_in", "_c_in"
    c_out = step(bb, it, c_in)
    bb.op("Identity", [cond_in], outputs=["_cond_out"])
    bb.op("Identity", [c_out], outputs=["_c_out"])
    bb.op("Identity", [c_out], outputs=["_c_scan"])
    ii = helper.make_tensor_value_info
    body = helper.make_graph(
        bb.nodes, "walk_body",
        [ii(it, TensorProto.INT64, []), ii(cond_in, TensorProto.BOOL, []), ii(c_in, TensorProto.INT64, None)],
        [ii("_cond_out", TensorProto.BOOL, []), ii("_c_out", TensorProto.INT64, None),
         ii("_c_scan", TensorProto.INT64, None)])
    b._n = bb._n + 1
    _, scan = b.op("Loop", [trip, cond, c0], "loop", n_out=2, body=body)     # scan [S-1, N, 1]
    scan = b.op("Squeeze", [scan, b.ints([2])], "scan2")                     # [S-1, N]
    scan = b.op("Transpose", [scan], "scanT", perm=[1, 0])                   # [N, S-1]
    return b.op("Concat", [c0, scan], "idx", axis=1)


def greedy_walk_function(num_slots: int | None = None, opset: int = 20, walk: str = "unrolled"):
    """FunctionProto lilicorr::GreedyWalk(anchor_scores, pair_scores) -> idx (int64).
    walk="unrolled" needs ``num_slots`` (S); walk="loop" works for any S."""
    b = _Body()
    c = b.argmax("anchor_scores")                                            # [N,1]
    if walk == "unrolled":
        if num_slots is None or num_slots < 1:
            raise ValueError("walk='unrolled' needs the static number of slots S >= 1")
        picks = [c]
        for j in range(num_slots - 1):
            pj = b.op("Gather", ["pair_scores", b.scalar_int(j)], "pj", axis=1)   # [N,K,K]
            row = b.op("GatherND", [pj, c], "row", batch_dims=1)                   # [N,K]
            c = b.argmax(row)
            picks.append(c)
        b.op("Concat", picks, outputs=["idx"], axis=1)
    elif walk == "loop":
        def step(bb, it, c_in):
            pj = bb.op("Gather", ["pair_scores", it], "pj", axis=1)
            row = bb.op("GatherND", [pj, c_in], "row", batch_dims=1)
            return bb.argmax(row)
        idx = _loop_walk(b, c, "pair_scores", 1, step)
        b.op("Identity", [idx], outputs=["idx"])
    else:
        raise ValueError(f"walk must be 'unrolled' or 'loop', not {walk!r}")
    return _make("GreedyWalk", ["anchor_scores", "pair_scores"], ["idx"], b, opset, with_sigma=False)


def lattice_match_walk_function(num_slots: int | None = None, opset: int = 20,
                                walk: str = "unrolled"):
    """FunctionProto lilicorr::LatticeMatchWalk(anchor_out, out_vec, in_vec; sigma) -> idx."""
    b = _Body()
    in0 = b.op("Gather", ["in_vec", b.scalar_int(0)], "in0", axis=1)         # [N,K,E]
    z, sig = b.row_scores(in0, "anchor_out", None)
    c = b.argmax(z)
    if walk == "unrolled":
        if num_slots is None or num_slots < 1:
            raise ValueError("walk='unrolled' needs the static number of slots S >= 1")
        picks = [c]
        for j in range(1, num_slots):
            oj = b.op("Gather", ["out_vec", b.scalar_int(j - 1)], "oj", axis=1)    # [N,K,E]
            o = b.op("GatherND", [oj, c], "o", batch_dims=1)                       # [N,E]
            ij = b.op("Gather", ["in_vec", b.scalar_int(j)], "ij", axis=1)         # [N,K,E]
            z, _ = b.row_scores(ij, o, sig)
            c = b.argmax(z)
            picks.append(c)
        b.op("Concat", picks, outputs=["idx"], axis=1)
    elif walk == "loop":
        o_head = b.op("Slice", ["out_vec", b.ints([0]), b.ints([-1]), b.ints([1])], "o_head")
        i_tail = b.op("Slice", ["in_vec", b.ints([1]), b.ints([_INT64_MAX]), b.ints([1])], "i_tail")

        def step(bb, it, c_in):
            oj = bb.op("Gather", [o_head, it], "oj", axis=1)
            o = bb.op("GatherND", [oj, c_in], "o", batch_dims=1)
            ij = bb.op("Gather", [i_tail, it], "ij", axis=1)
            z, _ = bb.row_scores(ij, o, sig)
            return bb.argmax(z)
        idx = _loop_walk(b, c, o_head, 1, step)
        b.op("Identity", [idx], outputs=["idx"])
    else:
        raise ValueError(f"walk must be 'unrolled' or 'loop', not {walk!r}")
    return _make("LatticeMatchWalk", ["anchor_out", "out_vec", "in_vec"], ["idx"], b, opset,
                 with_sigma=True)


def draft_tree_function(num_slots: int, opset: int = 20):
    """FunctionProto lilicorr::DraftTree(anchor_scores, pair_scores; num_nodes)
    -> (parent, depth, cand, score), unrolled over the static S (``num_slots``); N and K dynamic.

    The by-slot form of ``lattice.build_tree``: LogSoftmax, then per slot TopK of the kept paths'
    children (k = min(M, width x K), computed at run time), then TopK of all kept paths and a
    ScatterElements that renumbers parents as node indices. TopK (sorted, largest) returns equal
    values lowest index first, which is the reference's tie order."""
    if num_slots is None or num_slots < 1:
        raise ValueError("DraftTree's function needs the static number of slots S >= 1")
    b = _Body()
    ref = AttributeProto()
    ref.name, ref.ref_attr_name, ref.type = "value_int", "num_nodes", AttributeProto.INT
    node = helper.make_node("Constant", [], [b.name("m_scalar")])
    node.attribute.append(ref)
    b.nodes.append(node)
    budget = b.op("Unsqueeze", [node.output[0], b.ints([0])], "m")                     # [1]
    k = b.op("Slice", [b.op("Shape", ["anchor_scores"], "shape_a"), b.ints([1]), b.ints([2])], "k")  # [1]
    root = b.op("LogSoftmax", [b.op("Cast", ["anchor_scores"], "a32", to=TensorProto.FLOAT)], "root", axis=-1)
    cond = b.op("LogSoftmax", [b.op("Cast", ["pair_scores"], "p32", to=TensorProto.FLOAT)], "cond", axis=-1)

    def top(x: str, width: str, hint: str):
        return b.op("TopK", [x, width], hint, n_out=2, axis=-1, largest=1, sorted=1)

    def width_of(x: str) -> str:                                                        # [1]
        return b.op("Slice", [b.op("Shape", [x], "shape"), b.ints([1]), b.ints([2])], "w")

    val, c = top(root, b.op("Min", [budget, k], "w0"), "t0")                            # [N, W0]
    zeros = b.op("Mul", [c, b.scalar_int(0)], "zeros")
    vals, cands, depths, parents = [val], [c], [zeros], [b.op("Sub", [zeros, b.scalar_int(1)], "root_par")]
    offset = b.ints([0])
    for j in range(num_slots - 1):
        w = width_of(val)
        rows = b.op("GatherND", [b.op("Gather", [cond, b.scalar_int(j)], "cj", axis=1),
                                 b.op("Unsqueeze", [c, b.ints([-1])], "cidx")], "rows", batch_dims=1)  # [N, W, K]
        ext = b.op("Add", [b.op("Unsqueeze", [val, b.ints([-1])], "v3"), rows], "ext")  # [N, W, K]
        flat = b.op("Reshape", [ext, b.ints([0, -1])], "flat")                          # [N, W*K]
        val, f = top(flat, b.op("Min", [budget, b.op("Mul", [w, k], "wk")], "wn"), f"t{j + 1}")
        c = b.op("Mod", [f, k], "cand")
        parents.append(b.op("Add", [b.op("Div", [f, k], "pr"), offset], "par"))
        offset = b.op("Add", [offset, w], "off")
        vals.append(val)
        cands.append(c)
        depths.append(b.op("Add", [b.op("Mul", [c, b.scalar_int(0)], "z"), b.scalar_int(j + 1)], "d"))
    score_all, depth_all, cand_all, par_all = (b.op("Concat", xs, hint, axis=1) for xs, hint in
                                               ((vals, "scores"), (depths, "depths"), (cands, "cands"),
                                                (parents, "parents")))
    m = b.op("Min", [budget, width_of(score_all)], "m_eff")                             # [1]
    score, sel = top(score_all, m, "tsel")                                              # [N, M]
    b.op("Identity", [score], outputs=["score"])
    numbers = b.op("Range", [b.scalar_int(0), b.op("Squeeze", [m, b.ints([0])], "m0"), b.scalar_int(1)], "ar")
    numbers = b.op("Expand", [numbers, b.op("Shape", [sel], "shape_sel")], "numbers")   # [N, M]
    minus = b.op("Sub", [b.op("Mul", [par_all, b.scalar_int(0)], "z2"), b.scalar_int(1)], "minus")
    node_of = b.op("ScatterElements", [minus, sel, numbers], "node_of", axis=1)         # [N, P]
    par = b.op("GatherElements", [par_all, sel], "par_sel", axis=1)                     # [N, M]
    as_node = b.op("GatherElements", [node_of, b.op("Max", [par, b.scalar_int(0)], "par0")], "par_node", axis=1)
    b.op("Where", [b.op("Less", [par, b.scalar_int(0)], "is_root"), par, as_node], outputs=["parent"])
    b.op("GatherElements", [depth_all, sel], outputs=["depth"], axis=1)
    b.op("GatherElements", [cand_all, sel], outputs=["cand"], axis=1)
    if opset < 15:
        raise ValueError(f"the lilicorr local functions need default-domain opset >= 15; got {opset}")
    return helper.make_function(
        NAMESPACE, "DraftTree", ["anchor_scores", "pair_scores"], ["parent", "depth", "cand", "score"], b.nodes,
        [helper.make_opsetid("", opset)], attributes=["num_nodes"], attribute_protos=_plugin_attr_protos(),
        doc_string="lilicorr::DraftTree (reference: lilicorr.lattice.build_tree)")


# --------------------------------------------------------------------------------------------
# model editing
# --------------------------------------------------------------------------------------------

def _graphs(graph) -> Iterable:
    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.type == AttributeProto.GRAPH:
                yield from _graphs(a.g)
            elif a.type == AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _graphs(g)


def lilicorr_nodes(model, op_types: Iterable[str] | None = None) -> list:
    """All nodes of domain ``lilicorr`` (optionally only ``op_types``) in the main graph and its
    subgraphs."""
    wanted = set(op_types) if op_types is not None else set(OP_NAMES)
    return [n for g in _graphs(model.graph) for n in g.node
            if n.domain == NAMESPACE and n.op_type in wanted]


def _known_shapes(model) -> dict:
    shapes = {}
    for g in _graphs(model.graph):
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            t = vi.type.tensor_type
            if t.HasField("shape"):
                shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return shapes


def infer_num_slots(model, node) -> int | None:
    """Static S of a GreedyWalk / LatticeMatchWalk / DraftTree node from the model's recorded shapes
    (graph inputs/outputs/value_info); None if unknown."""
    shapes = _known_shapes(model)
    cands = []
    if node.op_type in ("GreedyWalk", "DraftTree"):
        p = shapes.get(node.input[1])
        if p and len(p) == 4 and p[1] is not None:
            cands.append(p[1] + 1)
    elif node.op_type in ("LatticeMatchWalk", "LatticeMatch"):
        for name in node.input[1:3]:
            v = shapes.get(name)
            if v and len(v) == 4 and v[1] is not None:
                cands.append(v[1])
    if node.op_type in ("GreedyWalk", "LatticeMatchWalk"):
        o = shapes.get(node.output[0])
        if o and len(o) == 2 and o[1] is not None:
            cands.append(o[1])
    if not cands:
        return None
    if len(set(cands)) != 1:
        raise ValueError(f"inconsistent slot counts {cands} around node {node.name!r}")
    return cands[0]


def add_local_functions(model, num_slots: int | None = None, walk: str = "auto",
                        ops: Iterable[str] | None = None):
    """Attach the lilicorr local functions needed by ``model`` (in place; returns the model).

    num_slots: S for the unrolled walks; by default read from the recorded shapes of the walk
      nodes (the dynamo exporter records them). walk: "unrolled" | "loop" | "auto" (unrolled
      when S is known, else loop). ops: restrict to these op types (default: the ones used).
    Existing lilicorr functions of the same names are replaced.
    Also adds the ``lilicorr`` v1 opset import and registers the schemas.
    """
    register_schemas()
    opset = default_opset(model)
    used = {n.op_type for n in lilicorr_nodes(model)}
    wanted = set(ops) if ops is not None else used
    s_by_op: dict[str, set] = {}
    for n in lilicorr_nodes(model, {"GreedyWalk", "LatticeMatchWalk"}):
        s = num_slots if num_slots is not None else infer_num_slots(model, n)
        s_by_op.setdefault(n.op_type, set()).add(s)

    def walk_args(op):
        ss = s_by_op.get(op, {num_slots})
        known = {s for s in ss if s is not None}
        if walk == "loop" or (walk == "auto" and (len(known) != 1 or None in ss)):
            return dict(num_slots=None, walk="loop")
        if len(known) != 1:
            raise ValueError(f"{op}: unrolled walk needs one static S; found {sorted(ss, key=str)} "
                             "(pass num_slots=... or walk='loop')")
        return dict(num_slots=known.pop(), walk="unrolled")

    new = []
    if "LatticeMatch" in wanted:
        new.append(lattice_match_function(opset))
    if "GreedyWalk" in wanted:
        new.append(greedy_walk_function(opset=opset, **walk_args("GreedyWalk")))
    if "LatticeMatchWalk" in wanted:
        new.append(lattice_match_walk_function(opset=opset, **walk_args("LatticeMatchWalk")))
    if "DraftTree" in wanted:
        slots = {num_slots if num_slots is not None else infer_num_slots(model, n)
                 for n in lilicorr_nodes(model, ["DraftTree"])} or {num_slots}
        if len(slots) != 1 or None in slots:
            raise ValueError(f"DraftTree's function needs one static S; found {sorted(slots, key=str)} "
                             "(pass num_slots=...)")
        new.append(draft_tree_function(slots.pop(), opset))
    names = {f.name for f in new}
    keep = [f for f in model.functions if not (f.domain == NAMESPACE and f.name in names)]
    del model.functions[:]
    model.functions.extend(keep + new)
    if not any(imp.domain == NAMESPACE for imp in model.opset_import):
        model.opset_import.append(helper.make_opsetid(NAMESPACE, 1))
    if model.ir_version < 8:
        model.ir_version = 8
    return model


def set_node_attributes(model, op_types: Iterable[str] | None = None, *,
                        remove: Iterable[str] = (), **attrs):
    """Rewrite attributes of the lilicorr nodes (in place; returns the number of nodes touched).

    Example: ``set_node_attributes(m, sigma=12.0)``, ``set_node_attributes(m, ["GreedyWalk"],
    remove=["plugin_namespace"])`` (then TensorRT >= 10.15 prefers the local function over a
    registered plugin), ``set_node_attributes(m, plugin_namespace="lilicorr", plugin_version="1")``.
    """
    remove = set(remove)
    touched = 0
    for node in lilicorr_nodes(model, op_types):
        kept = [a for a in node.attribute if a.name not in remove and a.name not in attrs]
        del node.attribute[:]
        node.attribute.extend(kept)
        for k, v in attrs.items():
            if k == "sigma":
                v = float(v)
            node.attribute.append(helper.make_attribute(k, v))
        touched += 1
    return touched
