"""Export the drafter + head to ONNX and build engine directories (``convert/build_engine.py``).

Two graphs, so the drafter's context cache lives outside them (in the runtime's KVCache):

    context.onnx  captured [N, T, n, H] f32, positions [N, T] i64
                  -> ctx_k_i, ctx_v_i [N, h, T, D] for every draft layer i (to append to the cache)
    draft.onnx    anchor_ids [N] i64, anchor_pos [N] i64, ctx_lengths [N] i64,
                  ctx_k_i, ctx_v_i [N, h, C, D], target_state [N, n, H] (head only)
                  -> tokens [N, S] i64 (greedy walk, Eq. 8), cand_ids [N, S, K] i64,
                     anchor_scores [N, K], pair_scores [N, S-1, K, K] (head only),
                     tree_parent, tree_depth, tree_cand [N, M] i64, tree_score [N, M] f32
                     (head only: rule `tree`'s draft tree of M = BuildOptions.tree_nodes nodes)

    draft.{backbone,lm_head,head}.onnx  draft.onnx cut at slot_hidden and slot_logits (`split_draft`):
                  one ONNX Runtime session per stage of the stage table; bit-identical to draft.onnx
    draft.tree.onnx  DraftTree cut off the head at the lattice scores (engines with a tree budget)

For ONNX Runtime the build also saves ORT-optimised copies (*.ort.onnx; their RMSNorm chains
fused into one kernel each: `lilicorr.onnx_fusions`) and, with int8 draft
weights (`BuildOptions.draft_weights`, the default there), their int8 copies (*.int8.onnx, ONNX
Runtime dynamic quantization: `quantize_onnxruntime`), which the engine then serves. The drafter
only proposes and the target verifies every token, so int8 weights change drafts, never outputs.

N (rows), T (new context tokens) and C (cached context length) are dynamic. The draft graph of a
LiLiCorr checkpoint carries the custom nodes lilicorr::LatticeMatch, lilicorr::GreedyWalk and
lilicorr::DraftTree
(plugin_namespace="lilicorr", plugin_version="1") plus their ONNX local functions, so ONNX
Runtime runs it as is and TensorRT maps the nodes to the IPluginV3 plugins when they are
registered (to the functions otherwise). A vanilla DFlash checkpoint exports without them
(tokens = top-1 of each slot).

    build_engine_dir(ckpt_dir, target_dir, out_dir, backend="onnxruntime")  -> Path
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lilicorr import lattice
from lilicorr.checkpoint import CONFIG, META, WEIGHTS, CheckpointError, atomic_dir
from lilicorr.drafter import inference_attention_mask
from lilicorr.engine_dir import (BACKENDS, FORMAT, FORMAT_VERSION, MANIFEST, REPO, EngineDirError,
                                 file_sha256, portable_path, target_record, write_manifest)
from lilicorr.head import top_k_candidates
from lilicorr.ngram import parse_prompt_lookup
from lilicorr.onnx_fusions import fuse_file
from lilicorr.ort_runner import TREE_OUTPUTS, context_io_names, draft_io_names, ort_session
from lilicorr.plugins import plan_plugins
from lilicorr.profiling import STAGE_DRAFT, STAGE_HEAD, STAGE_LM_HEAD

CONTEXT_ONNX, DRAFT_ONNX = "context.onnx", "draft.onnx"
# the draft graph cut into three parts at these tensors, one ONNX Runtime session (and one stage of
# the stage table) each; draft.onnx stays whole for TensorRT and as the reference. A graph with a
# draft tree has a fourth part, `tree` (lilicorr::DraftTree from the head's lattice scores), cut
# off the head so that the head's session builds no tree for the rows of the other rules
DRAFT_CUTS = ("slot_hidden", "slot_logits")
TREE_CUTS = ("anchor_scores", "pair_scores")
DRAFT_PARTS = ("backbone", "lm_head", "head", "tree")
DRAFT_PART_FILES = {p: f"draft.{p}.onnx" for p in DRAFT_PARTS}
DRAFT_PART_STAGES = {"backbone": STAGE_DRAFT, "lm_head": STAGE_LM_HEAD, "head": STAGE_HEAD, "tree": STAGE_HEAD}
ORT_SUFFIX = ".ort.onnx"
INT8_SUFFIX = ".int8.onnx"
# the drafter's weights in the graphs ONNX Runtime serves: int8 (dynamic quantization, per output
# channel) or float32 (the exact compiled copy of the PyTorch drafter); auto = int8 for onnxruntime
DRAFT_WEIGHTS = ("auto", "int8", "float32")
# int8 drafts may differ from PyTorch's near ties; the build fails if fewer of the sample rows'
# drafted tokens than this agree with PyTorch's (a broken quantization, not rounding)
INT8_MIN_TOKEN_AGREEMENT = 0.5
OPSET = 20
ORT_LEVEL = "ORT_ENABLE_EXTENDED"    # saved optimised graphs stay portable across CPUs
DEFAULT_TARGET = REPO / ".cache" / "smollm2-135m-instruct-float32"
EXTERNAL_DATA_BYTES = 1_500_000_000  # above this, weights go to a .data file next to the .onnx
# (N rows, C cached context) for the draft graph and (N, T new tokens) for the context graph
DRAFT_CASES = ((1, 1), (2, 5), (4, 16), (8, 40))
CONTEXT_CASES = ((1, 1), (3, 6), (5, 24))


class BuildError(RuntimeError):
    """Bad input to the engine build (named precisely); nothing has been written."""


# ------------------------------------------------------------------------------ graphs
class ContextGraph(nn.Module):
    """captured [N, T, n, H], positions [N, T] -> (k_0, v_0, k_1, v_1, ...) each [N, h, T, D]."""

    def __init__(self, model):
        super().__init__()
        self.drafter = model.drafter

    def forward(self, captured: torch.Tensor, positions: torch.Tensor):
        d = self.drafter
        out = []
        for k, v in d.context_kv(d.project_context(captured), positions):
            out += [k, v]
        return tuple(out)


class DraftGraph(nn.Module):
    """One block per row over the cached context; see the module docstring for the I/O. With
    `taps`, the cut tensors of the three-part split (`DRAFT_CUTS`: slot_hidden, slot_logits) are
    extra outputs after the usual ones."""

    def __init__(self, model, taps: bool = False, tree_nodes: int = 0):
        super().__init__()
        self.model = model
        self.taps = taps
        self.tree_nodes = tree_nodes if model.head is not None else 0
        # the head's token term of every target id, folded once (a constant gather in the graph)
        self.register_buffer("token_table", model.head.token_table() if model.head is not None else None,
                             persistent=False)                                 # [V, W]

    def forward(self, anchor_ids, anchor_pos, ctx_lengths, ctx_kv, target_state=None):
        m = self.model
        d, b = m.drafter, m.block_size
        emb = d.block_embeddings(anchor_ids[:, None], b)                       # [N, B, H]
        pos = anchor_pos[:, None] + torch.arange(b, device=anchor_pos.device)[None, :]   # [N, B]
        kv = [(ctx_kv[2 * i], ctx_kv[2 * i + 1]) for i in range(len(ctx_kv) // 2)]
        mask = inference_attention_mask(ctx_lengths, ctx_kv[0].shape[2], b)    # [N, 1, B, C+B]
        slot_hidden = d(emb, pos, kv, mask)[:, 1:]                             # [N, S, H]
        slot_logits = d.logits(slot_hidden)                                    # [N, S, V']
        id_map = d.draft_to_target                      # [V'] target id per draft-vocabulary entry, or None
        if m.head is None:
            cand_ids = torch.topk(slot_logits, m.cfg.head.top_k, dim=-1).indices   # [N, S, K]
            if id_map is not None:
                cand_ids = id_map[cand_ids]                                    # constant gather: target ids
            out = (cand_ids[..., 0], cand_ids)
            return out + (slot_hidden, slot_logits) if self.taps else out
        # top-K over the (draft) vocabulary, then a constant gather to target ids where there is a map
        cand_ids, cand_feats = top_k_candidates(slot_logits, m.cfg.head.top_k, id_map=id_map)
        out_vec, in_vec, anchor_out = m.head(cand_ids, cand_feats, slot_hidden, target_state, self.token_table)
        anchor_scores, pair_scores = lattice.match_scores(anchor_out, out_vec, in_vec, m.cfg.head.sigma)
        idx = lattice.greedy_walk(anchor_scores, pair_scores)                  # [N, S]
        tokens = torch.gather(cand_ids, -1, idx[..., None]).squeeze(-1)        # [N, S]
        out = (tokens, cand_ids, anchor_scores, pair_scores)
        if self.tree_nodes:                                                    # rule `tree`: lilicorr::DraftTree
            t = lattice.build_tree(anchor_scores, pair_scores, self.tree_nodes)
            out += (t.parent, t.depth, t.cand, t.score)                        # [N, M] each
        return out + (slot_hidden, slot_logits) if self.taps else out


def context_inputs(model, n: int, t: int, seed: int = 0, start: int = 0):
    cfg = model.cfg.drafter
    g = torch.Generator().manual_seed(seed)
    captured = torch.randn(n, t, cfg.num_target_layers_captured, cfg.hidden_size, generator=g)
    offs = torch.randint(0, 64, (n, 1), generator=g) + start
    return captured, offs + torch.arange(t)[None, :]


def draft_inputs(model, n: int, c: int, seed: int = 0):
    """Random but consistent draft inputs: context K/V from the context graph over random
    features, ragged lengths (>= 1), anchors right after each row's context."""
    cfg = model.cfg.drafter
    g = torch.Generator().manual_seed(seed + 1)
    captured, pos = context_inputs(model, n, c, seed)
    pos = pos - pos[:, :1]
    with torch.no_grad():
        kv = [t.contiguous() for t in ContextGraph(model)(captured, pos)]
    lengths = torch.randint(1, c + 1, (n,), generator=g)
    lengths[0] = c
    anchors = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    state = torch.randn(n, cfg.num_target_layers_captured, cfg.hidden_size, generator=g)
    args = [anchors, lengths.clone(), lengths, kv]
    if model.head is not None:
        args.append(state)
    return tuple(args)


def _flat_draft_feeds(model, args) -> dict:
    names = draft_io_names(model.cfg.drafter.num_layers, model.head is not None)[0]
    flat = list(args[:3]) + list(args[3]) + list(args[4:])
    return dict(zip(names, flat))


# ------------------------------------------------------------------------------ export
def _save(proto, path: Path, param_bytes: int) -> None:
    import onnx

    if param_bytes > EXTERNAL_DATA_BYTES:
        onnx.save(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".data")
    else:
        onnx.save(proto, str(path))


def dedupe_initializers(proto) -> int:
    """Merge initializers with identical type, shape and bytes (the frozen target embedding is
    lifted once for the drafter and once for the head). Returns the number removed."""
    import hashlib

    from onnx import numpy_helper

    first: dict[tuple, str] = {}
    rename: dict[str, str] = {}
    keep = []
    for init in proto.graph.initializer:
        data = init.raw_data or numpy_helper.to_array(init).tobytes()
        key = (init.data_type, tuple(init.dims), hashlib.sha256(data).hexdigest())
        if key in first:
            rename[init.name] = first[key]
        else:
            first[key] = init.name
            keep.append(init)
    if not rename:
        return 0
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
    from onnx import AttributeProto

    def walk(graph):
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name in rename:
                    node.input[i] = rename[name]
            for a in node.attribute:      # subgraphs may read outer-scope initializers
                if a.type == AttributeProto.GRAPH:
                    walk(a.g)
                elif a.type == AttributeProto.GRAPHS:
                    for g in a.graphs:
                        walk(g)
    walk(proto.graph)
    for out in proto.graph.output:
        if out.name in rename:
            raise RuntimeError(f"initializer {out.name} is a graph output; cannot merge it")
    return len(rename)


def _param_bytes(module: nn.Module, extra=()) -> int:
    tensors = {id(p): p for p in module.parameters()}
    tensors.update({id(t): t for t in extra})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _onnx_export(module, args, dynamic_shapes, in_names, out_names):
    # the exporter logs a warning per missing torchvision op; not ours to fix
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dynamic_shapes,
                                 input_names=in_names, output_names=out_names, opset_version=OPSET,
                                 optimize=True, verbose=False)
    return prog.model_proto


def export_context(model, path) -> "onnx.ModelProto":
    """Write context.onnx for `model` (float32, eval) to `path`."""
    cfg = model.cfg.drafter
    ins, outs = context_io_names(cfg.num_layers)
    n_dim = torch.export.Dim("batch", min=1, max=4096)
    t_dim = torch.export.Dim("new_tokens", min=1, max=1 << 20)
    args = context_inputs(model, 2, 5)
    proto = _onnx_export(ContextGraph(model), args, ({0: n_dim, 1: t_dim}, {0: n_dim, 1: t_dim}), ins, outs)
    proto.doc_string = "lilicorr drafter context: captured target features -> per-layer context K/V"
    _save(proto, Path(path), _param_bytes(model.drafter))
    return proto


def _export_draft_tapped(model, tree_nodes: int = 0):
    """The draft graph with the cut tensors (DRAFT_CUTS) as extra outputs, initializers merged
    and the lilicorr local functions attached."""
    from lilicorr.plugins import onnx_functions

    cfg = model.cfg.drafter
    has_head = model.head is not None
    ins, outs = draft_io_names(cfg.num_layers, has_head, tree=bool(tree_nodes))
    n_dim = torch.export.Dim("batch", min=1, max=4096)
    c_dim = torch.export.Dim("context", min=1, max=1 << 20)
    args = draft_inputs(model, 3, 6)
    shapes = [{0: n_dim}, {0: n_dim}, {0: n_dim}, [{0: n_dim, 2: c_dim} for _ in args[3]]]
    if has_head:
        shapes.append({0: n_dim})
    proto = _onnx_export(DraftGraph(model, taps=True, tree_nodes=tree_nodes), args, tuple(shapes), ins,
                         outs + list(DRAFT_CUTS))
    dedupe_initializers(proto)
    if has_head:
        onnx_functions.add_local_functions(proto)
    return proto


def export_draft(model, path, parts_dir=None, tree_nodes: int = 0) -> tuple["onnx.ModelProto", dict]:
    """Write draft.onnx (+ local functions of the lilicorr nodes) for `model` to `path`; with
    `parts_dir`, also its split there (`split_draft`, files DRAFT_PART_FILES). Returns the draft
    graph and the parts written ({part: proto}, empty without `parts_dir`).
    tree_nodes M > 0 (LiLiCorr checkpoints): the graph also builds rule `tree`'s draft tree of M
    nodes (lilicorr::DraftTree, outputs TREE_OUTPUTS)."""
    import onnx

    tapped = _export_draft_tapped(model, tree_nodes)
    proto = onnx.ModelProto()
    proto.CopyFrom(tapped)
    n_out = len(draft_io_names(model.cfg.drafter.num_layers, model.head is not None, bool(tree_nodes))[1])
    del proto.graph.output[n_out:]                     # the cut tensors stay internal in draft.onnx
    proto.doc_string = ("lilicorr draft block: anchor + cached context K/V -> drafted tokens (greedy walk), "
                        "top-K candidates, lattice scores")
    _save(proto, Path(path), _proto_bytes(proto))
    parts = split_draft(tapped, parts_dir) if parts_dir is not None else {}
    return proto, parts


def _proto_bytes(proto) -> int:
    from onnx import numpy_helper

    return sum(len(t.raw_data) or numpy_helper.to_array(t).nbytes for t in proto.graph.initializer)


# ------------------------------------------------------------------------------ three-part split
def _outer_names(graph) -> set[str]:
    """Names a subgraph reads from its enclosing scope."""
    from onnx import AttributeProto

    local = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    local |= {o for n in graph.node for o in n.output}
    used = set()
    for n in graph.node:
        used |= set(n.input)
        for a in n.attribute:
            for g in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
                used |= _outer_names(g)
    return {u for u in used if u and u not in local}


def part_inputs(graph, outputs, stops=()) -> list[str]:
    """The inputs of the sub-graph of `graph` that computes `outputs` from the tensors in `stops`:
    the stops it reads plus every graph input it reaches without passing through a stop (in the
    graph's input order, then the order of `stops`)."""
    from onnx import AttributeProto

    producer = {o: n for n in graph.node for o in n.output}
    graph_inputs = [i.name for i in graph.input]
    inits = {i.name for i in graph.initializer}
    need, seen, todo = set(), set(), list(outputs)
    while todo:
        name = todo.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        if name in stops or name in graph_inputs:
            need.add(name)
            continue
        if name in inits:
            continue
        node = producer.get(name)
        if node is None:
            raise RuntimeError(f"draft graph: no node produces {name!r}")
        todo += list(node.input)
        for a in node.attribute:
            for g in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
                todo += sorted(_outer_names(g))
    return [n for n in graph_inputs if n in need] + [n for n in stops if n in need]


def draft_part_io(tapped) -> dict[str, tuple[list[str], list[str]]]:
    """{part: (inputs, outputs)} of the parts of a tapped draft graph: backbone, LM head and head,
    and `tree` when the graph builds a draft tree (TREE_OUTPUTS, read from TREE_CUTS only)."""
    outs = [o.name for o in tapped.graph.output if o.name not in DRAFT_CUTS]
    tree = [o for o in outs if o in TREE_OUTPUTS]
    hidden, logits = DRAFT_CUTS
    wanted = {"backbone": ([], [hidden]), "lm_head": ([hidden], [logits]),
              "head": ([hidden, logits], [o for o in outs if o not in tree])}
    if tree:
        wanted["tree"] = (list(TREE_CUTS), tree)
    io = {p: (part_inputs(tapped.graph, o, stops), o) for p, (stops, o) in wanted.items()}
    if io["lm_head"][0] != [hidden]:
        raise RuntimeError(f"the LM-head part of the draft graph reads {io['lm_head'][0]}, expected only {hidden}")
    if hidden in io["backbone"][0] or logits in io["backbone"][0]:
        raise RuntimeError("the backbone part of the draft graph reads a cut tensor")
    if tree and io["tree"][0] != list(TREE_CUTS):
        raise RuntimeError(f"the tree part of the draft graph reads {io['tree'][0]}, expected only {list(TREE_CUTS)}")
    return io


def split_draft(tapped, out_dir) -> dict[str, "onnx.ModelProto"]:
    """Cut a tapped draft graph (`_export_draft_tapped`) into its parts and write them to
    `out_dir` under DRAFT_PART_FILES (stage of each part: DRAFT_PART_STAGES):

        backbone  anchor_ids, anchor_pos, ctx_lengths, ctx_k_i, ctx_v_i -> slot_hidden [N, S, H]
        lm_head   slot_hidden -> slot_logits [N, S, V'] (the frozen target head, or its draft-vocabulary rows)
        head      slot_hidden, slot_logits, target_state -> tokens, cand_ids (+ anchor_scores,
                  pair_scores): top-K, confidence features, head, LatticeMatch, GreedyWalk
        tree      anchor_scores, pair_scores -> TREE_OUTPUTS (lilicorr::DraftTree), in graphs with
                  a draft tree only; the runner runs it only for rule `tree`

    Every node of the part is copied unchanged (onnx.utils.Extractor), so the chain computes what
    the whole graph computes; `validate_split` checks that at build time."""
    import onnx

    ex = onnx.utils.Extractor(tapped)
    parts = {}
    for part, (ins, outs) in draft_part_io(tapped).items():
        proto = ex.extract_model(ins, outs)
        proto.ir_version = tapped.ir_version
        proto.producer_name, proto.producer_version = tapped.producer_name, tapped.producer_version
        proto.doc_string = f"lilicorr draft block, part {part!r} of draft.onnx ({DRAFT_PART_STAGES[part]})"
        onnx.checker.check_model(proto)
        _save(proto, Path(out_dir) / DRAFT_PART_FILES[part], _proto_bytes(proto))
        parts[part] = proto
    return parts


def validate_split(model, draft_path, part_paths: dict, draft_cases=DRAFT_CASES) -> dict:
    """Run the whole draft graph and the chain of its parts (`part_paths`, in DRAFT_PARTS order) in
    ONNX Runtime on the same sample inputs: every output must be bit-identical (tokens, cand_ids,
    the lattice scores and the draft tree)."""
    from lilicorr.ort_runner import OrtSession, run_draft_parts

    whole = OrtSession(draft_path)
    parts = {p: OrtSession(path) for p, path in part_paths.items()}
    rep = {"cases": [], "bit_identical": True, "tokens_equal": True, "cand_ids_equal": True, "max_abs_diff": 0.0}
    for i, (n, c) in enumerate(draft_cases):
        feeds = _flat_draft_feeds(model, draft_inputs(model, n, c, seed=300 + i))
        ref = whole.run(feeds)
        got = run_draft_parts([parts[p] for p in DRAFT_PARTS if p in parts], feeds)
        case = {"N": n, "C": c, "bit_identical": all(torch.equal(got[k], v) for k, v in ref.items()),
                "tokens_equal": torch.equal(got["tokens"], ref["tokens"]),
                "cand_ids_equal": torch.equal(got["cand_ids"], ref["cand_ids"]),
                "max_abs_diff": max(float((got[k].double() - v.double()).abs().max()) for k, v in ref.items())}
        rep["cases"].append(case)
        for k in ("bit_identical", "tokens_equal", "cand_ids_equal"):
            rep[k] &= case[k]
        rep["max_abs_diff"] = max(rep["max_abs_diff"], case["max_abs_diff"])
    return rep


def check_split_drafts(model, folder: Path, files: dict, draft_cases, what: str) -> dict:
    """`validate_split` of the graphs `files` names in `folder` (graph -> file: draft and
    draft_<part>); raises BuildError unless the parts draft the whole graph's tokens and candidates."""
    rep = validate_split(model, folder / files["draft"],
                         {p: folder / files[f"draft_{p}"] for p in DRAFT_PARTS if f"draft_{p}" in files}, draft_cases)
    if not (rep["tokens_equal"] and rep["cand_ids_equal"]):
        raise BuildError(f"the {what} draft parts draft other tokens than the {what} whole graph {files['draft']}")
    return rep


def graph_summary(proto) -> dict:
    """Opset, custom nodes (with their attributes) and local functions of an exported graph."""
    from onnx import helper

    nodes = []
    for n in proto.graph.node:
        if n.domain == "lilicorr":
            nodes.append({"op_type": n.op_type, "name": n.name,
                          "attributes": {a.name: helper.get_attribute_value(a) for a in n.attribute}})
    for n in nodes:
        n["attributes"] = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in n["attributes"].items()}
    return {
        "opset": {(imp.domain or "ai.onnx"): imp.version for imp in proto.opset_import},
        "ir_version": proto.ir_version,
        "inputs": {i.name: _dims(i) for i in proto.graph.input},
        "outputs": {o.name: _dims(o) for o in proto.graph.output},
        "custom_nodes": nodes,
        "local_functions": [f"{f.domain}::{f.name}" for f in proto.functions],
        "num_nodes": len(proto.graph.node),
    }


def _dims(vi) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in vi.type.tensor_type.shape.dim]


# ------------------------------------------------------------------------------ validation
def validate_onnxruntime(model, context_path, draft_path, draft_cases=DRAFT_CASES,
                         context_cases=CONTEXT_CASES, tree_nodes: int = 0) -> dict:
    """Run both graphs in ONNX Runtime and PyTorch on sample inputs (several batch sizes and
    context lengths): max abs error of the context K/V and the lattice scores, exact equality of
    drafted tokens, candidate ids and (with tree_nodes) the draft tree's nodes, and the share of
    drafted tokens and candidate ids that agree (`token_agreement`, `cand_id_agreement`: below 1
    for the int8 graphs, whose errors are reported, not bounded)."""
    from lilicorr.ort_runner import OrtSession

    ctx_sess, draft_sess = OrtSession(context_path), OrtSession(draft_path)
    ctx_names = context_io_names(model.cfg.drafter.num_layers)[1]
    rep = {"context": {"cases": [], "max_abs_err": 0.0}, "draft": {"cases": []}}
    for i, (n, t) in enumerate(context_cases):
        captured, pos = context_inputs(model, n, t, seed=100 + i)
        with torch.no_grad():
            ref = ContextGraph(model)(captured, pos)
        got = ctx_sess.run({"captured": captured, "positions": pos})
        err = max(float((got[name] - r).abs().max()) for name, r in zip(ctx_names, ref))
        rep["context"]["cases"].append({"N": n, "T": t, "max_abs_err": err})
        rep["context"]["max_abs_err"] = max(rep["context"]["max_abs_err"], err)
    d = rep["draft"]
    d.update(tokens_equal=True, cand_ids_equal=True, mismatched_rows=0, rows=0)
    agree = {"tokens": [0, 0], "cand_ids": [0, 0]}          # equal, total
    if model.head is not None:
        d.update(anchor_scores_max_abs_err=0.0, pair_scores_max_abs_err=0.0)
    if tree_nodes:
        d.update(tree_equal=True)
    for i, (n, c) in enumerate(draft_cases):
        args = draft_inputs(model, n, c, seed=200 + i)
        with torch.no_grad():
            ref = DraftGraph(model, tree_nodes=tree_nodes)(*args)
        got = draft_sess.run(_flat_draft_feeds(model, args))
        case = {"N": n, "C": c, "tokens_equal": bool(torch.equal(got["tokens"], ref[0])),
                "cand_ids_equal": bool(torch.equal(got["cand_ids"], ref[1]))}
        bad_rows = int(((got["tokens"] != ref[0]).any(-1) | (got["cand_ids"] != ref[1]).flatten(1).any(-1)).sum())
        for name, r in (("tokens", ref[0]), ("cand_ids", ref[1])):
            agree[name][0] += int((got[name] == r).sum())
            agree[name][1] += r.numel()
        d["mismatched_rows"] += bad_rows
        d["rows"] += n
        d["tokens_equal"] &= case["tokens_equal"]
        d["cand_ids_equal"] &= case["cand_ids_equal"]
        if model.head is not None:
            case["anchor_scores_max_abs_err"] = float((got["anchor_scores"] - ref[2]).abs().max())
            case["pair_scores_max_abs_err"] = float((got["pair_scores"] - ref[3]).abs().max())
            for k in ("anchor_scores_max_abs_err", "pair_scores_max_abs_err"):
                d[k] = max(d[k], case[k])
        if tree_nodes:      # the node sets and order; equal scores up to the lattice scores' rounding
            case["tree_equal"] = all(torch.equal(got[name], r) for name, r in zip(TREE_OUTPUTS[:3], ref[4:7]))
            d["tree_equal"] &= case["tree_equal"]
        d["cases"].append(case)
    rep["max_abs_err"] = max([rep["context"]["max_abs_err"]] + [v for k, v in d.items() if k.endswith("_err")])
    rep["token_agreement"] = agree["tokens"][0] / agree["tokens"][1]
    rep["cand_id_agreement"] = agree["cand_ids"][0] / agree["cand_ids"][1]
    return rep


def optimize_onnxruntime(src, dst, level: str = ORT_LEVEL) -> None:
    """Save ONNX Runtime's optimised graph of `src` (functions inlined, fusions applied) to `dst`."""
    ort_session(src, optimized_out=dst, level=level)
    if not Path(dst).is_file():
        raise RuntimeError(f"onnxruntime did not write the optimised model {dst}")


def quantize_onnxruntime(src, dst) -> dict:
    """int8 copy of an ORT-optimised graph: every MatMul / Gemm with a constant weight gets int8
    weights, one scale per output channel, and its activations are quantized per tensor at run time
    (ONNX Runtime dynamic quantization: DynamicQuantizeLinear + MatMulInteger, fused to
    DynamicQuantizeMatMul when the session loads). On a CPU these small-row GEMMs stream their
    weights from memory, so a quarter of the bytes is most of the speed. Returns what changed."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)      # the quantizer logs advice through the root logger
    try:
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul", "Gemm"])
    finally:
        logging.getLogger().setLevel(level)
    if not Path(dst).is_file():
        raise RuntimeError(f"onnxruntime's quantizer did not write {dst}")
    q = onnx.load(str(dst), load_external_data=False)
    ops = [n.op_type for n in q.graph.node]
    return {"bytes": Path(src).stat().st_size, "int8_bytes": Path(dst).stat().st_size,
            "quantized_matmuls": sum(o in ("MatMulInteger", "DynamicQuantizeMatMul") for o in ops),
            "float_matmuls_left": sum(o in ("MatMul", "Gemm", "FusedMatMul") for o in ops)}


# ------------------------------------------------------------------------------ tensorrt
def _inspect_plan(trt, plan: bytes) -> dict | None:
    """Engine-inspector layer info; needs a GPU to deserialize (None here on a CPU-only machine)."""
    import shutil

    if not (Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi")):
        return None
    try:
        engine = trt.Runtime(trt.Logger(trt.Logger.ERROR)).deserialize_cuda_engine(plan)
        if engine is None:
            return None
        insp = engine.create_engine_inspector()
        info = json.loads(insp.get_engine_information(trt.LayerInformationFormat.JSON))
        layers = info.get("Layers", [])
        names = [ly if isinstance(ly, str) else json.dumps(ly) for ly in layers]
        return {"num_layers": len(layers),
                "plugin_layers": [n[:200] for n in names if "lilicorr" in n or "Plugin" in n]}
    except Exception as e:  # pragma: no cover - GPU only
        return {"error": str(e)}


def _trt_profiles(proto, max_batch: int, max_context: int) -> dict:
    """(min, opt, max) shape per input: dim 0 = rows, any other dynamic dim = context length."""
    prof = {}
    for vi in proto.graph.input:
        dims = _dims(vi)

        def shape(n, c):
            return tuple((n if j == 0 else c) if not isinstance(d, int) or d == 0 else d
                         for j, d in enumerate(dims))
        prof[vi.name] = (shape(1, 1), shape(min(8, max_batch), min(256, max_context)),
                         shape(max_batch, max_context))
    return prof


def build_trt_plans(tmp: Path, backend: str, context_proto, draft_proto, has_head: bool,
                    max_batch: int, max_context: int, compute_capabilities=None) -> dict:
    """context.plan, draft.plan (plugins) and, for a head on tensorrt-rtx, draft.functions.plan
    (local functions, no plugins registered). Returns the manifest's `tensorrt` section."""
    from lilicorr.plugins.trt_build import build_engine_from_onnx
    from lilicorr.plugins.trt_v3 import load_trt

    trt = load_trt(backend)
    kw = dict(backend=backend, log_level="ERROR")
    if backend == "tensorrt-rtx":
        kw["compute_capabilities"] = compute_capabilities
    variants = [("context", CONTEXT_ONNX, context_proto, "context.plan", False)]
    variants.append(("draft", DRAFT_ONNX, draft_proto, "draft.plan", has_head))
    if has_head and backend == "tensorrt-rtx":
        variants.append(("draft_functions", DRAFT_ONNX, draft_proto, "draft.functions.plan", False))
    plans = {}
    for key, src, proto, out, use_plugins in variants:
        info = build_engine_from_onnx(tmp / src, tmp / out, use_plugins=use_plugins,
                                      profiles=_trt_profiles(proto, max_batch, max_context), **kw)
        data = (tmp / out).read_bytes()
        plans[key] = {
            "file": out, "onnx": src, "use_plugins": use_plugins,
            "plugins": plan_plugins(data),
            "network_plugin_layers": [list(x) for x in info["plugin_layers"]],
            "layer_types": info["layer_types"], "compute_capabilities": info["compute_capabilities"],
            "build_s": info["build_s"], "size_bytes": info["size_bytes"],
            "optimization_profile": {k: [list(s) for s in v] for k, v in (info["optimization_profile"] or {}).items()},
            "inspector": _inspect_plan(trt, data),
        }
    return {"backend": backend, "module": trt.__name__, "version": getattr(trt, "__version__", "?"),
            "max_batch": max_batch, "max_context": max_context, "plans": plans}


# ------------------------------------------------------------------------------ build
@dataclass
class BuildOptions:
    backend: str = "onnxruntime"
    max_batch: int = 32                 # TensorRT optimisation profile: rows
    max_context: int = 2048             # TensorRT optimisation profile: cached context length
    compute_capabilities: list[str] | None = None   # TensorRT-RTX targets (default SM80/86/89/120)
    yarn_factor: float | None = None    # bake YaRN rope scaling into the graphs
    tolerance: float = 1e-3             # max abs error (ORT vs torch) above which the build fails
    dtype: str = "auto"                 # serving dtype of the target recorded in the manifest
    draft_length: str = ""              # serving draft length recorded in the manifest ("", N, auto)
    prompt_lookup: str = "3"            # serving prompt lookup recorded in the manifest (N: longest n-gram, 0: off)
    draft_weights: str = "auto"         # DRAFT_WEIGHTS: the drafter graphs ONNX Runtime serves
    tree_nodes: int = lattice.DEFAULT_TREE_NODES   # rule `tree`'s node budget M built into the draft graph (0: none)
    draft_cases: tuple = DRAFT_CASES
    context_cases: tuple = CONTEXT_CASES
    log: object = field(default=print, repr=False)


def resolve_target(ckpt_dir, target_dir=None) -> Path:
    """--target, else a target path recorded in the checkpoint (meta.json / config.json 'target'
    'path'), else the default CPU target folder when its fingerprint matches."""
    from lilicorr.checkpoint import read_config, target_fingerprint
    from lilicorr.target import TargetConfig

    if target_dir is not None:
        return Path(target_dir)
    ckpt_dir = Path(ckpt_dir)
    cands = []
    for name, get in ((META, lambda d: d.get("target_dir")),
                      (CONFIG, lambda d: (d.get("target") or {}).get("path"))):
        try:
            v = get(json.loads((ckpt_dir / name).read_text()))
        except (OSError, ValueError, AttributeError):
            v = None
        if isinstance(v, str) and v:
            p = Path(v)
            cands.append(p if p.is_absolute() else (ckpt_dir / p))
    for p in cands:
        if (p / "config.json").is_file():
            return p
    _, fingerprint = read_config(ckpt_dir)
    if (DEFAULT_TARGET / "config.json").is_file():
        if target_fingerprint(TargetConfig.from_hf_dir(DEFAULT_TARGET)) == fingerprint:
            return DEFAULT_TARGET
    raise BuildError(f"checkpoint {ckpt_dir} does not record its target folder and the default target "
                     f"({DEFAULT_TARGET}) is absent or does not match; pass --target DIR")


def default_out(ckpt_dir, backend: str) -> Path:
    return REPO / "engines" / f"{Path(ckpt_dir).resolve().name}-{backend}"


def _check_backend(backend: str) -> None:
    """Fail before any work when the backend or its tools are missing."""
    if backend not in BACKENDS:
        raise BuildError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    for mod, why in (("onnx", "ONNX export"), ("onnxscript", "the dynamo ONNX exporter"),
                     ("onnxruntime", "graph optimisation and validation")):
        try:
            __import__(mod)
        except ImportError as e:
            raise BuildError(f"{why} needs the Python package `{mod}`, which is not installed ({e}); "
                             "pip install 'lilicorr[onnx]'") from e
    if backend in ("tensorrt", "tensorrt-rtx"):
        from lilicorr.plugins.trt_v3 import load_trt
        try:
            trt = load_trt(backend)
        except ImportError as e:
            raise BuildError(f"--backend {backend}: {e}") from e
        if backend == "tensorrt-rtx":
            from lilicorr.plugins.trt_build import check_rtx_parser_library
            try:
                check_rtx_parser_library(trt)
            except RuntimeError as e:
                raise BuildError(f"--backend tensorrt-rtx: {e}") from e


def resolve_draft_weights(draft_weights: str, backend: str) -> str:
    """auto -> int8 for the onnxruntime backend, float32 for TensorRT (its int8 needs calibrated
    Q/DQ graphs, which this build does not make)."""
    if draft_weights not in DRAFT_WEIGHTS:
        raise BuildError(f"draft weights {draft_weights!r}: choose from {', '.join(DRAFT_WEIGHTS)}")
    if draft_weights == "auto":
        return "int8" if backend == "onnxruntime" else "float32"
    if draft_weights == "int8" and backend != "onnxruntime":
        raise BuildError(f"int8 draft weights are built for the onnxruntime backend only, not {backend}")
    return draft_weights


def _check_out(out: Path, ckpt_dir: Path, target_dir: Path) -> None:
    out_r = out.resolve()
    for what, p in (("checkpoint", ckpt_dir), ("target", target_dir)):
        p = p.resolve()
        if out_r == p or p.is_relative_to(out_r):
            raise BuildError(f"--out {out} would replace the {what} directory {p}")
    if out.exists():
        if not out.is_dir():
            raise BuildError(f"--out {out} exists and is not a directory")
        if any(out.iterdir()) and not (out / MANIFEST).is_file():
            raise BuildError(f"refusing to write an engine over {out}: it is a non-empty directory "
                             f"that is not an engine directory (no {MANIFEST})")


def _tool_versions(backend: str) -> dict:
    import importlib.metadata as md

    tools = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("onnx", "onnxruntime", "onnxscript", "transformers"):
        try:
            tools[mod] = md.version(mod)
        except md.PackageNotFoundError:
            pass
    for dist, key in (("tensorrt-rtx-cu12", "tensorrt_rtx"), ("tensorrt", "tensorrt")):
        try:
            tools[key] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    try:
        tools["lilicorr"] = md.version("lilicorr")
    except md.PackageNotFoundError:
        pass
    return tools


def _yaml_scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))          # a JSON string is a valid YAML scalar


def llm_api_yaml(target_path: str, ckpt_path: str, cfg, max_batch: int, max_seq_len: int) -> str:
    """model.yaml for TensorRT-LLM's `llmapi` Triton model: top-level keys are `LLM(**args)`
    arguments; `triton_config` and `lilicorr` are popped before the call (see engines/README.md)."""
    d, h = cfg.drafter, cfg.head
    lines = [
        "# TensorRT-LLM LLM-API configuration for this LiLiCorr engine (NGC container path).",
        "# Consumed by TensorRT-LLM's `llmapi` Triton model (triton_backend/all_models/llmapi/",
        "# tensorrt_llm/1/model.yaml): every top-level key except `triton_config` and `lilicorr`",
        "# is an argument of tensorrt_llm.LLM(**args) (PyTorch backend). The drafter is a",
        "# DFlash-family speculative model; the `lilicorr` section is read by LiLiCorr's subclass of",
        "# the DFlash worker (top-K lattice reranking) and must be popped before LLM(**args).",
        f"model: {_yaml_scalar(target_path)}",
        f"tokenizer: {_yaml_scalar(target_path)}",
        'backend: "pytorch"',
        "tensor_parallel_size: 1",
        "pipeline_parallel_size: 1",
        f"max_batch_size: {max_batch}",
        f"max_seq_len: {max_seq_len}",
        "speculative_config:",
        '  decoding_type: "DFlash"',
        f"  max_draft_len: {d.block_size - 1}  # S = B - 1 drafted slots per block",
        f"  speculative_model_dir: {_yaml_scalar(ckpt_path)}",
        "lilicorr:",
        f"  block_size: {d.block_size}  # B = anchor + S slots",
        f"  top_k: {h.top_k}  # K candidates per slot",
        f"  sigma: {h.sigma}  # Eq. 1 cosine scale",
        f"  target_layer_ids: [{', '.join(str(i) for i in d.target_layer_ids)}]  # captured target layers",
        f"  decode_rule: {_yaml_scalar('argmax' if cfg.vanilla else 'lilicorr')}",
        f"  has_head: {_yaml_scalar(not cfg.vanilla)}",
        '  plugin_namespace: "lilicorr"',
        "triton_config:",
        "  max_batch_size: 0",
        "  decoupled: true",
        "",
    ]
    return "\n".join(lines)


def build_engine_dir(ckpt_dir, target_dir=None, out_dir=None, opts: BuildOptions | None = None) -> Path:
    """Checkpoint -> engine directory (appears atomically; on any error nothing is left)."""
    from lilicorr import checkpoint as ckpt_io
    from lilicorr.model import LiLiCorrModel
    from lilicorr.target import TargetConfig, load_target

    opts = opts or BuildOptions()
    log = opts.log or (lambda *a, **k: None)
    t_start = time.perf_counter()
    _check_backend(opts.backend)
    draft_weights = resolve_draft_weights(opts.draft_weights, opts.backend)
    try:
        prompt_lookup = parse_prompt_lookup(opts.prompt_lookup)
    except ValueError as e:
        raise BuildError(f"--prompt-lookup: {e}") from None
    ckpt_dir = Path(ckpt_dir)
    cfg, fingerprint = ckpt_io.read_config(ckpt_dir)            # CheckpointError: missing / corrupt
    ckpt_io.read_meta(ckpt_dir)
    target_dir = resolve_target(ckpt_dir, target_dir)
    if not (Path(target_dir) / "config.json").is_file():
        raise BuildError(f"--target {target_dir}: not an HF folder (config.json missing)")
    ckpt_io.check_target(ckpt_dir, fingerprint, TargetConfig.from_hf_dir(target_dir))
    out = Path(out_dir) if out_dir is not None else default_out(ckpt_dir, opts.backend)
    _check_out(out, ckpt_dir, Path(target_dir))

    state = ckpt_io.load_state_dict(ckpt_dir)                   # CheckpointError: truncated weights
    log(f"[build] target {target_dir}")
    target = load_target(target_dir, dtype=torch.float32, yarn_factor=opts.yarn_factor)
    model = LiLiCorrModel(cfg, target)
    ckpt_io.load_into(model, {k: v.float() for k, v in state.items()}, ckpt_dir)
    model = model.float().eval().requires_grad_(False)
    has_head = model.head is not None
    weights_sha = file_sha256(ckpt_dir / WEIGHTS)

    def fill(tmp: Path):
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)           # mkdtemp makes it 0700; an engine dir is shared like any folder
        t0 = time.perf_counter()
        log("[build] exporting context.onnx (torch.onnx dynamo)")
        ctx_proto = export_context(model, tmp / CONTEXT_ONNX)
        log("[build] exporting draft.onnx and its parts (torch.onnx dynamo)")
        tree_nodes = opts.tree_nodes if has_head else 0
        draft_proto, part_protos = export_draft(model, tmp / DRAFT_ONNX, parts_dir=tmp, tree_nodes=tree_nodes)
        t_export = time.perf_counter() - t0
        part_files = {p: tmp / DRAFT_PART_FILES[p] for p in DRAFT_PARTS if p in part_protos}
        draft_summary = graph_summary(draft_proto)
        ops = sorted({n["op_type"] for n in draft_summary["custom_nodes"]})
        want = (["DraftTree"] if tree_nodes else []) + (["GreedyWalk", "LatticeMatch"] if has_head else [])
        if ops != want:
            raise RuntimeError(f"draft graph has custom nodes {ops}, expected {want}")
        log("[build] validating ONNX Runtime against PyTorch")
        validation = validate_onnxruntime(model, tmp / CONTEXT_ONNX, tmp / DRAFT_ONNX,
                                          opts.draft_cases, opts.context_cases, tree_nodes)
        validation["tolerance"] = opts.tolerance
        if validation["max_abs_err"] > opts.tolerance:
            raise BuildError(f"ONNX Runtime differs from PyTorch by {validation['max_abs_err']:.3g} "
                             f"(> tolerance {opts.tolerance}); the export is wrong")
        if not (validation["draft"]["tokens_equal"] and validation["draft"]["cand_ids_equal"]):
            log(f"[build] WARNING: {validation['draft']['mismatched_rows']} of {validation['draft']['rows']} "
                "sample rows differ in drafted tokens / candidates (near-ties in top-K?)")
        validation["split"] = validate_split(model, tmp / DRAFT_ONNX, part_files, opts.draft_cases)
        if not validation["split"]["bit_identical"]:
            raise BuildError("the draft parts chained in ONNX Runtime differ from draft.onnx "
                             f"(max abs diff {validation['split']['max_abs_diff']:.3g}); the split is wrong")
        manifest_ort = None
        if opts.backend == "onnxruntime":
            log(f"[build] optimising for ONNX Runtime ({ORT_LEVEL})")
            files = {}
            sources = [("context", CONTEXT_ONNX), ("draft", DRAFT_ONNX)]
            sources += [(f"draft_{p}", DRAFT_PART_FILES[p]) for p in part_files]
            fused = {}
            for graph, src in sources:
                dst = src.replace(".onnx", ORT_SUFFIX)
                optimize_onnxruntime(tmp / src, tmp / dst)
                fused[graph] = fuse_file(tmp / dst)       # RMSNorm chains -> one kernel each
                files[graph] = dst
            val_opt = validate_onnxruntime(model, tmp / files["context"], tmp / files["draft"],
                                           opts.draft_cases, opts.context_cases, tree_nodes)
            if val_opt["max_abs_err"] > opts.tolerance:
                raise BuildError(f"the ORT-optimised graphs differ from PyTorch by {val_opt['max_abs_err']:.3g}")
            val_opt["split"] = check_split_drafts(model, tmp, files, opts.draft_cases, "ORT-optimised")
            validation["optimized"] = val_opt
            quantized = None
            if draft_weights == "int8":
                log("[build] int8 draft weights (ONNX Runtime dynamic quantization)")
                quantized = {}
                for graph, src in list(files.items()):
                    dst = src.replace(ORT_SUFFIX, INT8_SUFFIX)
                    quantized[graph] = {"file": dst, **quantize_onnxruntime(tmp / src, tmp / dst)}
                    files[graph] = dst
                val_q = validate_onnxruntime(model, tmp / files["context"], tmp / files["draft"],
                                             opts.draft_cases, opts.context_cases, tree_nodes)
                if val_q["token_agreement"] < INT8_MIN_TOKEN_AGREEMENT:
                    raise BuildError(f"the int8 draft graph drafts {val_q['token_agreement']:.0%} of the "
                                     "sample tokens PyTorch drafts; the quantization is broken")
                val_q["split"] = check_split_drafts(model, tmp, files, opts.draft_cases, "int8")
                validation["int8"] = val_q
            import onnxruntime as ort
            manifest_ort = {"files": files, "graph_optimization_level": ORT_LEVEL, "fused_rms_norms": fused,
                            "session_level": "ORT_ENABLE_ALL", "providers": ["CPUExecutionProvider"],
                            "version": ort.__version__, "draft_weights": draft_weights,
                            "quantized": quantized}
        trt_section = None
        if opts.backend in ("tensorrt", "tensorrt-rtx"):
            log(f"[build] building {opts.backend} plans")
            trt_section = build_trt_plans(tmp, opts.backend, ctx_proto, draft_proto, has_head,
                                          opts.max_batch, opts.max_context, opts.compute_capabilities)
            if has_head and sorted(trt_section["plans"]["draft"]["plugins"]) != want:
                raise RuntimeError(f"draft.plan carries plugins {trt_section['plans']['draft']['plugins']}, "
                                   f"expected {', '.join(want)}")
        # target side + config + manifest
        tpath = portable_path(target_dir, out)
        cpath = portable_path(ckpt_dir, out)
        doc = {"lilicorr": cfg.to_dict(), "target": fingerprint}
        (tmp / CONFIG).write_text(json.dumps(doc, indent=2, sort_keys=True))
        (tmp / "model.yaml").write_text(llm_api_yaml(str(Path(target_dir).resolve()), str(ckpt_dir.resolve()),
                                                     cfg, opts.max_batch, min(opts.max_context,
                                                                              target.config.max_position_embeddings)))
        d, h = cfg.drafter, cfg.head
        files = {}
        for f in sorted(tmp.iterdir()):
            if f.is_file():
                files[f.name] = {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
        ctx_summary = graph_summary(ctx_proto)
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "backend": opts.backend,
            "target_dir": tpath, "ckpt": cpath,
            "block_size": d.block_size, "top_k": h.top_k, "sigma": h.sigma, "has_head": has_head,
            "dtype": "float32",
            "draft_weights": draft_weights,     # of the graphs the engine serves (onnxruntime.files)
            # how to serve this engine: target precision ("auto": lilicorr.target.resolve_precision on the
            # serving machine) and draft length ("" = the whole block, N, or "auto"); ServeOptions override them
            "serving": {"dtype": opts.dtype, "draft_length": str(opts.draft_length or ""),
                        "tree_nodes": tree_nodes or None, "prompt_lookup": str(prompt_lookup)},
            "draft_vocab_size": d.draft_vocab_size,
            "checkpoint": {"path": cpath, "sha256": weights_sha, "config_sha256": file_sha256(ckpt_dir / CONFIG),
                           "step": ckpt_io.read_meta(ckpt_dir).get("step")},
            "target": {"path": tpath, **target_record(target, target_dir), "yarn_factor": opts.yarn_factor},
            "shapes": {"H": d.hidden_size, "n": d.num_target_layers_captured, "layers": d.num_layers,
                       "heads": d.num_heads, "kv_heads": d.num_kv_heads, "head_dim": d.head_dim,
                       "V": d.vocab_size, "B": d.block_size, "S": d.block_size - 1,
                       "K": h.top_k, "E": None if cfg.vanilla else h.embed_dim,
                       "target_layer_ids": list(d.target_layer_ids)},
            "config": cfg.to_dict(),
            "opset": OPSET,
            "onnx": {"exporter": "torch.onnx.export(dynamo=True)", "opset": OPSET,
                     "custom_ops": ops, "plugin_namespace": lattice.ONNX_DOMAIN,
                     "plugin_version": lattice.PLUGIN_VERSION,
                     "local_functions": draft_summary["local_functions"]},
            "graphs": {"context": {"file": CONTEXT_ONNX, **ctx_summary},
                       "draft": {"file": DRAFT_ONNX, **draft_summary},
                       **{f"draft_{p}": {"file": DRAFT_PART_FILES[p], "part_of": DRAFT_ONNX,
                                         "stage": DRAFT_PART_STAGES[p], **graph_summary(proto)}
                          for p, proto in ((p, part_protos[p]) for p in part_files)}},
            "onnxruntime": manifest_ort,
            "tensorrt": trt_section,
            "validation": validation,
            "llm_api_config": "model.yaml",
            "tools": _tool_versions(opts.backend),
            "build": {"export_s": round(t_export, 2), "total_s": None, "argv": sys.argv},
            "files": files,
        }
        manifest["build"]["total_s"] = round(time.perf_counter() - t_start, 2)
        write_manifest(tmp, manifest)

    atomic_dir(out, fill)
    log(f"[build] wrote {out}")
    return out


__all__ = ["BuildError", "BuildOptions", "ContextGraph", "DraftGraph", "build_engine_dir", "export_context",
           "export_draft", "split_draft", "validate_split", "validate_onnxruntime", "optimize_onnxruntime",
           "quantize_onnxruntime", "resolve_draft_weights", "plan_plugins", "resolve_target",
           "default_out", "CheckpointError", "EngineDirError"]
