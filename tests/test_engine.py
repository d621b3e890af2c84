"""SpecEngine (DESIGN.md §5): greedy verification is lossless for every decode rule, batch mix and
block size; partial acceptance, oracle and per-slot statistics are exact; continuous batching,
rollback of both caches, bad input, stop tokens / EOS, YaRN and the stage timer (issue 6).

Real components throughout (target, drafter, head, lattice rules, caches). The one test double is
`ScriptedRunner` (tests/spec_helpers.py): the real TorchDraftRunner with scripted slot logits,
which chooses the proposals so that acceptance paths with tau > 1 are exercised exactly.
"""
from __future__ import annotations

import contextlib
import gc
import math
import random

import pytest
import torch

from lilicorr import profiling
from lilicorr.bf16_gemm import _missing as bf16_gemm_missing
from lilicorr.draft_runner import TorchDraftRunner
from lilicorr.engine import SpecEngine, length_groups
from lilicorr.kv_cache import KVCache
from lilicorr.model import untrained_model
from lilicorr.profiling import BLOCK, STAGES, StageTimer, current_timer
from lilicorr.target import load_target
from lilicorr.tokenizer import Tokenizer

from spec_helpers import (RULES, SPEC_RULES, Corruptor, ScriptedRunner, hf_greedy,  # noqa: F401
                          random_prompts, run_requests, small_model, target_greedy, target_of)

pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen2", "qwen3")
PROMPT_LENS = (1, 11, 5, 17)          # ragged, including a one-token prompt
MAX_TOKENS = (13, 6, 19, 9)           # different per request


def _mixed_requests(prompts, max_tokens, rules=RULES, at=None):
    """Every prompt under every rule, interleaved so that each engine batch mixes rules."""
    reqs = []
    for p, m in zip(prompts, max_tokens):
        for rule in rules:
            reqs.append(dict(prompt=p, max_tokens=m, rule=rule, key=len(reqs)))
    if at is not None:
        for i, r in enumerate(reqs):
            r["at"] = at(i)
    return reqs


def _check_stats(r, evs, block_size, spec: bool):
    """Result bookkeeping agrees with the step events (acceptance, per-slot, histogram, tau)."""
    s = block_size - 1
    assert evs[0].drafted == 0 and evs[0].accepted == 1              # prefill token
    steps = evs[1:]
    assert r.num_steps == len(steps)
    assert r.accepted_tokens == sum(e.accepted for e in steps)
    assert r.tokens == [t for e in evs for t in e.new_tokens]
    assert sum(e.finished for e in evs) == 1 and evs[-1].finished
    if r.num_steps:
        assert math.isclose(r.tau, r.accepted_tokens / r.num_steps)
    if not spec:
        assert all(e.accepted == 1 and e.drafted == 0 for e in steps)
        return
    acc = [e.accepted - 1 for e in steps]                               # accepted drafts per step
    assert all(e.drafted == s and 0 <= a <= s for e, a in zip(steps, acc))
    assert r.slot_reached == [sum(a >= j for a in acc) for j in range(s)]
    assert r.slot_accepted == [sum(a > j for a in acc) for j in range(s)]
    assert r.accept_hist == [0] + [acc.count(k - 1) for k in range(1, block_size + 1)]
    # the proposal always comes from the pool, so the oracle prefix covers the accepted drafts
    assert r.oracle_accepted >= r.accepted_tokens


def test_prefill_length_groups():
    """New rows are prefilled in groups of similar length: one long prompt does not pad the rest."""
    lengths = [5, 500, 6, 7, 480, 300, 9]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [1, 4] in [sorted(g) for g in groups] or any(1 in g and 4 in g for g in groups)
    for g in groups:
        longest, real = max(lengths[i] for i in g), sum(lengths[i] for i in g)
        assert len(g) * longest <= 1.25 * real + 64 * len(g)
    assert all(len(g) == 1 for g in length_groups([10, 1000, 100000]))
    assert length_groups([]) == [] and length_groups([7] * 5) == [[0, 1, 2, 3, 4]]


# ---------------------------------------------------------------------------------- lossless
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_untrained_drafter(tiny_target_dir, family, block_size):
    """Mixed rules x ragged prompts x different max_tokens, 16 requests through 8 slots (so requests
    join as others finish): every output equals transformers' greedy generate and rule `ar`."""
    path = tiny_target_dir(family)
    target = target_of(path)
    engine = SpecEngine(target, TorchDraftRunner(untrained_model(target, block_size=block_size), 8), max_batch=8)
    prompts = random_prompts(PROMPT_LENS, target.config.vocab_size, seed=block_size)
    reqs = _mixed_requests(prompts, MAX_TOKENS)
    results, events = run_requests(engine, reqs)
    for i, (req, r) in enumerate(zip(reqs, results)):
        ref = hf_greedy(path, req["prompt"], req["max_tokens"])
        assert r.tokens == ref, f"{req['rule']} request {i} diverges from transformers' greedy output"
        assert r.finish_reason == "length" and r.prompt_len == len(req["prompt"])
        _check_stats(r, events[i], block_size, spec=req["rule"] != "ar")
    assert engine.num_active == 0 and engine.cache.num_free == 8 and engine.runner.cache.num_free == 8


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_with_partial_acceptance(tiny_target_dir, family, block_size):
    """Scripted proposals along the target's greedy continuation with a corrupted slot: `argmax`
    rows accept exactly the scripted number of drafts per step, lilicorr / viterbi rows pick with
    the real head from pools of 2 that hold the true token; outputs stay equal to the reference,
    tau > 1, and oracle / per-slot / histogram statistics are exact."""
    path = tiny_target_dir(family)
    target = target_of(path)
    vocab = target.config.vocab_size
    prompts = random_prompts(PROMPT_LENS, vocab, seed=100 + block_size)
    reqs = _mixed_requests(prompts, MAX_TOKENS, at=lambda i: i % 3)
    truths = {r["key"]: r["prompt"] + hf_greedy(path, r["prompt"], r["max_tokens"] + block_size) for r in reqs}
    script = Corruptor(truths, vocab, block_size, top_k=2, seed=block_size)
    runner = ScriptedRunner(small_model(target, block_size, top_k=2), 8, script)
    engine = SpecEngine(target, runner, max_batch=8)
    results, events = run_requests(engine, reqs, runner=runner)
    taus = {rule: [0, 0] for rule in SPEC_RULES}
    for i, (req, r) in enumerate(zip(reqs, results)):
        m = req["max_tokens"]
        assert r.tokens == truths[req["key"]][len(req["prompt"]):][:m], f"{req['rule']} request {i}"
        spec = req["rule"] != "ar"
        _check_stats(r, events[i], block_size, spec)
        if not spec:
            continue
        log = script.log[req["key"]]
        steps = events[i][1:]
        assert len(log) == len(steps) == r.num_steps
        if req["rule"] == "argmax":   # the verifier accepts exactly the scripted prefix
            assert [e.accepted - 1 for e in steps] == [c for _, c, _ in log]
        # the oracle prefix: scripted coverage d, cut where the target's continuation is unknown
        known = len(req["prompt"]) + 1 + sum(e.accepted for e in steps)
        assert r.oracle_accepted == sum(min(d, known - pos - 1) + 1 for pos, _, d in log)
        taus[req["rule"]][0] += r.accepted_tokens
        taus[req["rule"]][1] += r.num_steps
    assert taus["argmax"][0] / taus["argmax"][1] > 1 + 0.3 * (block_size - 1)
    for rule, (acc, steps) in taus.items():      # the head's picks from pools of 2 accept less
        assert acc / steps > 1.1, f"{rule}: tau {acc / steps:.2f} does not exercise multi-token acceptance"


@pytest.mark.parametrize("runner_kind", ["untrained", "scripted"])
def test_requests_joining_midway_do_not_change_outputs(tiny_target_dir, runner_kind):
    """The same requests alone, all at once, and joining at scattered steps: identical tokens."""
    path = tiny_target_dir("qwen3")
    target = target_of(path)
    b = 8
    prompts = random_prompts((7, 2, 14, 4, 9), target.config.vocab_size, seed=7)
    max_tokens = (20, 11, 6, 15, 9)
    outputs = []
    for schedule in ("alone", "together", "joining"):
        reqs = _mixed_requests(prompts, max_tokens, rules=("lilicorr", "argmax", "ar"),
                               at=(lambda i: 0) if schedule == "together" else (lambda i: (3 * i) % 7))
        truths = {r["key"]: r["prompt"] + hf_greedy(path, r["prompt"], r["max_tokens"] + b) for r in reqs}
        if runner_kind == "scripted":
            runner = ScriptedRunner(small_model(target, b, top_k=2), 6,
                                    Corruptor(truths, target.config.vocab_size, b, 2, seed=1, high_accept=True))
        else:
            runner = TorchDraftRunner(untrained_model(target, block_size=b), 6)
        if schedule == "alone":
            results = []
            for r in reqs:
                engine = SpecEngine(target, runner, max_batch=6)
                results += run_requests(engine, [dict(r, at=0)], runner=runner if runner_kind == "scripted" else None)[0]
        else:
            engine = SpecEngine(target, runner, max_batch=6)
            results = run_requests(engine, reqs, runner=runner if runner_kind == "scripted" else None)[0]
        outs = [r.tokens for r in results]
        assert outs == [truths[r["key"]][len(r["prompt"]):][: r["max_tokens"]] for r in reqs]
        outputs.append(outs)
    assert outputs[0] == outputs[1] == outputs[2]


def test_generate_matches_uncached_target_and_per_rule_batches(tiny_target_dir):
    """generate(): homogeneous batches per rule (more prompts than slots) equal a cache-free greedy
    loop over our own target."""
    path = tiny_target_dir("llama")
    target = target_of(path)
    engine = SpecEngine(target, TorchDraftRunner(untrained_model(target, block_size=4), 3), max_batch=3)
    prompts = random_prompts((6, 3, 9, 1, 12), target.config.vocab_size, seed=3)
    max_tokens = [8, 5, 3, 10, 7]
    ref = [target_greedy(target, p, m) for p, m in zip(prompts, max_tokens)]
    seen = []
    for rule in RULES:
        res = engine.generate(prompts, max_tokens, rule=rule, progress=seen.append)
        assert [r.tokens for r in res] == ref, rule
    assert sum(seen) == len(RULES) * sum(max_tokens)


def test_prefill_in_length_groups_is_lossless(tiny_target_dir):
    """Prompts of very different lengths arrive together (several prefill groups in one step)."""
    path = tiny_target_dir("llama")
    target = target_of(path)
    engine = SpecEngine(target, TorchDraftRunner(untrained_model(target, block_size=4), 4), max_batch=4)
    lens = (1, 110, 2, 3)
    assert len(length_groups(list(lens))) == 2
    prompts = random_prompts(lens, target.config.vocab_size, seed=5)
    ref = [target_greedy(target, p, 6) for p in prompts]
    for rule in ("ar", "lilicorr"):
        assert [r.tokens for r in engine.generate(prompts, [6] * 4, rule=rule)] == ref, rule


# ---------------------------------------------------------------------------------- rollback
@pytest.mark.parametrize("block_size", [4, 16])
def test_rollback_matches_fresh_run_on_accepted_prefix(tiny_target_dir, block_size):
    """After every step (rejections at scripted slots), each row's target KV cache up to its length
    and its drafter context cache equal those computed from scratch on the accepted prefix."""
    path = tiny_target_dir("qwen2")
    target = target_of(path)
    vocab = target.config.vocab_size
    prompts = random_prompts((5, 12, 2), vocab, seed=11)
    reqs = _mixed_requests(prompts, (14, 9, 17), rules=("argmax", "lilicorr"))
    truths = {r["key"]: r["prompt"] + hf_greedy(path, r["prompt"], r["max_tokens"] + block_size) for r in reqs}
    model = small_model(target, block_size, top_k=2)
    runner = ScriptedRunner(model, 6, Corruptor(truths, vocab, block_size, 2, seed=5))
    engine = SpecEngine(target, runner, max_batch=6)
    drafter = model.drafter
    capture = engine.capture
    rids = {}
    for r in reqs:
        runner.expect(r["key"])
        rids[engine.add_request(r["prompt"], r["max_tokens"], rule=r["rule"])] = r["key"]
    checked = partial = 0
    with torch.no_grad():
        while engine.num_active:
            events = engine.step()
            partial += sum(0 < e.accepted < block_size for e in events if e.drafted)
            for rid, seq in engine._seqs.items():
                truth = truths[rids[rid]]
                n = int(engine.cache.lengths[seq.tslot])
                assert n == seq.anchor_pos, "target cache must hold exactly the tokens before the anchor"
                assert truth[: n + 1] == seq.prompt + seq.tokens
                # fresh target run on the accepted prefix
                fresh = target.new_cache(1, capacity=8)
                out = target(torch.tensor([truth[:n]]), torch.arange(n)[None], cache=fresh,
                             rows=torch.tensor([0]), capture=capture)
                for layer in range(target.config.num_hidden_layers):
                    k, v = engine.cache.read(layer, torch.tensor([seq.tslot]), n)
                    fk, fv = fresh.read(layer, torch.tensor([0]), n)
                    torch.testing.assert_close(k, fk, atol=2e-5, rtol=1e-4)
                    torch.testing.assert_close(v, fv, atol=2e-5, rtol=1e-4)
                # fresh drafter context on the verified prefix it holds
                m = int(runner.cache.lengths[seq.dslot])
                assert m <= n
                queued = torch.cat(seq.pending) if seq.pending else None           # [P, n, H]
                pending = 0 if queued is None else len(queued)
                assert m + pending == n, "verified features are either in the drafter context or pending"
                if m:
                    kv = drafter.context_kv(drafter.project_context(out.captured[:, :m]), torch.arange(m)[None])
                    for layer, (fk, fv) in enumerate(kv):
                        k, v = runner.cache.read(layer, torch.tensor([seq.dslot]), m)
                        torch.testing.assert_close(k, fk, atol=2e-5, rtol=1e-4)
                        torch.testing.assert_close(v, fv, atol=2e-5, rtol=1e-4)
                    if pending:
                        torch.testing.assert_close(queued, out.captured[0, m:n], atol=2e-5, rtol=1e-4)
                # the head's target state is the captured layers just before the anchor
                torch.testing.assert_close(seq.state, out.captured[0, n - 1], atol=2e-5, rtol=1e-4)
                checked += 1
    assert checked > 10 and partial > 3, (checked, partial)


# ---------------------------------------------------------------------------------- bad input
def test_bad_input_raises_and_leaves_the_batch_untouched(tiny_target_dir):
    path = tiny_target_dir("llama")
    target = target_of(path)
    vocab = target.config.vocab_size
    engine = SpecEngine(target, TorchDraftRunner(untrained_model(target, block_size=4), 8), max_batch=8)
    prompts = random_prompts((4, 9, 6), vocab, seed=21)
    rids = [engine.add_request(p, 12, rule=rule) for p, rule in zip(prompts, ("lilicorr", "viterbi", "ar"))]
    engine.step()
    engine.step()
    room = engine.max_seq_len - engine.block_size - 1
    bad = [
        (dict(prompt_ids=[], max_tokens=4), "empty prompt"),
        (dict(prompt_ids=[5] * (room + 1), max_tokens=1), "longer than the context"),
        (dict(prompt_ids=[5] * 10, max_tokens=room), "exceeds the context"),
        (dict(prompt_ids=[5, 6], max_tokens=0), "max_tokens must be a positive integer"),
        (dict(prompt_ids=[5, 6], max_tokens=-3), "max_tokens must be a positive integer"),
        (dict(prompt_ids=[5, 6], max_tokens=2.5), "max_tokens must be a positive integer"),
        (dict(prompt_ids=[5, 6], max_tokens=4, rule="beam"), "unknown decode rule 'beam'"),
        (dict(prompt_ids=[5, 6], max_tokens=4, temperature=-0.5), "temperature must be a finite number"),
        (dict(prompt_ids=[5, 6], max_tokens=4, temperature=float("nan")), "temperature must be a finite number"),
        (dict(prompt_ids=[5, 6], max_tokens=4, temperature=float("inf")), "temperature must be a finite number"),
        (dict(prompt_ids=[5, 6], max_tokens=4, temperature="hot"), "temperature must be a finite number"),
        (dict(prompt_ids=[5, vocab], max_tokens=4), rf"token ids \[{vocab}\] outside the vocabulary"),
        (dict(prompt_ids=[-1, 5], max_tokens=4), r"token ids \[-1\] outside the vocabulary"),
        (dict(prompt_ids=[5, 2.5], max_tokens=4), "integer token ids"),
        (dict(prompt_ids="hello world", max_tokens=4), "not a string"),
        (dict(prompt_ids=[5, 6], max_tokens=4, stop_ids=["eos"]), "stop_ids must be integer"),
        (dict(prompt_ids=[5, 6], max_tokens=4, temperature=1.0, seed="x"), "seed must be an integer"),
    ]
    free = (engine.cache.num_free, engine.runner.cache.num_free)
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            engine.add_request(**kw)
        assert engine.num_active == 3 and (engine.cache.num_free, engine.runner.cache.num_free) == free
    # generate() validates every prompt before it queues any
    with pytest.raises(ValueError, match=r"prompt 1: empty prompt"):
        engine.generate([[5, 6], [], [7]], 3)
    with pytest.raises(ValueError, match="3 max_tokens values for 2 prompts"):
        engine.generate([[5, 6], [7]], [3, 3, 3])
    assert engine.num_active == 3
    while engine.num_active:
        engine.step()
    for rid, p in zip(rids, prompts):
        assert engine.pop_result(rid).tokens == hf_greedy(path, p, 12)
    # rules that need parts the engine lacks
    ar_only = SpecEngine(target, None, max_batch=2)
    with pytest.raises(ValueError, match="needs a drafter"):
        ar_only.add_request([5, 6], 3, rule="argmax")
    assert ar_only.generate([[5, 6]], 3, rule="ar")[0].tokens == target_greedy(target, [5, 6], 3)
    vanilla = SpecEngine(target, TorchDraftRunner(untrained_model(target, vanilla=True, block_size=4), 2), max_batch=2)
    for rule in ("lilicorr", "viterbi"):
        with pytest.raises(ValueError, match="needs a LiLiCorr head"):
            vanilla.add_request([5, 6], 3, rule=rule)
    assert vanilla.generate([[5, 6]], 5, rule="argmax")[0].tokens == target_greedy(target, [5, 6], 5)


def test_full_engine_and_cancel(tiny_target_dir):
    path = tiny_target_dir("llama")
    target = target_of(path)
    engine = SpecEngine(target, TorchDraftRunner(untrained_model(target, block_size=4), 2), max_batch=2)
    a = engine.add_request([5, 6, 7], 10, rule="lilicorr")
    b = engine.add_request([8, 9], 10, rule="ar")
    with pytest.raises(RuntimeError, match="full"):
        engine.add_request([5], 3)
    engine.step()
    engine.cancel(a)
    engine.cancel(a)                                   # no-op the second time
    assert engine.num_active == 1 and engine.cache.num_free == 1 and engine.runner.cache.num_free == 2
    c = engine.add_request([10, 11, 12, 13], 6, rule="viterbi")
    while engine.num_active:
        engine.step()
    assert engine.pop_result(b).tokens == hf_greedy(path, [8, 9], 10)
    assert engine.pop_result(c).tokens == hf_greedy(path, [10, 11, 12, 13], 6)


@contextlib.contextmanager
def _step_rows_recorded(target, seen: list):
    """Within: the target-cache rows of every step's target forward (not prefill) go to `seen`."""
    forward = target.forward

    def recording(ids, pos, *args, rows=None, **kwargs):
        if kwargs.get("logits", True):                   # a step (a prefill asks for no logits)
            seen.append(rows.tolist())
        return forward(ids, pos, *args, rows=rows, **kwargs)

    target.forward = recording
    try:
        yield
    finally:
        del target.forward


def test_running_rows_are_stepped_in_slot_order(tiny_target_dir):
    """Continuous batching at a steady load keeps the running rows on consecutive slots, stepped in
    slot order, so the target reads its cache as views (no gathered copies): requests that join as
    others finish take the lowest free slots."""
    path = tiny_target_dir("llama")
    target = target_of(path)
    engine = SpecEngine(target, TorchDraftRunner(untrained_model(target, block_size=4), 4), max_batch=4)
    seen = []
    with _step_rows_recorded(target, seen):
        prompts = random_prompts((5, 3, 8, 4, 6, 2, 7), target.config.vocab_size, seed=3)
        reqs = [dict(prompt=p, max_tokens=m, rule=r, key=i) for i, (p, m, r) in
                enumerate(zip(prompts, (9, 3, 12, 5, 7, 4, 6), ("lilicorr", "argmax") * 4))]
        results = run_requests(engine, reqs)[0]
    assert [r.tokens for r in results] == [hf_greedy(path, q["prompt"], q["max_tokens"]) for q in reqs]
    steps = [rows for rows in seen if len(rows) > 1]
    full = [rows for rows in seen if len(rows) == 4]
    assert len(full) > 5 and all(rows == [0, 1, 2, 3] for rows in full)     # joiners fill the holes
    assert all(rows == sorted(rows) for rows in steps)
    assert max(max(rows) for rows in seen) == 3          # never past the 4 slots a full batch needs


def test_rows_after_a_finished_one_move_down_to_keep_slots_packed(tiny_target_dir):
    """When a row finishes below other running rows and no new request takes its slot, the rows
    above it move down (KVCache.move, once), so every later step reads slots 0..N-1 as views; the
    moved rows' outputs stay the target's."""
    path = tiny_target_dir("llama")
    target = target_of(path)
    engine = SpecEngine(target, TorchDraftRunner(untrained_model(target, block_size=4), 4), max_batch=4)
    seen = []
    with _step_rows_recorded(target, seen):
        prompts = random_prompts((5, 3, 8, 4), target.config.vocab_size, seed=4)
        lengths = (2, 12, 5, 14)                        # slot 0 finishes first, then slot 2
        rids = [engine.add_request(p, m, rule=r) for p, m, r in
                zip(prompts, lengths, ("lilicorr", "argmax", "viterbi", "lilicorr"))]
        while engine.num_active:
            engine.step()
    for rid, p, m in zip(rids, prompts, lengths):
        assert engine.pop_result(rid).tokens == hf_greedy(path, p, m)
    spec = [rows for rows in seen if len(rows) > 1]
    assert len(spec) > 3 and all(rows == list(range(rows[0], rows[0] + len(rows))) for rows in spec), seen
    assert seen[-1] == [0] and engine.cache.num_free == 4


def test_cache_move_keeps_a_rows_entries():
    cache = KVCache(2, 4, 1, 3, capacity=4)
    a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
    kv = torch.arange(3 * 3, dtype=torch.float32).view(1, 3, 1, 3)           # [N=1, T=3, h, D]
    for layer in range(2):
        cache.write(layer, torch.tensor([c]), kv + layer, kv - layer, start=torch.tensor([0]))
    cache.advance(torch.tensor([c]), 3)
    cache.free(a)
    assert cache.move(c) == a and c in cache._free and cache.lengths[a] == 3
    for layer in range(2):
        k, v = cache.read(layer, slice(a, a + 1), 3)
        torch.testing.assert_close(k, (kv + layer).transpose(1, 2))
        torch.testing.assert_close(v, (kv - layer).transpose(1, 2))
    with pytest.raises(ValueError):
        cache.move(c)                                   # no longer allocated


# ---------------------------------------------------------------------------------- stop / EOS
def test_stop_tokens_end_a_sequence_mid_block(tiny_target_dir):
    """A stop id ends the sequence at its first occurrence, also when it is an accepted draft in
    the middle of a block (the rest of the block is dropped); other rows continue."""
    path = tiny_target_dir("qwen2")
    target = target_of(path)
    vocab, b = target.config.vocab_size, 8
    prompts = random_prompts((6, 3, 10), vocab, seed=31)
    reqs = _mixed_requests(prompts, (24, 24, 24))
    for r in reqs:
        ref = hf_greedy(path, r["prompt"], r["max_tokens"])
        r["stop_ids"] = [ref[5 + r["key"] % 7], vocab + 50]     # a token from the middle (+ one never made)
    truths = {r["key"]: r["prompt"] + hf_greedy(path, r["prompt"], 24 + b) for r in reqs}
    runner = ScriptedRunner(small_model(target, b, top_k=2), 8,
                            Corruptor(truths, vocab, b, 2, seed=3, high_accept=True))
    engine = SpecEngine(target, runner, max_batch=8)
    results, events = run_requests(engine, reqs, runner=runner)
    mid_block = 0
    for r, res, evs in zip(reqs, results, events.values()):
        ref = hf_greedy(path, r["prompt"], r["max_tokens"])
        stop = r["stop_ids"][0]
        cut = ref.index(stop) + 1
        assert res.tokens == ref[:cut] and res.finish_reason == "stop", r
        last = evs[-1]
        mid_block += last.drafted > 0 and len(last.new_tokens) < last.accepted
    assert mid_block > 0, "no stop token landed inside an accepted block"


def test_eos_and_tiny_limits(tiny_target_dir):
    """EOS from the tokenizer ends a sequence exactly where transformers' generate stops; a stop
    token sampled at prefill and max_tokens=1 finish without a verify step."""
    path = tiny_target_dir("llama")
    target = target_of(path)
    tok = Tokenizer.from_dir(path)
    eos = sorted(tok.eos_ids)
    assert target.config.eos_token_ids[0] in eos
    # a prompt whose greedy continuation produces EOS
    for seed in range(200):
        prompt = random_prompts((5,), target.config.vocab_size, seed=1000 + seed)[0]
        ref = target_greedy(target, prompt, 30)
        if eos[0] in ref[1:] and ref[0] != eos[0]:
            break
    else:
        pytest.skip("no EOS within 30 tokens for 200 random prompts")
    hf = hf_greedy(path, prompt, 30, stop_at_eos=True)
    assert hf[-1] == eos[0] and len(hf) < 30
    engine = SpecEngine(target, TorchDraftRunner(small_model(target, 4), 4), max_batch=4)
    for rule in RULES:
        res = engine.generate([prompt], 30, rule=rule, stop_ids=eos)[0]
        assert res.tokens == hf and res.finish_reason == "stop", rule
    first = ref[0]
    res = engine.generate([prompt, prompt], [30, 1], rule="lilicorr", stop_ids=[first])
    assert [r.tokens for r in res] == [[first], [first]]
    assert [r.finish_reason for r in res] == ["stop", "stop"] and [r.num_steps for r in res] == [0, 0]
    res = engine.generate([prompt], 1, rule="viterbi")[0]
    assert res.tokens == [first] and res.finish_reason == "length" and res.num_steps == 0 and res.tau == 0


# ---------------------------------------------------------------------------------- YaRN
def test_yarn_engine_is_lossless_against_ar_with_the_same_yarn(tiny_target_dir):
    """YaRN x2 on a 128-position model: prompts past the training length decode the same under
    every rule as under `ar` with the same scaling (the drafter shares the target's rope)."""
    path = tiny_target_dir("qwen3")
    engine = SpecEngine.from_paths(path, untrained_seed=0, block_size=4, max_batch=8, yarn_factor=2.0)
    assert engine.target.config.rope_scaling["rope_type"] == "yarn"
    assert engine.max_seq_len == 256
    vocab = engine.vocab_size
    prompts = random_prompts((150, 9, 131), vocab, seed=41)
    reqs = _mixed_requests(prompts, (12, 10, 8))
    results, _ = run_requests(engine, reqs)
    ar = {tuple(r["prompt"]): res.tokens for r, res in zip(reqs, results) if r["rule"] == "ar"}
    for r, res in zip(reqs, results):
        assert res.tokens == ar[tuple(r["prompt"])], r["rule"]
    assert ar[tuple(prompts[1])] == target_greedy(engine.target, prompts[1], 10)
    # the scaling is really on: a plain target decodes the long prompt differently
    plain = target_of(path)
    logits_plain = plain(torch.tensor([prompts[0]]), torch.arange(150)[None]).logits[0, -1]
    logits_yarn = engine.target(torch.tensor([prompts[0]]), torch.arange(150)[None]).logits[0, -1]
    assert not torch.allclose(logits_plain, logits_yarn, atol=1e-3)
    # and with a scripted high-acceptance runner (tau > 1) under YaRN
    b = 4
    cont = {tuple(p): target_greedy(engine.target, p, 12 + b) for p in prompts}
    truths = {r["key"]: r["prompt"] + cont[tuple(r["prompt"])] for r in reqs}
    runner = ScriptedRunner(small_model(engine.target, b, top_k=2), 8, Corruptor(truths, vocab, b, 2, seed=2))
    spec = SpecEngine(engine.target, runner, max_batch=8, max_seq_len=256)
    results, _ = run_requests(spec, reqs, runner=runner)
    assert [res.tokens for res in results] == [ar[tuple(r["prompt"])] for r in reqs]
    assert sum(res.accepted_tokens for res in results) > 1.3 * sum(res.num_steps for res in results)


# ---------------------------------------------------------------------------------- stage timer
def test_stage_times_add_up_to_the_block_wall(tiny_target_dir):
    """Issue 6: every part of a block is inside one of the five stages (within 5% of the wall).

    Python's cyclic garbage collector can pause anywhere, also between two stages; with pytest,
    torch and transformers loaded a full collection costs milliseconds, several % of a tiny
    model's block. It is switched off for the timed loops: what is tested is the engine's
    attribution of its own work.

    The process can also be descheduled between two stages when other jobs share the cores, so
    each rule gets up to 3 runs and the closest one is checked: work outside every stage is missing
    from all of them alike."""
    path = tiny_target_dir("llama")
    target = target_of(path)
    engine = SpecEngine(target, TorchDraftRunner(small_model(target, 8), 8), max_batch=8)
    prompts = random_prompts((5, 9, 3, 12), target.config.vocab_size, seed=51)
    engine.generate(prompts, 4, rule="lilicorr")                    # warm up

    def gap(t):
        return abs(t["stage_sum_ms"] - t["per_block_wall_ms"]) / t["per_block_wall_ms"]

    for rule in RULES:
        runs = []
        while len(runs) < 3 and (not runs or gap(runs[-1][0].table()) > 0.05):
            timer = StageTimer()
            gc.collect()
            gc.disable()
            try:
                with timer.active():
                    res = engine.generate(prompts, 12, rule=rule)
            finally:
                gc.enable()
            runs.append((timer, res))
        timer, res = min(runs, key=lambda r: gap(r[0].table()))
        t = timer.table()
        assert t["blocks"] == max(r.num_steps for r in res), rule      # one block per engine step
        assert gap(t) <= 0.05, (rule, t)
        if rule == "ar":
            assert t["stages_ms"][profiling.STAGE_HEAD] == 0 and t["stages_ms"][profiling.STAGE_VERIFY] > 0
        else:
            assert all(t["stages_ms"][s] > 0 for s in STAGES), (rule, t)
        assert "Per-block wall" in timer.markdown(rule)


class _CountingDomain:
    """Delegates to the real NVTX domain and counts pushes / pops (a spy, not a replacement)."""

    def __init__(self, real):
        self.real, self.depth, self.pushed = real, 0, []

    def get_event_attributes(self, **kw):
        return self.real.get_event_attributes(**kw) if self.real is not None else kw

    def push_range(self, attrs):
        self.depth += 1
        self.pushed.append(attrs)
        if self.real is not None:
            self.real.push_range(attrs)

    def pop_range(self):
        self.depth -= 1
        if self.real is not None:
            self.real.pop_range()


def test_stage_ranges_close_on_errors(tiny_target_dir, monkeypatch):
    path = tiny_target_dir("llama")
    target = target_of(path)
    domain = _CountingDomain(profiling._DOMAIN)
    monkeypatch.setattr(profiling, "_DOMAIN", domain)
    runner = ScriptedRunner(small_model(target, 4), 2, script=None, fail_on_draft=True)
    engine = SpecEngine(target, runner, max_batch=2)
    engine.add_request([5, 6, 7], 5, rule="argmax")
    timer = StageTimer()
    with pytest.raises(RuntimeError, match="scripted draft failure"):
        with timer.active():
            engine.step()                     # prefill
            assert current_timer() is timer and domain.depth == 0
            engine.step()                     # the draft raises inside block / draft stages
    assert domain.depth == 0 and len(domain.pushed) >= 3, "an NVTX range was left open"
    assert current_timer() is None
    assert timer.blocks == 1 and timer.block_wall > 0
    assert timer.totals[profiling.STAGE_DRAFT] > 0                   # the append-context stage closed
    assert timer.totals[profiling.STAGE_DRAFT] <= timer.block_wall
    assert BLOCK not in timer.totals


# ---------------------------------------------------------------------------------- SmolLM2 (slow)
def _smollm2_prompts(path, n=3):
    from lilicorr.data.suites import load_prompts, to_messages

    tok = Tokenizer.from_dir(path)
    items = load_prompts("gsm-symbolic", limit=n - 1) + [{"id": "x", "prompt": "Say hello in French."}]
    return [tok.encode_chat(to_messages(it)) for it in items]


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [4, 16])
def test_smollm2_lossless(smollm2_dir, block_size):
    """SmolLM2-135M-Instruct with chat-templated suite prompts: an untrained drafter (every rule,
    mixed in one batch) and a scripted partial-acceptance drafter (tau > 1) both reproduce
    transformers' greedy generate and rule `ar` token for token."""
    target = target_of(smollm2_dir)
    prompts = _smollm2_prompts(smollm2_dir)
    max_tokens = (20, 9, 14)
    reqs = _mixed_requests(prompts, max_tokens, at=lambda i: i % 2)
    engine = SpecEngine(target, TorchDraftRunner(untrained_model(target, block_size=block_size), 6), max_batch=6)
    results, events = run_requests(engine, reqs)
    for i, (r, res) in enumerate(zip(reqs, results)):
        assert res.tokens == hf_greedy(smollm2_dir, r["prompt"], r["max_tokens"]), (r["rule"], i)
        _check_stats(res, events[i], block_size, spec=r["rule"] != "ar")
    truths = {r["key"]: r["prompt"] + hf_greedy(smollm2_dir, r["prompt"], r["max_tokens"] + block_size)
              for r in reqs}
    vocab = target.config.vocab_size
    runner = ScriptedRunner(small_model(target, block_size, top_k=2), 6,
                            Corruptor(truths, vocab, block_size, 2, seed=9, high_accept=True))
    engine = SpecEngine(target, runner, max_batch=6)
    results, events = run_requests(engine, reqs, runner=runner)
    spec_acc = spec_steps = 0
    for i, (r, res) in enumerate(zip(reqs, results)):
        assert res.tokens == truths[r["key"]][len(r["prompt"]):][: r["max_tokens"]], (r["rule"], i)
        _check_stats(res, events[i], block_size, spec=r["rule"] != "ar")
        if r["rule"] != "ar":
            spec_acc, spec_steps = spec_acc + res.accepted_tokens, spec_steps + res.num_steps
    assert spec_acc / spec_steps > 1.5


# ---------------------------------------------------------------------------------- draft length
def _scripted_engine(path, block_size, draft_length, high_accept=True, seed=0):
    target = target_of(path)
    vocab = target.config.vocab_size
    prompts = random_prompts(PROMPT_LENS, vocab, seed=seed)
    reqs = _mixed_requests(prompts, MAX_TOKENS, rules=("lilicorr", "argmax", "ar"), at=lambda i: i % 2)
    truths = {r["key"]: r["prompt"] + hf_greedy(path, r["prompt"], r["max_tokens"] + block_size) for r in reqs}
    script = Corruptor(truths, vocab, block_size, top_k=2, seed=seed, high_accept=high_accept)
    runner = ScriptedRunner(small_model(target, block_size, top_k=2), 8, script)
    engine = SpecEngine(target, runner, max_batch=8, draft_length=draft_length)
    return engine, runner, reqs, truths


def _set_costs(engine, verify_ratio, step_seconds):
    """Fill the engine's measured cost model with chosen numbers for every load bucket:
    verify_ratio(k) = t_N(k)/t_N(1); the drafter's measured seconds are divided by step_seconds."""
    cm = engine.cost
    cm.online = False                  # these figures, not what the run measures, price every step
    for b in (1, 2, 4, 8):
        cm._ratios[b] = [verify_ratio(k) for k in range(1, cm.max_k + 1)]
        cm.step_seconds[b] = step_seconds
        cm.draft_seconds.pop(b, None)


@pytest.mark.parametrize("draft_length", [1, 2, "auto"])
def test_draft_length_is_lossless_and_bounded(tiny_target_dir, draft_length):
    """A fixed or adaptive draft length only verifies fewer drafts: outputs stay the target's greedy
    continuation for every rule, and no step verifies more drafts than asked."""
    path = tiny_target_dir("llama")
    engine, runner, reqs, truths = _scripted_engine(path, 5, draft_length)
    if draft_length == "auto":       # verifying is nearly free and drafting costs nothing: auto drafts
        _set_costs(engine, lambda k: 1.0 + 0.01 * (k - 1), step_seconds=1e9)
    results, events = run_requests(engine, reqs, runner=runner)
    limit = 4 if draft_length == "auto" else draft_length
    multi = 0
    for i, (req, r) in enumerate(zip(reqs, results)):
        assert r.tokens == truths[req["key"]][len(req["prompt"]):][: req["max_tokens"]], req["rule"]
        for e in events[i][1:]:
            assert e.drafted <= (0 if req["rule"] == "ar" else limit)
            assert e.accepted <= e.drafted + 1
            multi += e.accepted > 1
    assert multi > 0, "no step accepted a draft: the test does not exercise acceptance"


def test_auto_draft_length_degrades_to_plain_steps_under_cost(tiny_target_dir):
    """When verifying costs k plain steps for k tokens and the drafter is expensive, `auto` stops
    drafting (0 drafts = a plain step, features still captured) except for rare probes, and stays
    lossless, also when drafting resumes."""
    path = tiny_target_dir("llama")
    engine, runner, reqs, truths = _scripted_engine(path, 5, "auto", seed=3)
    _set_costs(engine, lambda k: float(k), step_seconds=1e-12)   # any drafter pass costs >> a step
    results, events = run_requests(engine, reqs, runner=runner)
    spec_steps = [e for i, req in enumerate(reqs) if req["rule"] != "ar" for e in events[i][1:]]
    for req, r in zip(reqs, results):
        assert r.tokens == truths[req["key"]][len(req["prompt"]):][: req["max_tokens"]], req["rule"]
    plain = sum(e.drafted == 0 for e in spec_steps)
    assert plain >= 0.7 * len(spec_steps), f"{plain} plain steps of {len(spec_steps)}"


@pytest.mark.parametrize("temperature,prompt_lookup", [(0.0, 0), (1.0, 0), (0.0, 3)])
def test_plain_spec_step_leaves_the_state_of_a_full_zero_draft_step(tiny_target_dir, temperature, prompt_lookup):
    """A speculative step with nothing to verify (no row drafts, every lookup priced at 0 tokens)
    takes the lean plain path; it must leave exactly what the full path leaves: the tokens and
    random draws, the per-row statistics (oracle, slot counts, acceptance histogram, lookup
    acceptance), the events, and the features the drafter later catches up on."""
    path = tiny_target_dir("llama")
    runs = []
    for lean in (True, False):
        engine, runner, reqs, truths = _scripted_engine(path, 5, "auto", seed=3)
        if temperature > 0:            # sampled anchors: a real (untrained) drafter instead of the script
            runner = TorchDraftRunner(small_model(engine.target, 5, top_k=2), 8)
            engine = SpecEngine(engine.target, runner, max_batch=8, draft_length="auto")
        engine.lean_plain_steps = lean
        engine.prompt_lookup = prompt_lookup
        _set_costs(engine, lambda k: float(k), step_seconds=1e-12)   # mostly plain steps, a few probes
        for i, r in enumerate(reqs):
            r["temperature"], r["seed"] = temperature, 100 + i
        appended, append = [], runner.append_context
        runner.append_context = lambda slots, feats, pos: appended.append(
            (slots.tolist(), [f.clone() for f in feats], pos.tolist())) or append(slots, feats, pos)
        plain, spec_step = [], engine._plain_spec_step
        engine._plain_spec_step = lambda seqs, look: plain.append(any(look)) or spec_step(seqs, look)
        results, events = run_requests(engine, reqs, runner=runner if temperature == 0 else None)
        runs.append((results, events, appended, plain, (engine._prior, engine._lookup_prior)))
    lean_res, lean_ev, lean_app, lean_plain, lean_learnt = runs[0]
    full_res, full_ev, full_app, full_plain, full_learnt = runs[1]
    assert lean_plain and not full_plain          # the lean path ran, and only where it was on
    assert any(lean_plain) == bool(prompt_lookup)   # with lookups: some of its steps had one, unverified
    assert lean_res == full_res
    assert lean_learnt == full_learnt               # the acceptance new rows start from, drafts and lookups
    assert [[(e.new_tokens, e.accepted, e.drafted) for e in lean_ev[i]] for i in range(len(lean_res))] == \
           [[(e.new_tokens, e.accepted, e.drafted) for e in full_ev[i]] for i in range(len(full_res))]
    assert len(lean_app) == len(full_app) > 0
    for (s1, f1, p1), (s2, f2, p2) in zip(lean_app, full_app):
        assert s1 == s2 and p1 == p2 and all(torch.equal(a, b) for a, b in zip(f1, f2))


def test_auto_draft_length_probes_back_off_while_they_do_not_pay(tiny_target_dir):
    """Where every drafter pass costs far more than it commits, each probing step doubles the wait
    before the next probe up to PROBE_BACKOFF_MAX, so the drafter runs less often than with a fixed
    probe interval; where drafting pays, the wait stays at its base. Outputs stay the target's."""
    path = tiny_target_dir("llama")
    drafted = {}
    for backoff in (1, SpecEngine.PROBE_BACKOFF_MAX):
        engine, runner, reqs, truths = _scripted_engine(path, 5, "auto", seed=3)
        engine.PROBE_EVERY, engine.PROBE_BACKOFF_MAX = 1, backoff      # short requests: probe often
        _set_costs(engine, lambda k: float(k), step_seconds=1e-12)   # any drafter pass costs >> a step
        passes, draft = [], runner.draft
        runner.draft = lambda *a, **k: passes.append(1) or draft(*a, **k)     # count drafter passes
        results, events = run_requests(engine, reqs, runner=runner)
        for req, r in zip(reqs, results):
            assert r.tokens == truths[req["key"]][len(req["prompt"]):][: req["max_tokens"]], req["rule"]
        assert engine._probe_scale == backoff
        drafted[backoff] = len(passes)
    assert 0 < drafted[SpecEngine.PROBE_BACKOFF_MAX] < drafted[1], drafted   # drafter passes
    engine, runner, reqs, truths = _scripted_engine(path, 5, "auto", high_accept=True)
    _set_costs(engine, lambda k: 1.0 + 0.01 * (k - 1), step_seconds=1e9)   # drafting always pays
    run_requests(engine, reqs, runner=runner)
    assert engine._probe_scale == 1


def test_auto_draft_length_probes_one_row_at_a_time(tiny_target_dir):
    """Where drafting never pays, rows that start together do not all probe on their first step:
    every drafter pass drafts for one row (the batch probes one row per PROBE_EVERY steps), and the
    rows take turns (the one that has gone longest without drafting). Outputs stay the target's."""
    path = tiny_target_dir("llama")
    engine, runner, reqs, truths = _scripted_engine(path, 5, "auto", seed=3)
    engine.PROBE_EVERY = engine._probe_wait = 3
    engine.PROBE_BACKOFF_MAX = 1
    _set_costs(engine, lambda k: float(k), step_seconds=1e-12)   # any drafter pass costs >> a step
    passes, draft = [], runner.draft
    runner.draft = lambda slots, *a, **k: passes.append(len(slots)) or draft(slots, *a, **k)
    results, events = run_requests(engine, reqs, runner=runner)
    for req, r in zip(reqs, results):
        assert r.tokens == truths[req["key"]][len(req["prompt"]):][: req["max_tokens"]], req["rule"]
    spec = [i for i, req in enumerate(reqs) if req["rule"] != "ar"]
    assert len(spec) >= 4 and passes and set(passes) == {1}, passes
    probed = [i for i in spec if any(e.drafted for e in events[i][1:])]
    assert len(probed) >= 3, probed                              # several rows had their turn


def test_auto_draft_length_rows_that_stopped_drafting_come_back(tiny_target_dir):
    """A row whose own acceptance history says drafting does not pay (here: every slot at 0, as
    after a run of rejected blocks) while every row's observed acceptance (the prior) says it does,
    moves back towards the prior on each step it does not draft, and drafts again within a few
    steps, without probes (switched off here). Without that it would never draft again: it sees no
    verified drafts while it does not draft. Outputs stay the target's."""
    path = tiny_target_dir("llama")
    engine, runner, reqs, truths = _scripted_engine(path, 5, "auto", high_accept=True)
    _set_costs(engine, lambda k: 1.0 + 0.01 * (k - 1), step_seconds=1e9)   # drafting always pays
    engine.PROBE_EVERY = engine._probe_wait = 10 ** 9                      # no probes
    engine._prior = [0.9] * len(engine._prior)
    add = engine.add_request

    def add_pessimist(*a, **k):
        rid = add(*a, **k)
        engine._seqs[rid].accept_rate = [0.0] * len(engine._prior)
        return rid
    engine.add_request = add_pessimist
    results, events = run_requests(engine, reqs, runner=runner)
    for i, (req, r) in enumerate(zip(reqs, results)):
        assert r.tokens == truths[req["key"]][len(req["prompt"]):][: req["max_tokens"]], req["rule"]
        if req["rule"] != "ar":
            steps = events[i][1:]
            first = next((j for j, e in enumerate(steps) if e.drafted), None)
            assert first is not None and 0 < first <= 5, (req["rule"], [e.drafted for e in steps])


def test_auto_draft_length_new_rows_start_from_the_observed_acceptance(tiny_target_dir):
    """Under `auto` a new row's per-slot acceptance starts from what the engine has observed over
    all rows' verified drafts: below the initial prior for a drafter whose drafts are mostly
    rejected, higher for one whose drafts are accepted; the outputs stay the target's."""
    path = tiny_target_dir("llama")
    priors = {}
    for high in (False, True):
        engine, runner, reqs, truths = _scripted_engine(path, 5, "auto", high_accept=high)
        _set_costs(engine, lambda k: 1.0 + 0.01 * (k - 1), step_seconds=1e9)   # drafting always pays
        start = list(engine._prior)
        results, events = run_requests(engine, reqs, runner=runner)
        for req, r in zip(reqs, results):
            assert r.tokens == truths[req["key"]][len(req["prompt"]):][: req["max_tokens"]], req["rule"]
        drafted = [e for ev in events.values() for e in ev if e.drafted]
        hits = sum(e.accepted > 1 for e in drafted) / len(drafted)        # slot 1 accepted
        priors[high] = list(engine._prior)
        assert engine._prior != start
        rid = engine.add_request(reqs[0]["prompt"], 4, rule="lilicorr")
        assert engine._seqs[rid].accept_rate == engine._prior and engine._seqs[rid].accept_rate is not engine._prior
        engine.cancel(rid)
        if not high:
            assert hits < 0.6 and priors[high][0] < start[0]
    assert priors[True][0] > priors[False][0]


def test_draft_length_rejects_bad_values(tiny_target_dir):
    target = target_of(tiny_target_dir("llama"))
    for bad in (0, 9, "fast", -1):
        with pytest.raises(ValueError, match="draft length"):
            SpecEngine(target, TorchDraftRunner(small_model(target, 5), 2), max_batch=2, draft_length=bad)


# ---------------------------------------------------------------------------------- bfloat16
def _bf16_ulp(x: float) -> float:
    """Spacing of bfloat16 numbers at |x| (8 significant bits: 2^(e - 7) for |x| in [2^e, 2^(e+1)))."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


class _FollowReference:
    """Script for ScriptedRunner over reference continuations that may be left: while a row's
    anchor is the reference token at its position, pools of 2 hold the reference's next tokens
    (at rank 0 nine times in ten), so blocks are verified k tokens at a time and mostly accepted;
    once the row has left the reference (a bf16 divergence), random pools."""

    def __init__(self, refs: dict, vocab: int, block_size: int, seed: int = 0):
        self.refs, self.vocab, self.s = refs, vocab, block_size - 1
        self.rng = random.Random(seed)

    def _other(self, avoid: int) -> int:
        t = self.rng.randrange(self.vocab)
        while t == avoid:
            t = self.rng.randrange(self.vocab)
        return t

    def __call__(self, key, pos: int, anchor: int) -> list[list[int]]:
        ref = self.refs[key]
        on = pos < len(ref) and ref[pos] == anchor
        pools = []
        for j in range(self.s):
            t = ref[pos + 1 + j] if on and pos + 1 + j < len(ref) else self.rng.randrange(self.vocab)
            o = self._other(t)
            pools.append([t, o] if self.rng.random() < 0.9 else [o, t])
        return pools


BF16_TIE_ULPS = 2


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_speculative_agrees_with_ar_up_to_near_ties(tiny_target_dir, family):
    """DESIGN.md §5, reduced precision: with the target in bfloat16 a k-token verify and a 1-token
    step round differently, so greedy speculative output need not equal greedy `ar` token for
    token. What must hold: the speculative output equals the `ar` output of the same bf16 target
    up to its first divergence, and every divergence starts at a near-tie of the plain step.

    The bound: at the divergence position the `ar` step's logit of its own token and of the token
    the speculative run emitted differ by at most BF16_TIE_ULPS = 2 bf16 ulps at the magnitude of
    the top logit (so the top-2 gap is within that too). The logits leave the LM head as bf16
    numbers; the verify computes the same real-valued logits with other matmul shapes, i.e. other
    rounding, and the two roundings can each move a logit by one representable step, in opposite
    directions for the two tokens: a flip needs a gap of at most two steps. A larger gap would be a
    real disagreement (a wrong cache row, mask or position), not rounding. Observed here: gaps of
    0 (exact bf16 ties) or 1 ulp. The fp32 tests above keep exact equality, and so does bf16 in
    batch-invariant mode (the default on CPUs, below); this test runs PyTorch's own kernels."""
    path = tiny_target_dir(family)
    target = load_target(path, dtype=torch.bfloat16, batch_invariant=False)      # PyTorch's kernels
    vocab, block, n_new = target.config.vocab_size, 8, 40
    prompts = random_prompts((3, 11, 5, 17, 8, 2), vocab, seed=7)

    # greedy `ar`, one request at a time, with the logits of every plain step (prefill included)
    ar_engine = SpecEngine(target, TorchDraftRunner(small_model(target, block, top_k=2), 1), max_batch=1)
    head, step_logits = target.lm_head, []
    inner = head.forward

    def record(x):
        out = inner(x)
        step_logits[-1].append(out.reshape(-1, out.shape[-1])[-1].float())
        return out
    ar_out = []
    head.forward = record                       # the real LM head; its outputs are kept
    try:
        for p in prompts:
            step_logits.append([])
            ar_out.append(ar_engine.generate([p], n_new, rule="ar")[0].tokens)
    finally:
        del head.forward
    assert all(len(lg) == n_new for lg in step_logits)

    # speculative rules, all requests batched, drafts along the `ar` output
    refs = {i: p + t for i, (p, t) in enumerate(zip(prompts, ar_out))}
    runner = ScriptedRunner(small_model(target, block, top_k=2), 8, _FollowReference(refs, vocab, block))
    engine = SpecEngine(target, runner, max_batch=8)
    reqs = [dict(prompt=p, max_tokens=n_new, rule=rule, key=i) for i, p in enumerate(prompts)
            for rule in ("lilicorr", "argmax")]
    results, _ = run_requests(engine, reqs, runner=runner)
    agreed, divergences = 0, []
    for req, r in zip(reqs, results):
        ref = ar_out[req["key"]]
        assert len(r.tokens) == len(ref) == n_new
        j = next((i for i, (a, b) in enumerate(zip(r.tokens, ref)) if a != b), None)
        agreed += n_new if j is None else j
        if j is None:
            continue
        logits = step_logits[req["key"]][j]             # the ar step that emitted ref[j]
        top2 = torch.topk(logits, 2).values
        bound = BF16_TIE_ULPS * _bf16_ulp(float(top2[0]))
        lost = float(logits[ref[j]] - logits[r.tokens[j]])   # >= 0: ref[j] is the step's argmax
        divergences.append((req["rule"], req["key"], j, lost / _bf16_ulp(float(top2[0]))))
        assert 0 <= lost <= bound, (f"{req['rule']} request {req['key']} diverges at token {j} where the plain "
                                    f"step prefers {ref[j]} by {lost:.4g} > {bound:.4g} (not a bf16 near-tie)")
        assert float(top2[0] - top2[1]) <= bound
    rate = agreed / (n_new * len(reqs))
    print(f"\nbf16 {family}: agreement with ar {rate:.1%} of tokens; divergences (rule, request, "
          f"token, gap in ulps): {divergences}")
    tau = sum(r.accepted_tokens for r in results) / sum(r.num_steps for r in results)
    assert tau > 1.5, f"tau {tau:.2f}: the k-token verify path is barely exercised"
    assert rate > 0.25 and len(divergences) < len(reqs), "speculative output does not follow ar at all"


# ---------------------------------------------------------------------------------- fp16 weights
def _lossless_runs(target, prompts, n_new: int, block: int, seed: int):
    """Greedy `ar` of `target`, then every speculative rule with scripted drafts along it (mostly
    accepted, some slots corrupted), all requests batched: (requests, results, ar outputs)."""
    vocab = target.config.vocab_size
    ar_engine = SpecEngine(target, TorchDraftRunner(small_model(target, block, top_k=2), 1), max_batch=1)
    ar = [ar_engine.generate([p], n_new + block, rule="ar")[0].tokens for p in prompts]
    truths = {i: p + t for i, (p, t) in enumerate(zip(prompts, ar))}
    runner = ScriptedRunner(small_model(target, block, top_k=2), 8,
                            Corruptor(truths, vocab, block, top_k=2, seed=seed, high_accept=True))
    engine = SpecEngine(target, runner, max_batch=8)
    reqs = [dict(prompt=p, max_tokens=n_new, rule=rule, key=i) for i, p in enumerate(prompts) for rule in SPEC_RULES]
    results, _ = run_requests(engine, reqs, runner=runner)
    return reqs, results, ar


def _assert_speculative_equals_ar(target) -> None:
    """Every speculative rule's greedy output is `ar`'s token for token, tau > 1.5."""
    prompts = random_prompts(PROMPT_LENS, target.config.vocab_size, seed=5)
    reqs, results, ar = _lossless_runs(target, prompts, n_new=24, block=8, seed=2)
    for req, r in zip(reqs, results):
        assert r.tokens == ar[req["key"]][:24], f"{req['rule']} request {req['key']} differs from ar"
    tau = sum(r.accepted_tokens for r in results) / sum(r.num_steps for r in results)
    assert tau > 1.5, f"tau {tau:.2f}: the k-token verify path is barely exercised"


@pytest.mark.parametrize("family,gemm_threads", [(f, 0) for f in FAMILIES] + [("llama", 2)])
def test_fp16_weights_speculative_equals_ar(tiny_target_dir, family, gemm_threads):
    """With the target as fp16-weights (fp16 weight matrices, fp32 arithmetic) a k-token verify and
    a 1-token step multiply the same fp16 values with fp32 accumulation: greedy output of every
    speculative rule equals greedy `ar` of the same target token for token, with multi-token
    acceptance exercised (tau > 1.5). Also as the server runs it on 2 cores: one torch thread,
    multi-token GEMMs split across 2 (`PackedFP16`)."""
    from lilicorr.fp16_linear import gemm_threads as current, set_gemm_threads
    set_gemm_threads(gemm_threads)
    try:
        assert current() == (gemm_threads or torch.get_num_threads())
        target = load_target(tiny_target_dir(family), dtype="fp16-weights")
        assert target.precision == "fp16-weights"
        _assert_speculative_equals_ar(target)
    finally:
        set_gemm_threads(0)


@pytest.mark.skipif(bool(bf16_gemm_missing()), reason=f"bf16-gemm: {bf16_gemm_missing()}")
@pytest.mark.parametrize("family,threads", [(f, 1) for f in FAMILIES] + [("llama", 2)])
def test_bf16_gemm_speculative_equals_ar(tiny_target_dir, family, threads):
    """With the target as bf16-gemm (bf16 weights and GEMM inputs, fp32 sums in a fixed order, each
    query's attention on its own) a k-token verify and a 1-token step give each row the same bits:
    greedy output of every speculative rule equals greedy `ar` of the same target token for token,
    with multi-token acceptance exercised (tau > 1.5), at 1 thread and with the kernel's columns
    split over 2."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        target = load_target(tiny_target_dir(family), dtype="bf16-gemm")
        # batch-invariant by default: its attention (`fused_attention`) passed the load-time check
        assert target.precision == "bf16-gemm" and target.batch_invariant
        _assert_speculative_equals_ar(target)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(bool(bf16_gemm_missing()), reason=f"bf16-gemm: {bf16_gemm_missing()}")
def test_prefill_threads_split_only_the_prefill_and_change_no_token(tiny_target_dir):
    """`set_prefill_threads(2)` with torch on one thread: prompts long enough for the bf16-gemm
    kernel to split (PARALLEL_ROWS tokens) prefill on 2 threads, and every token is the same as
    with the prefill on one; the GEMM-thread setting is back to its value after each prefill."""
    from lilicorr.bf16_gemm import PARALLEL_ROWS
    from lilicorr.fp16_linear import gemm_threads, set_prefill_threads
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = load_target(tiny_target_dir("llama"), dtype="bf16-gemm")
        prompts = random_prompts((PARALLEL_ROWS + 8, PARALLEL_ROWS + 3, 6), target.config.vocab_size, seed=7)
        runs = []
        for threads in (0, 2):
            set_prefill_threads(threads)
            runs.append([r.tokens for r in SpecEngine(target, None, max_batch=3).generate(prompts, 12, rule="ar")])
            assert gemm_threads() == 1
        assert runs[0] == runs[1]
        with pytest.raises(ValueError, match="prefill threads"):
            set_prefill_threads(-1)
    finally:
        set_prefill_threads(0)
        torch.set_num_threads(before)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_batch_invariant_speculative_equals_ar(tiny_target_dir, family):
    """With the target in bf16 on a CPU, in batch-invariant mode (`lilicorr.batch_invariant`, on by
    default where this machine's kernels pass its check), greedy output of every speculative rule
    equals greedy `ar` of the same bf16 target token for token, with multi-token acceptance
    exercised (tau > 1.5); the fp16-weights test's drafts and checks. Where the kernels fail the
    check there is nothing to test here: `test_bf16_speculative_agrees_with_ar_up_to_near_ties`
    covers PyTorch's own kernels."""
    target = load_target(tiny_target_dir(family), dtype="bfloat16")
    if not target.batch_invariant:
        pytest.skip("this machine's bf16 kernels are not batch-invariant (load_target warned)")
    _assert_speculative_equals_ar(target)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16-weights", "bfloat16"])
def test_smollm2_speculative_equals_ar(smollm2_dir, dtype):
    """The same on SmolLM2-135M-Instruct with chat prompts: fp16-weights (what `auto` serves on
    CPUs without AMX) and bf16 in batch-invariant mode (what it serves on AMX CPUs)."""
    target = load_target(smollm2_dir, dtype=dtype)
    if dtype == "bfloat16" and not target.batch_invariant:
        pytest.skip("this machine's bf16 kernels are not batch-invariant (load_target warned)")
    reqs, results, ar = _lossless_runs(target, _smollm2_prompts(smollm2_dir), n_new=20, block=8, seed=4)
    for req, r in zip(reqs, results):
        assert r.tokens == ar[req["key"]][:20], f"{req['rule']} request {req['key']} differs from ar"


def test_auto_draft_length_decides_for_the_whole_batch():
    """One verify runs every row to the longest draft and every row pays for the drafter pass: the
    cap and the drafting decision weigh the batch's expected tokens against that cost (by hand)."""
    from lilicorr.engine import _batch_cap
    cost = [1.0, 1.5, 2.0, 2.5]                           # verify 1..4 tokens, in plain steps
    gain = [1.0, 1.9, 2.5, 2.8]                           # expected tokens verifying 0..3 drafts
    assert _batch_cap([3], [gain], cost) == [1]           # 1.9 / 1.5 beats 1, 2.5 / 2 and 2.8 / 2.5
    assert _batch_cap([3, 0, 0, 0], [gain, [1.0], [1.0], [1.0]], cost) == [0, 0, 0, 0]   # 4.9 / 1.5 < 4
    assert _batch_cap([2, 2], [gain, gain], cost) == [1, 1]
    rows = [type("Row", (), {"accept_rate": [0.9, 0.6, 0.3]})() for _ in range(4)]
    both = SpecEngine._batch_drafting(["gain", None, None, "probe"], rows, cost, lambda d: 0.1)
    assert both == ([False, False, False, True], None)    # one row's gain does not pay for four rows
    assert SpecEngine._batch_drafting(["gain"] * 4, rows, cost, lambda d: 0.1) == ([True] * 4, 4.0)
    assert SpecEngine._batch_drafting(["gain"] * 4, rows, cost, lambda d: 0.05 * d)[0] == [True] * 4
    assert SpecEngine._batch_drafting(["gain"] * 4, rows, cost, lambda d: 0.5 * d)[0] == [False] * 4  # 4 rows' pass
    # a load whose drafting steps have been slower than plain ones: only the probe drafts
    assert SpecEngine._batch_drafting(["gain", "gain", "gain", "probe"], rows, cost, lambda d: 0.1,
                                      allowed=False) == ([False, False, False, True], None)
    # the bar is the batch without the drafter: with cheap verifies two rows verify good lookups
    # (2 drafts each: 2 x 2.7 + 2 tokens for 1.2 plain steps = 6.17 per plain step); drafting the two
    # others (3 drafts each: 2 x 2.602 + 5.4 tokens for 1.3 + the pass) beats n = 4 but not that
    cheap = [1.0, 1.1, 1.2, 1.3]
    lookups = {2: [1.0, 1.9, 2.7], 3: [1.0, 1.9, 2.7]}
    wish = ["gain", "gain", "lookup", "lookup"]
    assert SpecEngine._batch_drafting(wish, rows, cheap, lambda d: 0.5, lookups=lookups) == ([False] * 4, None)
    drafts, plain = SpecEngine._batch_drafting(wish, rows, cheap, lambda d: 0.1, lookups=lookups)
    assert drafts == [True, True, False, False] and plain == pytest.approx(7.4 / 1.2)


def test_served_verify_costs_replace_the_start_up_figures():
    """While serving, every verify forward folds into the cost at its exact number of rows: t(1) in
    seconds, t(k)/t(1) as ratios, each a running mean started from the bucket's start-up figures;
    ratios stay non-decreasing in k; with online=False the start-up figures stand (by hand)."""
    from lilicorr.costmodel import CostModel
    cm = CostModel(target=None, max_k=4)
    cm._ratios[4], cm.step_seconds[4] = [1.0, 1.02, 1.2, 1.3], 0.05
    cm.observe_verify(3, 1, 0.04)                       # 3 rows: a bucket-4 load with its own figures
    assert cm.plain_seconds(3) == pytest.approx(0.05 + 0.1 * (0.04 - 0.05))
    assert cm.plain_seconds(4) == 0.05 and cm.ratios(4) == [1.0, 1.02, 1.2, 1.3]
    base = cm.plain_seconds(3)
    cm.observe_verify(3, 2, 3.0 * base)                 # verifying 2 tokens was dearer than measured
    assert cm.ratio(3, 2) == pytest.approx(1.02 + 0.1 * (3.0 - 1.02))      # 1.218: above k = 3's 1.2
    assert cm.ratios(3)[2] == cm.ratio(3, 2) and cm.ratio(3, 4) == 1.3      # a running max over k
    assert cm.plain_steps(3, 2 * base) == pytest.approx(2.0)
    cm.observe_verify(3, 9, 1.0)                        # wider than the block: not a verify it prices
    cm.online = False
    cm.observe_verify(4, 1, 1.0)
    assert cm.ratios(3) == [1.0, 1.02, 1.2, 1.3] and cm.plain_seconds(3) == 0.05 and 4 not in cm._observed


def test_auto_draft_length_pauses_where_drafting_steps_were_slower(tiny_target_dir):
    """A drafting step's realized tokens per unit of measured cost, against the same batch without
    the drafter, is a running mean per number of rows (by hand); where it is below 1 the gate keeps
    the drafter off (no probes here), so those steps run plain, and a paused load moves back
    towards trying again while it does not draft. Outputs stay the target's."""
    path = tiny_target_dir("llama")
    engine, runner, reqs, truths = _scripted_engine(path, 5, "auto", high_accept=True)
    engine.cost.online = True
    assert engine._draft_gain_at(2) == 1.0                           # nothing seen: the gate is open
    engine._learn_draft_gain(2, tokens=3, paid=2.0, plain=2.0)      # 3 tokens where plain steps made 4
    engine._learn_draft_gain(2, tokens=5, paid=2.0, plain=2.0)      # 5 where they made 4
    keep, prior = 1 - SpecEngine.DRAFT_GAIN_RATE, SpecEngine.DRAFT_GAIN_PRIOR * 4
    retry = SpecEngine.DRAFT_GAIN_RETRY
    want = ((keep * (keep * retry * prior + 3) + 5) / (keep * (keep * prior + 4) + 4))   # a ratio of sums
    assert engine._draft_gain_at(2) == pytest.approx(want)
    for _ in range(3):
        engine._learn_draft_gain(2, tokens=1, paid=2.0, plain=2.0)
    gain = engine._draft_gain_at(2)
    assert gain < 1.0
    engine._relax_draft_gain(2)
    assert gain < engine._draft_gain_at(2) == pytest.approx(gain + SpecEngine.DRAFT_GAIN_RELAX * (retry - gain))
    drafted = {}
    for paused in (False, True):
        engine, runner, reqs, truths = _scripted_engine(path, 5, "auto", high_accept=True)
        _set_costs(engine, lambda k: 1.0 + 0.01 * (k - 1), step_seconds=1e9)   # drafting always pays
        engine.PROBE_EVERY = engine._probe_wait = 10 ** 9                      # no probes
        if paused:
            engine._draft_gain = {rows: (0.5, 1.0) for rows in range(1, engine.max_batch + 1)}
        results, events = run_requests(engine, reqs, runner=runner)
        for req, r in zip(reqs, results):
            assert r.tokens == truths[req["key"]][len(req["prompt"]):][: req["max_tokens"]], req["rule"]
        drafted[paused] = sum(e.drafted > 0 for ev in events.values() for e in ev)
        if paused:
            gains = [engine._draft_gain_at(r) for r in engine._draft_gain]
            assert all(g < 1.0 for g in gains) and max(gains) > 0.5, gains     # relaxing, still paused
    assert drafted[False] > 0 and drafted[True] == 0, drafted


def test_auto_draft_length_gate_and_probe_back_off_together(tiny_target_dir):
    """Both pauses at once, on a load where drafting pays again: every load's draft-gain gate
    closed and the probes backed off, rows starting from an acceptance that asks for no drafting.
    A closed gate still lets probes run (one row per step; nothing else drafts); a probe that pays
    resets the back-off and lifts the acceptance rows start from, so rows ask to draft (and stop
    probing); the gate holds them only until their load relaxes open, then drafting resumes.
    Outputs stay the target's throughout."""
    path = tiny_target_dir("llama")
    engine, runner, reqs, truths = _scripted_engine(path, 5, "auto", high_accept=True)
    _set_costs(engine, lambda k: 1.0 + 0.01 * (k - 1), step_seconds=1e9)   # drafting pays again
    engine._prior = [0.0] * len(engine._prior)             # what a losing stretch left: no row asks to draft
    engine.PROBE_EVERY, engine.PROBE_BACKOFF_MAX = 1, 4
    engine._probe_scale = engine._probe_wait = engine.PROBE_BACKOFF_MAX   # backed off by losing probes
    engine._draft_gain = {rows: (0.97, 1.0) for rows in range(1, engine.max_batch + 1)}   # gates closed
    steps, spec_step = [], engine._spec_step

    def watched(seqs):
        closed = engine._draft_gain_at(len(seqs)) < 1.0
        drafted_before = [s.drafted for s in seqs]
        out = spec_step(seqs)
        rows = sum(s.drafted > d for s, d in zip(seqs, drafted_before))
        steps.append((closed, rows, engine._probe_scale))
        return out

    engine._spec_step = watched
    results, events = run_requests(engine, reqs, runner=runner)
    for req, r in zip(reqs, results):
        assert r.tokens == truths[req["key"]][len(req["prompt"]):][: req["max_tokens"]], req["rule"]
    closed = [(rows, scale) for was_closed, rows, scale in steps if was_closed]
    opened = [rows for was_closed, rows, _ in steps if not was_closed]
    assert all(rows <= 1 for rows, _ in closed)                  # a closed gate: probes only
    assert any(rows == 1 and scale == 1 for rows, scale in closed)   # a probe paid: back-off reset
    assert opened and max(opened) >= 1                           # relaxed open: drafting resumed


def test_draft_cost_of_an_unseen_load_is_the_nearest_seen_one():
    """A drafter pass is priced by how many rows draft, in plain steps of the current load. Before a
    number of drafting rows (its bucket) has seen a pass, the nearest bucket's that has (the
    smaller one on a tie) stands in, not free; with none seen it is 0."""
    from lilicorr.costmodel import CostModel
    cm = CostModel(target=None, max_k=4)
    for b, step in ((1, 1.0), (2, 1.0), (4, 2.0), (8, 4.0), (16, 4.0)):
        cm._ratios[b], cm.step_seconds[b] = [1.0] * 4, step
    assert cm.draft_cost_at(3) == 0.0
    cm.observe_draft(1, 0.5)
    cm.observe_draft(8, 2.0)
    assert cm.draft_cost_at(1) == 0.5 and cm.draft_cost_at(8) == 0.5        # 2 s at a 4 s step
    assert cm.draft_cost_at(8, drafting=1) == 0.125                         # one row drafts at 8 rows
    assert cm.draft_cost_at(2) == 0.5 and cm.draft_cost_at(4) == 1.0        # nearest power of two
    assert cm.draft_cost_at(16) == 0.5
    cm.observe_draft(8, 4.0)                                                # a running mean
    assert cm.draft_cost_at(8) == pytest.approx((0.8 * 2.0 + 0.2 * 4.0) / 4.0)
    cm.observe_draft(1, 500.0)                              # a one-off pass counts for 3x the mean at most
    assert cm.draft_cost_at(1) == pytest.approx(0.8 * 0.5 + 0.2 * 1.5)
    cm.observe_draft(1, 0.25, replace=True)                 # a start-up measurement sets it
    assert cm.draft_cost_at(1) == 0.25
    cm.draft_seconds = {1: 0.5, 4: 1.0}
    assert cm.draft_cost_at(2) == 0.5                                       # a tie: the smaller count


def test_measure_costs_covers_every_load_before_serving(tiny_target_dir):
    """`measure_costs` measures the verify cost and the drafter's cost of every power-of-two bucket
    up to max_batch once; afterwards steps at any number of rows measure no verify cost (no request
    waits for a measurement)."""
    from lilicorr.costmodel import CostModel
    path = tiny_target_dir("llama")
    engine, runner, reqs, truths = _scripted_engine(path, 5, "auto", seed=3)
    assert set(engine.cost._ratios) == {1}                      # the start-up measurement at one row
    engine.measure_costs()
    want = {CostModel.bucket(r) for r in range(1, engine.max_batch + 1)}
    assert set(engine.cost._ratios) == want and max(want) >= engine.max_batch
    assert set(engine.cost.draft_seconds) == want               # the drafter's cost too, per bucket
    assert all(c > 0 for c in engine.cost.draft_seconds.values())
    assert all(runner.context_length(s) == 0 for s in range(engine.max_batch))   # its slots freed
    measured = dict(engine.cost._ratios)
    results, _ = run_requests(engine, reqs, runner=runner)
    assert engine.cost._ratios == measured                     # nothing measured while serving
    for req, r in zip(reqs, results):
        assert r.tokens == truths[req["key"]][len(req["prompt"]):][: req["max_tokens"]], req["rule"]
    plain = SpecEngine(engine.target, None, max_batch=4)
    plain.measure_costs()                                       # no auto draft length: nothing to measure
    assert plain.cost is None
