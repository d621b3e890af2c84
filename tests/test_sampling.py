"""Sampling at T > 0 (DESIGN.md §5): exact rejection sampling keeps the target's distribution.

A tiny target with an 8-token vocabulary; every request decodes 3 tokens from the same prompt with
its own seed. The joints (t1, t2) and (t2, t3) of the generated tokens are compared with the exact
distributions computed from the target's logits by a chi-square goodness-of-fit test. t1 comes
from the prefill; t2 and t3 from the first speculative step(s): accepted drafts, residual samples
after a rejection, or the bonus token. The sample size is checked to detect a 2% shift of
probability mass, and deliberately biased verifiers must fail the same test.
"""
from __future__ import annotations

import pytest
import torch

from lilicorr.draft_runner import TorchDraftRunner
from lilicorr.engine import SpecEngine

from spec_helpers import ScriptedRunner, chi2_test, run_requests, small_model, target_of  # noqa: F401

VOCAB = 8
PROMPT = [1, 5, 7, 4]
N = 16000                  # samples per arm that must pass (see the power check)
N_BIASED = 2000            # a biased verifier must fail even with fewer samples
ALPHA = 1e-3               # significance level of every test here (the runs are seeded: deterministic)
BLOCK = 4


@pytest.fixture(scope="module")
def setup(tiny_target_dir):
    path = tiny_target_dir("llama", vocab_size=VOCAB)
    target = target_of(path)
    v, p = VOCAB, len(PROMPT)
    with torch.no_grad():
        ids1 = torch.tensor([PROMPT + [a] for a in range(v)])                                 # [V, P+1]
        ids2 = torch.tensor([PROMPT + [a, b] for a in range(v) for b in range(v)])           # [V*V, P+2]
        p1 = torch.softmax(target(torch.tensor([PROMPT]), torch.arange(p)[None]).logits[0, -1].double(), -1)
        p2 = torch.softmax(target(ids1, torch.arange(p + 1).expand(v, -1)).logits[:, -1].double(), -1)
        p3 = torch.softmax(target(ids2, torch.arange(p + 2).expand(v * v, -1)).logits[:, -1].double(), -1)
    p3 = p3.view(v, v, v)
    joint12 = p1[:, None] * p2                                                                # [t1, t2]
    joint23 = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)                               # [t2, t3]
    return dict(path=path, target=target, joint12=joint12, joint23=joint23, p2=p2, p3=p3)


def _greedy_script(p2, p3, top_k):
    """Drafts along the target's most likely tokens (high acceptance): at the first step the block
    after t1 is argmax p(.|t1), then argmax p(.|t1, d1); later steps use the anchor alone. Any
    deterministic function of the context is a valid proposal for exact rejection sampling."""
    p_len = len(PROMPT)

    def script(key, pos, anchor):
        d1 = int(p2[anchor].argmax())
        drafts = [d1, int(p3[anchor, d1].argmax()), int(p2[d1].argmax())] if pos == p_len else \
                 [d1, int(p2[d1].argmax()), int(p2[anchor].argmin())]
        pools = []
        for d in drafts[: BLOCK - 1]:
            pools.append([d] + [t for t in range(VOCAB) if t != d][: top_k - 1])
        return pools

    return script


class AlwaysAccept(SpecEngine):
    """A biased verifier: every draft is accepted."""

    def _reject_sample(self, logits, drafts, s):
        probs = torch.softmax(logits.float() / s.temperature, -1)
        return len(drafts), int(torch.multinomial(probs[len(drafts)], 1, generator=s.generator))


class ResampleFromTarget(SpecEngine):
    """A classic bug: after a rejection, sample from p instead of the residual (p without x)."""

    def _reject_sample(self, logits, drafts, s):
        probs = torch.softmax(logits.float() / s.temperature, -1)
        for i, x in enumerate(drafts):
            if float(torch.rand((), generator=s.generator)) < float(probs[i, x]):
                continue
            return i, int(torch.multinomial(probs[i], 1, generator=s.generator))
        return len(drafts), int(torch.multinomial(probs[len(drafts)], 1, generator=s.generator))


def _sample(setup, engine_cls=SpecEngine, runner="scripted", rule="argmax", n=N, temperature=1.0, seed=0):
    target = setup["target"]
    if runner == "scripted":
        r = ScriptedRunner(small_model(target, BLOCK), 500, _greedy_script(setup["p2"], setup["p3"], 4))
    elif runner == "untrained":
        r = TorchDraftRunner(small_model(target, BLOCK), 500)
    else:
        r = None
    engine = engine_cls(target, r, max_batch=500)
    res = engine.generate([PROMPT] * n, 3, rule=rule, temperature=temperature, seed=seed)
    toks = torch.tensor([x.tokens for x in res])                                             # [n, 3]
    assert toks.shape == (n, 3)
    steps = sum(x.num_steps for x in res)
    tau = sum(x.accepted_tokens for x in res) / max(steps, 1)
    return toks, tau


def _counts(toks, a, b):
    return torch.bincount(toks[:, a] * VOCAB + toks[:, b], minlength=VOCAB * VOCAB).view(VOCAB, VOCAB)


def _pvalues(setup, toks):
    return (chi2_test(_counts(toks, 0, 1), setup["joint12"])[2], chi2_test(_counts(toks, 1, 2), setup["joint23"])[2])


def test_sample_size_detects_a_two_percent_shift(setup):
    """Power of the test: moving 2% of the probability mass between two of the most likely cells
    of the (t1, t2) joint (the hardest place to see it) is detected at ALPHA in >= 90% of
    simulated runs of N samples, while the exact distribution is (almost) never rejected."""
    g = torch.Generator().manual_seed(0)
    for joint in (setup["joint12"],):
        p = joint.flatten()
        top = torch.argsort(p, descending=True)
        for src, dst in ((top[0], top[1]), (top[1], top[0]), (top[0], top[3]), (top[2], top[5])):
            q = p.clone()
            q[src] -= 0.02
            q[dst] += 0.02
            hits = sum(chi2_test(torch.bincount(torch.multinomial(q, N, True, generator=g), minlength=len(p)),
                                 p)[2] < ALPHA for _ in range(100))
            assert hits >= 90, f"only {hits}% power against a 2% shift {int(src)} -> {int(dst)}"
        false = sum(chi2_test(torch.bincount(torch.multinomial(p, N, True, generator=g), minlength=len(p)),
                              p)[2] < ALPHA for _ in range(100))
        assert false <= 2


@pytest.mark.parametrize("runner,rule,seed", [("scripted", "argmax", 1_000_000), ("untrained", "lilicorr", 2_000_000)])
def test_speculative_sampling_preserves_the_target_distribution(setup, runner, rule, seed):
    """Request i of an arm has seed `seed + i`: the arms use disjoint seed ranges, so their t1
    samples (drawn at prefill) are independent. Seeded, hence deterministic: a change of the random
    stream re-rolls the test, which then fails with probability ALPHA per joint."""
    toks, tau = _sample(setup, runner=runner, rule=rule, seed=seed)
    p12, p23 = _pvalues(setup, toks)
    assert p12 > ALPHA and p23 > ALPHA, (p12, p23)
    if runner == "scripted":
        assert tau > 1.5, tau                # the acceptance path is what is being tested


@pytest.mark.parametrize("engine_cls", [AlwaysAccept, ResampleFromTarget])
def test_biased_verifiers_fail_the_same_test(setup, engine_cls):
    toks, _ = _sample(setup, engine_cls=engine_cls, n=N_BIASED)
    p12, p23 = _pvalues(setup, toks)
    assert min(p12, p23) < 1e-6, (engine_cls.__name__, p12, p23)


def test_temperature_below_one_targets_the_sharpened_distribution(setup):
    """At T = 0.6 the samples follow softmax(logits / 0.6), not the T = 1 distribution."""
    t = 0.6
    target = setup["target"]
    p_len = len(PROMPT)
    with torch.no_grad():
        ids1 = torch.tensor([PROMPT + [a] for a in range(VOCAB)])
        l1 = target(torch.tensor([PROMPT]), torch.arange(p_len)[None]).logits[0, -1].double()
        l2 = target(ids1, torch.arange(p_len + 1).expand(VOCAB, -1)).logits[:, -1].double()
    joint = torch.softmax(l1 / t, -1)[:, None] * torch.softmax(l2 / t, -1)
    toks, _ = _sample(setup, n=4000, temperature=t)
    assert chi2_test(_counts(toks, 0, 1), joint)[2] > ALPHA
    assert chi2_test(_counts(toks, 0, 1), setup["joint12"])[2] < 1e-6


def test_per_request_seeds_are_reproducible(tiny_target_dir):
    """A request's output depends on its seed only: not on its batch mates, their number or the
    order of arrival; different seeds give different samples."""
    path = tiny_target_dir("qwen2")
    target = target_of(path)
    model = small_model(target, 8)
    prompts = [[5, 9, 11, 4], [7, 3], [20, 21, 22, 23, 24, 25]]

    def run(order, at, mates):
        engine = SpecEngine(target, TorchDraftRunner(model, 8), max_batch=8)
        reqs = [dict(prompt=prompts[i % 3], max_tokens=12, rule=("lilicorr", "argmax", "ar")[i % 3],
                     temperature=0.9, seed=100 + i, at=at(i)) for i in order]
        reqs += [dict(prompt=[9, 9, 9], max_tokens=7, rule="viterbi", temperature=1.3, seed=7 + j)
                 for j in range(mates)]
        results, _ = run_requests(engine, reqs)
        return {order[k]: results[k].tokens for k in range(len(order))}

    a = run(list(range(6)), lambda i: 0, 0)
    b = run([5, 3, 1, 4, 0, 2], lambda i: i % 4, 3)
    assert a == b
    c = {i: SpecEngine(target, TorchDraftRunner(model, 2), max_batch=2).generate(
        [prompts[i % 3]], 12, rule=("lilicorr", "argmax", "ar")[i % 3], temperature=0.9, seed=100 + i)[0].tokens
         for i in range(6)}
    assert a == c
    d = SpecEngine(target, TorchDraftRunner(model, 8), max_batch=8).generate(
        [prompts[0]] * 6, 12, rule="lilicorr", temperature=0.9, seed=500)
    assert len({tuple(r.tokens) for r in d}) > 1, "different seeds gave identical samples"
