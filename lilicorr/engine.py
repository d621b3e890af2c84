"""The speculative decoding engine (DESIGN.md §5): one implementation for eval, bench and Triton.

Continuous batching over ragged sequences: every request has its own target KV-cache slot and
drafter context-cache slot; requests join (prefill) and leave (finish / cancel) between steps;
rejected tokens roll back by length. One step for the speculative rows:

    drafter context <- newly verified target features     (draft runner)
    draft block [anchor, mask x S] -> top-K -> head -> decode rule     (draft runner)
    target verify of [anchor, d_1..d_S] -> accept (+ bonus token) -> capture features

Rows with rule `ar` verify a single token per step (plain autoregressive decoding).

Rule `tree`: instead of the walk's one path, the best `tree_nodes` = M nodes of the lattice's path
tree (`lattice.build_tree`: best-first by summed log-conditionals, Eq. 2) are verified in one
target forward over [anchor, M nodes] with a tree attention mask and positions by depth, and the
target cache is compacted to the accepted path (`KVCache.keep_paths`). Greedy: the longest path
whose tokens equal the target's argmax is accepted, plus the bonus token. T > 0 (multi-draft
rejection sampling over deterministic siblings, `_tree_path`): at a node with target distribution
p, its children are tried in tree order; child x is accepted with probability r(x) / sum(r), where r
is p with every sibling already tried set to 0, and the walk moves on to it; when every child is
rejected the bonus comes from r renormalised (from p at a leaf). Each token then has probability
exactly p: a tried sibling x_i is emitted with prob. prod_{j<i}(1 - r_j) r(x_i)/sum(r_i) = p(x_i),
any other token with (1 - sum_i p(x_i)) p(x) / (1 - sum_i p(x_i)) = p(x).

Draft length (`draft_length`): None verifies the whole block; an int N verifies the first N drafted
tokens; "auto" chooses per row and step from the lattice's own scores. The walk's local
probabilities (softmax of the match scores at each chosen candidate, calibrated per slot against
observed acceptance) give the expected tokens E(L) of verifying L drafts; a `CostModel` measured on
this machine gives the verify cost t_N(L+1)/t_N(1) at the current number of rows N and the drafter's
cost in plain steps (a verify in which every row checks L+1 tokens: the policy prices a step at its
longest row, though the forward is packed, `lilicorr.target.Packing`, and each row computes only its
own tokens; pricing the packed mixes as they cost let the policy verify more drafts for no more
tokens per second, results/packed_verify_epyc/). A row verifies the L maximising E(L) / cost(L); a row whose recent acceptance
does not pay for the drafter skips drafting (L = 0: a plain step, with features still captured), so
under load speculation degrades to plain decoding. While a row skips, its history moves back
towards the acceptance every row has shown (`_relax`), so a few rejected blocks pause its drafting
instead of ending it. The verify costs keep learning while serving (`CostModel.observe_verify`, per
exact number of rows). The batch drafts only where the whole step is expected to beat the same step
without the drafter, and only at loads where drafting steps have, on a running mean, committed more
tokens per unit of measured cost than that (`_learn_draft_gain`): where plans overrate drafting,
the load pauses it and falls back to plain steps and lookups. Rows probe (draft anyway) now and
then, one row at a time for the whole batch (the one that has gone longest without drafting), so rows that
start together do not all pay for a drafter pass at once; probes back off while probing steps commit
fewer tokens than plain steps would have for their measured cost (drafter passes are priced by the
number of rows that draft). A new row starts from the acceptance observed over all rows so far, so a weak
drafter's new rows do not draft by default. Every choice of L is
lossless: verification is unchanged, only fewer drafts are checked.

Prompt lookup (`prompt_lookup` = N > 0, `lilicorr.ngram`): a lilicorr/argmax/viterbi row whose last
n tokens (N >= n >= 2) occurred earlier in its prompt or output verifies the tokens that followed
them instead of drafting; the drafter runs only for the other rows, and a lookup row's verified
features wait for its next drafter pass like those of a row that skipped drafting. Under `auto`
its length comes from the row's own acceptance of lookup drafts (no drafter cost); otherwise it
verifies the whole copied continuation (at most the block, or N drafts). Lossless like any draft.
State kept per row after each step: the anchor (last committed token, not yet in the target
cache) at position p = target cache length, the target features of verified tokens not yet in the
drafter context, and the captured layers at p-1 (the head's target state).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lilicorr.costmodel import CostModel, best_length
from lilicorr.fp16_linear import gemm_threads_for, prefill_threads
from lilicorr.lattice import DEFAULT_TREE_NODES, build_tree, tree_attention, tree_size
from lilicorr.model import RULES, load_model, untrained_model
from lilicorr.ngram import NgramIndex, parse_prompt_lookup
from lilicorr.profiling import BLOCK, STAGE_ACCEPT, STAGE_DRAFT, STAGE_VERIFY, nvtx_range, stage
from lilicorr.target import load_target


@dataclass
class StepEvent:
    rid: int
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None = None
    accepted: int = 0            # tokens committed by this step (accepted drafts + bonus)
    drafted: int = 0             # draft tokens proposed by this step


@dataclass
class Result:
    rid: int
    prompt_len: int
    tokens: list[int]
    finish_reason: str
    num_steps: int               # verify steps after prefill
    accepted_tokens: int         # sum over steps of (accepted drafts + bonus), before truncation
    oracle_accepted: int         # same with a perfect reranker over the drafter's top-K pools
    slot_reached: list[int]      # per slot: steps in which the slot was verified
    slot_accepted: list[int]     # per slot: steps in which the slot's draft was accepted
    accept_hist: list[int] = field(default_factory=list)  # [B+1]: steps that committed k tokens (k=1..B)
    lookup_steps: int = 0        # verify steps whose draft came from prompt lookup, not the drafter
    drafted_tokens: int = 0      # sum over steps of the draft tokens proposed to the verifier

    @property
    def tau(self) -> float:
        return self.accepted_tokens / max(self.num_steps, 1)


@dataclass
class _Seq:
    rid: int
    prompt: list[int]
    max_tokens: int
    rule: str
    temperature: float
    generator: torch.Generator | None
    stop_ids: frozenset
    tslot: int = -1                      # target cache slot
    dslot: int = -1                      # drafter context slot (-1 for ar rows)
    tokens: list[int] = field(default_factory=list)
    anchor: int = -1
    pending: list | None = None          # [P_i, n, H] chunks: verified features not yet in the drafter context
    pending_pos: int = 0
    state: torch.Tensor | None = None    # [n, H] captured layers at anchor position - 1
    prefilled: bool = False
    steps: int = 0
    accepted: int = 0
    oracle: int = 0
    slot_reached: list[int] = field(default_factory=list)
    slot_accepted: list[int] = field(default_factory=list)
    accept_hist: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # oracle bookkeeping: `truth` is the prompt plus every token verification produced (also those
    # cut off by max_tokens or after a stop token); `open_pools` holds (anchor position, per-slot
    # candidate pools) of steps whose oracle prefix is not settled yet (truth not known far enough)
    truth: list[int] = field(default_factory=list)
    open_pools: list = field(default_factory=list)
    # adaptive draft length: per-slot conditional acceptance of this row (EMA) and the steps since it
    # last drafted (the probe order)
    accept_rate: list[float] = field(default_factory=list)
    idle: int = 0
    # prompt lookup: the row's n-gram index (None when off or for ar/tree rows), its per-slot
    # conditional acceptance of lookup drafts (EMA) and how many steps verified one
    ngram: NgramIndex | None = None
    lookup_rate: list[float] = field(default_factory=list)
    lookup_steps: int = 0
    drafted: int = 0                     # draft tokens verified over all steps

    @property
    def anchor_pos(self) -> int:
        return len(self.prompt) + len(self.tokens) - 1


def length_groups(lengths: list[int], waste: float = 0.25) -> list[list[int]]:
    """Indices of `lengths` grouped for padded batching: sorted by length, a group grows while its
    padded size (count x longest) stays within (1 + waste) x its real tokens plus 64 per row."""
    groups: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        g = groups[-1] if groups else None
        if g is not None and (len(g) + 1) * lengths[i] <= (1 + waste) * (total + lengths[i]) + 64 * (len(g) + 1):
            g.append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def parse_draft_length(value, slots: int):
    """None / "" / "full" -> None (whole block); "auto" -> "auto"; N -> int in [1, slots]."""
    if value is None or value == "" or value == "full":
        return None
    if value == "auto":
        return "auto"
    try:
        n = operator.index(value) if not isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ValueError(f"draft length must be 'auto' or a number of drafted tokens, got {value!r}") from None
    if slots and not 1 <= n <= slots:
        raise ValueError(f"draft length {n} outside [1, {slots}] (the block drafts {slots} tokens)")
    return min(n, slots) if slots else None


def _batch_cap(lengths: list[int], expected: list[list[float]], cost: list[float]) -> list[int]:
    """One verify forward runs every row to the longest length, so cap the rows' draft lengths at
    the c (0..max) that maximises the batch's expected tokens per unit cost:
    sum_i expected[i][min(lengths[i], c)] / cost[c]. c = 0 is a plain step for every row."""
    best_c, best = 0, len(lengths) / cost[0]
    for c in range(1, max(lengths, default=0) + 1):
        value = sum(e[min(n_d, c)] for e, n_d in zip(expected, lengths)) / cost[c]
        if value > best * (1 + 1e-9):
            best_c, best = c, value
    return [min(n_d, best_c) for n_d in lengths]


def _expected(rates) -> list[float]:
    """Per-slot conditional acceptance -> expected tokens committed when verifying 0..S drafts."""
    out, run, total = [1.0], 1.0, 1.0
    for r in rates:
        run *= r if r is not None else 0.0
        total += run
        out.append(total)
    return out


class SpecEngine:
    def __init__(self, target, runner=None, max_batch: int = 32, max_seq_len: int = 2048,
                 draft_length: int | str | None = None, tree_nodes: int = DEFAULT_TREE_NODES,
                 prompt_lookup: int = 0):
        """target: TargetModel; runner: a draft runner (None -> only rule `ar`); draft_length: None
        (whole block), N (verify the first N drafts) or "auto" (module docstring); tree_nodes: the
        draft-tree size M of rule `tree`; prompt_lookup: the longest n-gram prompt lookup matches
        (0: off; module docstring)."""
        if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or not 1 <= tree_nodes <= 256:
            raise ValueError(f"tree_nodes must be an integer in [1, 256], got {tree_nodes!r}")
        self.prompt_lookup = parse_prompt_lookup(prompt_lookup)
        self.tree_nodes = tree_nodes
        self.target = target
        self.runner = runner
        self.max_batch = max_batch
        limit = target.config.max_position_embeddings
        self.max_seq_len = min(max_seq_len, limit) if limit else max_seq_len
        self.block_size = runner.block_size if runner is not None else 1
        self.capture = list(runner.model.cfg.drafter.target_layer_ids) if runner is not None else []
        self.device = target.embed_tokens.weight.device
        self.cache = target.new_cache(max_batch, capacity=min(256, self.max_seq_len + self.block_size))
        self.vocab_size = target.config.vocab_size
        self._seqs: dict[int, _Seq] = {}
        self._finished: dict[int, _Seq] = {}   # kept for result()/pop_result() when keep_results
        self.keep_results = True
        self._wanted: set[int] = set()         # rids generate() waits for (kept even without keep_results)
        self._ids = itertools.count()
        self.draft_length = parse_draft_length(draft_length, self.block_size - 1)
        self.cost = None
        if self.draft_length == "auto" and runner is not None:
            self.cost = CostModel(target, max_k=self.block_size, capture=self.capture)
            self.cost.ratios(1)                        # the start-up measurement at one row
        # per slot: (observed accepted, predicted) sums that calibrate the walk's probabilities
        self._calib = [[1.0, 1.0] for _ in range(max(self.block_size - 1, 0))]
        # per-slot acceptance a new row starts from: every row's verified drafts, a slow running mean
        # (a weak drafter's new rows start pessimistic instead of drafting until their own history
        # catches up: under load those first blocks widen every row's verify)
        self._prior = [0.6] * max(self.block_size - 1, 0)
        self._lookup_prior = [0.6] * max(self.block_size - 1, 0)     # the same for prompt-lookup drafts
        # one row probes per PROBE_EVERY x this many steps: doubled after a probing step that
        # committed fewer tokens than its cost in plain steps, back to 1 after one that paid
        self._probe_scale = 1
        self._probe_wait = self.PROBE_EVERY        # steps until the next probe
        # per number of rows: (tokens its drafting steps committed, tokens the same batches would have
        # committed without the drafter in the same time), running sums (`_learn_draft_gain`); the
        # gate drafts where their ratio is >= 1
        self._draft_gain: dict[int, tuple[float, float]] = {}

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_paths(cls, target_dir, ckpt_dir=None, engine_dir=None, max_batch: int = 32,
                   max_seq_len: int = 2048, device: str = "cpu", dtype=torch.float32,
                   draft_backend: str = "torch", yarn_factor: float | None = None,
                   untrained_seed: int | None = None, block_size: int | None = None,
                   draft_length: int | str | None = None, tree_nodes: int = DEFAULT_TREE_NODES,
                   batch_invariant: bool | None = None, prompt_lookup: int = 0) -> "SpecEngine":
        """Target from an HF folder; drafter+head from a checkpoint, an engine directory (its
        manifest names the checkpoint and the built graph), or untrained (`untrained_seed`).
        `batch_invariant`: `load_target`'s (default: on for bf16 on a CPU)."""
        target = load_target(target_dir, dtype=dtype, device=device, batch_invariant=batch_invariant)
        if yarn_factor:
            target.enable_yarn(yarn_factor)
        runner = None
        if engine_dir is not None:
            from lilicorr.engine_dir import make_runner  # written by the converter stage
            runner = make_runner(Path(engine_dir), target, num_slots=max_batch, backend=draft_backend,
                                 target_dir=target_dir)
        elif ckpt_dir is not None:
            from lilicorr.draft_runner import TorchDraftRunner
            runner = TorchDraftRunner(load_model(ckpt_dir, target), max_batch)
        elif untrained_seed is not None:
            from lilicorr.draft_runner import TorchDraftRunner
            runner = TorchDraftRunner(untrained_model(target, seed=untrained_seed, block_size=block_size), max_batch)
        return cls(target, runner, max_batch=max_batch, max_seq_len=max_seq_len, draft_length=draft_length,
                   tree_nodes=tree_nodes, prompt_lookup=prompt_lookup)

    def measure_costs(self) -> None:
        """With auto draft length: measure the verify cost now for every load the engine can see
        (1..max_batch rows, by the cost model's power-of-two buckets), so that no step waits for a
        measurement when a new number of rows first appears. A start-up step for servers and
        benchmarks (several seconds on a CPU); without it each bucket is measured on first use. The
        drafter's cost is measured per bucket too (`_measure_draft`); without it each bucket learns
        it from its first drafter pass, and borrows the nearest measured bucket's until then."""
        if self.cost is None:
            return
        rows = 1
        while True:
            self.cost.ratios(rows)
            self._measure_draft(rows)
            if rows >= self.max_batch:
                break
            rows = min(2 * rows, self.max_batch)

    @torch.no_grad()
    def _measure_draft(self, rows: int) -> None:
        """Time one drafter pass of `rows` rows (a one-token context append and a block each, over
        `cost.context` cached positions of zero features) into the cost model, after an untimed
        one, so that the first steps at this load do not take drafting for free."""
        dev, ctx = self.device, self.cost.context
        dtype = self.target.embed(torch.zeros(1, dtype=torch.long, device=dev)).dtype
        shape = (len(self.capture), self.target.config.hidden_size)
        slots = [self.runner.allocate() for _ in range(rows)]
        try:
            sl = torch.tensor(slots, device=dev)
            zero = torch.zeros(rows, dtype=torch.long, device=dev)
            state = torch.zeros((rows,) + shape, dtype=dtype, device=dev)
            rules = ["lilicorr" if self.runner.has_head else "argmax"] * rows
            self.runner.append_context(sl, [torch.zeros((ctx - 2,) + shape, dtype=dtype, device=dev)] * rows, zero)
            for timed in (False, True):
                pos = torch.full((rows,), self.runner.context_length(slots[0]), dtype=torch.long, device=dev)
                t0 = time.perf_counter()
                self.runner.append_context(sl, [state[0, None]] * rows, pos)
                self.runner.draft(sl, zero, pos + 1, state, rules)
                if timed:
                    self.cost.observe_draft(rows, time.perf_counter() - t0, replace=True)
        finally:
            for slot in slots:
                self.runner.free(slot)

    # -- requests ------------------------------------------------------------------------------
    def check_request(self, prompt_ids, max_tokens: int, rule: str = "lilicorr", temperature: float = 0.0,
                      seed: int | None = None, stop_ids=None) -> tuple[list[int], int, float, frozenset]:
        """Validate one request without touching any state; returns the normalised
        (prompt, max_tokens, temperature, stop_ids). Raises ValueError with the reason."""
        if isinstance(prompt_ids, (str, bytes)):
            raise ValueError("prompt must be a list of token ids, not a string (tokenize it first)")
        try:
            prompt = [operator.index(t) for t in prompt_ids]
        except TypeError:
            raise ValueError("prompt must be a sequence of integer token ids, got "
                             f"{type(prompt_ids).__name__} {str(prompt_ids)[:60]}") from None
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if rule not in RULES:
            raise ValueError(f"unknown decode rule {rule!r}; choose from {', '.join(RULES)}")
        if rule != "ar" and self.runner is None:
            raise ValueError(f"rule {rule!r} needs a drafter; this engine has none (only 'ar')")
        if rule in ("lilicorr", "viterbi", "tree") and not self.runner.has_head:
            raise ValueError(f"rule {rule!r} needs a LiLiCorr head; this checkpoint is vanilla DFlash")
        if isinstance(max_tokens, bool):
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        try:
            max_tokens = operator.index(max_tokens)
        except TypeError:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}") from None
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        try:
            temperature = float(temperature)
        except (TypeError, ValueError):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}") from None
        if math.isnan(temperature) or temperature < 0 or math.isinf(temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer or None, got {seed!r}")
        try:
            stops = frozenset(operator.index(t) for t in (stop_ids or ()))
        except TypeError:
            raise ValueError(f"stop_ids must be integer token ids, got {stop_ids!r}") from None
        room = self.max_seq_len - self.block_size - 1
        if len(prompt) > room:
            raise ValueError(f"prompt of {len(prompt)} tokens is longer than the context allows ({room})")
        if len(prompt) + max_tokens > room + 1:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the context "
                             f"({self.max_seq_len} incl. a block of {self.block_size})")
        return prompt, max_tokens, temperature, stops

    def add_request(self, prompt_ids, max_tokens: int, rule: str = "lilicorr", temperature: float = 0.0,
                    seed: int | None = None, stop_ids=None) -> int:
        """Validate and queue a request (prefilled at the next step). Raises ValueError on bad input
        (nothing is allocated then) and RuntimeError when every slot is taken."""
        prompt, max_tokens, temperature, stops = self.check_request(prompt_ids, max_tokens, rule, temperature,
                                                                    seed, stop_ids)
        if len(self._seqs) >= self.max_batch:
            raise RuntimeError(f"engine is full ({self.max_batch} active sequences)")
        gen = None
        if temperature > 0:
            gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
        rid = next(self._ids)
        s = _Seq(rid, prompt, max_tokens, rule, temperature, gen, stops)
        s.tslot = self.cache.allocate()
        if rule != "ar":
            try:
                s.dslot = self.runner.allocate()
            except BaseException:
                self.cache.free(s.tslot)
                raise
        s.slot_reached = [0] * (self.block_size - 1)
        s.slot_accepted = [0] * (self.block_size - 1)
        s.accept_hist = [0] * (self.block_size + 1)
        s.accept_rate = list(self._prior)
        s.truth = list(prompt)
        if self.prompt_lookup and rule not in ("ar", "tree"):
            s.ngram = NgramIndex(self.prompt_lookup)
            s.ngram.extend(prompt)
            s.lookup_rate = list(self._lookup_prior)
        self._seqs[rid] = s
        return rid

    def cancel(self, rid: int) -> None:
        """Drop a sequence and free its cache slots (no-op if it already finished)."""
        s = self._seqs.pop(rid, None)
        if s is not None:
            self._release(s)

    @property
    def num_active(self) -> int:
        return len(self._seqs)

    def _release(self, s: _Seq) -> None:
        self.cache.free(s.tslot)
        if s.dslot >= 0:
            self.runner.free(s.dslot)
        s.pending = s.state = None

    # -- stepping ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[StepEvent]:
        """Prefill new requests, then one speculative (or AR) step for every other active one.

        One engine step over the running rows is one `block` for the stage timer (its stages add
        up to the block's wall time); prefill is not part of a block."""
        events: list[StepEvent] = []
        self._pack_slots()
        fresh = [s for s in self._seqs.values() if not s.prefilled]
        # in slot order: rows on consecutive slots read their caches as views, not gathered copies
        running = sorted((s for s in self._seqs.values() if s.prefilled), key=lambda s: s.tslot)
        if fresh:
            with nvtx_range("engine/prefill"):
                events += self._prefill(fresh)
        tree = [s for s in running if s.rule == "tree"]
        spec = [s for s in running if s.rule not in ("ar", "tree")]
        ar = [s for s in running if s.rule == "ar"]
        if spec or ar or tree:
            with stage(BLOCK):
                if spec:
                    events += self._spec_step(spec)
                if tree:
                    with nvtx_range("engine/tree_step"):
                        events += self._tree_step(tree)
                if ar:
                    with nvtx_range("engine/ar_step"):
                        events += self._ar_step(ar)
        for ev in events:
            if ev.finished:
                s = self._seqs.pop(ev.rid)
                self._release(s)
                self._settle_oracle(s, final=True)
                if self.keep_results or ev.rid in self._wanted:
                    self._finished[ev.rid] = s
        return events

    def _pack_slots(self) -> None:
        """Keep the N active rows on target-cache slots 0..N-1: a row above that range (a row
        below it finished, and no new row filled its slot) moves down to the lowest free slot,
        once, so that the rows stepped in slot order read their caches as views instead of a
        gathered copy at every layer of every step."""
        n = len(self._seqs)
        for s in self._seqs.values():      # as many rows at or above n as free slots below it
            if s.tslot >= n:
                s.tslot = self.cache.move(s.tslot)

    def _prefill(self, seqs: list[_Seq]) -> list[StepEvent]:
        """Prefill new rows in groups of similar prompt length, so one long prompt does not pad
        every other new row to its length."""
        events: list[StepEvent] = []
        for group in length_groups([len(s.prompt) for s in seqs]):
            events += self._prefill_group([seqs[i] for i in group])
        return events

    def _prefill_group(self, seqs: list[_Seq]) -> list[StepEvent]:
        n, dev = len(seqs), self.device
        lens = torch.tensor([len(s.prompt) for s in seqs], device=dev)
        t = int(lens.max())
        ids = torch.zeros(n, t, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s.prompt)] = torch.tensor(s.prompt)
        pos = torch.arange(t, device=dev).expand(n, t)
        rows = torch.tensor([s.tslot for s in seqs], device=dev)
        capture = self.capture if any(s.rule != "ar" for s in seqs) else []
        with gemm_threads_for(prefill_threads()):          # a prompt: the largest GEMMs a server runs
            out = self.target(ids.to(dev), pos, cache=self.cache, rows=rows, valid=lens, capture=capture,
                              logits=False)
        last = out.last_hidden[torch.arange(n, device=dev), lens - 1]          # [N, H]
        logits = self.target.lm_head(last).float()                             # [N, V]
        events = []
        for i, s in enumerate(seqs):
            s.prefilled = True
            tok = self._sample(logits[i], s)
            if s.rule != "ar":
                s.pending = [out.captured[i, : len(s.prompt)].clone()]        # [[P, n, H]]
                s.pending_pos = 0
                s.state = out.captured[i, len(s.prompt) - 1].clone()           # [n, H]
            events.append(self._commit(s, [tok], accepted=1, drafted=0, count_step=False))
        return events

    def _spec_step(self, seqs: list[_Seq]) -> list[StepEvent]:
        b, dev, n = self.block_size, self.device, len(seqs)
        auto = self.cost is not None
        t0 = time.perf_counter()
        # the draft-length policy's and prompt lookup's bookkeeping counts with accept/residual (a
        # stage only when it runs)
        policy = auto or bool(self.prompt_lookup)
        with stage(STAGE_ACCEPT) if policy else contextlib.nullcontext():   # which rows draft
            # prompt lookup: [n] copied continuations ([] where the row's suffix did not occur before)
            look = [s.ngram.propose(b - 1) if s.ngram is not None else [] for s in seqs]
            if auto:
                cost = self.cost.ratios(n)[:b]                           # cost[j]: verify j drafts
                one_row = self.cost.draft_cost_at(n, 1)
                # a row verifies its lookup where the row's acceptance of lookups pays for the verify
                lk_exp = {i: self._lookup_expected(s, look[i]) for i, s in enumerate(seqs) if look[i]}
                wish = ["lookup" if i in lk_exp and best_length(lk_exp[i], cost, 0.0)[0]
                        else self._wants_draft(s, cost, one_row) for i, s in enumerate(seqs)]
                self._schedule_probe(wish, seqs)
                lk_idx = [i for i in range(n) if wish[i] == "lookup"]          # rows verifying a lookup
                drafting, plain = self._batch_drafting(
                    wish, seqs, cost, lambda d: self.cost.draft_cost_at(n, d),
                    lookups={i: lk_exp[i] for i in lk_idx}, allowed=self._draft_gain_at(n) >= 1.0)
                if plain is None:
                    self._relax_draft_gain(n)
            else:
                wish, drafting, plain = [None] * n, [not x for x in look], None
                lk_idx = [i for i in range(n) if look[i]]
            d_idx = [i for i in range(n) if drafting[i]]
            for i, s in enumerate(seqs):
                s.idle = 0 if drafting[i] else s.idle + 1
                if auto and not drafting[i]:
                    self._relax(s)
            dseqs = [seqs[i] for i in d_idx]
            prop = None
        draft_s = 0.0
        if dseqs:
            sel = torch.tensor(d_idx, device=dev)
            prop = self._draft(dseqs, torch.tensor([s.anchor for s in dseqs], device=dev),
                               torch.tensor([s.anchor_pos for s in dseqs], device=dev))
            draft_s = time.perf_counter() - t0
            if auto:
                self.cost.observe_draft(len(d_idx), draft_s)
        # drafts verified per row
        lengths = [0] * n
        probs = None
        if prop is not None or lk_idx:
            with stage(STAGE_ACCEPT) if policy else contextlib.nullcontext():
                if auto:
                    probs = self._walk_probs(prop) if prop is not None else None   # [D, S] or None
                    expected = [[1.0]] * n
                    for j, i in enumerate(d_idx):
                        rates = self._calibrated(probs[j].tolist() if probs is not None else None,
                                                 seqs[i].accept_rate)
                        expected[i] = _expected(rates)
                        lengths[i] = best_length(expected[i], cost, 0.0)[0]     # the draft is paid for
                    for i in lk_idx:               # a lookup costs no drafter pass; at most its own length
                        expected[i] = lk_exp[i]
                        lengths[i] = best_length(expected[i], cost, 0.0)[0]
                    lengths = _batch_cap(lengths, expected, cost)
                    for i in d_idx:                # a probe verifies at least one draft: it is there to learn
                        if wish[i] == "probe":
                            lengths[i] = max(lengths[i], 1)
                else:
                    for i in d_idx:
                        lengths[i] = self.draft_length or (b - 1)
                    for i in lk_idx:
                        lengths[i] = min(len(look[i]), self.draft_length or (b - 1))
        if prop is None and not any(lengths) and self.lean_plain_steps:   # nothing to verify: a plain step
            return self._plain_spec_step(seqs, look)
        t = 1 + max(lengths)
        with stage(STAGE_VERIFY):
            anchors = torch.tensor([s.anchor for s in seqs], device=dev)                  # [N]
            apos = torch.tensor([s.anchor_pos for s in seqs], device=dev)                 # [N]
            block = torch.zeros(n, t, dtype=torch.long, device=dev)
            block[:, 0] = anchors
            if prop is not None and t > 1:
                block[sel, 1:] = prop.tokens[:, : t - 1].to(dev)
            for i in lk_idx:
                if lengths[i]:
                    block[i, 1: 1 + lengths[i]] = torch.tensor(look[i][: lengths[i]], device=dev)
            rows = torch.tensor([s.tslot for s in seqs], device=dev)
            pos = apos[:, None] + torch.arange(t, device=dev)[None, :]
            # packed: each row computes only its anchor and its own drafts (target Packing), so the
            # rows below the longest length cost less than the padded verify the policy priced
            valid = torch.tensor([1 + n_d for n_d in lengths], device=dev)                # [N]
            tv = time.perf_counter()
            out = self.target(block, pos, cache=self.cache, rows=rows, capture=self.capture, valid=valid)
            verify_s = time.perf_counter() - tv
            if auto and len(set(lengths)) == 1:     # the cost model's points: every row at t tokens
                self.cost.observe_verify(n, t, verify_s)
        events = []
        with stage(STAGE_ACCEPT):
            greedy = out.greedy().tolist()                                    # [N][T]
            block = block.tolist()                                            # [N][T]
            pools = prop.cand_ids.cpu().tolist() if prop is not None else None  # [D][S][K]
            where = {i: j for j, i in enumerate(d_idx)}
            looked = set(lk_idx)
            new_len = []
            for i, s in enumerate(seqs):
                n_d = lengths[i]
                drafts = block[i][1: 1 + n_d]
                if s.temperature > 0:
                    a, bonus = self._reject_sample(out.logits[i, : n_d + 1], drafts, s)
                else:                     # the longest prefix of drafts equal to the target's argmax
                    a = 0
                    while a < n_d and drafts[a] == greedy[i][a]:
                        a += 1
                    bonus = greedy[i][a]
                # oracle: settled against the target's own continuation once it is known (a lookup
                # slot's pool is its one copied token)
                self._record(s, out.captured[i, : a + 1].clone(), min(a + 1, n_d), a,
                             pools[where[i]] if i in where else [[x] for x in drafts] if i in looked else [])
                if auto and i in where:
                    self._learn(s, a, n_d, probs[where[i]].tolist() if probs is not None else None)
                if look[i]:                # verified or not, the committed tokens tell how far it was right
                    if i in looked and n_d:
                        s.lookup_steps += 1
                    self._learn_lookup(s, look[i], drafts[:a] + [bonus])
                # roll the target cache back to anchor + accepted drafts (bonus not yet run)
                new_len.append(s.anchor_pos + a + 1)
                events.append(self._commit(s, drafts[:a] + [bonus], accepted=a + 1, drafted=n_d))
                self._settle_oracle(s)
            self.cache.truncate(rows, torch.tensor(new_len, device=dev))
            if "probe" in wish:
                # this step's own drafter time: a probing row first catches up its context
                paid = cost[max(lengths)] + self.cost.plain_steps(n, draft_s)
                self._probe_outcome(sum(e.accepted for e in events), paid, n)
            if plain is not None:
                self._learn_draft_gain(n, sum(e.accepted for e in events),
                                       self.cost.plain_steps(n, verify_s + draft_s), plain)
        return events

    def _plain_spec_step(self, seqs: list[_Seq], look: list[list[int]]) -> list[StepEvent]:
        """A speculative step in which no row verifies a draft or a lookup (the draft-length policy
        paused the drafter and priced every lookup at 0 tokens, as under load): one plain target
        step, as lean as `_ar_step`, that still captures the drafter's features and keeps each row's
        bookkeeping of a 0-draft verify. The same tokens, random draws and statistics as
        `_spec_step` with every length 0."""
        with stage(STAGE_VERIFY):
            tv = time.perf_counter()
            out = self._plain_forward(seqs, self.capture)
            if self.cost is not None:
                self.cost.observe_verify(len(seqs), 1, time.perf_counter() - tv)
        events = []
        with stage(STAGE_ACCEPT):
            feats = out.captured.clone()                                                # [N, 1, n, H]
            for i, s in enumerate(seqs):
                tok = self._sample(out.logits[i, 0], s)
                self._record(s, feats[i], 0, 0, [])
                if look[i]:            # an unverified lookup still learns from the committed token
                    self._learn_lookup(s, look[i], [tok])
                events.append(self._commit(s, [tok], accepted=1, drafted=0))
                self._settle_oracle(s)
        return events

    def _draft(self, dseqs: list[_Seq], anchors: torch.Tensor, apos: torch.Tensor):
        """The drafter's context catches up on the rows' verified features, then one block per row
        (a `tree` row drafts as `lilicorr`: the lattice's scores come with the proposal)."""
        dev = self.device
        with stage(STAGE_DRAFT):
            dslots = torch.tensor([s.dslot for s in dseqs], device=dev)
            pend = [(i, s) for i, s in enumerate(dseqs) if s.pending]
            if pend:
                feats = [p[0] if len(p) == 1 else torch.cat(p) for p in (s.pending for _, s in pend)]  # [P, n, H]
                self.runner.append_context(dslots[[i for i, _ in pend]], feats,
                                           torch.tensor([s.pending_pos for _, s in pend], device=dev))
                for _, s in pend:
                    s.pending = None
            state = torch.stack([s.state for s in dseqs])                     # [D, n, H]
        return self.runner.draft(dslots, anchors, apos, state,
                                 ["lilicorr" if s.rule == "tree" else s.rule for s in dseqs],
                                 tree=any(s.rule == "tree" for s in dseqs))

    def _record(self, s: _Seq, feats: torch.Tensor, depth_reached: int, a: int, pools) -> None:
        """Per-row bookkeeping of one verified step: slot statistics (`depth_reached` drafted slots
        were checked, `a` accepted), the oracle pools, the verified features [a+1, n, H] queued for
        the drafter context and the head's next target state (the last of them)."""
        s.open_pools.append((s.anchor_pos, pools))
        for j in range(depth_reached):
            s.slot_reached[j] += 1
        for j in range(a):
            s.slot_accepted[j] += 1
        s.accept_hist[a + 1] += 1
        if s.pending is None:
            s.pending, s.pending_pos = [feats], s.anchor_pos
        else:                      # a row that skipped drafting keeps its features queued (joined when it drafts)
            s.pending.append(feats)
        s.state = feats[-1].clone()
        s.steps += 1

    def _tree_step(self, seqs: list[_Seq]) -> list[StepEvent]:
        """Rule `tree` (module docstring): draft, build each row's tree from the lattice, verify
        [anchor, M nodes] in one forward, accept a path (`_tree_path`), compact the cache."""
        dev, n = self.device, len(seqs)
        anchors = torch.tensor([s.anchor for s in seqs], device=dev)
        apos = torch.tensor([s.anchor_pos for s in seqs], device=dev)
        prop = self._draft(seqs, anchors, apos)
        with stage(STAGE_ACCEPT):
            tree = prop.tree                           # built by the draft graph (lilicorr::DraftTree) ...
            _, s_, k = prop.cand_ids.shape
            if tree is None or tree.parent.shape[1] != min(self.tree_nodes, tree_size(k, s_)):
                tree = build_tree(prop.anchor_scores, prop.pair_scores, self.tree_nodes)   # ... or here
            cand_ids = prop.cand_ids.cpu()                                     # [N, S, K]
            tokens = tree.tokens(cand_ids)                                     # [N, M]
            vis = tree_attention(tree.parent)                                  # [N, 1+M, 1+M]
            m = tokens.shape[1]
        with stage(STAGE_VERIFY):
            block = torch.cat([anchors.cpu()[:, None], tokens], 1).to(dev)     # [N, 1+M]
            depth = torch.cat([torch.zeros(n, 1, dtype=torch.long), tree.depth.cpu() + 1], 1).to(dev)
            rows = torch.tensor([s.tslot for s in seqs], device=dev)
            start = self.cache.lengths[rows].clone()                           # [N] = anchor positions
            out = self.target(block, apos[:, None] + depth, cache=self.cache, rows=rows, capture=self.capture,
                              tree=vis.to(dev))
        events = []
        with stage(STAGE_ACCEPT):
            greedy = out.logits.argmax(-1).cpu()                               # [N, 1+M]
            parent, tok = tree.parent.tolist(), tokens.tolist()
            pools = cand_ids.tolist()                                          # [N][S][K]
            paths = []
            for i, s in enumerate(seqs):
                children: dict[int, list[int]] = {}
                for node in range(m):
                    children.setdefault(parent[i][node] + 1, []).append(node + 1)
                path, bonus = self._tree_path(s, out.logits[i], greedy[i], children, tok[i])
                a = len(path) - 1
                paths.append(path)
                drafts = [tok[i][c - 1] for c in path[1:]]
                depth_reached = min(a + 1, self.block_size - 1)
                self._record(s, out.captured[i, path].clone(), depth_reached, a, pools[i])
                events.append(self._commit(s, drafts + [bonus], accepted=a + 1, drafted=m))
                self._settle_oracle(s)
            self.cache.keep_paths(rows, start, paths)
        return events

    def _tree_path(self, s: _Seq, logits: torch.Tensor, greedy: torch.Tensor, children: dict[int, list[int]],
                   tok: list[int]) -> tuple[list[int], int]:
        """One row's accepted path through its verified tree and the bonus token.

        logits [1+M, V] and greedy [1+M] at the block positions (0 = anchor, node i = i + 1);
        children: position -> child positions in tree order; tok[i]: node i's token. -> (path of
        positions starting at 0, bonus). Greedy: follow the child equal to the argmax. T > 0: the
        multi-draft rule of the module docstring."""
        path, cur = [0], 0
        if s.temperature <= 0:
            while True:
                want = int(greedy[cur])
                nxt = next((c for c in children.get(cur, ()) if tok[c - 1] == want), None)
                if nxt is None:
                    return path, want
                path.append(nxt)
                cur = nxt
        probs = torch.softmax(logits.float().cpu() / s.temperature, -1)        # [1+M, V]
        while True:
            resid = probs[cur].clone()                 # p at this node, tried siblings zeroed
            nxt = None
            for c in children.get(cur, ()):
                x = tok[c - 1]
                total = float(resid.sum())
                if float(torch.rand((), generator=s.generator)) * total < float(resid[x]):
                    nxt = c
                    break
                resid[x] = 0.0
                if float(resid.sum()) <= 0:            # x held all the mass up to rounding: it is certain
                    nxt = c
                    break
            if nxt is None:
                return path, int(torch.multinomial(resid / resid.sum(), 1, generator=s.generator))
            path.append(nxt)
            cur = nxt

    # -- adaptive draft length -----------------------------------------------------------------
    PROBE_EVERY = 16        # a batch that stopped drafting probes one row per this many steps
    PRIOR_RATE = 0.05       # weight of one verified draft in the acceptance new rows start from
    ACCEPT_RATE = 0.3       # weight of one verified draft in a row's own acceptance history (0.1 drafted
                            # more at concurrency 1, tau 1.16 -> 1.24, but was not faster: 1.06x ar at 1, 0.96x at 4)

    IDLE_RELAX = 0.3        # share of the way back to the prior a non-drafting row's history moves per step
    PROBE_BACKOFF_MAX = 16  # probes back off to at most once per PROBE_EVERY x this many steps
    lean_plain_steps = True  # a step with nothing to verify takes `_plain_spec_step` (False: the full path)

    @staticmethod
    def _wants_draft(s: _Seq, cost: list[float], draft_cost: float) -> str | None:
        """Row `s`'s wish this step: "gain" when its recent acceptance pays for a drafter pass of its
        own (`draft_cost`, in plain steps) at today's load, else None (`_schedule_probe` may make
        it a probe)."""
        return "gain" if best_length(_expected(s.accept_rate), cost, draft_cost)[0] > 0 else None

    def _schedule_probe(self, wish: list[str | None], seqs: list[_Seq]) -> None:
        """One probe per PROBE_EVERY x back-off steps for the whole batch: the row without a gain
        that has gone longest without drafting becomes "probe" (in `wish`). Rows that join
        together take turns instead of all probing on their first step: under load a probe costs
        its own drafter pass and widens every row's verify, and a new row already starts from the
        acceptance every row has shown (the prior)."""
        idle = [i for i, w in enumerate(wish) if w is None]
        if not idle:
            return
        self._probe_wait -= 1
        if self._probe_wait > 0:
            return
        wish[max(idle, key=lambda i: seqs[i].idle)] = "probe"
        self._probe_wait = self.PROBE_EVERY * self._probe_scale

    def _probe_outcome(self, tokens: int, paid: float, rows: int) -> None:
        """A step with a probe committed `tokens` over its `rows` rows for `paid` plain steps
        (verify + drafter, measured): one that did worse than plain steps (rows tokens per plain
        step) doubles the wait between probes, up to PROBE_BACKOFF_MAX; one that did better resets
        it. Where drafting does not pay on this machine, probes then cost 1/PROBE_BACKOFF_MAX as
        much; a drafter that starts to pay is found again at the next probe."""
        if tokens > rows * paid:
            self._probe_scale = 1
        else:
            self._probe_scale = min(2 * self._probe_scale, self.PROBE_BACKOFF_MAX)

    @staticmethod
    def _batch_drafting(wish: list[str | None], seqs: list[_Seq], cost: list[float], draft_cost_of,
                        lookups: dict[int, list[float]] | None = None,
                        allowed: bool = True) -> tuple[list[bool], float | None]:
        """Which rows draft. Every row of a step pays for the longest verify and for the drafter
        pass (draft_cost_of(D): its cost in plain steps over D drafting rows), so the rows that would
        gain draft only if the whole batch is expected to commit more tokens per unit cost than it
        would without the drafter (n tokens for one plain step, or the rows verifying a lookup,
        `lookups` {row: expected tokens}, verifying theirs), and only where drafting is `allowed`
        at this load (`_learn_draft_gain`). Probes always draft. Returns (which rows draft, the
        expected tokens per plain step without the drafter when the gain rows draft, else None)."""
        n = len(seqs)
        lookups = lookups or {}
        gain = [i for i, w in enumerate(wish) if w == "gain"] if allowed else []
        plain = None
        if gain:
            draft_cost = draft_cost_of(len(gain) + wish.count("probe"))
            exp = {i: _expected(seqs[i].accept_rate) for i in gain}
            lens = {i: best_length(exp[i], cost, draft_cost)[0] for i in gain}
            lk = {i: best_length(e, cost, 0.0)[0] for i, e in lookups.items()}
            looked = sum(lookups[i][lk[i]] for i in lk)
            # without the drafter: the lookup rows verify theirs, every other row takes a plain step
            plain = (n - len(lk) + looked) / cost[max(lk.values(), default=0)]
            tokens = n - len(gain) - len(lk) + sum(exp[i][lens[i]] for i in gain) + looked
            if tokens / (cost[max([*lens.values(), *lk.values()])] + draft_cost) <= plain:
                gain, plain = [], None
        return [i in gain or wish[i] == "probe" for i in range(n)], plain

    DRAFT_GAIN_RATE = 0.05   # weight of one drafting step in its load's running sums
    DRAFT_GAIN_RELAX = 0.05  # share of the way to DRAFT_GAIN_RETRY a paused load moves per step
    DRAFT_GAIN_RETRY = 1.1
    DRAFT_GAIN_PRIOR = 5     # a load's sums start as this many steps at DRAFT_GAIN_RETRY

    def _draft_gain_at(self, rows: int) -> float:
        """Tokens committed per unit of measured cost by drafting steps at `rows` rows, against the
        same batches without the drafter (running sums; 1.0 before any)."""
        got, plain = self._draft_gain.get(rows, (1.0, 1.0))
        return got / plain

    def _learn_draft_gain(self, rows: int, tokens: int, paid: float, plain: float) -> None:
        """A step whose gain rows drafted committed `tokens` for `paid` plain steps (its verify and
        drafter pass, measured), where the batch would have committed `plain` per plain step
        without the drafter, so `paid * plain` in the same time. Both go into the load's running
        sums (a ratio of sums: a few unlucky blocks move it little). While their ratio is below 1,
        drafting steps at this load have been slower than plain steps (their plans overrated them:
        acceptance the walk's probabilities then cut short, a drafter pass dearer than its running
        mean), and the gate keeps the drafter off there: speculation falls back to plain steps and
        lookups instead of running below plain decoding."""
        if not self.cost.online or paid <= 0 or plain <= 0:
            return
        step = paid * plain                  # the tokens plain steps would have committed meanwhile
        prior = self.DRAFT_GAIN_PRIOR * step   # a first unlucky block or two must not pause the load
        got, base = self._draft_gain.get(rows, (self.DRAFT_GAIN_RETRY * prior, prior))
        keep = 1.0 - self.DRAFT_GAIN_RATE
        self._draft_gain[rows] = (keep * got + tokens, keep * base + step)

    def _relax_draft_gain(self, rows: int) -> None:
        """A load whose gain rows do not draft learns nothing new: its ratio moves towards
        DRAFT_GAIN_RETRY, so a bad stretch pauses drafting there for a few dozen steps, then the
        gate lets it try again (and the next drafting steps decide)."""
        if rows in self._draft_gain:
            got, base = self._draft_gain[rows]
            self._draft_gain[rows] = (got + self.DRAFT_GAIN_RELAX * (self.DRAFT_GAIN_RETRY * base - got), base)

    @staticmethod
    def _walk_probs(prop) -> torch.Tensor | None:
        """[D, S] local probability of each chosen candidate under the lattice's scores: the softmax
        of the anchor scores (slot 1), then of the pair scores from the previous choice (Eq. 1, 8).
        None when the proposal carries no scores (argmax rows, vanilla DFlash)."""
        a_s, p_s = prop.anchor_scores, prop.pair_scores
        if a_s is None or p_s is None:
            return None
        cand, tok = prop.cand_ids.cpu(), prop.tokens.cpu()
        idx = (cand == tok[..., None]).float().argmax(-1)                     # [D, S]
        a_s, p_s = a_s.cpu().float(), p_s.cpu().float()
        first = torch.softmax(a_s, -1).gather(-1, idx[:, :1])                 # [D, 1]
        k = cand.shape[-1]
        rows = torch.softmax(p_s, -1).gather(2, idx[:, :-1, None, None].expand(-1, -1, 1, k)).squeeze(2)
        rest = rows.gather(-1, idx[:, 1:, None]).squeeze(-1)                   # [D, S-1]
        p = torch.cat([first, rest], 1)
        return torch.nan_to_num(p, nan=-1.0)           # rows without head scores: -1 -> use history

    def _calibrated(self, p: list[float] | None, fallback: list[float]) -> list[float]:
        """Walk probabilities scaled per slot by observed / predicted acceptance; the row's own
        history where there are no scores."""
        if p is None or any(x < 0 for x in p):
            return fallback
        return [min(1.0, max(0.0, x * c[0] / c[1])) for x, c in zip(p, self._calib)]

    def _learn(self, s: _Seq, a: int, n_d: int, p: list[float] | None) -> None:
        """Update the row's acceptance history and the calibration with a verified step."""
        for j in range(min(a + 1, n_d)):
            hit = 1.0 if j < a else 0.0
            s.accept_rate[j] = (1 - self.ACCEPT_RATE) * s.accept_rate[j] + self.ACCEPT_RATE * hit
            self._prior[j] = (1 - self.PRIOR_RATE) * self._prior[j] + self.PRIOR_RATE * hit
            if p is not None and p[j] >= 0:
                c = self._calib[j]
                c[0], c[1] = 0.98 * c[0] + hit, 0.98 * c[1] + p[j]

    def _relax(self, s: _Seq) -> None:
        """A row that does not draft this step sees none of its drafts verified, so its own history
        would stay where its last rejections left it: it moves IDLE_RELAX of the way back to the
        acceptance every row has shown (the prior). A few unlucky blocks then pause a row's drafting
        for a few steps instead of for good."""
        for j, p in enumerate(self._prior):
            s.accept_rate[j] += self.IDLE_RELAX * (p - s.accept_rate[j])

    @staticmethod
    def _lookup_expected(s: _Seq, draft: list[int]) -> list[float]:
        """Expected tokens committed when verifying 0..len(draft) tokens of a lookup draft."""
        return _expected(s.lookup_rate)[: len(draft) + 1]

    def _learn_lookup(self, s: _Seq, draft: list[int], committed: list[int]) -> None:
        """The row's (and new rows') per-slot conditional acceptance of prompt-lookup drafts, from
        the tokens a step committed: slot j is observed where the draft matched the committed tokens
        before it, hit where it matches at j too. Under greedy verification this is exactly what
        verifying the draft would have accepted, so a row that did not verify its lookup (a plain
        or drafter step) learns too, and a row whose lookups once failed finds out when they start
        to pay (at T > 0 the committed tokens are samples: an estimate)."""
        for j in range(min(len(draft), len(committed))):
            hit = 1.0 if draft[j] == committed[j] else 0.0
            s.lookup_rate[j] = (1 - self.ACCEPT_RATE) * s.lookup_rate[j] + self.ACCEPT_RATE * hit
            self._lookup_prior[j] = (1 - self.PRIOR_RATE) * self._lookup_prior[j] + self.PRIOR_RATE * hit
            if not hit:
                break

    def _plain_forward(self, seqs: list[_Seq], capture: Sequence[int] = ()):
        """One plain target step of every row: its anchor at its position, [N, 1]."""
        dev = self.device
        ids = torch.tensor([[s.anchor] for s in seqs], device=dev)                     # [N, 1]
        pos = torch.tensor([[s.anchor_pos] for s in seqs], device=dev)                 # [N, 1]
        rows = torch.tensor([s.tslot for s in seqs], device=dev)
        return self.target(ids, pos, cache=self.cache, rows=rows, capture=capture)

    def _ar_step(self, seqs: list[_Seq]) -> list[StepEvent]:
        with stage(STAGE_VERIFY):
            out = self._plain_forward(seqs)
        events = []
        with stage(STAGE_ACCEPT):
            for i, s in enumerate(seqs):
                tok = self._sample(out.logits[i, 0], s)
                s.steps += 1
                events.append(self._commit(s, [tok], accepted=1, drafted=0))
        return events

    # -- acceptance ----------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, s: _Seq) -> int:
        if s.temperature <= 0:
            return int(logits.argmax())
        p = torch.softmax(logits.float().cpu() / s.temperature, -1)
        return int(torch.multinomial(p, 1, generator=s.generator))

    def _reject_sample(self, logits: torch.Tensor, drafts: list[int], s: _Seq) -> tuple[int, int]:
        """Exact rejection sampling for a deterministic proposal (DESIGN.md §5): accept x_i with
        probability p_i(x_i); on rejection sample from p_i without x_i (renormalised); if every
        draft is accepted the bonus comes from p_B. Preserves the target distribution."""
        probs = torch.softmax(logits.float().cpu() / s.temperature, -1)        # [B, V]
        for i, x in enumerate(drafts):
            u = float(torch.rand((), generator=s.generator))
            if u < float(probs[i, x]):
                continue
            resid = probs[i].clone()
            resid[x] = 0.0
            total = float(resid.sum())
            if total <= 0:          # p_i(x) == 1 up to rounding: x is certain, accept it
                continue
            return i, int(torch.multinomial(resid / total, 1, generator=s.generator))
        return len(drafts), int(torch.multinomial(probs[len(drafts)], 1, generator=s.generator))

    def _commit(self, s: _Seq, new: list[int], accepted: int, drafted: int, count_step: bool = True) -> StepEvent:
        """Append tokens, apply stop tokens and max_tokens; returns the step's event."""
        if count_step:
            s.accepted += accepted
            s.drafted += drafted
        s.truth.extend(new)           # the target's continuation, also past a stop / max_tokens
        room = s.max_tokens - len(s.tokens)
        reason = None
        out = []
        for t in new[:room]:
            out.append(t)
            if t in s.stop_ids:
                reason = "stop"
                break
        if reason is None and len(s.tokens) + len(out) >= s.max_tokens:
            reason = "length"
        s.tokens.extend(out)
        if s.ngram is not None:
            s.ngram.extend(out)
        s.anchor = s.tokens[-1]
        s.finish_reason = reason
        return StepEvent(s.rid, out, reason is not None, reason, accepted, drafted)

    @staticmethod
    def _settle_oracle(s: _Seq, final: bool = False) -> None:
        """Oracle acceptance (DESIGN.md §6, the oracle prefix of §3.3): for each verify step, the
        longest leading run of slots whose pool holds the target's own next token, plus the
        bonus token. The target's continuation beyond the first rejected slot is only known later
        (it is what the sequence goes on to commit; exact under greedy verification, the sampled
        continuation at T > 0), so a step is settled once its run ends or, at the finish, with what
        is known by then."""
        keep = []
        truth = s.truth
        for pos, pools in s.open_pools:
            run, done = 0, True
            for j, pool in enumerate(pools):
                q = pos + 1 + j
                if q >= len(truth):
                    done = False
                    break
                if truth[q] not in pool:
                    break
                run += 1
            if done or final:
                s.oracle += run + 1
            else:
                keep.append((pos, pools))
        s.open_pools = keep

    # -- convenience ---------------------------------------------------------------------------
    def result(self, rid: int) -> Result:
        s = self._finished.get(rid) or self._seqs[rid]
        return Result(s.rid, len(s.prompt), list(s.tokens), s.finish_reason or "running", s.steps,
                      s.accepted, s.oracle, list(s.slot_reached), list(s.slot_accepted), list(s.accept_hist),
                      s.lookup_steps, s.drafted)

    def pop_result(self, rid: int) -> Result:
        r = self.result(rid)
        self._finished.pop(rid, None)
        self._wanted.discard(rid)
        return r

    def generate(self, prompts: list[list[int]], max_tokens, rule: str = "lilicorr", temperature: float = 0.0,
                 seed: int | None = None, stop_ids=None, progress=None) -> list[Result]:
        """Run prompts to completion with continuous batching (at most max_batch at a time).
        Every request is validated before any is queued (ValueError names the prompt); request i
        gets seed `seed + i`."""
        if isinstance(max_tokens, (list, tuple)):
            if len(max_tokens) != len(prompts):
                raise ValueError(f"{len(max_tokens)} max_tokens values for {len(prompts)} prompts")
            max_list = list(max_tokens)
        else:
            max_list = [max_tokens] * len(prompts)
        for i, p in enumerate(prompts):
            try:
                self.check_request(p, max_list[i], rule, temperature, None if seed is None else seed + i, stop_ids)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        queue = collections.deque(enumerate(prompts))
        rid_of: dict[int, int] = {}
        live: set[int] = set()                 # this call's requests still running
        while queue or live:
            while queue and len(self._seqs) < self.max_batch:
                i, p = queue.popleft()
                rid = rid_of[i] = self.add_request(p, max_list[i], rule=rule, temperature=temperature,
                                                   seed=None if seed is None else seed + i, stop_ids=stop_ids)
                live.add(rid)
                self._wanted.add(rid)
            for ev in self.step():
                if ev.rid in live and progress is not None:
                    progress(len(ev.new_tokens))
            live = {r for r in live if r in self._seqs}
        return [self.pop_result(rid_of[i]) for i in range(len(prompts))]
