"""Magpie user turns (lilicorr/data/magpie.py, train/magpie.py) on the tiny random target.

The engine samples the turns for real (rule "ar", temperature > 0); the tiny target's word-level
tokenizer decodes words joined by spaces, so a turn's text can be checked against its opener.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lilicorr.data.magpie import (OPENERS, acceptable, generate_user_turns, normalise, opener_for,
                                  user_turn_prefix)

REPO = Path(__file__).resolve().parents[1]
TINY_OPENERS = ["how are you", "please write", "what is", "why"]   # words of the tiny vocabulary


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    from lilicorr.tokenizer import Tokenizer
    target = tiny_target_dir("llama")
    return target, Tokenizer.from_dir(target)


def _engine(target):
    from lilicorr.engine import SpecEngine
    return SpecEngine.from_paths(target, ckpt_dir=None, max_batch=8, max_seq_len=128, dtype=torch.float32)


def _turns(tiny, n, **kw):
    target, tok = tiny
    kw = dict(dict(temperature=2.0, max_tokens=12, batch_size=8, max_attempts=400), **kw)
    return generate_user_turns(_engine(target), tok, n, seed=3, **kw)


def test_user_turn_prefix_renders_the_template_up_to_the_message(tiny):
    _, tok = tiny
    prefix = user_turn_prefix(tok)
    whole = tok.encode_chat([{"role": "user", "content": "hello world"}], add_generation_prompt=False)
    assert whole[: len(prefix)] == prefix and len(whole) > len(prefix)
    assert tok.decode(whole[len(prefix):]).startswith("hello world")


def test_acceptable_and_normalise():
    assert acceptable("What is the best way to learn Python?")
    assert not acceptable("Too short here")                       # fewer than 4 words
    assert not acceptable("the the the the the the the the cat")   # a degenerate loop
    assert not acceptable("Tell me <|im_start|> more about it")    # template markup
    assert normalise("  What is  X?? ") == normalise("what is x")


def test_turns_deterministic_distinct_and_resumable(tiny):
    full = _turns(tiny, 6)
    assert len(full) == 6, "the tiny target should finish 6 acceptable turns in 400 attempts"
    assert _turns(tiny, 6) == full                                 # deterministic in the seed
    assert len({normalise(it["prompt"]) for it in full}) == 6
    for it in full:
        assert it["source"] == "magpie" and it["kind"] == "chat" and acceptable(it["prompt"])
        assert it["id"].startswith("magpie-3-")
    # an interrupted run (its first items kept) continues to the same list
    by_attempt = sorted(full, key=lambda it: int(it["id"].rsplit("-", 1)[1]))
    resumed = _turns(tiny, 6, done=by_attempt[:2])
    assert resumed[:2] == by_attempt[:2]
    assert {it["id"] for it in resumed} == {it["id"] for it in full}


def test_turns_with_openers_start_with_their_phrase(tiny):
    items = _turns(tiny, 6, openers=TINY_OPENERS)
    assert len(items) == 6
    plain = {it["id"]: it["prompt"] for it in _turns(tiny, 6)}
    for it in items:
        attempt = int(it["id"].rsplit("-", 1)[1])
        assert it["source"] == "magpie:opener"
        assert it["prompt"].startswith(opener_for(TINY_OPENERS, 3, attempt) + " ")
        assert plain.get(it["id"]) != it["prompt"]                # the opener changed what was sampled
    used = {opener_for(TINY_OPENERS, 3, a) for a in range(40)}
    assert used == set(TINY_OPENERS)                               # every phrase is drawn
    assert opener_for(TINY_OPENERS, 3, 7) == opener_for(TINY_OPENERS, 3, 7)
    with pytest.raises(ValueError, match="openers"):
        _turns(tiny, 2, openers=[])
    with pytest.raises(ValueError, match="openers"):
        _turns(tiny, 2, openers=["why", "  "])
    assert len(set(OPENERS)) == len(OPENERS) and all(o == o.strip() and o for o in OPENERS)


def test_cli_openers_file_and_guards(tiny, tmp_path):
    target, _ = tiny
    phrases = tmp_path / "openers.txt"
    phrases.write_text("\n".join(TINY_OPENERS) + "\n\n")
    out = tmp_path / "p.jsonl"

    def run(*extra):
        return subprocess.run([sys.executable, str(REPO / "train" / "magpie.py"), "--target", str(target),
                               "--out", str(out), "--num", "3", "--max-tokens", "12", "--temperature", "2",
                               "--batch-size", "8", "--dtype", "float32", "--max-attempts", "400", *extra],
                              capture_output=True, text=True, timeout=300)
    p = run("--seed", "3", "--openers", str(phrases))
    assert p.returncode == 0, p.stderr
    items = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(items) == 3 and all(it["source"] == "magpie:opener" for it in items)
    assert all(it["prompt"].split()[0] in {o.split()[0] for o in TINY_OPENERS} for it in items)
    p = run("--seed", "3")                                         # same file without openers: refused
    assert p.returncode == 2 and "--openers" in p.stderr
    p = run("--seed", "3", "--openers", str(tmp_path / "missing.txt"))
    assert p.returncode == 2 and "--openers" in p.stderr
