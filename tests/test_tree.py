"""Rule `tree`: draft trees built from the lattice (lattice.build_tree), their attention mask, the
target's tree verify, KV-cache compaction to the accepted path, and the engine's lossless
greedy output for mixed batches and several tree sizes."""
from __future__ import annotations

import heapq
import itertools
import math

import pytest
import torch

from lilicorr.engine import SpecEngine
from lilicorr.kv_cache import KVCache
from lilicorr.lattice import build_tree, greedy_walk, tree_attention, tree_size
from lilicorr.target import load_target

from spec_helpers import Corruptor, ScriptedRunner, hf_greedy, random_prompts, run_requests, small_model, target_of

LOG = math.log


def _hand_lattice():
    """K = 2, S = 2: root probabilities (0.7, 0.3); after candidate 0: (0.9, 0.1); after 1: (0.5, 0.5)."""
    anchor = torch.tensor([[LOG(0.7), LOG(0.3)]])
    pair = torch.tensor([[[[LOG(0.9), LOG(0.1)], [LOG(0.5), LOG(0.5)]]]])          # [1, 1, 2, 2]
    return anchor, pair


def test_build_tree_by_hand():
    """Best-first order on a lattice worked by hand: path probabilities .7, .63, .3, .15, .15 (tie:
    the child that entered the frontier first), .07; the tree stops at all K + K^2 paths."""
    anchor, pair = _hand_lattice()
    t = build_tree(anchor, pair, num_nodes=10)
    assert t.parent.tolist() == [[-1, 0, -1, 2, 2, 0]]
    assert t.depth.tolist() == [[0, 1, 0, 1, 1, 1]]
    assert t.cand.tolist() == [[0, 0, 1, 0, 1, 1]]
    want = [LOG(0.7), LOG(0.63), LOG(0.3), LOG(0.15), LOG(0.15), LOG(0.07)]
    assert torch.allclose(t.score, torch.tensor([want]), atol=1e-6)
    # a smaller budget keeps the first nodes; logits that differ by a constant give the same tree
    small = build_tree(anchor + 3.0, pair - 1.0, num_nodes=3)
    assert small.parent.tolist() == [[-1, 0, -1]] and small.cand.tolist() == [[0, 0, 1]]
    cand_ids = torch.tensor([[[11, 12], [21, 22]]])                                   # [1, S, K]
    assert t.tokens(cand_ids).tolist() == [[11, 21, 12, 21, 22, 22]]
    with pytest.raises(ValueError, match="at least one node"):
        build_tree(anchor, pair, num_nodes=0)


def best_first_by_heap(anchor_scores, pair_scores, num_nodes):
    """The definition of the tree, run literally: pop the best frontier path M times, pushing its
    K children (ties: the path that joined the frontier first). -> parent, depth, cand, score lists."""
    n, k = anchor_scores.shape
    s = pair_scores.shape[1] + 1
    root = torch.log_softmax(anchor_scores.double(), -1).tolist()
    cond = torch.log_softmax(pair_scores.double(), -1).tolist()
    out = []
    for r in range(n):
        order = itertools.count()
        frontier = [(-root[r][c], next(order), -1, 0, c) for c in range(k)]
        heapq.heapify(frontier)
        nodes = []
        for node in range(min(num_nodes, tree_size(k, s))):
            neg, _, par, d, c = heapq.heappop(frontier)
            nodes.append((par, d, c, -neg))
            if d + 1 < s:
                for c2 in range(k):
                    heapq.heappush(frontier, (neg - cond[r][d][c][c2], next(order), node, d + 1, c2))
        out.append(nodes)
    return out


@pytest.mark.parametrize("k,s,m", [(2, 3, 5), (4, 3, 12), (8, 7, 16), (8, 7, 64), (3, 2, 100), (5, 4, 1)])
def test_build_tree_equals_best_first_expansion(k, s, m):
    """The by-slot computation equals popping a best-first heap M times, row by row."""
    g = torch.Generator().manual_seed(k * 100 + s * 10 + m)
    anchor, pair = 2 * torch.randn(3, k, generator=g), 2 * torch.randn(3, s - 1, k, k, generator=g)
    t = build_tree(anchor, pair, num_nodes=m)
    want = best_first_by_heap(anchor, pair, m)
    assert t.parent.shape == (3, min(m, tree_size(k, s)))
    for r in range(3):
        assert t.parent[r].tolist() == [x[0] for x in want[r]]
        assert t.depth[r].tolist() == [x[1] for x in want[r]]
        assert t.cand[r].tolist() == [x[2] for x in want[r]]
        assert torch.allclose(t.score[r].double(), torch.tensor([x[3] for x in want[r]], dtype=torch.double),
                              atol=1e-5)


def test_build_tree_runs_where_its_inputs_are():
    """Tensor ops only: the tree comes back on the scores' device and dtype-independent (bf16 in)."""
    g = torch.Generator().manual_seed(3)
    anchor, pair = torch.randn(2, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    t32 = build_tree(anchor, pair, 9)
    t16 = build_tree(anchor.bfloat16(), pair.bfloat16(), 9)
    assert t16.parent.device == anchor.device and t16.score.dtype == torch.float32
    assert t16.parent.shape == t32.parent.shape == (2, 9)


def test_build_tree_batch_rows_are_independent_and_start_with_the_walk():
    """Each row's tree is the tree of that row alone; its first node is the walk's first pick and,
    with a budget of S nodes or more, the first S nodes never leave the best-first frontier order
    (scores never increase along the expansion)."""
    g = torch.Generator().manual_seed(0)
    anchor, pair = torch.randn(3, 4, generator=g), torch.randn(3, 3, 4, 4, generator=g)
    t = build_tree(anchor, pair, num_nodes=12)
    for r in range(3):
        one = build_tree(anchor[r: r + 1], pair[r: r + 1], num_nodes=12)
        assert torch.equal(one.parent, t.parent[r: r + 1]) and torch.equal(one.cand, t.cand[r: r + 1])
    walk = greedy_walk(anchor, pair)
    assert t.cand[:, 0].tolist() == walk[:, 0].tolist() and (t.depth[:, 0] == 0).all()
    assert bool((t.score[:, 1:] <= t.score[:, :-1] + 1e-6).all())
    # every node's parent precedes it, at one slot less
    for r in range(3):
        for i, p in enumerate(t.parent[r].tolist()):
            assert p < i and (t.depth[r, i] == (0 if p < 0 else int(t.depth[r, p]) + 1))


def test_tree_attention_by_hand():
    vis = tree_attention(torch.tensor([[-1, 0, -1, 2, 2, 0]]))
    want = torch.tensor([[1, 0, 0, 0, 0, 0, 0],      # anchor
                         [1, 1, 0, 0, 0, 0, 0],      # node 0: anchor, itself
                         [1, 1, 1, 0, 0, 0, 0],      # node 1 (child of 0)
                         [1, 0, 0, 1, 0, 0, 0],      # node 2 (child of the anchor)
                         [1, 0, 0, 1, 1, 0, 0],      # node 3 (child of 2)
                         [1, 0, 0, 1, 0, 1, 0],      # node 4 (child of 2)
                         [1, 1, 0, 0, 0, 0, 1]],     # node 5 (child of 0)
                        dtype=torch.bool)
    assert torch.equal(vis[0], want)


def test_keep_paths_moves_entries_and_sets_lengths():
    cache = KVCache(num_layers=2, num_slots=3, num_kv_heads=1, head_dim=2, capacity=8)
    for slot in range(3):
        cache.allocate()
    rows = torch.tensor([2, 0])
    vals = torch.arange(2 * 6 * 2, dtype=torch.float32).view(2, 6, 1, 2)               # [N, T, h, D]
    start = torch.tensor([1, 0])
    cache.lengths[rows] = start
    for layer in range(2):
        cache.write(layer, rows, vals + 100 * layer, vals - 100 * layer, start)
    cache.advance(rows, 6)
    cache.keep_paths(rows, start, [[0, 2, 5], [0, 1]])
    assert cache.lengths[rows].tolist() == [4, 2]
    for layer in range(2):
        k, v = cache.read(layer, torch.tensor([2]), 4)                                  # [1, h, 4, D]
        assert torch.equal(k[0, 0, 1:], (vals[0, [0, 2, 5], 0] + 100 * layer))
        assert torch.equal(v[0, 0, 1:], (vals[0, [0, 2, 5], 0] - 100 * layer))
        k0, _ = cache.read(layer, torch.tensor([0]), 2)
        assert torch.equal(k0[0, 0], vals[1, :2, 0] + 100 * layer)
    with pytest.raises(ValueError, match="not increasing"):
        cache.keep_paths(rows, start, [[0, 2, 2], [0]])


@torch.no_grad()
def test_tree_verify_equals_each_path_run_causally(tiny_target_dir):
    """One forward over [anchor, tree nodes] with the tree mask and depth positions gives, at every
    node, the logits and captured features of running its path alone, causally, after the prompt."""
    target = target_of(tiny_target_dir("qwen3"))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, 96, (1, 7), generator=g)
    parent = torch.tensor([[-1, 0, -1, 1, 2, 0, 3]])
    depth = torch.tensor([[0, 1, 0, 2, 1, 1, 3]])
    nodes = torch.randint(4, 96, (1, 7), generator=g)
    anchor = torch.tensor([[5]])
    cache = target.new_cache(1, capacity=32)
    rows = torch.tensor([cache.allocate()])
    target(prompt, torch.arange(7)[None], cache=cache, rows=rows, logits=False)
    block = torch.cat([anchor, nodes], 1)
    pos = 7 + torch.cat([torch.zeros(1, 1, dtype=torch.long), depth + 1], 1)
    out = target(block, pos, cache=cache, rows=rows, capture=(1,), tree=tree_attention(parent))
    assert cache.lengths[rows].tolist() == [15]
    for i in range(7):
        path, p = [], i
        while p >= 0:
            path.append(p)
            p = int(parent[0, p])
        ids = torch.cat([prompt, anchor, nodes[:, path[::-1]]], 1)
        ref = target(ids, torch.arange(ids.shape[1])[None], capture=(1,))
        assert torch.allclose(out.logits[0, i + 1], ref.logits[0, -1], atol=1e-5, rtol=1e-5), i
        assert torch.allclose(out.captured[0, i + 1], ref.captured[0, -1], atol=1e-5, rtol=1e-5), i
    with pytest.raises(ValueError, match="tree must be"):
        target(block, pos, cache=cache, rows=rows, tree=torch.ones(1, 3, 3, dtype=torch.bool))


def _tree_requests(prompts, max_tokens, rules=("tree", "lilicorr", "ar")):
    return [dict(prompt=p, max_tokens=m, rule=rules[i % len(rules)], key=i, at=i % 3)
            for i, (p, m) in enumerate(zip(prompts, max_tokens))]


@pytest.mark.parametrize("tree_nodes", [1, 5, 14, 40])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_rule_is_lossless_in_mixed_batches(tiny_target_dir, family, tree_nodes):
    """Scripted pools of 2 along the target's greedy continuation (some slots without the true
    token): `tree` rows batched with `lilicorr` and `ar` rows, joining midway, reproduce
    transformers' greedy output token for token. With the whole tree (K + K^2 + K^3 = 14 nodes at
    block 4, or more) a tree row accepts exactly the oracle prefix of every step."""
    path = tiny_target_dir(family)
    target = target_of(path)
    block, vocab = 4, target.config.vocab_size
    prompts = random_prompts((3, 9, 1, 14, 6, 11, 5, 2, 8), vocab, seed=tree_nodes)
    max_tokens = (17, 9, 21, 12, 15, 7, 19, 11, 13)
    reqs = _tree_requests(prompts, max_tokens)
    truths = {r["key"]: r["prompt"] + hf_greedy(path, r["prompt"], r["max_tokens"] + block + 1) for r in reqs}
    runner = ScriptedRunner(small_model(target, block, top_k=2), 4, Corruptor(truths, vocab, block, 2, seed=1))
    engine = SpecEngine(target, runner, max_batch=4, tree_nodes=tree_nodes)
    results, events = run_requests(engine, reqs, runner=runner)
    for req, r in zip(reqs, results):
        assert r.tokens == truths[req["key"]][len(req["prompt"]):][: req["max_tokens"]], (req["rule"], req["key"])
        assert r.finish_reason == "length"
        if req["rule"] == "tree":
            assert r.num_steps == len(events[req["key"]]) - 1          # the prefill event, then one per step
            assert sum(r.accept_hist) == r.num_steps
            if tree_nodes >= 14:
                assert r.accepted_tokens == r.oracle_accepted, (r.accepted_tokens, r.oracle_accepted)
    assert engine.num_active == 0 and engine.cache.num_free == 4 and engine.runner.cache.num_free == 4
    acc = {rule: sum(r.accepted_tokens for q, r in zip(reqs, results) if q["rule"] == rule) /
           sum(r.num_steps for q, r in zip(reqs, results) if q["rule"] == rule) for rule in ("tree", "lilicorr")}
    print(f"\ntau at M={tree_nodes}: {acc}")
    if tree_nodes >= 14:
        assert acc["tree"] > acc["lilicorr"], acc


def test_tree_rule_at_temperature_is_seeded_and_mixes_with_greedy_rows(tiny_target_dir):
    """At T > 0 a `tree` row verifies its tree (multi-draft sampling, distribution tested in
    test_sampling.py): a seed fixes its tokens, alone or in a mixed batch with greedy rows, which
    stay equal to transformers' greedy output."""
    path = tiny_target_dir("llama")
    target = target_of(path)
    model = small_model(target, 4, top_k=2)
    from lilicorr.draft_runner import TorchDraftRunner
    engine = SpecEngine(target, TorchDraftRunner(model, 3), max_batch=3, tree_nodes=8)
    prompts = random_prompts((6, 9, 5), target.config.vocab_size, seed=4)
    alone = engine.generate([prompts[0]], 24, rule="tree", temperature=1.0, seed=7)[0]
    again = engine.generate([prompts[0]], 24, rule="tree", temperature=1.0, seed=7)[0]
    assert alone.tokens == again.tokens and len(alone.tokens) == 24
    reqs = [dict(prompt=prompts[0], max_tokens=24, rule="tree", temperature=1.0, seed=7),
            dict(prompt=prompts[1], max_tokens=20, rule="lilicorr", temperature=0.0),
            dict(prompt=prompts[2], max_tokens=20, rule="tree", temperature=0.0)]
    mixed, _ = run_requests(engine, reqs)
    assert mixed[0].tokens == alone.tokens
    assert mixed[1].tokens == hf_greedy(path, prompts[1], 20)
    assert mixed[2].tokens == hf_greedy(path, prompts[2], 20)


def test_tree_rule_needs_a_head_and_a_valid_size(tiny_target_dir):
    from lilicorr.draft_runner import TorchDraftRunner
    target = target_of(tiny_target_dir("llama"))
    vanilla = SpecEngine(target, TorchDraftRunner(small_model(target, 4, vanilla=True), 1), max_batch=1)
    with pytest.raises(ValueError, match="needs a LiLiCorr head"):
        vanilla.add_request([1, 2], 4, rule="tree")
    for bad in (0, 257, 2.5, True):
        with pytest.raises(ValueError, match="tree_nodes"):
            SpecEngine(target, TorchDraftRunner(small_model(target, 4), 1), max_batch=1, tree_nodes=bad)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16-weights", "bf16-gemm", "bfloat16", "bfloat16:blocked"])
def test_smollm2_tree_rule_is_lossless(smollm2_dir, dtype):
    """The real target in fp16-weights, bf16-gemm (what `auto` serves on CPUs with AVX512-BF16 but
    no AMX) and batch-invariant bf16 (what it serves on AMX CPUs), the latter also with the
    blocked-GEMM attention (`use_blocked_attention`: a tree's queries then take `TreeKeys`), with
    scripted pools: `tree` output equals `ar` of the same target token for token."""
    from lilicorr.target import use_blocked_attention
    if dtype == "bf16-gemm":
        from lilicorr.bf16_gemm import bf16_gemm_available
        if not bf16_gemm_available():
            pytest.skip("bf16-gemm needs AVX512-BF16 and a C++ toolchain")
    target = load_target(smollm2_dir, dtype=dtype.removesuffix(":blocked"))
    if dtype.endswith(":blocked"):
        if not target.batch_invariant:
            pytest.skip("this machine's bf16 kernels are not batch-invariant")
        use_blocked_attention(target)
    from lilicorr.draft_runner import TorchDraftRunner
    prompts = random_prompts((12, 30, 7), target.config.vocab_size, seed=2)
    ar_engine = SpecEngine(target, TorchDraftRunner(small_model(target, 8, top_k=2), 1), max_batch=1)
    ar = [ar_engine.generate([p], 30, rule="ar")[0].tokens for p in prompts]
    truths = {i: p + t for i, (p, t) in enumerate(zip(prompts, ar))}
    runner = ScriptedRunner(small_model(target, 8, top_k=2), 3,
                            Corruptor(truths, target.config.vocab_size, 8, 2, seed=3, high_accept=True))
    engine = SpecEngine(target, runner, max_batch=3, tree_nodes=40)
    reqs = [dict(prompt=p, max_tokens=22, rule="tree", key=i) for i, p in enumerate(prompts)]
    results, _ = run_requests(engine, reqs, runner=runner)
    for req, r in zip(reqs, results):
        assert r.tokens == ar[req["key"]][:22], req["key"]
