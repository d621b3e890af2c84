"""Generate the Triton model repository (TensorRT-LLM's layout) from an engine directory.

    <repo>/preprocessing/   chat template + tokenizer: text_input / messages_json -> input_ids
    <repo>/lilicorr/        decoupled Python model: one SpecEngine, in-flight batching, streaming
    <repo>/postprocessing/  detokenizer: streamed token deltas -> text deltas
    <repo>/ensemble/        preprocessing -> lilicorr -> postprocessing

Templates live in ``lilicorr/serving/templates/<model>/`` (``config.pbtxt`` with ``${var}``
placeholders, ``1/model.py``). Everything the server needs to know about the engine goes through
`read_engine_manifest` (one place to adapt when the manifest format changes) and reaches the
models as config ``parameters``; the ``lilicorr`` model builds its engine with `open_engine`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import string
from pathlib import Path
from typing import Any, Mapping

from .launcher import venv_root
from .protocol import MODEL_ENGINE, MODEL_ENSEMBLE, MODEL_POST, MODEL_PRE

TEMPLATES = Path(__file__).resolve().parent / "templates"
MODELS = (MODEL_PRE, MODEL_ENGINE, MODEL_POST, MODEL_ENSEMBLE)


@dataclasses.dataclass
class EngineSpec:
    """What the server needs from an engine directory (or from a bare target + checkpoint)."""

    target_dir: Path
    engine_dir: Path | None = None
    ckpt_dir: Path | None = None
    draft_backend: str = "torch"
    block_size: int | None = None
    top_k: int | None = None
    manifest: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return (self.engine_dir or self.ckpt_dir or self.target_dir).name


def _resolve(p: str | os.PathLike | None, base: Path) -> Path | None:
    if p is None or p == "":
        return None
    path = Path(p).expanduser()
    if path.is_absolute():
        return path
    for cand in (base / path, Path.cwd() / path):
        if cand.exists():
            return cand.resolve()
    return (base / path).resolve()


def read_engine_manifest(engine_dir: str | os.PathLike) -> EngineSpec:
    """Read ``<engine_dir>/manifest.json`` (written by convert/build_engine.py).

    Required: ``target_dir`` (absolute, or relative to the engine dir). Used when present:
    ``ckpt`` (relative like target_dir), ``backend`` (the draft backend, e.g. "onnxruntime"),
    ``block_size``, ``top_k``.
    """
    engine_dir = Path(engine_dir).expanduser().resolve()
    mpath = engine_dir / "manifest.json"
    if not mpath.is_file():
        raise FileNotFoundError(f"{mpath} not found: --engine must be a folder made by convert/build_engine.py")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as e:
        raise ValueError(f"{mpath} is not valid JSON: {e}") from None
    if "target_dir" not in manifest:
        raise ValueError(f"{mpath}: no 'target_dir' entry")
    target_dir = _resolve(manifest["target_dir"], engine_dir)
    ckpt = manifest.get("ckpt") or manifest.get("ckpt_dir")
    return EngineSpec(
        target_dir=target_dir,
        engine_dir=engine_dir,
        ckpt_dir=_resolve(ckpt, engine_dir) if isinstance(ckpt, (str, os.PathLike)) else None,
        draft_backend=str(manifest.get("backend") or manifest.get("draft_backend") or "onnxruntime"),
        block_size=manifest.get("block_size"),
        top_k=manifest.get("top_k"),
        manifest=manifest,
    )


@dataclasses.dataclass
class ServeOptions:
    max_batch: int = 32                 # concurrent sequences in the engine
    max_seq_len: int = 2048             # prompt + generated tokens per sequence
    max_tokens_limit: int | None = None  # largest max_tokens a request may ask for (default: max_seq_len - 1)
    default_max_tokens: int = 128
    default_decode_rule: str = "lilicorr"
    device: str = "auto"                # "auto" -> cuda if available else cpu
    dtype: str = "float32"
    cancel_check_ms: int = 20
    pre_instances: int = 1
    post_instances: int = 1
    num_threads: int = 0                # torch threads in the engine stub (0: torch default)
    draft_backend: str | None = None    # override the manifest's backend
    chat_template: bool = True          # preprocessing applies the chat template to text_input
    profile: bool = False               # time the Table 3 stages in the engine thread (-> /metrics)
    extra_parameters: dict = dataclasses.field(default_factory=dict)   # more lilicorr-model parameters


def template_vars(spec: EngineSpec, opts: ServeOptions) -> dict[str, str]:
    env = venv_root()
    return {
        "target_dir": str(spec.target_dir),
        "engine_dir": str(spec.engine_dir or ""),
        "ckpt_dir": str(spec.ckpt_dir or ""),
        "draft_backend": opts.draft_backend or spec.draft_backend,
        "max_batch": str(opts.max_batch),
        "max_seq_len": str(opts.max_seq_len),
        "max_tokens_limit": str(opts.max_tokens_limit or opts.max_seq_len - 1),
        "default_max_tokens": str(opts.default_max_tokens),
        "default_decode_rule": opts.default_decode_rule,
        "device": opts.device,
        "dtype": opts.dtype,
        "cancel_check_ms": str(opts.cancel_check_ms),
        "pre_instances": str(opts.pre_instances),
        "post_instances": str(opts.post_instances),
        "num_threads": str(opts.num_threads),
        "chat_template": "true" if opts.chat_template else "false",
        "profile": "true" if opts.profile else "false",
        "extra_parameters": "\n".join(
            f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}'
            for k, v in opts.extra_parameters.items()),
        # the stub sources <venv>/bin/activate before it starts (see launcher.py)
        "execution_env": (f'parameters: {{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "{env}" }} }}'
                          if env is not None else ""),
    }


def render_template(text: str, variables: Mapping[str, str]) -> str:
    return string.Template(text).substitute(variables)


def generate_repository(spec: EngineSpec, out_dir: str | os.PathLike, opts: ServeOptions | None = None,
                        models: tuple[str, ...] = MODELS) -> Path:
    """Write the model repository for `spec` into `out_dir` (replacing models already there)."""
    opts = opts or ServeOptions()
    if opts.default_decode_rule not in ("lilicorr", "viterbi", "argmax", "ar"):
        raise ValueError(f"unknown default decode rule {opts.default_decode_rule!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    variables = template_vars(spec, opts)
    for model in models:
        src = TEMPLATES / model
        dst = out / model
        if dst.exists():
            shutil.rmtree(dst)
        (dst / "1").mkdir(parents=True)
        cfg = render_template((src / "config.pbtxt").read_text(), variables)
        (dst / "config.pbtxt").write_text(cfg)
        for f in (src / "1").glob("*.py") if (src / "1").is_dir() else ():
            shutil.copy2(f, dst / "1" / f.name)
    return out


def model_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """Config ``parameters`` of a Python model as a plain dict (unfilled ``${...}`` count as unset)."""
    out = {}
    for k, v in (model_config.get("parameters") or {}).items():
        s = v.get("string_value", "") if isinstance(v, Mapping) else str(v)
        if s.startswith("${"):
            s = ""
        out[k] = s
    return out


def open_engine(params: Mapping[str, str]):
    """Build the SpecEngine described by the ``lilicorr`` model's parameters.

    Returns (engine, limits). Runs inside the Triton stub (and in tests without Triton).
    """
    from .protocol import Limits

    max_batch = int(params.get("max_batch") or 32)
    max_seq_len = int(params.get("max_seq_len") or 2048)
    limits = dict(max_seq_len=max_seq_len,
                  max_tokens_limit=int(params.get("max_tokens_limit") or max_seq_len - 1),
                  default_max_tokens=int(params.get("default_max_tokens") or 128),
                  default_rule=params.get("default_decode_rule") or "lilicorr")
    import torch

    from lilicorr.engine import SpecEngine

    device = params.get("device") or "auto"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    n_threads = int(params.get("num_threads") or 0)
    if n_threads > 0:
        torch.set_num_threads(n_threads)
    dtype = getattr(torch, params.get("dtype") or "float32")
    target_dir = params["target_dir"]
    kwargs: dict[str, Any] = dict(max_batch=max_batch, max_seq_len=max_seq_len, device=device, dtype=dtype)
    if params.get("engine_dir"):
        kwargs["engine_dir"] = params["engine_dir"]           # the engine names its checkpoint
    elif params.get("ckpt_dir"):
        kwargs["ckpt_dir"] = params["ckpt_dir"]
    backend = params.get("draft_backend") or ""
    if backend.startswith("tensorrt") and not device.startswith("cuda"):
        backend = "onnxruntime"   # every engine dir carries validated ONNX graphs (engines/README.md)
    if backend:
        kwargs["draft_backend"] = backend
    for key in ("untrained_seed", "block_size"):      # tests: an untrained drafter, no checkpoint
        if params.get(key):
            kwargs[key] = int(params[key])
    engine = SpecEngine.from_paths(target_dir, **kwargs)
    engine.keep_results = False          # a server must not keep every finished sequence
    # the engine clamps max_seq_len to the target's positions and needs room for one block
    limits["max_seq_len"] = int(engine.max_seq_len) - int(getattr(engine, "block_size", 1))
    limits["max_tokens_limit"] = min(limits["max_tokens_limit"], limits["max_seq_len"])
    limits["default_max_tokens"] = min(limits["default_max_tokens"], limits["max_tokens_limit"])
    return engine, Limits(vocab_size=int(engine.vocab_size), stop_ids=tuple(stop_ids_for(target_dir)), **limits)


def stop_ids_for(target_dir: str | os.PathLike) -> list[int]:
    """End-of-sequence ids: the tokenizer's EOS and end-of-turn tokens, else the target config's."""
    try:
        from lilicorr.tokenizer import Tokenizer
        return sorted(Tokenizer.from_dir(target_dir).eos_ids)
    except (FileNotFoundError, ImportError):
        from lilicorr.target import TargetConfig
        return list(TargetConfig.from_hf_dir(target_dir).eos_token_ids)
