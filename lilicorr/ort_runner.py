"""Draft runners over a built engine directory: ONNX Runtime (CPU) and TensorRT (GPU).

Same interface as `lilicorr.draft_runner.TorchDraftRunner`. The drafter's context cache stays
outside the graphs, in a `KVCache` (one slot per sequence, ragged lengths, rollback by length):

    append_context: captured target features [N, T, n, H] + positions --context graph-->
                    per-layer K/V [N, h, T, D] -> written to the cache at each row's length
    draft:          anchors, positions, cached K/V [N, h, C, D] + lengths [N], target state
                    --draft graph--> tokens [N, S] (greedy walk), cand_ids [N, S, K],
                    anchor_scores [N, K], pair_scores [N, S-1, K, K] and, in engines built with
                    a tree budget M, rule `tree`'s draft tree (lilicorr::DraftTree) of M nodes

Under ONNX Runtime the draft graph runs as its parts (`lilicorr.export.split_draft`), one
session each and each under its own stage of the stage table: backbone -> slot_hidden
(STAGE_DRAFT), LM head -> slot_logits (STAGE_LM_HEAD), top-K + head + LatticeMatch + GreedyWalk
-> tokens (STAGE_HEAD), the same boundaries as the torch runner's, and in engines with a tree
budget the tree part (DraftTree, STAGE_HEAD), run only when a row drafts for rule `tree`. The
chain is bit-identical to the whole graph (checked at build time). The TensorRT plans keep the
whole graph; its stage is titled as backbone + LM head + head.

Decode rules are applied on the host from the outputs: lilicorr = the graph's greedy walk,
argmax = cand_ids[..., 0], viterbi = lilicorr.lattice.viterbi on the scores.
"""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from lilicorr import lattice
from lilicorr.draft_runner import ContextCacheRunner, pad_ragged
from lilicorr.engine_dir import EngineDirError, lilicorr_config
from lilicorr.kv_cache import KVCache
from lilicorr.model import Proposal
from lilicorr.profiling import STAGE_DRAFT, STAGE_HEAD, STAGE_LM_HEAD, stage


def context_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    outs = [f"{kv}_{i}" for i in range(num_layers) for kv in ("ctx_k", "ctx_v")]
    return ["captured", "positions"], outs


TREE_OUTPUTS = ("tree_parent", "tree_depth", "tree_cand", "tree_score")   # lilicorr::DraftTree, rule `tree`


def draft_io_names(num_layers: int, has_head: bool, tree: bool = False) -> tuple[list[str], list[str]]:
    ins = ["anchor_ids", "anchor_pos", "ctx_lengths"]
    ins += [f"{kv}_{i}" for i in range(num_layers) for kv in ("ctx_k", "ctx_v")]
    outs = ["tokens", "cand_ids"]
    if has_head:
        ins.append("target_state")
        outs += ["anchor_scores", "pair_scores"]
        if tree:
            outs += list(TREE_OUTPUTS)
    return ins, outs


# ------------------------------------------------------------------------------ sessions
def ort_threads(threads: int | None = None) -> int:
    """Intra-op threads of the drafter's sessions: `threads`, else $LILICORR_ORT_THREADS, else
    torch's intra-op thread count (the engine's thread budget)."""
    if threads is None:
        env = os.environ.get("LILICORR_ORT_THREADS", "").strip()
        threads = int(env) if env else torch.get_num_threads()
    if threads < 1:
        raise ValueError(f"ONNX Runtime threads must be >= 1, got {threads}")
    return threads


def ort_session(path, optimize: bool = True, threads: int | None = None, optimized_out=None,
                level: str = "ORT_ENABLE_ALL", profile_prefix=None):
    """An ONNX Runtime CPU session; `optimized_out` saves the optimised graph there; with
    `profile_prefix` ONNX Runtime's profiler is on and `end_profiling()` writes under that prefix.

    Threads: `threads`, else $LILICORR_ORT_THREADS, else torch's intra-op thread count. The drafter
    runs between target forwards on the same cores, never beside them, so it gets the same thread
    budget as torch, and its pool threads do not spin-wait after a run ($LILICORR_ORT_SPIN=1 lets
    them): with ONNX Runtime's defaults (a thread per core, spinning) a 2-core machine at 1 torch
    thread lost about 40 ms of every drafted block to the drafter's idle threads, most of it in the
    target's verify (results/ort_threads_cpu.md)."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise ImportError("the onnxruntime draft backend needs the `onnxruntime` package "
                          "(pip install 'lilicorr[onnx]')") from e
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level if optimize else "ORT_DISABLE_ALL")
    so.intra_op_num_threads = ort_threads(threads)
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", os.environ.get("LILICORR_ORT_SPIN", "0"))
    so.log_severity_level = 3
    if profile_prefix is not None:
        so.enable_profiling, so.profile_file_prefix = True, str(profile_prefix)
    if optimized_out is not None:
        so.optimized_model_filepath = str(optimized_out)
        if Path(str(path) + ".data").is_file():     # weights > 2 GB stay in an external file
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                        Path(optimized_out).name + ".data")
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                        "1024")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


class OrtSession:
    """dict of torch tensors in -> dict of torch tensors out (feeds the session does not read are
    ignored, so one dict can feed a chain of sessions)."""

    def __init__(self, path, threads: int | None = None):
        self.sess = ort_session(path, threads=threads)
        self.inputs = [i.name for i in self.sess.get_inputs()]
        self.outputs = [o.name for o in self.sess.get_outputs()]

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        arrays = {k: np.ascontiguousarray(feeds[k].detach().cpu().numpy()) for k in self.inputs}
        return {k: torch.from_numpy(v) for k, v in zip(self.outputs, self.sess.run(self.outputs, arrays))}


def run_draft_parts(sessions, feeds: dict[str, torch.Tensor], stages=None) -> dict[str, torch.Tensor]:
    """Run the parts of a split draft graph in order (backbone, LM head, head), each reading what
    it needs from the feeds and the earlier parts' outputs; each under its stage when `stages` is
    given. Returns every tensor produced."""
    pool = dict(feeds)
    for i, sess in enumerate(sessions):
        if stages is None:
            pool.update(sess.run(pool))
        else:
            with stage(stages[i]):
                pool.update(sess.run(pool))
    return {k: v for k, v in pool.items() if k not in feeds}


class TensorRTSession:
    """A serialized TensorRT / TensorRT-RTX engine run on CUDA torch tensors (needs a GPU; the
    lilicorr IPluginV3 creators are registered first so plugin layers deserialize)."""

    def __init__(self, plan_path, backend: str):
        from lilicorr.plugins.trt_v3 import load_trt, register_v3_plugins

        trt = load_trt(backend)                       # ImportError naming the module if missing
        if not torch.cuda.is_available():
            raise RuntimeError(f"running a {backend} engine needs a CUDA GPU and a CUDA build of torch; "
                               "on this machine use draft backend 'onnxruntime' (same engine directory)")
        register_v3_plugins(trt)
        self.trt = trt
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(
            Path(plan_path).read_bytes())
        if self.engine is None:
            raise EngineDirError(f"{plan_path}: {backend} could not deserialize the plan (see the log above)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) != mode]
        dt = trt.DataType
        self._dtype = {dt.FLOAT: torch.float32, dt.HALF: torch.float16, dt.BF16: torch.bfloat16,
                       dt.INT64: torch.int64, dt.INT32: torch.int32, dt.BOOL: torch.bool}

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        keep = []
        for name in self.inputs:
            t = feeds[name].to("cuda", self._dtype[self.engine.get_tensor_dtype(name)]).contiguous()
            keep.append(t)
            self.context.set_input_shape(name, tuple(t.shape))
            self.context.set_tensor_address(name, t.data_ptr())
        outs = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            outs[name] = torch.empty(shape, dtype=self._dtype[self.engine.get_tensor_dtype(name)], device="cuda")
            self.context.set_tensor_address(name, outs[name].data_ptr())
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        stream.synchronize()
        return {k: v.cpu() for k, v in outs.items()}


# ------------------------------------------------------------------------------ runner
class GraphDraftRunner(ContextCacheRunner):
    """Runner over the graphs of an engine directory. `sessions` = (context, draft) where draft is
    one session for the whole draft graph, or a list of sessions for its parts (backbone, LM head,
    head[, tree]; see `lilicorr.export.split_draft`), each timed under its own stage. A whole graph is
    timed as one stage, STAGE_DRAFT, marked as including the LM head and the head
    (`profiling.stage(..., includes=...)`), so the stage table labels it as what it is."""

    fused_label = "one graph"

    def __init__(self, manifest: dict, sessions, num_slots: int, capacity: int = 256):
        cfg = lilicorr_config(manifest)
        d = cfg.drafter
        self.manifest = manifest
        self.model = SimpleNamespace(cfg=cfg)          # the engine reads model.cfg.drafter.target_layer_ids
        self._has_head = not cfg.vanilla
        self._ctx, self._draft = sessions
        self._split = isinstance(self._draft, (list, tuple))
        self.num_layers = d.num_layers
        self._ctx_out = context_io_names(d.num_layers)[1]
        self.cache = KVCache(d.num_layers, num_slots, d.num_kv_heads, d.head_dim, capacity, torch.float32, "cpu")

    @property
    def block_size(self) -> int:
        return self.model.cfg.drafter.block_size

    @property
    def has_head(self) -> bool:
        return self._has_head

    @torch.no_grad()
    def append_context(self, slots: torch.Tensor, feats: list[torch.Tensor], start_pos: torch.Tensor) -> None:
        """slots [N]; feats[i] [T_i, n, H] target features at positions start_pos[i] + t."""
        slots, start_pos = slots.cpu(), start_pos.cpu()        # the context cache lives on the host
        x, valid = pad_ragged([f.cpu() for f in feats])                         # [N, T, n, H]
        pos = start_pos[:, None].long() + torch.arange(x.shape[1])[None, :]     # [N, T]
        out = self._ctx.run({"captured": x.float(), "positions": pos})
        self.cache.reserve(slots, x.shape[1])
        plan = self.cache.write_plan(slots, self.cache.lengths[slots], x.shape[1], valid)
        for layer in range(self.num_layers):
            k, v = out[f"ctx_k_{layer}"], out[f"ctx_v_{layer}"]                 # [N, h, T, D]
            self.cache.write(layer, slots, k.transpose(1, 2), v.transpose(1, 2), plan=plan)
        self.cache.advance(slots, valid)

    @torch.no_grad()
    def draft(self, slots: torch.Tensor, anchors: torch.Tensor, anchor_pos: torch.Tensor,
              target_state: torch.Tensor, rules: list[str], tree: bool = False) -> Proposal:
        """slots/anchors/anchor_pos [N]; target_state [N, n, H]; rules: one decode rule per row;
        tree: also build rule `tree`'s draft tree (the whole graph always builds it, a split graph
        runs its tree part only when asked)."""
        bad = [r for r in rules if r not in ("lilicorr", "viterbi", "argmax")]
        if bad:
            raise ValueError(f"unknown decode rule {bad[0]!r} for a draft runner; choose from lilicorr, viterbi, argmax")
        if not self._has_head and any(r != "argmax" for r in rules):
            raise ValueError("decode rules lilicorr/viterbi need a LiLiCorr head; this engine is vanilla DFlash")
        slots, anchors, anchor_pos, target_state = (t.cpu() for t in (slots, anchors, anchor_pos, target_state))
        fused = () if self._split else (STAGE_LM_HEAD, STAGE_HEAD)
        with stage(STAGE_DRAFT, includes=fused, label=self.fused_label):
            lengths = self.cache.lengths[slots]
            upto = max(int(lengths.max()), 1)        # the graph needs C >= 1 (masked when length 0)
            idx = self.cache.row_index(slots)
            feeds = {"anchor_ids": anchors.long(), "anchor_pos": anchor_pos.long(), "ctx_lengths": lengths.clone()}
            for layer in range(self.num_layers):
                k, v = self.cache.read(layer, idx, upto)                          # [N, h, C, D]
                feeds[f"ctx_k_{layer}"], feeds[f"ctx_v_{layer}"] = k, v
            if self._has_head:
                feeds["target_state"] = target_state.float()
            if self._split:
                backbone, lm_head, head, *tree_part = self._draft
                feeds.update(backbone.run(feeds))
            else:
                out = self._draft.run(feeds)
        if self._split:
            with stage(STAGE_LM_HEAD):
                feeds.update(lm_head.run(feeds))
        with stage(STAGE_HEAD):
            if self._split:
                out = head.run(feeds)
                if tree and tree_part:
                    out.update(tree_part[0].run(out))
            cand_ids = out["cand_ids"].long()                                      # [N, S, K]
            tokens = out["tokens"].long().clone()                                  # [N, S]
            a_s, p_s = out.get("anchor_scores"), out.get("pair_scores")
            arg = [i for i, r in enumerate(rules) if r == "argmax"]
            if arg:
                tokens[arg] = cand_ids[arg, :, 0]
            vit = [i for i, r in enumerate(rules) if r == "viterbi"]
            if vit:
                path = lattice.viterbi(a_s[vit], p_s[vit])                         # [M, S]
                tokens[vit] = torch.gather(cand_ids[vit], -1, path[..., None]).squeeze(-1)
            tree = None
            if TREE_OUTPUTS[0] in out:
                tree = lattice.DraftTree(*(out[name] for name in TREE_OUTPUTS))
        return Proposal(tokens=tokens, cand_ids=cand_ids, anchor_scores=a_s, pair_scores=p_s, tree=tree)


DRAFT_PART_GRAPHS = ("draft_backbone", "draft_lm_head", "draft_head")   # manifest["graphs"] keys
DRAFT_TREE_GRAPH = "draft_tree"             # the fourth part, in engines built with a tree budget


class OrtDraftRunner(GraphDraftRunner):
    """ONNX Runtime (CPU) over the engine's graphs: the ORT-optimised copies when the engine was
    built for onnxruntime, else the portable ones (local functions). The draft graph runs as its
    parts (one session each: backbone, LM head, head, and the draft tree in engines with a tree
    budget) when the engine has them (engines built before the split have only the whole graph:
    one session, labelled as such; in engines built before the tree part, the head builds the tree)."""

    fused_label = "one ONNX Runtime graph"

    def __init__(self, engine_dir, manifest: dict, num_slots: int, capacity: int = 256,
                 threads: int | None = None):
        engine_dir = Path(engine_dir)
        ort_files = (manifest.get("onnxruntime") or {}).get("files") or {}
        graphs = manifest["graphs"]

        def path(graph):
            name = ort_files.get(graph) or graphs[graph]["file"]
            if not (engine_dir / name).is_file():
                raise EngineDirError(f"engine {engine_dir} is incomplete: {name} is missing")
            return engine_dir / name

        ctx = OrtSession(path("context"), threads)
        if all(g in graphs for g in DRAFT_PART_GRAPHS):
            draft = [OrtSession(path(g), threads) for g in DRAFT_PART_GRAPHS + (DRAFT_TREE_GRAPH,) if g in graphs]
        else:
            draft = OrtSession(path("draft"), threads)
        super().__init__(manifest, [ctx, draft], num_slots, capacity)


class TensorRTDraftRunner(GraphDraftRunner):
    """The engine's TensorRT / TensorRT-RTX plans (GPU only; the draft plan with the plugins). The
    draft plan is the whole graph, so its stage is labelled as backbone + LM head + head."""

    fused_label = "one TensorRT plan"

    def __init__(self, engine_dir, manifest: dict, num_slots: int, capacity: int = 256):
        engine_dir = Path(engine_dir)
        backend = manifest["backend"]
        plans = (manifest.get("tensorrt") or {}).get("plans") or {}
        sessions = []
        for graph in ("context", "draft"):
            if graph not in plans:
                raise EngineDirError(f"engine {engine_dir} has no {graph} plan for {backend}")
            sessions.append(TensorRTSession(engine_dir / plans[graph]["file"], backend))
        super().__init__(manifest, sessions, num_slots, capacity)
