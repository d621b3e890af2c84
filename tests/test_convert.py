"""convert/build_engine.py, lilicorr.export, lilicorr.engine_dir and the ONNX Runtime draft runner.

Fast tests build one onnxruntime engine from an untrained checkpoint on the tiny Llama target
(module fixture, ~30 s). TensorRT-RTX builds and the SmolLM2 check are marked slow.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from lilicorr import checkpoint as ckpt_io
from lilicorr import lattice as L
from lilicorr.engine_dir import EngineDirError, make_runner, read_manifest
from lilicorr.model import untrained_model
from lilicorr.target import load_target

onnx = pytest.importorskip("onnx", reason="the onnx extra is not installed")
pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
pytest.importorskip("onnxscript", reason="the dynamo ONNX exporter needs onnxscript")

from lilicorr.export import BuildError, BuildOptions, build_engine_dir, plan_plugins  # noqa: E402

from spec_helpers import load_script  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 5, 9, 12, 40], [1, 7, 7, 30], [1, 44, 50, 51, 52, 53, 54, 60, 61]]


def _cli():
    return load_script(REPO / "convert" / "build_engine.py", "build_engine_cli")


def _save_untrained(target_dir: Path, out: Path, vanilla: bool = False, seed: int = 0) -> Path:
    target = load_target(target_dir)
    model = untrained_model(target, seed=seed, vanilla=vanilla)
    return ckpt_io.save_checkpoint(out, model.cfg, model.state_dict(), target.config, {"step": 0})


@pytest.fixture(scope="module")
def llama_dir(tiny_target_dir):
    return tiny_target_dir("llama")


@pytest.fixture(scope="module")
def tiny_ckpt(llama_dir, tmp_path_factory):
    return _save_untrained(llama_dir, tmp_path_factory.mktemp("convert") / "ckpt-tiny")


@pytest.fixture(scope="module")
def ort_engine(llama_dir, tiny_ckpt, tmp_path_factory):
    """float32 draft weights: the exact compiled copy of the PyTorch drafter (int8: `int8_engine`)."""
    out = tmp_path_factory.mktemp("engines") / "tiny-onnxruntime"
    return build_engine_dir(tiny_ckpt, llama_dir, out, BuildOptions(log=None, draft_weights="float32"))


@pytest.fixture(scope="module")
def int8_engine(llama_dir, tiny_ckpt, tmp_path_factory):
    """The onnxruntime default: int8 draft weights."""
    out = tmp_path_factory.mktemp("engines") / "tiny-int8"
    return build_engine_dir(tiny_ckpt, llama_dir, out, BuildOptions(log=None))


# ------------------------------------------------------------------------------ build + manifest
def test_manifest_fields(ort_engine, tiny_ckpt, llama_dir):
    m = read_manifest(ort_engine, check_files=True)
    cfg, _ = ckpt_io.read_config(tiny_ckpt)
    assert m["format"] == "lilicorr-engine" and m["backend"] == "onnxruntime"
    assert m["checkpoint"]["sha256"] == ckpt_io.file_sha256(tiny_ckpt / "model.safetensors")
    assert Path(m["checkpoint"]["path"]).resolve() == tiny_ckpt.resolve()   # outside the repo: absolute
    assert Path(m["target_dir"]) == Path(llama_dir).resolve()
    t = m["target"]
    assert t["fingerprint"] == ckpt_io.target_fingerprint(load_target(llama_dir).config)
    assert len(t["tokenizer_sha256"]) == 64 and len(t["frozen_sha256"]) == 64
    d, h = cfg.drafter, cfg.head
    assert m["shapes"] == {"H": 64, "n": d.num_target_layers_captured, "layers": d.num_layers,
                           "heads": d.num_heads, "kv_heads": d.num_kv_heads, "head_dim": d.head_dim,
                           "V": 96, "B": d.block_size, "S": d.block_size - 1, "K": h.top_k,
                           "E": h.embed_dim, "target_layer_ids": d.target_layer_ids}
    assert (m["block_size"], m["top_k"], m["sigma"], m["has_head"]) == (d.block_size, h.top_k, h.sigma, True)
    assert m["opset"] == 20 and m["onnx"]["custom_ops"] == ["DraftTree", "GreedyWalk", "LatticeMatch"]
    for tool in ("torch", "onnx", "onnxruntime", "onnxscript", "python"):
        assert m["tools"][tool]
    assert m["created"].endswith("+00:00")
    assert set(m["files"]) >= {"context.onnx", "draft.onnx", "context.ort.onnx", "draft.ort.onnx",
                               "config.json", "model.yaml"}
    for part in ("backbone", "lm_head", "head"):          # the draft graph's three parts, hashed
        for f in (f"draft.{part}.onnx", f"draft.{part}.ort.onnx"):
            assert len(m["files"][f]["sha256"]) == 64, f
        assert m["graphs"][f"draft_{part}"]["file"] == f"draft.{part}.onnx"
        assert m["onnxruntime"]["files"][f"draft_{part}"] == f"draft.{part}.ort.onnx"
    v = m["validation"]
    assert v["max_abs_err"] < 1e-4 and v["optimized"]["max_abs_err"] < 1e-4
    assert v["draft"]["tokens_equal"] and v["draft"]["cand_ids_equal"]
    assert {c["N"] for c in v["draft"]["cases"]} >= {1, 8} and len({c["C"] for c in v["draft"]["cases"]}) >= 3
    assert v["draft"]["pair_scores_max_abs_err"] < 1e-4
    # the chained parts compute exactly what the whole draft graph computes (portable and optimised)
    for split in (v["split"], v["optimized"]["split"]):
        assert split["bit_identical"] and split["max_abs_diff"] == 0.0 and len(split["cases"]) >= 3
    # the ORT copies run each RMSNorm as one kernel: the context's norm, the drafter layers' and the head's
    fused = m["onnxruntime"]["fused_rms_norms"]
    assert set(fused) == set(m["onnxruntime"]["files"]) and fused["draft_lm_head"] == fused["draft_tree"] == 0
    assert fused["context"] >= 1 and fused["draft_backbone"] >= 3 and fused["draft_head"] >= 3
    assert fused["draft"] == fused["draft_backbone"] + fused["draft_head"]
    for graph, name in m["onnxruntime"]["files"].items():
        ops = [n.op_type for n in onnx.load(str(ort_engine / name), load_external_data=False).graph.node]
        assert ops.count("SimplifiedLayerNormalization") == fused[graph] and "Pow" not in ops, graph
    print(f"\nvalidation max_abs_err: context {v['context']['max_abs_err']:.3g}, anchor_scores "
          f"{v['draft']['anchor_scores_max_abs_err']:.3g}, pair_scores {v['draft']['pair_scores_max_abs_err']:.3g}")


def test_model_yaml(ort_engine, tiny_ckpt):
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load((ort_engine / "model.yaml").read_text())
    cfg, _ = ckpt_io.read_config(tiny_ckpt)
    assert doc["backend"] == "pytorch" and Path(doc["model"]).is_dir()
    assert doc["speculative_config"]["decoding_type"] == "DFlash"
    assert doc["speculative_config"]["max_draft_len"] == cfg.drafter.block_size - 1
    assert doc["lilicorr"]["top_k"] == cfg.head.top_k and doc["lilicorr"]["sigma"] == cfg.head.sigma
    assert doc["lilicorr"]["block_size"] == cfg.drafter.block_size


def test_draft_graph_has_plugin_nodes(ort_engine, tiny_ckpt):
    from lilicorr.plugins.onnx_functions import lilicorr_nodes

    cfg, _ = ckpt_io.read_config(tiny_ckpt)
    model = onnx.load(str(ort_engine / "draft.onnx"))
    onnx.checker.check_model(model)
    nodes = {n.op_type: n for n in lilicorr_nodes(model)}
    assert set(nodes) == {"LatticeMatch", "GreedyWalk", "DraftTree"}
    for n in nodes.values():
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert n.domain == "lilicorr"
        assert attrs["plugin_namespace"] == b"lilicorr" and attrs["plugin_version"] == b"1"
    sigma = onnx.helper.get_attribute_value(next(a for a in nodes["LatticeMatch"].attribute if a.name == "sigma"))
    assert sigma == pytest.approx(cfg.head.sigma)
    num_nodes = onnx.helper.get_attribute_value(next(a for a in nodes["DraftTree"].attribute if a.name == "num_nodes"))
    assert num_nodes == 16 == read_manifest(ort_engine)["serving"]["tree_nodes"]
    assert read_manifest(ort_engine)["serving"]["prompt_lookup"] == "3"      # the converter's default
    assert {(f.domain, f.name) for f in model.functions} == {("lilicorr", "LatticeMatch"), ("lilicorr", "GreedyWalk"),
                                                              ("lilicorr", "DraftTree")}
    # the context graph and the ORT-optimised graphs carry no custom nodes
    for name in ("context.onnx", "draft.ort.onnx"):
        assert not lilicorr_nodes(onnx.load(str(ort_engine / name)))
    inputs = [i.name for i in model.graph.input]
    assert inputs[:3] == ["anchor_ids", "anchor_pos", "ctx_lengths"] and inputs[-1] == "target_state"
    assert [o.name for o in model.graph.output] == ["tokens", "cand_ids", "anchor_scores", "pair_scores",
                                                    "tree_parent", "tree_depth", "tree_cand", "tree_score"]
    assert read_manifest(ort_engine)["validation"]["draft"]["tree_equal"] is True


# ------------------------------------------------------------------------------ runtime
def test_ort_runner_matches_torch_runner(ort_engine, tiny_ckpt, llama_dir):
    """Same appends / rollbacks / drafts on both runners -> identical proposals."""
    from lilicorr.draft_runner import TorchDraftRunner
    from lilicorr.model import load_model
    from lilicorr.ort_runner import OrtDraftRunner

    target = load_target(llama_dir)
    ref = TorchDraftRunner(load_model(tiny_ckpt, target), 4)
    ort = make_runner(ort_engine, target, 4, backend="onnxruntime", target_dir=llama_dir)
    assert isinstance(ort, OrtDraftRunner) and ort.block_size == ref.block_size and ort.has_head
    n = ref.model.cfg.drafter.num_target_layers_captured
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([ref.allocate() for _ in range(3)])
    assert [ort.allocate() for _ in range(3)] == slots.tolist()
    lens = [5, 2, 9]
    for step in range(3):
        feats = [torch.randn(t, n, 64, generator=g) for t in lens]
        start = torch.tensor([ref.context_length(int(s)) for s in slots])
        for r in (ref, ort):
            r.append_context(slots, feats, start)
        if step == 1:   # roll two rows back
            for r in (ref, ort):
                r.truncate(slots[:2], torch.tensor([3, 4]))
        anchors = torch.randint(0, 96, (3,), generator=g)
        apos = torch.tensor([ref.context_length(int(s)) for s in slots])
        state = torch.randn(3, n, 64, generator=g)
        rules = [["lilicorr", "viterbi", "argmax"], ["viterbi"] * 3, ["lilicorr"] * 3][step]
        a = ref.draft(slots, anchors, apos, state, rules, tree=True)
        b = ort.draft(slots, anchors, apos, state, rules, tree=step > 0)
        assert torch.equal(a.cand_ids, b.cand_ids) and torch.equal(a.tokens, b.tokens), step
        if step == 0:      # no tree row: the tree part does not run
            assert b.tree is None
        else:              # the graph's draft tree (lilicorr::DraftTree) is the torch reference's on its scores
            want = L.build_tree(b.anchor_scores, b.pair_scores, 16)
            assert a.tree is None and all(torch.equal(x, y) for x, y in zip(
                (b.tree.parent, b.tree.depth, b.tree.cand), (want.parent, want.depth, want.cand))), step
        assert [ref.context_length(int(s)) for s in slots] == [ort.context_length(int(s)) for s in slots]
        lens = [1, 3, 2]
    ort.free(int(slots[0]))
    assert ort.allocate() == int(slots[0]) and ort.context_length(int(slots[0])) == 0


def test_ort_sessions_take_torch_threads_and_do_not_spin(ort_engine, llama_dir, monkeypatch):
    """The drafter's sessions run between target forwards on the same cores: they take torch's
    intra-op thread count (or $LILICORR_ORT_THREADS) and their pool threads do not spin-wait."""
    monkeypatch.delenv("LILICORR_ORT_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        for threads, env in ((1, None), (2, None), (1, "2")):
            torch.set_num_threads(threads)
            if env is None:
                monkeypatch.delenv("LILICORR_ORT_THREADS", raising=False)
            else:
                monkeypatch.setenv("LILICORR_ORT_THREADS", env)
            runner = make_runner(ort_engine, load_target(llama_dir), 2, backend="onnxruntime",
                                 target_dir=llama_dir)
            for sess in [runner._ctx, *runner._draft]:
                so = sess.sess.get_session_options()
                assert so.intra_op_num_threads == int(env or threads)
                assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    finally:
        torch.set_num_threads(before)
    from lilicorr.ort_runner import ort_threads
    with pytest.raises(ValueError, match=">= 1"):
        ort_threads(0)


def test_draft_parts_cut_at_slot_hidden_logits_and_scores(ort_engine):
    """draft.onnx cut into backbone -> slot_hidden, LM head -> slot_logits, head -> tokens and the
    lattice scores, tree -> the draft tree: the LM-head part is the projection alone, the head part
    carries LatticeMatch and GreedyWalk, the tree part DraftTree alone, read from the scores."""
    from lilicorr.ort_runner import TREE_OUTPUTS
    from lilicorr.plugins.onnx_functions import lilicorr_nodes

    m = read_manifest(ort_engine)
    g = {p: m["graphs"][f"draft_{p}"] for p in ("backbone", "lm_head", "head", "tree")}
    assert list(g["backbone"]["outputs"]) == ["slot_hidden"]
    assert "target_state" not in g["backbone"]["inputs"]
    assert list(g["lm_head"]["inputs"]) == ["slot_hidden"] and list(g["lm_head"]["outputs"]) == ["slot_logits"]
    assert {"slot_hidden", "slot_logits", "target_state"} <= set(g["head"]["inputs"])
    whole = list(m["graphs"]["draft"]["outputs"])
    assert list(g["head"]["outputs"]) == [o for o in whole if o not in TREE_OUTPUTS]
    assert list(g["tree"]["inputs"]) == ["anchor_scores", "pair_scores"]
    assert list(g["tree"]["outputs"]) == list(TREE_OUTPUTS) == [o for o in whole if o in TREE_OUTPUTS]
    assert [g[p]["stage"] for p in g] == ["draft_backbone", "lm_head_projection", "speculative_head",
                                          "speculative_head"]
    for p in ("backbone", "lm_head"):
        proto = onnx.load(str(ort_engine / f"draft.{p}.onnx"))
        onnx.checker.check_model(proto)
        assert not lilicorr_nodes(proto) and not list(proto.functions)
    for p, ops in (("head", {"LatticeMatch", "GreedyWalk"}), ("tree", {"DraftTree"})):
        proto = onnx.load(str(ort_engine / f"draft.{p}.onnx"))
        assert {n.op_type for n in lilicorr_nodes(proto)} == ops
        assert {f.name for f in proto.functions} == ops


def test_ort_stage_table_times_backbone_lm_head_and_head(ort_engine, llama_dir):
    """Under ONNX Runtime the three draft parts run as three sessions, each under its stage: the
    stage timer records time in draft backbone, LM-head projection and speculative head, no stage
    is labelled as holding another, and the stages still add up to the block."""
    import gc

    from lilicorr import profiling
    from lilicorr.engine import SpecEngine
    from lilicorr.ort_runner import OrtDraftRunner

    eng = SpecEngine.from_paths(llama_dir, engine_dir=ort_engine, draft_backend="onnxruntime", max_batch=4,
                                max_seq_len=128)
    assert isinstance(eng.runner, OrtDraftRunner) and eng.runner._split
    eng.generate(PROMPTS, 4, rule="lilicorr")                          # warm up
    timer = profiling.StageTimer()
    gc.collect()
    gc.disable()
    try:
        with timer.active():
            eng.generate(PROMPTS, 12, rule="lilicorr")
    finally:
        gc.enable()
    t = timer.table()
    assert t["blocks"] > 0
    for s in (profiling.STAGE_DRAFT, profiling.STAGE_LM_HEAD, profiling.STAGE_HEAD):
        assert t["stages_ms"][s] > 0 and t["ranges_per_block"][s] >= 1, (s, t)
    assert "includes" not in t and t["head_share_pct"] > 0
    assert abs(t["stage_sum_ms"] - t["per_block_wall_ms"]) <= 0.05 * t["per_block_wall_ms"], t
    md = profiling.format_table(t)
    assert "| Draft backbone |" in md and "| LM-head projection |" in md and "| Speculative head |" in md


def test_whole_draft_graph_is_labelled_as_one_stage(ort_engine, llama_dir, tmp_path):
    """An engine without the parts (built before the split) runs draft.ort.onnx as one session:
    the table titles that row as backbone + LM head + head instead of printing a ~0 head."""
    import shutil

    from lilicorr import profiling
    from lilicorr.engine import SpecEngine

    old = tmp_path / "old-engine"
    shutil.copytree(ort_engine, old)
    m = json.loads((old / "manifest.json").read_text())
    for p in ("backbone", "lm_head", "head"):
        del m["graphs"][f"draft_{p}"], m["onnxruntime"]["files"][f"draft_{p}"]
        for f in (f"draft.{p}.onnx", f"draft.{p}.ort.onnx"):
            del m["files"][f]
            (old / f).unlink()
    (old / "manifest.json").write_text(json.dumps(m))
    eng = SpecEngine.from_paths(llama_dir, engine_dir=old, draft_backend="onnxruntime", max_batch=4,
                                max_seq_len=128)
    assert not eng.runner._split
    timer = profiling.StageTimer()
    with timer.active():
        out = [r.tokens for r in eng.generate(PROMPTS, 8, rule="lilicorr")]
    ar = SpecEngine.from_paths(llama_dir, max_batch=4, max_seq_len=128).generate(PROMPTS, 8, rule="ar")
    assert out == [r.tokens for r in ar]
    t = timer.table()
    assert t["includes"] == {profiling.STAGE_DRAFT: {"stages": [profiling.STAGE_LM_HEAD, profiling.STAGE_HEAD],
                                                     "label": "one ONNX Runtime graph"}}
    md = profiling.format_table(t)
    assert ("| Draft backbone + LM-head projection + Speculative head (one ONNX Runtime graph) |" in md)
    assert "| LM-head projection | (in Draft backbone) |" in md and "| Head share | n/a (in Draft backbone) |" in md


def generate_recording_drafts(target_dir, engine_dir, backend: str, rules, max_tokens: int):
    """Greedy PROMPTS through SpecEngine on `backend` for each rule -> ({rule: token lists},
    every Proposal the runner made, in order)."""
    from lilicorr.engine import SpecEngine

    eng = SpecEngine.from_paths(target_dir, engine_dir=engine_dir, draft_backend=backend, max_batch=4,
                                max_seq_len=128)
    proposals = []
    inner = eng.runner.draft

    def spy(*args, **kw):
        p = inner(*args, **kw)
        proposals.append(p)
        return p
    eng.runner.draft = spy
    return {rule: [r.tokens for r in eng.generate(PROMPTS, max_tokens, rule=rule)] for rule in rules}, proposals


def test_engine_ort_equals_torch(ort_engine, llama_dir):
    """Greedy verification through SpecEngine: ONNX Runtime and PyTorch drafters give the same
    drafts step by step and the same tokens (= the target's greedy output)."""
    from lilicorr.engine import SpecEngine

    def run(backend):
        out, props = generate_recording_drafts(llama_dir, ort_engine, backend, ("lilicorr", "viterbi", "argmax"), 12)
        return out, [p.tokens for p in props]

    (tok_t, dr_t), (tok_o, dr_o) = run("torch"), run("onnxruntime")
    ar = SpecEngine.from_paths(llama_dir, max_batch=4, max_seq_len=128).generate(PROMPTS, 12, rule="ar")
    assert tok_t == tok_o
    for rule in tok_t:
        assert tok_o[rule] == [r.tokens for r in ar], rule
    assert len(dr_t) == len(dr_o) and all(torch.equal(a, b) for a, b in zip(dr_t, dr_o))


def test_engine_runs_the_tree_part_only_for_tree_rows(ort_engine, llama_dir):
    """Through SpecEngine on ONNX Runtime: a `tree` row's proposals carry the graph's draft tree
    (the tree part ran), a `lilicorr` row's carry none (it did not), and both decode to the
    target's greedy output."""
    from lilicorr.engine import SpecEngine

    plain = SpecEngine.from_paths(llama_dir, max_batch=4, max_seq_len=128)
    ar = [r.tokens for r in plain.generate(PROMPTS, 12, rule="ar")]
    for rule, has_tree in (("tree", True), ("lilicorr", False)):
        out, props = generate_recording_drafts(llama_dir, ort_engine, "onnxruntime", (rule,), 12)
        assert out[rule] == ar and props, rule
        assert all((p.tree is not None) == has_tree for p in props), rule


def test_make_runner_errors(ort_engine, tiny_ckpt, llama_dir, tiny_target_dir, tmp_path):
    target = load_target(llama_dir)
    with pytest.raises(ValueError, match="unknown draft backend"):
        make_runner(ort_engine, target, 2, backend="nope")
    with pytest.raises(EngineDirError, match="no 'tensorrt' plans|built for 'onnxruntime'"):
        make_runner(ort_engine, target, 2, backend="tensorrt")
    with pytest.raises(EngineDirError, match="another target"):
        make_runner(ort_engine, load_target(tiny_target_dir("qwen3")), 2, backend="onnxruntime")
    yarn = load_target(llama_dir, yarn_factor=2.0)
    with pytest.raises(EngineDirError, match="rope_scaling"):
        make_runner(ort_engine, yarn, 2, backend="onnxruntime")
    with pytest.raises(EngineDirError, match="not an engine directory"):
        make_runner(tmp_path, target, 2)
    # torch backend: the checkpoint named by the manifest must be unchanged
    import shutil
    eng2 = tmp_path / "eng"
    shutil.copytree(ort_engine, eng2)
    ck2 = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck2)
    m = json.loads((eng2 / "manifest.json").read_text())
    m["checkpoint"]["path"] = str(ck2)
    (eng2 / "manifest.json").write_text(json.dumps(m))
    assert make_runner(eng2, target, 2, backend="torch").has_head
    _save_untrained(llama_dir, ck2, seed=1)
    with pytest.raises(EngineDirError, match="changed since the engine was built"):
        make_runner(eng2, target, 2, backend="torch")
    (eng2 / "draft.ort.onnx").unlink()
    with pytest.raises(EngineDirError, match="draft.ort.onnx is missing"):
        make_runner(eng2, target, 2, backend="onnxruntime")


# ------------------------------------------------------------------------------ bad input
def _corrupt(kind: str, ckpt: Path, tmp: Path) -> Path:
    import shutil
    bad = tmp / f"ckpt-{kind}"
    shutil.copytree(ckpt, bad)
    if kind == "config":
        (bad / "config.json").write_text("{not json")
    elif kind == "weights":
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    elif kind == "meta":
        (bad / "meta.json").unlink()
    return bad


@pytest.mark.parametrize("case,needle", [
    ("missing", "does not exist"),
    ("config", "config.json is corrupt"),
    ("weights", "truncated or corrupt"),
    ("meta", "meta.json is missing"),
    ("target", "trained for another target"),
    ("target_dir", "not an HF folder"),
    ("backend", "unknown backend 'tflite'"),
    ("out", "not an engine directory"),
    ("out_is_ckpt", "would replace the checkpoint"),
    ("prompt_lookup", "--prompt-lookup: prompt lookup n-gram '1' outside"),
])
def test_bad_input_clear_error_nothing_written(case, needle, tiny_ckpt, llama_dir, tiny_target_dir, tmp_path, capsys):
    ckpt, target, out, backend = tiny_ckpt, llama_dir, tmp_path / "engines" / "x", "onnxruntime"
    if case == "missing":
        ckpt = tmp_path / "nope"
    elif case in ("config", "weights", "meta"):
        ckpt = _corrupt(case, tiny_ckpt, tmp_path)
    elif case == "target":
        target = tiny_target_dir("qwen3")
    elif case == "target_dir":
        target = tmp_path / "empty-target"
        target.mkdir()
    elif case == "backend":
        backend = "tflite"
    elif case == "out":
        out.mkdir(parents=True)
        (out / "notes.txt").write_text("keep me")
    elif case == "out_is_ckpt":
        ckpt = _corrupt("copy", tiny_ckpt, tmp_path)
        out = ckpt
    extra = ["--prompt-lookup", "1"] if case == "prompt_lookup" else []
    before = sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else None
    rc = _cli().main(["--ckpt", str(ckpt), "--target", str(target), "--out", str(out), "--backend", backend, *extra])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    if case == "out":
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    elif case == "out_is_ckpt":
        assert (out / "model.safetensors").is_file() and not (out / "manifest.json").exists()
    else:
        assert not out.exists()
    after = sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else None
    assert before == after      # no temp folders left behind


def test_failure_mid_build_leaves_old_engine(ort_engine, tiny_ckpt, llama_dir, tmp_path, monkeypatch):
    import shutil

    from lilicorr import export

    out = tmp_path / "eng"
    shutil.copytree(ort_engine, out)
    before = (out / "manifest.json").read_text()

    def boom(*a, **k):
        raise RuntimeError("simulated exporter crash")
    monkeypatch.setattr(export, "export_draft", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        build_engine_dir(tiny_ckpt, llama_dir, out, BuildOptions(log=None))
    assert (out / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eng"]


def test_tensorrt_backend_missing(tiny_ckpt, llama_dir, tmp_path, capsys):
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("tensorrt is installed here; the missing-module path cannot be exercised")
    out = tmp_path / "trt"
    rc = _cli().main(["--ckpt", str(tiny_ckpt), "--target", str(llama_dir), "--out", str(out),
                      "--backend", "tensorrt"])
    err = capsys.readouterr().err
    assert rc == 2 and "`tensorrt`" in err and "not importable" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_vanilla_exports_without_plugin_nodes(llama_dir, tmp_path):
    from lilicorr.export import export_draft, validate_onnxruntime, export_context
    from lilicorr.plugins.onnx_functions import lilicorr_nodes

    model = untrained_model(load_target(llama_dir), vanilla=True)
    proto, parts = export_draft(model, tmp_path / "draft.onnx")
    assert parts == {}
    export_context(model, tmp_path / "context.onnx")
    assert not lilicorr_nodes(proto) and not list(proto.functions)
    assert [o.name for o in proto.graph.output] == ["tokens", "cand_ids"]
    assert "target_state" not in [i.name for i in proto.graph.input]
    rep = validate_onnxruntime(model, tmp_path / "context.onnx", tmp_path / "draft.onnx",
                               draft_cases=((1, 1), (3, 7)), context_cases=((2, 3),))
    assert rep["draft"]["tokens_equal"] and rep["draft"]["cand_ids_equal"] and rep["max_abs_err"] < 1e-4


# ------------------------------------------------------------------------------ TensorRT-RTX
@pytest.mark.slow
def test_tensorrt_rtx_build_with_plugins_and_functions(tiny_ckpt, llama_dir, tmp_path):
    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.skip("tensorrt_rtx is not installed (pip install 'lilicorr[tensorrt-rtx]')")
    from lilicorr.plugins.trt_build import check_rtx_parser_library
    try:
        check_rtx_parser_library()
    except RuntimeError as e:
        pytest.skip(f"TensorRT-RTX's parser library link is missing (scripts/install.sh makes it): {e}")
    out = tmp_path / "tiny-rtx"
    build_engine_dir(tiny_ckpt, llama_dir, out, BuildOptions(backend="tensorrt-rtx", max_batch=8,
                                                             max_context=256, log=None))
    m = read_manifest(out, check_files=True)
    plans = m["tensorrt"]["plans"]
    assert m["backend"] == "tensorrt-rtx" and m["tensorrt"]["module"] == "tensorrt_rtx"
    assert set(plans) == {"context", "draft", "draft_functions"}
    draft, funcs = plans["draft"], plans["draft_functions"]
    assert draft["use_plugins"] and draft["plugins"] == ["DraftTree", "GreedyWalk", "LatticeMatch"]
    assert sorted(p for _, p in draft["network_plugin_layers"]) == ["DraftTree", "GreedyWalk", "LatticeMatch"]
    assert not funcs["use_plugins"] and funcs["plugins"] == [] and funcs["network_plugin_layers"] == []
    assert plans["context"]["plugins"] == []
    assert draft["compute_capabilities"] == ["SM80", "SM86", "SM89", "SM120"]
    assert plan_plugins((out / "draft.plan").read_bytes()) == ["DraftTree", "GreedyWalk", "LatticeMatch"]
    assert plan_plugins((out / "draft.functions.plan").read_bytes()) == []
    assert b"lilicorr" in (out / "draft.plan").read_bytes()
    # the engine dir still runs on CPU through its ONNX graphs
    runner = make_runner(out, load_target(llama_dir), 2, backend="onnxruntime")
    assert runner.has_head


# ------------------------------------------------------------------------------ SmolLM2
@pytest.mark.slow
def test_smollm2_ort_equals_torch(smollm2_dir, tmp_path):
    from lilicorr.engine import SpecEngine

    ckpt = _save_untrained(smollm2_dir, tmp_path / "ckpt-smollm2")
    out = build_engine_dir(ckpt, smollm2_dir, tmp_path / "smollm2-onnxruntime",
                           BuildOptions(log=None, draft_weights="float32"))
    m = read_manifest(out)
    assert m["validation"]["max_abs_err"] < 1e-3 and m["validation"]["draft"]["tokens_equal"]
    prompts = [[1, 504, 3458, 282, 4350, 314], [1, 28120, 905, 30, 2665]]
    res = {}
    for backend in ("torch", "onnxruntime"):
        eng = SpecEngine.from_paths(smollm2_dir, engine_dir=out, draft_backend=backend, max_batch=2, max_seq_len=256)
        res[backend] = [r.tokens for r in eng.generate(prompts, 16, rule="lilicorr")]
    assert res["torch"] == res["onnxruntime"]


def test_draft_vocabulary_engine_equals_torch_and_ar(llama_dir, tmp_path):
    """A checkpoint with a draft vocabulary exports its id map into the graph: ONNX Runtime drafts
    the same target ids as PyTorch, only ids of the draft vocabulary, and output stays the target's."""
    import dataclasses

    from lilicorr.engine import SpecEngine
    from lilicorr.model import LiLiCorrModel

    target = load_target(llama_dir)
    base = untrained_model(target, seed=3)
    cfg = dataclasses.replace(base.cfg, drafter=dataclasses.replace(base.cfg.drafter, draft_vocab_size=40))
    torch.manual_seed(3)
    model = LiLiCorrModel(cfg, target)
    vocab = sorted({2, *range(7, 96, 2)})[:40]
    model.drafter.set_draft_vocab(vocab)
    ckpt = ckpt_io.save_checkpoint(tmp_path / "ckpt", model.cfg, model.state_dict(), target.config, {"step": 0})
    engine_dir = build_engine_dir(ckpt, llama_dir, tmp_path / "engine", BuildOptions(log=None, draft_weights="float32"))
    assert json.loads((engine_dir / "manifest.json").read_text())["draft_vocab_size"] == 40

    def run(backend):
        out, props = generate_recording_drafts(llama_dir, engine_dir, backend, ("lilicorr", "argmax"), 10)
        return out, [p.cand_ids for p in props]

    (tok_t, pools_t), (tok_o, pools_o) = run("torch"), run("onnxruntime")
    ar = SpecEngine.from_paths(llama_dir, max_batch=4, max_seq_len=128).generate(PROMPTS, 10, rule="ar")
    assert tok_t == tok_o and all(tok_o[r] == [x.tokens for x in ar] for r in tok_o)
    assert len(pools_t) == len(pools_o) and all(torch.equal(a, b) for a, b in zip(pools_t, pools_o))
    assert set(torch.cat([p.flatten() for p in pools_o]).tolist()) <= set(vocab)


# ------------------------------------------------------------------------------ int8 draft weights
def test_int8_engine_serves_quantized_graphs(int8_engine):
    """The onnxruntime default: every graph the engine serves is an int8 copy of its ORT-optimised
    graph (MatMulInteger / DynamicQuantizeMatMul in place of the weight MatMuls), hashed in the
    manifest, checked against PyTorch and split exactly like the whole graph."""
    m = read_manifest(int8_engine, check_files=True)
    assert m["draft_weights"] == "int8" and m["onnxruntime"]["draft_weights"] == "int8"
    files = m["onnxruntime"]["files"]
    assert set(files) == {"context", "draft", "draft_backbone", "draft_lm_head", "draft_head", "draft_tree"}
    for graph, name in files.items():
        assert name.endswith(".int8.onnx") and len(m["files"][name]["sha256"]) == 64, graph
        q = m["onnxruntime"]["quantized"][graph]
        model = onnx.load(str(int8_engine / name), load_external_data=False)
        if graph == "draft_tree":      # the draft tree has no weights: its int8 copy is the same graph
            assert q["file"] == name and q["quantized_matmuls"] == q["float_matmuls_left"] == 0, q
            continue
        assert q["file"] == name and q["quantized_matmuls"] >= 1, (graph, q)
        assert {"MatMulInteger", "DynamicQuantizeMatMul"} & {n.op_type for n in model.graph.node}, graph
    lm = m["onnxruntime"]["quantized"]["draft_lm_head"]
    assert lm["float_matmuls_left"] == 0 and lm["int8_bytes"] < lm["bytes"] / 2
    v = m["validation"]["int8"]
    assert 0.5 <= v["token_agreement"] <= 1.0 and 0.0 < v["cand_id_agreement"] <= 1.0
    assert v["split"]["tokens_equal"] and v["split"]["cand_ids_equal"]
    assert m["validation"]["max_abs_err"] < 1e-4          # the float32 graphs are still checked exactly


def test_int8_drafter_is_lossless(int8_engine, llama_dir):
    """int8 weights change drafts, never outputs: greedy speculative tokens equal `ar` for every
    rule, and the runner did draft."""
    from lilicorr.engine import SpecEngine

    out, props = generate_recording_drafts(llama_dir, int8_engine, "onnxruntime", ("lilicorr", "viterbi", "argmax"), 12)
    ar = SpecEngine.from_paths(llama_dir, max_batch=4, max_seq_len=128).generate(PROMPTS, 12, rule="ar")
    assert props
    for rule, toks in out.items():
        assert toks == [r.tokens for r in ar], rule


def test_draft_weights_choice():
    from lilicorr.export import resolve_draft_weights

    assert resolve_draft_weights("auto", "onnxruntime") == "int8"
    assert resolve_draft_weights("auto", "tensorrt-rtx") == "float32"
    assert resolve_draft_weights("float32", "onnxruntime") == "float32"
    with pytest.raises(BuildError, match="onnxruntime backend only"):
        resolve_draft_weights("int8", "tensorrt")
    with pytest.raises(BuildError, match="choose from"):
        resolve_draft_weights("int4", "onnxruntime")
