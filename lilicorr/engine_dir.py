"""Engine directories (made by ``convert/build_engine.py``): manifest I/O, target checks, runners.

Layout (engines/README.md describes every manifest field):

    manifest.json       what was built from what: checkpoint + target hashes, shapes, tools,
                        validation errors, files (sha256); written last
    config.json         LiLiCorrConfig + target fingerprint (the checkpoint's config.json format)
    context.onnx        captured target features -> per-layer drafter context K/V
    draft.onnx          anchor + cached context K/V -> drafted tokens, top-K pools, lattice scores;
                        lilicorr::LatticeMatch / GreedyWalk nodes + their ONNX local functions
    draft.backbone.onnx, draft.lm_head.onnx, draft.head.onnx
                        draft.onnx cut at slot_hidden / slot_logits: one ONNX Runtime session per
                        stage of the stage table (bit-identical to draft.onnx)
    *.ort.onnx          ONNX Runtime-optimised copies (backend onnxruntime)
    *.plan              serialized TensorRT / TensorRT-RTX engines (backends tensorrt*)
    model.yaml          TensorRT-LLM LLM-API arguments for NGC containers (llmapi Triton model)

``make_runner(engine_dir, target, num_slots, backend)`` returns a draft runner for the engine
(``lilicorr.draft_runner`` interface): ``torch`` loads the checkpoint the manifest names (checked
by sha256), ``onnxruntime`` runs the ONNX graphs, ``tensorrt`` / ``tensorrt-rtx`` the plans.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from lilicorr.checkpoint import WEIGHTS, file_sha256, target_fingerprint

MANIFEST = "manifest.json"
FORMAT = "lilicorr-engine"
FORMAT_VERSION = 1
BACKENDS = ("onnxruntime", "tensorrt", "tensorrt-rtx")
RUNNER_BACKENDS = ("auto", "torch") + BACKENDS
REPO = Path(__file__).resolve().parents[1]


class EngineDirError(RuntimeError):
    """An engine directory is missing, incomplete, corrupt or does not match its target."""


# ------------------------------------------------------------------------------ hashing
def tokenizer_sha256(target_dir) -> str | None:
    """sha256 over the target folder's tokenizer files (tokenizer.json first); None if it has none."""
    target_dir = Path(target_dir)
    names = [n for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
             if (target_dir / n).is_file()]
    if not names:
        return None
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode() + b"\0" + bytes.fromhex(file_sha256(target_dir / n)))
    return h.hexdigest()


def frozen_sha256(target) -> str:
    """sha256 of the target parts baked into the draft graph: input embedding, LM head and the
    rotary table (inv_freq, attention scaling), in float32."""
    h = hashlib.sha256()
    for t in (target.embed_tokens.weight, target.lm_head.weight, target.rotary.inv_freq):
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    h.update(repr(float(target.rotary.attention_scaling)).encode())
    return h.hexdigest()


def target_record(target, target_dir=None) -> dict:
    """What the manifest keeps about the target: the checkpoint fingerprint, the full shape/rope
    config, a hash of the frozen tensors baked into the graph, and the tokenizer hash."""

    c = target.config
    rec = {
        "fingerprint": target_fingerprint(c),
        "config": {"model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
                   "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
                   "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                   "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
                   "max_position_embeddings": c.max_position_embeddings,
                   "tie_word_embeddings": c.tie_word_embeddings},
        "dtype": target.precision,
        "frozen_sha256": frozen_sha256(target),
    }
    if target_dir is not None:
        rec["tokenizer_sha256"] = tokenizer_sha256(target_dir)
        cfg = Path(target_dir) / "config.json"
        rec["config_sha256"] = file_sha256(cfg) if cfg.is_file() else None
    return rec


def check_target(manifest: dict, target, target_dir=None, where: str = "engine") -> None:
    """Raise EngineDirError when `target` (and its folder, if given) is not the one the engine was
    built for: fingerprint, shapes/rope, frozen embedding/LM-head/rotary tensors, tokenizer."""
    want = manifest.get("target") or {}
    have = target_record(target, target_dir)
    problems = []
    for key in ("fingerprint", "config"):
        a, b = want.get(key) or {}, have[key]
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        problems += [f"{k}: engine {a.get(k)!r} vs target {b.get(k)!r}" for k in diff]
    if not problems and want.get("frozen_sha256") and want.get("dtype") == have["dtype"] \
            and want["frozen_sha256"] != have["frozen_sha256"]:
        problems.append("embedding / LM-head / rotary tensors differ (frozen_sha256)")
    if target_dir is not None and want.get("tokenizer_sha256") and have.get("tokenizer_sha256") \
            and want["tokenizer_sha256"] != have["tokenizer_sha256"]:
        problems.append("tokenizer files differ (tokenizer_sha256)")
    if problems:
        raise EngineDirError(f"{where} was built for another target: " + "; ".join(problems[:6]))


# ------------------------------------------------------------------------------ paths
def portable_path(path, engine_dir) -> str:
    """`path` relative to `engine_dir` when both lie inside this repository, else absolute."""
    path, engine_dir = Path(path).resolve(), Path(engine_dir).resolve()
    if path.is_relative_to(REPO) and engine_dir.is_relative_to(REPO):
        return os.path.relpath(path, engine_dir)
    return str(path)


def resolve_path(p: str, engine_dir) -> Path:
    path = Path(p).expanduser()
    return path if path.is_absolute() else (Path(engine_dir) / path).resolve()


# ------------------------------------------------------------------------------ manifest
def write_manifest(engine_dir, manifest: dict) -> Path:
    path = Path(engine_dir) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(engine_dir, check_files: bool = False) -> dict:
    """Read and sanity-check ``<engine_dir>/manifest.json``; with check_files, every listed file's
    size (and sha256) is verified too."""
    engine_dir = Path(engine_dir)
    path = engine_dir / MANIFEST
    if not engine_dir.is_dir():
        raise EngineDirError(f"engine directory {engine_dir} does not exist")
    if not path.is_file():
        raise EngineDirError(f"{engine_dir} is not an engine directory ({MANIFEST} is missing; "
                             "make one with convert/build_engine.py)")
    try:
        m = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineDirError(f"{path} is corrupt ({e})") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise EngineDirError(f"{path} is not a lilicorr engine manifest (format != {FORMAT!r})")
    if int(m.get("format_version", 0)) > FORMAT_VERSION:
        raise EngineDirError(f"{path} has format_version {m.get('format_version')}; this code reads "
                             f"<= {FORMAT_VERSION}")
    for key in ("backend", "config", "graphs", "target", "checkpoint", "files"):
        if key not in m:
            raise EngineDirError(f"{path} lacks the {key!r} entry")
    for name, info in m["files"].items():
        f = engine_dir / name
        if not f.is_file():
            raise EngineDirError(f"engine {engine_dir} is incomplete: {name} is missing")
        if check_files:
            if f.stat().st_size != info.get("bytes"):
                raise EngineDirError(f"engine {engine_dir}: {name} has {f.stat().st_size} bytes, "
                                     f"the manifest says {info.get('bytes')} (copied incompletely or changed?)")
            if file_sha256(f) != info.get("sha256"):
                raise EngineDirError(f"engine {engine_dir}: {name} does not match its sha256 in the manifest "
                                     "(corrupt or changed since the build)")
    check_manifest_fields(m, path)
    return m


def check_manifest_fields(m: dict, where="manifest") -> None:
    """The manifest's summary fields (block_size, top_k, shapes) agree with its config and with the
    draft graph's recorded output shapes (tokens [N, S], cand_ids [N, S, K]); EngineDirError names
    the first disagreement."""
    try:
        cfg = m["config"]
        want = {"block_size": int(cfg["drafter"]["block_size"]), "top_k": int(cfg["head"]["top_k"])}
    except (KeyError, TypeError, ValueError) as e:
        raise EngineDirError(f"{where}: the config entry lacks {e}") from None
    seen: dict[str, list[tuple[str, object]]] = {"block_size": [], "top_k": []}
    seen["block_size"].append(("block_size", m.get("block_size")))
    seen["top_k"].append(("top_k", m.get("top_k")))
    shapes = m.get("shapes") or {}
    if "B" in shapes:
        seen["block_size"].append(("shapes.B", shapes["B"]))
    if "S" in shapes:
        seen["block_size"].append(("shapes.S + 1", None if shapes["S"] is None else shapes["S"] + 1))
    if "K" in shapes:
        seen["top_k"].append(("shapes.K", shapes["K"]))
    outs = ((m.get("graphs") or {}).get("draft") or {}).get("outputs") or {}
    tokens, cand = outs.get("tokens"), outs.get("cand_ids")
    if isinstance(tokens, list) and len(tokens) == 2 and isinstance(tokens[1], int):
        seen["block_size"].append(("draft graph tokens [N, S] (S + 1)", tokens[1] + 1))
    if isinstance(cand, list) and len(cand) == 3 and isinstance(cand[2], int):
        seen["top_k"].append(("draft graph cand_ids [N, S, K]", cand[2]))
    for field, values in seen.items():
        for name, v in values:
            if v is not None and v != want[field]:
                raise EngineDirError(f"{where}: {name} is {v!r} but the engine's config and graph have "
                                     f"{field} {want[field]}")


def lilicorr_config(manifest: dict):
    from lilicorr.config import LiLiCorrConfig

    return LiLiCorrConfig.from_dict(manifest["config"])


# ------------------------------------------------------------------------------ runners
def make_runner(engine_dir, target, num_slots: int, backend: str | None = "auto",
                target_dir=None, capacity: int = 256):
    """A draft runner for the engine directory.

    backend: 'torch' (the checkpoint the manifest names, verified by sha256), 'onnxruntime',
    'tensorrt' / 'tensorrt-rtx' (the built plans; need the module and a CUDA GPU), or 'auto'/None
    (the manifest's backend). The target is checked against the manifest first.
    """
    engine_dir = Path(engine_dir)
    backend = "auto" if backend in (None, "") else backend
    if backend not in RUNNER_BACKENDS:
        raise ValueError(f"unknown draft backend {backend!r}; choose from {', '.join(RUNNER_BACKENDS)}")
    manifest = read_manifest(engine_dir)
    check_target(manifest, target, target_dir, where=f"engine {engine_dir}")
    if backend == "auto":
        backend = manifest["backend"]
    if backend == "torch":
        return _torch_runner(manifest, engine_dir, target, num_slots, capacity)
    from lilicorr.ort_runner import OrtDraftRunner, TensorRTDraftRunner

    if backend == "onnxruntime":
        return OrtDraftRunner(engine_dir, manifest, num_slots, capacity=capacity)
    if manifest["backend"] != backend:
        raise EngineDirError(f"engine {engine_dir} was built for {manifest['backend']!r}; it has no "
                             f"{backend!r} plans (rebuild with --backend {backend}, or use "
                             "draft backend 'onnxruntime' / 'torch')")
    return TensorRTDraftRunner(engine_dir, manifest, num_slots, capacity=capacity)


def _torch_runner(manifest, engine_dir, target, num_slots, capacity):
    from lilicorr.draft_runner import TorchDraftRunner
    from lilicorr.model import load_model

    ck = manifest["checkpoint"]
    ckpt_dir = resolve_path(ck["path"], engine_dir)
    weights = ckpt_dir / WEIGHTS
    if not weights.is_file():
        raise EngineDirError(f"engine {engine_dir}: its checkpoint {ckpt_dir} is gone ({WEIGHTS} missing); "
                             "the torch draft backend needs it (use 'onnxruntime' instead)")
    if file_sha256(weights) != ck["sha256"]:
        raise EngineDirError(f"engine {engine_dir}: checkpoint {ckpt_dir} changed since the engine was "
                             "built (model.safetensors sha256 differs); rebuild the engine")
    return TorchDraftRunner(load_model(ckpt_dir, target), num_slots, capacity=capacity)
