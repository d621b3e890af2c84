"""Tokenizer over an HF folder's `tokenizer.json` (the `tokenizers` package) + its chat template.

No transformers at run time: the chat template is rendered with jinja2 exactly as transformers'
`apply_chat_template` does (sandboxed environment, trim_blocks/lstrip_blocks, loopcontrols, the
`raise_exception`/`strftime_now`/`tojson`/`namespace` helpers, special-token strings as variables),
so `encode_chat` gives the token ids the target was trained on.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["Tokenizer", "StreamDecoder"]

_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# end-of-turn tokens of common chat formats; counted as EOS when present in the vocabulary
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def _token_str(v: Any) -> str | None:
    """tokenizer_config values are strings or AddedToken dicts {"content": ...}."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _compile_template(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers marks assistant spans)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = jinja2.utils.Namespace
    return env.from_string(source)


class Tokenizer:
    def __init__(self, tok: Any, config: dict[str, Any] | None = None, chat_template: str | None = None,
                 generation_eos: Iterable[int] = ()):
        self._tok = tok
        self.config = dict(config or {})
        self.special_tokens = {a: s for a in _SPECIAL_ATTRS if (s := _token_str(self.config.get(a)))}
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        eos = set(generation_eos)
        for s in [self.special_tokens.get("eos_token"), *_END_OF_TURN]:
            i = tok.token_to_id(s) if s else None
            if i is not None and (s == self.special_tokens.get("eos_token") or s in (chat_template or "")):
                eos.add(i)
        self.eos_ids: set[int] = eos

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read tokenizer.json, tokenizer_config.json (chat_template, special tokens), chat_template.jinja
        (newer transformers save the template there) and generation_config.json (extra EOS ids)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{tj} not found: the target folder needs a tokenizers-format tokenizer.json")
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text()
        gen_eos: list[int] = []
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            e = json.loads(gen_file.read_text()).get("eos_token_id")
            gen_eos = [] if e is None else ([e] if isinstance(e, int) else list(e))
        return cls(HFTokenizer.from_file(str(tj)), config, template, gen_eos)

    # ------------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        """Size of the id space including added tokens (HF `len(tokenizer)`)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _special_id(self, attr: str) -> int | None:
        s = self.special_tokens.get(attr)
        return self._tok.token_to_id(s) if s else None

    @property
    def bos_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_id(self) -> int | None:
        return self._special_id("pad_token")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. add_special_tokens=True applies tokenizer.json's post-processor
        (e.g. a BOS); chat prompts should use encode_chat, whose template already has them."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render one conversation as transformers' apply_chat_template(tokenize=False) does."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json / chat_template.jinja)")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise TypeError(f"chat messages must be dicts with a 'role', got {m!r}")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **kwargs}
        return self._template.render(messages=messages, tools=variables.pop("tools", None),
                                     documents=variables.pop("documents", None),
                                     add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False)

    def stream(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenisation: feed the growing token list, get text deltas.

    Decodes a short window of recent tokens (from a `prefix` offset, as in vLLM/TGI) so the cost per
    step is constant; a delta is held back while it ends in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0   # window start: decode(ids[prefix:read]) is the text already emitted of the window
        self.read = 0     # tokens whose text has been emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, new_ids: Iterable[int]) -> str:
        """Append tokens; return the newly completed text (possibly '')."""
        self.ids.extend(int(i) for i in new_ids)
        done = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if len(full) > len(done) and not full.endswith("\ufffd"):
            delta = full[len(done):]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (e.g. a genuinely invalid byte sequence at the end)."""
        done = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return full[len(done):]
