"""Tokenizer (tokenizers + jinja2) vs transformers' AutoTokenizer; StreamDecoder UTF-8 safety."""
from __future__ import annotations

import pytest

from lilicorr.tokenizer import StreamDecoder, Tokenizer

transformers = pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "hello how are you"}],
    [{"role": "system", "content": "please answer yes or no"},
     {"role": "user", "content": "is this code python ?"},
     {"role": "assistant", "content": "  yes  "},
     {"role": "user", "content": "why"}],
]


def _ids(x):
    return list(x["input_ids"] if hasattr(x, "keys") else x)


def _compare_with_hf(path):
    ours, ref = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(str(path))
    assert ours.vocab_size == len(ref)
    for chat in CHATS:
        for gen in (True, False):
            text = ours.apply_chat_template(chat, add_generation_prompt=gen)
            assert text == ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            ids = ours.encode_chat(chat, add_generation_prompt=gen)
            assert ids == _ids(ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True))
            assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
            assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    text = "hello world , how are you ?"
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == ref.encode(text, add_special_tokens=True)
    return ours, ref


def test_tiny_tokenizer_matches_transformers(tiny_target_dir):
    ours, ref = _compare_with_hf(tiny_target_dir("llama"))
    assert ours.eos_ids == {ours.token_id("</s>"), ours.token_id("<|im_end|>")}
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 3)
    assert ours.apply_chat_template(CHATS[0]).startswith("<s><|im_start|>user\nhello")
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError):
        ours.apply_chat_template([])


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def _stream(tok, ids, chunk):
    dec, parts = StreamDecoder(tok), []
    for i in range(0, len(ids), chunk):
        parts.append(dec.push(ids[i:i + chunk]))
    parts.append(dec.flush())
    return parts


def test_stream_decoder_tiny(tiny_target_dir):
    tok = Tokenizer.from_dir(tiny_target_dir("qwen2"))
    ids = tok.encode_chat(CHATS[1])
    for chunk in (1, 3):
        assert "".join(_stream(tok, ids, chunk)) == tok.decode(ids)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2_dir):
    ours, ref = _compare_with_hf(smollm2_dir)
    assert ours.vocab_size == 49152 and ours.eos_ids == {ours.token_id("<|im_end|>")}
    assert "SmolLM" in ours.apply_chat_template(CHATS[0])   # default system prompt of its template
    # multi-byte UTF-8 split across byte-level BPE tokens never leaks a replacement character
    text = "Grüße aus Köln: 東京タワー 🎉🚀 naïve café — done."
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    for chunk in (1, 2, 5):
        parts = _stream(ours, ids, chunk)
        assert "".join(parts) == text and not any("\ufffd" in p for p in parts)
