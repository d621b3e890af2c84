"""Generate the Triton model repository (TensorRT-LLM's layout) from an engine directory.

    <repo>/preprocessing/   chat template + tokenizer: text_input / messages_json -> input_ids
    <repo>/lilicorr/        decoupled Python model: one SpecEngine, in-flight batching, streaming
    <repo>/postprocessing/  detokenizer: streamed token deltas -> text deltas
    <repo>/ensemble/        preprocessing -> lilicorr -> postprocessing

Templates live in ``lilicorr/serving/templates/<model>/`` (``config.pbtxt`` with ``${var}``
placeholders, ``1/model.py``). Everything the server needs to know about the engine goes through
`read_engine_manifest` (one place to adapt when the manifest format changes) and reaches the
models as config ``parameters``; the ``lilicorr`` model builds its engine with `open_engine`.

The configs carry no absolute paths (``/v2/models/<m>/config`` is readable by every client): each
Python model directory holds symlinks ``target``, ``engine`` and ``ckpt``, and the parameters name
them relative to the model directory. There is no ``EXECUTION_ENV_PATH`` (it would be an absolute
path; a venv symlink inside a model directory, tried instead, coincided with model loads that
never finished): the stub runs the venv that is first on PATH, which `launcher.server_env`
arranges.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import string
from pathlib import Path
from typing import Any, Mapping

from lilicorr.config import DEFAULT_TREE_NODES
from lilicorr.ngram import parse_prompt_lookup

from .launcher import engine_threads, venv_root
from .protocol import DECODE_RULES, DEFAULT_MAX_PROMPT_BYTES, MODEL_ENGINE, MODEL_ENSEMBLE, MODEL_POST, MODEL_PRE

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
    """A manifest path: absolute, or relative to the engine directory (the manifest's folder)."""
    if p is None or p == "":
        return None
    path = Path(p).expanduser()
    return path if path.is_absolute() else (base / path).resolve()


SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")


def _check_target_dir(target_dir: Path, manifest: dict, engine_dir: Path, how: str) -> None:
    """The target folder exists and looks like the one the engine was built for (config shape
    fields and tokenizer hash; the stub checks the weights' fingerprint when it loads)."""
    from lilicorr.engine_dir import EngineDirError, tokenizer_sha256
    from lilicorr.target import TargetConfig

    if not (target_dir / "config.json").is_file():
        raise EngineDirError(
            f"engine {engine_dir.name}: target folder {target_dir} ({how}) does not exist or has no "
            "config.json; pass --target DIR with the HF folder the engine was built for")
    want = (manifest.get("target") or {}).get("config") or {}
    cfg = TargetConfig.from_hf_dir(target_dir)
    diff = [k for k in SHAPE_FIELDS if k in want and getattr(cfg, k, want[k]) != want[k]]
    if diff:
        raise EngineDirError(f"engine {engine_dir.name} was built for another target than {target_dir}: "
                             + ", ".join(f"{k} {want[k]!r} vs {getattr(cfg, k)!r}" for k in diff[:4]))
    want_tok = (manifest.get("target") or {}).get("tokenizer_sha256")
    if want_tok and tokenizer_sha256(target_dir) not in (None, want_tok):
        raise EngineDirError(f"engine {engine_dir.name}: the tokenizer in {target_dir} differs from the one "
                             "the engine was built with (tokenizer_sha256)")


def read_engine_manifest(engine_dir: str | os.PathLike, target: str | os.PathLike | None = None,
                         check_files: bool = True) -> EngineSpec:
    """Read ``<engine_dir>/manifest.json`` (written by convert/build_engine.py).

    The manifest is checked by `lilicorr.engine_dir.read_manifest`: format, every listed file's
    size and sha256 (``check_files``; a mismatch names the file), and its fields against the graph.
    The target is ``target`` when given (``--target``: an engine directory copied to another
    machine or folder), else the manifest's ``target_dir`` (absolute, or relative to the engine
    directory). Raises `EngineDirError` with a one-line message.
    """
    from lilicorr.engine_dir import EngineDirError, read_manifest

    engine_dir = Path(engine_dir).expanduser().resolve()
    manifest = read_manifest(engine_dir, check_files=check_files)
    if target is not None:
        target_dir = Path(target).expanduser().resolve()
        how = "--target"
    else:
        if not manifest.get("target_dir"):
            raise EngineDirError(f"{engine_dir / 'manifest.json'}: no 'target_dir' entry; pass --target DIR")
        target_dir = _resolve(manifest["target_dir"], engine_dir)
        how = f"manifest target_dir {manifest['target_dir']!r}"
    _check_target_dir(target_dir, manifest, engine_dir, how)
    ckpt = manifest.get("ckpt") or manifest.get("ckpt_dir")
    ckpt_dir = _resolve(ckpt, engine_dir) if isinstance(ckpt, (str, os.PathLike)) else None
    return EngineSpec(
        target_dir=target_dir,
        engine_dir=engine_dir,
        ckpt_dir=ckpt_dir if ckpt_dir is not None and ckpt_dir.is_dir() else None,
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
    dtype: str = ""                     # target dtype; "" -> the engine manifest's serving dtype, else "auto"
    draft_length: str = ""              # "auto", N, or "" -> the manifest's serving choice, else the whole block
    tree_nodes: int = 0                 # rule tree: draft-tree nodes verified per step (0: the manifest's, else 16)
    prompt_lookup: str = ""             # longest n-gram prompt lookup matches, "off"/"0", or "" -> the manifest's, else off
    cancel_check_ms: int = 20
    pre_instances: int = 1
    post_instances: int = 1
    num_threads: int = 0                # torch threads in the engine stub (0: `engine_threads()`)
    gemm_threads: int = 0               # multi-token GEMMs' threads (set_gemm_threads; 0: the engine's torch threads)
    prefill_threads: int = 0            # a prefill's GEMM threads (set_prefill_threads; 0: gemm_threads)
    draft_backend: str | None = None    # override the manifest's backend
    chat_template: bool = True          # preprocessing applies the chat template to text_input
    profile: bool = False               # time the Table 3 stages in the engine thread (-> /metrics)
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES   # text_input / messages_json, before tokenising
    extra_parameters: dict = dataclasses.field(default_factory=dict)   # more lilicorr-model parameters


# symlinks in each Python model directory (the configs name them, never an absolute path)
LINKS = {"target_dir": "target", "engine_dir": "engine", "ckpt_dir": "ckpt"}


def template_vars(spec: EngineSpec, opts: ServeOptions) -> dict[str, str]:
    env = venv_root()
    serving = (spec.manifest or {}).get("serving") or {}      # the engine's own serving choices
    return {
        "target_dir": LINKS["target_dir"],
        "engine_dir": LINKS["engine_dir"] if spec.engine_dir else "",
        "ckpt_dir": LINKS["ckpt_dir"] if spec.ckpt_dir else "",
        "max_prompt_bytes": str(opts.max_prompt_bytes),
        "draft_backend": opts.draft_backend or spec.draft_backend,
        "max_batch": str(opts.max_batch),
        "max_seq_len": str(opts.max_seq_len),
        "max_tokens_limit": str(opts.max_tokens_limit or opts.max_seq_len - 1),
        "default_max_tokens": str(opts.default_max_tokens),
        "default_decode_rule": opts.default_decode_rule,
        "device": opts.device,
        "dtype": opts.dtype or serving.get("dtype") or "auto",
        "draft_length": str(opts.draft_length or serving.get("draft_length") or ""),
        "tree_nodes": str(opts.tree_nodes or serving.get("tree_nodes")
                          or DEFAULT_TREE_NODES),
        "prompt_lookup": str(parse_prompt_lookup(opts.prompt_lookup or serving.get("prompt_lookup") or 0)),
        "cancel_check_ms": str(opts.cancel_check_ms),
        "pre_instances": str(opts.pre_instances),
        "post_instances": str(opts.post_instances),
        "num_threads": str(opts.num_threads),
        "gemm_threads": str(opts.gemm_threads),
        "prefill_threads": str(opts.prefill_threads),
        "chat_template": "true" if opts.chat_template else "false",
        "profile": "true" if opts.profile else "false",
        "extra_parameters": "\n".join(
            f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}'
            for k, v in opts.extra_parameters.items()),
        # the stub runs the venv first on PATH (launcher.server_env); no EXECUTION_ENV_PATH
        "execution_env": f"# Python stub environment: {'the venv' if env is not None else 'the interpreter'} "
                         "first on the server's PATH",
    }


def render_template(text: str, variables: Mapping[str, str]) -> str:
    return string.Template(text).substitute(variables)


def generate_repository(spec: EngineSpec, out_dir: str | os.PathLike, opts: ServeOptions | None = None,
                        models: tuple[str, ...] = MODELS) -> Path:
    """Write the model repository for `spec` into `out_dir` (replacing models already there)."""
    opts = opts or ServeOptions()
    if opts.default_decode_rule not in DECODE_RULES:
        raise ValueError(f"unknown default decode rule {opts.default_decode_rule!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    variables = template_vars(spec, opts)
    links = {LINKS["target_dir"]: spec.target_dir, LINKS["engine_dir"]: spec.engine_dir,
             LINKS["ckpt_dir"]: spec.ckpt_dir}
    for model in models:
        src = TEMPLATES / model
        dst = out / model
        if dst.is_symlink() or dst.is_file():
            dst.unlink()
        elif dst.exists():
            shutil.rmtree(dst)        # symlinks inside are removed, never followed
        (dst / "1").mkdir(parents=True)
        cfg = render_template((src / "config.pbtxt").read_text(), variables)
        (dst / "config.pbtxt").write_text(cfg)
        python_model = False
        for f in (src / "1").glob("*.py") if (src / "1").is_dir() else ():
            shutil.copy2(f, dst / "1" / f.name)
            python_model = True
        if python_model:
            for name, target in links.items():
                if target is not None:
                    os.symlink(Path(target).resolve(), dst / name)
    return out


def model_path(params: Mapping[str, str], key: str, base_dir: str | os.PathLike | None) -> str:
    """A path parameter of a model config: relative ones are resolved against the model directory
    (``args["model_repository"]`` in the stub) and their symlinks followed."""
    value = params.get(key) or ""
    if not value:
        return ""
    path = Path(value)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return os.path.realpath(path)


def model_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """Config ``parameters`` of a Python model as a plain dict (unfilled ``${...}`` count as unset)."""
    out = {}
    for k, v in (model_config.get("parameters") or {}).items():
        s = v.get("string_value", "") if isinstance(v, Mapping) else str(v)
        if s.startswith("${"):
            s = ""
        out[k] = s
    return out


def open_engine(params: Mapping[str, str], base_dir: str | os.PathLike | None = None):
    """Build the SpecEngine described by the ``lilicorr`` model's parameters (paths relative to
    ``base_dir``, the model directory).

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
    torch.set_num_threads(n_threads if n_threads > 0 else engine_threads())
    from lilicorr.fp16_linear import set_gemm_threads, set_prefill_threads
    set_gemm_threads(int(params.get("gemm_threads") or 0))      # 0: torch's, as just set
    set_prefill_threads(int(params.get("prefill_threads") or 0))
    from lilicorr.target import resolve_precision
    dtype = resolve_precision(params.get("dtype") or "auto", device)
    target_dir = model_path(params, "target_dir", base_dir)
    kwargs: dict[str, Any] = dict(max_batch=max_batch, max_seq_len=max_seq_len, device=device, dtype=dtype,
                                  draft_length=params.get("draft_length") or None,
                                  tree_nodes=int(params.get("tree_nodes") or DEFAULT_TREE_NODES),
                                  prompt_lookup=params.get("prompt_lookup") or 0)
    if params.get("engine_dir"):
        kwargs["engine_dir"] = model_path(params, "engine_dir", base_dir)   # the engine names its checkpoint
    elif params.get("ckpt_dir"):
        kwargs["ckpt_dir"] = model_path(params, "ckpt_dir", base_dir)
    backend = params.get("draft_backend") or ""
    if backend.startswith("tensorrt") and not device.startswith("cuda"):
        backend = "onnxruntime"   # every engine dir carries validated ONNX graphs (engines/README.md)
    if backend:
        kwargs["draft_backend"] = backend
    for key in ("untrained_seed", "block_size"):      # tests: an untrained drafter, no checkpoint
        if params.get(key):
            kwargs[key] = int(params[key])
    engine = SpecEngine.from_paths(target_dir, **kwargs)
    engine.measure_costs()               # auto draft length: measured at start-up, not in a request
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
