"""Shared pieces of the engine / sampling / eval tests.

`ScriptedRunner` is the one test double of the engine tests: a draft runner that keeps the real
TorchDraftRunner machinery (drafter context KV cache, drafter forward, LM-head shapes, the real head
and decode rules) but replaces the drafter's slot logits with scripted candidate pools, so the
proposals, and with them the verifier's acceptance, are chosen by the test.
"""
from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from lilicorr.config import preset
from lilicorr.draft_runner import TorchDraftRunner, _propose_mixed
from lilicorr.drafter import inference_attention_mask
from lilicorr.model import LiLiCorrModel, Proposal
from lilicorr.profiling import STAGE_DRAFT, STAGE_HEAD, STAGE_LM_HEAD, stage
from lilicorr.target import load_target

REPO_ROOT = Path(__file__).resolve().parents[1]
RULES = ("lilicorr", "viterbi", "argmax", "ar")
SPEC_RULES = ("lilicorr", "viterbi", "argmax")


# ------------------------------------------------------------------------------------- models
@lru_cache(maxsize=None)
def load_script(path, name: str):
    """A script that is not a package module (convert/, deploy/, scripts/, train/) imported by path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def target_of(path) -> "torch.nn.Module":
    """A loaded TargetModel per folder (frozen; shared by the tests that do not change its rope)."""
    return load_target(Path(path))


def small_model(target, block_size: int, top_k: int = 4, seed: int = 0, vanilla: bool = False) -> LiLiCorrModel:
    """An untrained drafter + head, the `cpu` preset shrunk for fast tests (1 draft layer, head
    width 64, d_e 32), with a chosen block size and pool size."""
    cfg = preset("cpu")
    cfg.drafter.block_size = block_size
    cfg.drafter.num_layers = 1
    cfg.head.top_k = top_k
    cfg.head.width, cfg.head.num_heads, cfg.head.ffn_width, cfg.head.embed_dim = 64, 2, 128, 32
    cfg.vanilla = vanilla
    cfg.drafter = cfg.drafter.for_target(target.config)
    torch.manual_seed(seed)
    model = LiLiCorrModel(cfg, target)
    return model.to(target.embed_tokens.weight.dtype).eval().requires_grad_(False)


def random_prompts(lengths, vocab: int, seed: int = 0, low: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------------------------- references
_HF: dict = {}


def hf_model(path):
    import transformers

    key = str(path)
    if key not in _HF:
        m = transformers.AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
        m.generation_config.eos_token_id = None      # the engine stops only on the stop ids it is given
        m.generation_config.pad_token_id = m.config.pad_token_id if m.config.pad_token_id is not None else 0
        _HF[key] = m
    return _HF[key]


_GREEDY: dict = {}


def hf_greedy(path, prompt: list[int], n: int, stop_at_eos: bool = False) -> list[int]:
    """transformers' own greedy generate (no EOS stop unless asked): the losslessness reference."""
    key = (str(path), tuple(prompt), n, stop_at_eos)
    if key not in _GREEDY:
        m = hf_model(path)
        kw = {}
        if stop_at_eos:
            kw["eos_token_id"] = m.config.eos_token_id
        ids = torch.tensor([prompt])
        with torch.no_grad():  # an explicit mask: chat prompts contain the pad id (SmolLM2: pad = <|im_end|>)
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kw)
        _GREEDY[key] = out[0, len(prompt):].tolist()
    return _GREEDY[key]


@torch.no_grad()
def target_greedy(target, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with our TargetModel and no cache at all (full forward per token)."""
    ids = list(prompt)
    for _ in range(n):
        x = torch.tensor([ids])
        ids.append(int(target(x, torch.arange(len(ids))[None]).logits[0, -1].argmax()))
    return ids[len(prompt):]


# ------------------------------------------------------------------------------------- the double
class ScriptedRunner(TorchDraftRunner):
    """Runner interface of TorchDraftRunner; the slot logits come from `script`.

    script(key, anchor_pos, anchor) -> S pools of K distinct token ids (rank order). The slot
    logits rank each pool's tokens first (10, 9, ...), so the argmax rule proposes pool[j][0] and
    lilicorr / viterbi run the real head and lattice walk over exactly these pools.
    `expect(key)` binds the next allocated drafter slot to `key` (allocation order = add order).

    It also checks the engine's bookkeeping of the drafter context: appends are contiguous and,
    when a block is drafted, the context holds exactly the positions before the anchor.
    """

    def __init__(self, model, num_slots: int, script, fail_on_draft: bool = False):
        super().__init__(model, num_slots)
        self.script = script
        self.fail_on_draft = fail_on_draft
        self._queue: list = []
        self.key_of: dict[int, object] = {}
        self.calls = 0

    def expect(self, key) -> None:
        self._queue.append(key)

    def allocate(self) -> int:
        slot = super().allocate()
        self.key_of[slot] = self._queue.pop(0) if self._queue else None
        return slot

    def free(self, slot: int) -> None:
        super().free(slot)
        self.key_of.pop(slot, None)

    def append_context(self, slots, feats, start_pos) -> None:
        have = self.cache.lengths[slots]
        assert torch.equal(have, start_pos), f"non-contiguous context append: cached {have.tolist()}, " \
                                             f"new features start at {start_pos.tolist()}"
        super().append_context(slots, feats, start_pos)

    @torch.no_grad()
    def draft(self, slots, anchors, anchor_pos, target_state, rules, tree=False) -> Proposal:
        self.calls += 1
        if self.fail_on_draft:
            raise RuntimeError("scripted draft failure")
        lengths = self.cache.lengths[slots]
        assert torch.equal(lengths, anchor_pos), \
            f"drafter context lengths {lengths.tolist()} != anchor positions {anchor_pos.tolist()}"
        model, b = self.model, self.block_size
        with stage(STAGE_DRAFT):  # the real drafter pass (its hidden states feed the real head)
            emb = model.drafter.block_embeddings(anchors[:, None], b)
            pos = anchor_pos[:, None] + torch.arange(b)[None, :]
            upto = int(lengths.max())
            idx = self.cache.row_index(slots)
            ctx_kv = [self.cache.read(layer, idx, upto) for layer in range(self.cache.num_layers)]
            hidden = model.drafter(emb, pos, ctx_kv, inference_attention_mask(lengths, upto, b))
        with stage(STAGE_LM_HEAD):
            n, s, v = len(slots), b - 1, model.cfg.drafter.vocab_size
            logits = torch.zeros(n, s, v)
            for i in range(n):
                pools = self.script(self.key_of[int(slots[i])], int(anchor_pos[i]), int(anchors[i]))
                assert len(pools) == s
                for j, pool in enumerate(pools):
                    assert len(set(pool)) == len(pool) == model.cfg.head.top_k, pool
                    logits[i, j, pool] = 10.0 - torch.arange(len(pool), dtype=torch.float32)
        with stage(STAGE_HEAD):
            return _propose_mixed(model, hidden[:, 1:], logits, target_state, rules)


class Corruptor:
    """Script for ScriptedRunner over known greedy continuations.

    truths[key] = prompt + the target's greedy continuation (long enough to cover the last block).
    Each call draws a corruption slot c in 0..S (S: none) and a coverage d in c..S: slots j < c
    propose the true token, slot c a wrong one (true token at rank 1 when d > c), slots j >= d
    have pools without the true token. Under greedy verification an `argmax` row therefore
    accepts exactly c drafts, and the oracle prefix of the step is d (where the truth is known).
    `log[key]` lists (anchor_pos, c, d) per call. high_accept biases c towards S.
    """

    def __init__(self, truths: dict, vocab: int, block_size: int, top_k: int, seed: int = 0,
                 high_accept: bool = False):
        self.truths, self.vocab, self.s, self.k = truths, vocab, block_size - 1, top_k
        self.rng = random.Random(seed)
        self.high_accept = high_accept
        self.log: dict = {k: [] for k in truths}

    def _others(self, avoid: set, n: int) -> list[int]:
        out = []
        while len(out) < n:
            t = self.rng.randrange(self.vocab)
            if t not in avoid:
                avoid.add(t)
                out.append(t)
        return out

    def __call__(self, key, pos: int, anchor: int) -> list[list[int]]:
        if key is None:          # a slot of no request (the engine timing a drafter pass): any pools
            return [list(range(self.k)) for _ in range(self.s)]
        truth = self.truths[key]
        assert truth[pos] == anchor, f"anchor {anchor} at {pos} is not the target's greedy token {truth[pos]}"
        s, k = self.s, self.k
        if self.high_accept and self.rng.random() < 0.5:
            c = s
        else:
            c = self.rng.randint(0, s)
        d = self.rng.randint(c, s)
        self.log[key].append((pos, c, d))
        pools = []
        for j in range(s):
            t = truth[pos + 1 + j]
            if j < c:
                pools.append([t] + self._others({t}, k - 1))
            elif j == c:
                wrong = self._others({t}, 1)
                rest = [t] + self._others({t, wrong[0]}, k - 2) if j < d else self._others({t, wrong[0]}, k - 1)
                pools.append(wrong + rest)
            elif j < d:
                pool = [t] + self._others({t}, k - 1)
                self.rng.shuffle(pool)
                pools.append(pool)
            else:
                pools.append(self._others({t}, k))
        return pools


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(x / 2.0, dtype=torch.float64)))


def chi2_test(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Goodness of fit of `counts` to `probs` (same shape); cells with expected count below
    `min_expected` are pooled into one. -> (statistic, degrees of freedom, p-value)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    exp = n * probs / probs.sum()
    big = exp >= min_expected
    obs_cells = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_cells = torch.cat([exp[big], exp[~big].sum()[None]])
    if exp_cells[-1] < min_expected:            # the pooled rest is itself too small: fold it in
        obs_cells[-2] += obs_cells[-1]
        exp_cells[-2] += exp_cells[-1]
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    stat = float(((obs_cells - exp_cells) ** 2 / exp_cells).sum())
    df = len(exp_cells) - 1
    return stat, df, chi2_sf(stat, df)


# ------------------------------------------------------------------------------------- driving
def run_requests(engine, requests: list[dict], runner=None, max_steps: int = 5000):
    """Drive `engine` step by step over `requests` (dicts: prompt, max_tokens, rule and optional
    temperature, seed, stop_ids, key, at = first engine step at which it may join). Requests join
    in list order once their step has come and a slot is free (continuous batching).
    -> (results in request order, events per request in order)."""
    waiting = list(range(len(requests)))
    rid_of: dict[int, int] = {}
    idx_of: dict[int, int] = {}
    events: dict[int, list] = {i: [] for i in range(len(requests))}
    step = 0
    while waiting or engine.num_active:
        still = []
        for pos, i in enumerate(waiting):
            r = requests[i]
            if engine.num_active >= engine.max_batch:
                still += waiting[pos:]
                break
            if r.get("at", 0) > step:
                still.append(i)
                continue
            if runner is not None and r["rule"] != "ar":
                runner.expect(r.get("key", i))
            rid = engine.add_request(r["prompt"], r["max_tokens"], rule=r["rule"],
                                     temperature=r.get("temperature", 0.0), seed=r.get("seed"),
                                     stop_ids=r.get("stop_ids"))
            rid_of[i], idx_of[rid] = rid, i
        waiting = still
        for ev in engine.step():
            events[idx_of[ev.rid]].append(ev)
        step += 1
        assert step < max_steps, "engine made no progress"
    return [engine.pop_result(rid_of[i]) for i in range(len(requests))], events
