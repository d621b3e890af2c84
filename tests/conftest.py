"""Shared fixtures: tiny random HF target folders and the real SmolLM2-135M-Instruct folder.

`tiny_target_dir(family, **overrides)` writes (once per session and argument set) a randomly
initialised 'llama' | 'qwen2' | 'qwen3' model with transformers' save_pretrained, plus a tiny
word-level tokenizer.json and a ChatML-style chat template. `smollm2_dir` runs
train/prepare_target.py into the repo's `.cache/` folder (a no-op once it exists).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LILICORR_CACHE", REPO / ".cache"))

TINY_WORDS = ("the a an is was of to and in on for with it this that hello world how are you fine "
              "what why who where when code math answer question please write number one two three "
              "four five six seven eight nine ten yes no python def return print if else").split()
TINY_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}\n"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """One intra-op thread for the whole run: on shared 2-core machines two OpenMP threads spin
    against each other and other jobs (small matmuls 10-20x slower); tiny models gain nothing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


FAMILY_CONFIG = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=1, head_dim=24),
}


def _tiny_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + TINY_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(TINY_SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", chat_template=TINY_CHAT_TEMPLATE)
    fast.save_pretrained(str(path))


def _write_tiny(path: Path, family: str, overrides: dict) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(FAMILY_CONFIG[family])
    model_type = kw.pop("model_type")
    kw.update(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, rms_norm_eps=1e-6,
              max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=3, rope_theta=10000.0)
    kw.update(overrides)
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(sum(map(ord, family + repr(sorted(overrides.items())))))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # larger-than-default weights so every term matters in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if "embed" in name else 0.15)
    model.save_pretrained(str(path), safe_serialization=True)
    _tiny_tokenizer(path)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """Factory: tiny_target_dir('llama'|'qwen2'|'qwen3', **config_overrides) -> Path (cached per session)."""
    made: dict[tuple, Path] = {}

    def make(family: str = "llama", **overrides) -> Path:
        if family not in FAMILY_CONFIG:
            raise ValueError(f"unknown family {family!r}")
        key = (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            _write_tiny(path, family, overrides)
            made[key] = path
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an fp32 HF folder under .cache/ (built once by train/prepare_target.py)."""
    out = CACHE / "smollm2-135m-instruct-float32"
    proc = subprocess.run([sys.executable, str(REPO / "train" / "prepare_target.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"prepare_target failed:\n{proc.stdout}\n{proc.stderr}")
    return out
