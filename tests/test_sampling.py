"""Sampling at T > 0 (DESIGN.md §5): exact rejection sampling keeps the target's distribution.

A tiny target with an 8-token vocabulary and block size B = 4 (3 draft slots, 0..2, plus the bonus);
every request decodes B + 1 = 5 tokens from the same prompt with its own seed. t1 comes from the
prefill; the first speculative step, drafted from t1, verifies slots 0, 1, 2 at t2, t3, t4 and, if
all three are accepted, takes the bonus token as t5. Later steps (from anchors t2, t3, ...) produce
the rest. The joints (t1, t2), (t2, t3), (t3, t4) and (t4, t5) of the generated tokens are compared
with the exact distributions computed from the target's logits by a chi-square goodness-of-fit
test, so draft slot 2 and the bonus token reach the test. The sample size is checked to detect a 2%
shift of probability mass, and deliberately biased verifiers, swapped in for
`SpecEngine._reject_sample`, must fail the same test: one that always accepts slot 2 and beyond,
one that takes the bonus token by argmax, one that always accepts and one that resamples from p
instead of the residual after a rejection. Rule `tree` (multi-draft sampling over the tree's
siblings) passes the same test, and a tree verifier that tests siblings against p instead of the
residual fails it.
"""
from __future__ import annotations

import pytest
import torch

from lilicorr.draft_runner import TorchDraftRunner
from lilicorr.engine import SpecEngine

from spec_helpers import ScriptedRunner, chi2_test, run_requests, small_model, target_of  # noqa: F401


VOCAB = 8
PROMPT = [1, 5, 7, 4]
BLOCK = 4
TOKENS = BLOCK + 1         # per request: prefill token + one full block (3 drafts + bonus)
N = 16000                  # samples per arm that must pass (see the power check)
N_BIASED = 2000            # a biased verifier must fail even with fewer samples
ALPHA = 1e-3               # significance level of every test here (the runs are seeded: deterministic)
PAIRS = [(k, k + 1) for k in range(TOKENS - 1)]   # (t1, t2), (t2, t3), (t3, t4), (t4, t5), 0-based


@pytest.fixture(scope="module")
def setup(tiny_target_dir):
    """Exact joint distribution of the first TOKENS tokens after PROMPT: one batched forward per
    prefix length over every prefix (8^4 = 4096 rows at most)."""
    path = tiny_target_dir("llama", vocab_size=VOCAB)
    target = target_of(path)
    v, p = VOCAB, len(PROMPT)
    joint = torch.ones(())
    with torch.no_grad():
        for k in range(TOKENS):
            prefixes = torch.cartesian_prod(*[torch.arange(v)] * k).view(v ** k, k) if k else \
                torch.zeros(1, 0, dtype=torch.long)
            ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], 1)
            logits = target(ids, torch.arange(p + k).expand(len(ids), -1)).logits[:, -1].double()
            cond = torch.softmax(logits, -1).view(*([v] * k), v)                              # p(t_k+1 | t_1..t_k)
            joint = joint.unsqueeze(-1) * cond                                                # [V] * (k+1)
    assert abs(float(joint.sum()) - 1) < 1e-9
    pairs = {}
    for a, b in PAIRS:
        pairs[a, b] = joint.sum(dim=[d for d in range(TOKENS) if d not in (a, b)])
    return dict(path=path, target=target, joint=joint, pairs=pairs)


def _greedy_script(joint, top_k):
    """Drafts along the most likely continuation (high acceptance). The proposal is a deterministic
    function of (anchor position, anchor), which is a valid proposal for exact rejection sampling:
    from anchor t_m (m = position - len(PROMPT) + 1), draft j is the argmax of the exact marginal of
    t_m+j given t_m = anchor and the earlier drafts. At the first step (anchor t1) this is the exact
    conditional argmax, so all of slots 0..2 are often accepted and the bonus token is reached;
    positions past the last generated token get a fixed draft."""
    p_len = len(PROMPT)

    def script(key, pos, anchor):
        m = pos - p_len                                  # 0-based index of the anchor in the output
        cond = joint.sum(dim=list(range(m))) if m else joint   # [t_m, t_m+1, ...]
        cond = cond[anchor]
        drafts = []
        for _ in range(BLOCK - 1):
            if cond.dim() == 0:
                drafts.append(0)
                continue
            marg = cond.sum(dim=list(range(1, cond.dim()))) if cond.dim() > 1 else cond
            d = int(marg.argmax())
            drafts.append(d)
            cond = cond[d]
        return [[d] + [t for t in range(VOCAB) if t != d][: top_k - 1] for d in drafts]

    return script


class AcceptFromSlot2(SpecEngine):
    """A biased verifier: exact rejection sampling at slots 0 and 1, but every draft at slot 2 and
    beyond is accepted without a test."""

    def _reject_sample(self, logits, drafts, s):
        probs = torch.softmax(logits.float().cpu() / s.temperature, -1)
        for i, x in enumerate(drafts):
            if i >= 2:
                continue
            if float(torch.rand((), generator=s.generator)) < float(probs[i, x]):
                continue
            resid = probs[i].clone()
            resid[x] = 0.0
            return i, int(torch.multinomial(resid / resid.sum(), 1, generator=s.generator))
        return len(drafts), int(torch.multinomial(probs[len(drafts)], 1, generator=s.generator))


class BonusByArgmax(SpecEngine):
    """A biased verifier: exact rejection sampling of every draft, but the bonus token after a
    fully accepted block is the target's argmax instead of a sample."""

    def _reject_sample(self, logits, drafts, s):
        a, tok = super()._reject_sample(logits, drafts, s)
        if a == len(drafts):
            tok = int(logits[a].argmax())
        return a, tok


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


class TreeSiblingsAgainstP(SpecEngine):
    """A biased tree verifier: every sibling is tested against the node's full distribution p
    instead of the residual left by the siblings tried before it."""

    def _tree_path(self, s, logits, greedy, children, tok):
        probs = torch.softmax(logits.float() / s.temperature, -1)
        path, cur = [0], 0
        while True:
            resid = probs[cur].clone()
            nxt = None
            for c in children.get(cur, ()):
                if float(torch.rand((), generator=s.generator)) < float(probs[cur, tok[c - 1]]):
                    nxt = c
                    break
                resid[tok[c - 1]] = 0.0
            if nxt is None:
                return path, int(torch.multinomial(resid / resid.sum(), 1, generator=s.generator))
            path.append(nxt)
            cur = nxt


class CountedTreePaths(SpecEngine):
    """The real tree verifier, counting accepted nodes that are not their parent's first child."""

    later_siblings = 0

    def _tree_path(self, s, logits, greedy, children, tok):
        path, bonus = super()._tree_path(s, logits, greedy, children, tok)
        type(self).later_siblings += sum(children[a].index(b) > 0 for a, b in zip(path, path[1:]))
        return path, bonus


def _sample(setup, engine_cls=SpecEngine, runner="scripted", rule="argmax", n=N, temperature=1.0, seed=0,
            tokens=TOKENS):
    """-> (tokens [n, tokens], tau, per-slot acceptance counts, steps that accepted every draft)."""
    target = setup["target"]
    if runner == "scripted":
        r = ScriptedRunner(small_model(target, BLOCK), 500, _greedy_script(setup["joint"], 4))
    elif runner == "untrained":
        r = TorchDraftRunner(small_model(target, BLOCK), 500)
    else:
        r = None
    engine = engine_cls(target, r, max_batch=500)
    res = engine.generate([PROMPT] * n, tokens, rule=rule, temperature=temperature, seed=seed)
    toks = torch.tensor([x.tokens for x in res])                                             # [n, tokens]
    assert toks.shape == (n, tokens)
    steps = sum(x.num_steps for x in res)
    tau = sum(x.accepted_tokens for x in res) / max(steps, 1)
    slot_accepted = [sum(x.slot_accepted[j] for x in res) for j in range(BLOCK - 1)]
    full_blocks = sum(x.accept_hist[BLOCK] for x in res)
    return toks, tau, slot_accepted, full_blocks


def _counts(toks, a, b):
    return torch.bincount(toks[:, a] * VOCAB + toks[:, b], minlength=VOCAB * VOCAB).view(VOCAB, VOCAB)


def _pvalues(setup, toks, pairs=PAIRS):
    """p-value of the chi-square test of each consecutive pair's joint: {(a, b): p}."""
    return {(a, b): chi2_test(_counts(toks, a, b), setup["pairs"][a, b])[2] for a, b in pairs}


def test_sample_size_detects_a_two_percent_shift(setup):
    """Power of the test: moving 2% of the probability mass between two of the most likely cells
    of a pair's joint is detected at ALPHA in >= 90% of simulated runs of N samples, while the exact
    distribution is (almost) never rejected. Checked on (t1, t2), the most peaked joint (the hardest
    place to see a shift), and on (t4, t5), the joint of slot 2 and the bonus."""
    g = torch.Generator().manual_seed(0)
    for pair in ((0, 1), (3, 4)):
        p = setup["pairs"][pair].flatten()
        top = torch.argsort(p, descending=True)
        for src, dst in ((top[0], top[1]), (top[1], top[0]), (top[0], top[3]), (top[2], top[5])):
            q = p.clone()
            q[src] -= 0.02
            q[dst] += 0.02
            hits = sum(chi2_test(torch.bincount(torch.multinomial(q, N, True, generator=g), minlength=len(p)),
                                 p)[2] < ALPHA for _ in range(100))
            assert hits >= 90, f"{pair}: only {hits}% power against a 2% shift {int(src)} -> {int(dst)}"
        false = sum(chi2_test(torch.bincount(torch.multinomial(p, N, True, generator=g), minlength=len(p)),
                              p)[2] < ALPHA for _ in range(100))
        assert false <= 2


SEED_SCRIPTED = 1_000_000


@pytest.mark.parametrize("engine_cls", [SpecEngine, AcceptFromSlot2, BonusByArgmax])
def test_every_slot_and_the_bonus_keep_the_target_distribution(setup, engine_cls):
    """The real verifier passes at every pair of positions, including slot 2 (t4 of the first step)
    and the bonus token (t5); a verifier biased only at slot 2 and beyond, or only at the bonus,
    is rejected, and only at the pairs that involve t4 / t5: t1..t3 never see those slots, which
    is why the test generates B + 1 tokens. Same requests, seeds and sample size for every arm.
    Request i has seed SEED_SCRIPTED + i; the runs are deterministic, so a change of the random
    stream re-rolls the test, which then fails with probability about ALPHA per pair."""
    toks, tau, slot_accepted, full_blocks = _sample(setup, engine_cls=engine_cls, seed=SEED_SCRIPTED)
    # the paths under test are exercised: multi-token steps, slot 2 accepted, full blocks + bonus
    assert tau > 1.5, tau
    assert slot_accepted[2] > N // 20 and full_blocks > N // 20, (slot_accepted, full_blocks)
    pv = _pvalues(setup, toks)
    early = {k: v for k, v in pv.items() if k[1] <= 2}                     # (t1, t2), (t2, t3)
    late = {k: v for k, v in pv.items() if k[1] > 2}                       # (t3, t4), (t4, t5)
    assert min(early.values()) > ALPHA, (engine_cls.__name__, pv)         # no verifier here is biased there
    if engine_cls is SpecEngine:
        assert min(late.values()) > ALPHA, pv
    else:
        assert min(late.values()) < 1e-6, (engine_cls.__name__, pv)


def test_untrained_drafter_with_the_head_keeps_the_target_distribution(setup):
    """Proposals from the real (untrained) drafter through the LiLiCorr head and decode rule."""
    toks, _, _, _ = _sample(setup, runner="untrained", rule="lilicorr", seed=2_000_000)
    pv = _pvalues(setup, toks)
    assert min(pv.values()) > ALPHA, pv


@pytest.mark.parametrize("engine_cls", [CountedTreePaths, TreeSiblingsAgainstP])
def test_tree_multi_draft_rule_keeps_the_target_distribution(setup, engine_cls):
    """Rule `tree` at T = 1 (multi-draft rejection sampling over the tree's siblings) passes at
    every pair of positions, with later siblings accepted often (the residual path is exercised);
    testing each sibling against p instead of the residual fails."""
    CountedTreePaths.later_siblings = 0
    toks, tau, _, _ = _sample(setup, engine_cls=engine_cls, rule="tree", seed=4_000_000,
                              n=N if engine_cls is CountedTreePaths else N_BIASED)
    pv = _pvalues(setup, toks)
    if engine_cls is CountedTreePaths:
        assert tau > 1.5 and CountedTreePaths.later_siblings > N // 20, (tau, CountedTreePaths.later_siblings)
        assert min(pv.values()) > ALPHA, pv
    else:
        assert min(pv.values()) < 1e-6, pv


@pytest.mark.parametrize("engine_cls", [AlwaysAccept, ResampleFromTarget])
def test_biased_verifiers_fail_with_fewer_samples(setup, engine_cls):
    toks, _, _, _ = _sample(setup, engine_cls=engine_cls, n=N_BIASED, seed=3_000_000)
    pv = _pvalues(setup, toks)
    assert min(pv.values()) < 1e-6, (engine_cls.__name__, pv)


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
    toks, _, _, _ = _sample(setup, n=4000, temperature=t, tokens=2)
    assert chi2_test(_counts(toks, 0, 1), joint)[2] > ALPHA
    assert chi2_test(_counts(toks, 0, 1), setup["pairs"][0, 1])[2] < 1e-6


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
