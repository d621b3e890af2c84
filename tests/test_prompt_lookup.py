"""Prompt lookup (lilicorr.ngram, SpecEngine(prompt_lookup=N)): the n-gram index proposes what
followed the latest earlier occurrence of the longest matching suffix; in the engine a row with a
match verifies that copy instead of drafting, exactly (accepted = the copy's leading run equal to the
target's greedy tokens), losslessly for every rule and draft length, and without a drafter pass.

Real target (tiny random llama) and real drafter + head; the drafter's pools are scripted
(`ScriptedRunner`) to miss the target's token at slot 1, so every accepted draft is a lookup's.
"""
from __future__ import annotations

import random

import pytest
import torch

from lilicorr.engine import SpecEngine
from lilicorr.ngram import MIN_NGRAM, NgramIndex, parse_prompt_lookup, replay_lookup

from spec_helpers import ScriptedRunner, hf_greedy, run_requests, small_model, target_of

pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------- the index
def _brute_force(tokens: list[int], max_n: int, min_n: int, length: int) -> list[int]:
    """The definition, by scanning: longest suffix n first, its latest earlier start."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        pat = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == pat:
                return tokens[start + n:start + n + length]
    return []


def test_index_proposes_the_latest_earlier_continuation_of_the_longest_suffix():
    idx = NgramIndex(3)
    idx.extend([5, 6, 7, 8, 9, 6, 7, 1, 2, 5, 6, 7])
    # suffix (5, 6, 7) occurred at 0 -> what followed it there
    assert idx.propose(4) == [8, 9, 6, 7]
    assert idx.propose(2) == [8, 9]
    idx.extend([3])                               # suffix (6, 7, 3): none; (7, 3): none -> nothing
    assert idx.propose(4) == []
    idx = NgramIndex(3)
    idx.extend([1, 2, 9, 1, 2, 4, 4, 1, 2])       # (4, 1, 2) new; (1, 2) latest earlier start is 3
    assert idx.propose(3) == [4, 4, 1]
    single = NgramIndex(2, min_ngram=2)
    single.extend([7, 1, 3, 7])                   # a 1-token match is below min_ngram
    assert single.propose(3) == []


def test_index_matches_a_brute_force_scan_as_tokens_arrive():
    rng = random.Random(0)
    for trial in range(20):
        max_n = rng.choice([2, 3, 4])
        idx, seq = NgramIndex(max_n), []
        for _ in range(120):
            new = [rng.randrange(6) for _ in range(rng.choice([1, 1, 2, 5]))]   # small vocabulary: repeats
            idx.extend(new)
            seq += new
            length = rng.randrange(1, 9)
            assert idx.propose(length) == _brute_force(seq, max_n, MIN_NGRAM, length), (trial, seq)


def test_bad_prompt_lookup_values_are_refused(tiny_target_dir):
    assert parse_prompt_lookup(None) == parse_prompt_lookup("off") == parse_prompt_lookup(0) == 0
    assert parse_prompt_lookup("3") == 3
    for bad in (1, -2, "many", 65, True):
        with pytest.raises(ValueError, match="prompt lookup"):
            parse_prompt_lookup(bad)
    target = target_of(tiny_target_dir("llama"))
    with pytest.raises(ValueError, match="prompt lookup"):
        SpecEngine(target, None, max_batch=2, prompt_lookup=1)
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramIndex(2, min_ngram=3)


# ------------------------------------------------------------------------------------- the engine
class _MissSlotOne:
    """Pools that never hold the target's greedy token at slot 1: the drafter accepts nothing."""

    def __init__(self, truths: dict, vocab: int, slots: int, top_k: int):
        self.truths, self.vocab, self.s, self.k = truths, vocab, slots, top_k

    def __call__(self, key, pos: int, anchor: int) -> list[list[int]]:
        if key is None:
            return [list(range(self.k)) for _ in range(self.s)]
        truth = self.truths[key]
        nxt = truth[pos + 1] if pos + 1 < len(truth) else -1
        pool = [t for t in range(self.vocab) if t != nxt][: self.k]
        return [pool] * self.s


def _repetitive_prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts made of a repeated motif, so a row's suffix often occurred before."""
    g = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [g.randrange(4, vocab) for _ in range(g.randrange(3, 7))]
        out.append((motif * 4)[: g.randrange(9, 20)])
    return out


def _lookup_engine(path, draft_length, prompt_lookup=3, block_size=5, max_tokens=24):
    target = target_of(path)
    vocab = target.config.vocab_size
    prompts = _repetitive_prompts(vocab, 5)
    reqs = [dict(prompt=p, max_tokens=max_tokens, rule=rule, key=i * 3 + j, at=(i + j) % 3)
            for i, p in enumerate(prompts) for j, rule in enumerate(("lilicorr", "argmax", "viterbi"))]
    truths = {r["key"]: r["prompt"] + hf_greedy(path, r["prompt"], max_tokens + block_size) for r in reqs}
    runner = ScriptedRunner(small_model(target, block_size, top_k=2), 8, _MissSlotOne(truths, vocab, block_size - 1, 2))
    engine = SpecEngine(target, runner, max_batch=8, draft_length=draft_length, prompt_lookup=prompt_lookup)
    return engine, runner, reqs, truths


@pytest.mark.parametrize("draft_length", [None, 2])
def test_lookup_steps_are_exact_lossless_and_skip_the_drafter(tiny_target_dir, draft_length):
    """Greedy output equals the target's for every spec rule; each row's steps, accepted tokens and
    lookup steps equal a replay over the target's own continuation where a step verifies the lookup
    copy (the whole copy, or the first N tokens) or else accepts nothing; and the drafter drafts only
    for rows without a lookup match."""
    path = tiny_target_dir("llama")
    engine, runner, reqs, truths = _lookup_engine(path, draft_length)
    drafted_rows = []
    draft = runner.draft

    def spy(slots, anchors, anchor_pos, state, rules, **kw):
        for slot, pos in zip(slots.tolist(), anchor_pos.tolist()):
            drafted_rows.append((runner.key_of[slot], pos))
        return draft(slots, anchors, anchor_pos, state, rules, **kw)

    runner.draft = spy
    results, events = run_requests(engine, reqs, runner=runner)
    verify = draft_length or engine.block_size - 1
    lookups = 0
    for i, (req, r) in enumerate(zip(reqs, results)):
        truth = truths[req["key"]]
        p = len(req["prompt"])
        assert r.tokens == truth[p:p + req["max_tokens"]], req["rule"]
        assert r.drafted_tokens == sum(e.drafted for e in events[i])
        steps, accepted, looked, _ = replay_lookup(truth, p, 3, verify, limit=req["max_tokens"])
        assert (r.num_steps, r.accepted_tokens, r.lookup_steps) == (steps, accepted, looked), req
        lookups += looked
    for key, pos in drafted_rows:               # the drafter ran only where the row had no match
        if key is None:
            continue
        idx = NgramIndex(3)
        idx.extend(truths[key][: pos + 1])
        assert idx.propose(4) == [], (key, pos)
    assert lookups > 0 and drafted_rows, "the test does not exercise both proposers"
    assert any(e.accepted > 1 for ev in events.values() for e in ev), "no lookup was accepted"


def test_auto_draft_length_verifies_lookups_that_pay_and_stays_lossless(tiny_target_dir):
    """Under auto with cheap verifies, rows verify their lookups (no drafter cost) and the output
    stays the target's; with verifies that cost k plain steps for k tokens they stop verifying
    copies that are rarely right, and learn from the committed tokens meanwhile."""
    path = tiny_target_dir("llama")
    for ratio, expect_lookups in ((lambda k: 1.0 + 0.01 * (k - 1), True), (lambda k: float(k), False)):
        engine, runner, reqs, truths = _lookup_engine(path, "auto")
        cm = engine.cost
        cm.online = False                  # these figures, not what the run measures, price every step
        for b in (1, 2, 4, 8):
            cm._ratios[b] = [ratio(k) for k in range(1, cm.max_k + 1)]
            cm.step_seconds[b] = 1e9 if expect_lookups else 1e-12   # drafting: free / far too dear
            cm.draft_seconds.pop(b, None)
        prior = list(engine._lookup_prior)
        results, events = run_requests(engine, reqs, runner=runner)
        for req, r in zip(reqs, results):
            p = len(req["prompt"])
            assert r.tokens == truths[req["key"]][p:p + req["max_tokens"]], req["rule"]
        looked = sum(r.lookup_steps for r in results)
        steps = sum(r.num_steps for r in results)
        assert engine._lookup_prior != prior              # it learned from the committed tokens
        if expect_lookups:
            assert looked > 0
        else:
            assert looked < 0.5 * steps, (looked, steps)


def test_prompt_lookup_off_by_default_and_ar_rows_never_look_up(tiny_target_dir):
    path = tiny_target_dir("llama")
    target = target_of(path)
    runner = ScriptedRunner(small_model(target, 5, top_k=2), 4, lambda key, pos, anchor: [[0, 1]] * 4)
    engine = SpecEngine(target, runner, max_batch=4)
    assert engine.prompt_lookup == 0
    rid = engine.add_request([5, 6, 7, 5, 6, 7], 4, rule="lilicorr")
    assert engine._seqs[rid].ngram is None
    engine = SpecEngine(target, runner, max_batch=4, prompt_lookup=3)
    for rule in ("ar", "tree"):
        rid = engine.add_request([5, 6, 7, 5, 6, 7], 4, rule=rule)
        assert engine._seqs[rid].ngram is None
        engine.cancel(rid)
    rid = engine.add_request([5, 6, 7, 5, 6, 7], 4, rule="argmax")
    assert engine._seqs[rid].ngram.propose(3) == [5, 6, 7]
