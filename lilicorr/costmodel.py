"""Verify cost model: how much a target forward of k new tokens per row costs against a plain step.

    t = measure_forward_times(target, rows=1, ks=range(1, 17))   # {k: median seconds}
    model = CostModel.measure(target, max_k=8)                    # lazily per number of rows
    model.ratio(rows, k)                                          # t_rows(k) / t_rows(1)

Used by `scripts/verify_cost.py` (the committed t(k)/t(1) table) and by the engine's adaptive
draft length (`--draft-length auto`), which measures the ratios at start-up on the machine it
runs on (and once more the first time a new number of running rows appears), then keeps them
true while it serves: every verify forward it runs is folded in (`observe_verify`), per exact number
of rows, so the start-up's few noisy samples at a power-of-two load do not decide every step.
"""
from __future__ import annotations

import statistics
import time

import torch


@torch.no_grad()
def measure_forward_times(target, rows: int = 1, ks=range(1, 17), context: int = 200, reps: int = 12,
                          warmup: int = 2, capture=()) -> dict[int, float]:
    """Median wall seconds of one target forward of k new tokens for each of `rows` rows, each row
    holding `context` cached tokens (random ids). The cache is rolled back after every forward, so
    every measurement sees the same context. Reps are interleaved over k (drift hits every k alike)."""
    ks = list(ks)
    dev = target.embed_tokens.weight.device
    vocab = target.config.vocab_size
    cache = target.new_cache(rows, capacity=context + max(ks) + 1)
    slots = torch.tensor([cache.allocate() for _ in range(rows)], device=dev)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, context + max(ks)), generator=gen).to(dev)
    pos = torch.arange(context + max(ks), device=dev).expand(rows, -1)
    target(ids[:, :context], pos[:, :context], cache=cache, rows=slots, logits=False)
    base = torch.full((rows,), context, dtype=torch.long, device=dev)
    capture = list(capture)

    def one(k: int) -> float:
        t0 = time.perf_counter()
        out = target(ids[:, context: context + k], pos[:, context: context + k], cache=cache, rows=slots,
                     capture=capture)
        out.logits.argmax(-1)              # the engine always reads the argmax
        dt = time.perf_counter() - t0
        cache.truncate(slots, base)
        return dt

    for _ in range(warmup):
        for k in ks:
            one(k)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(reps):
        for k in ks:
            times[k].append(one(k))
    return {k: statistics.median(v) for k, v in times.items()}


class _Observed:
    """The verify cost at one exact number of rows as serving measures it: t(1) in seconds and the
    ratios t(k)/t(1), each a running mean, started from the start-up measurement of its bucket."""

    def __init__(self, base: float, ratios: list[float]):
        self.base, self.ratios = base, list(ratios)


class CostModel:
    """t_N(k) / t_N(1) per number of rows N, measured on first use of N (rounded up to a power of
    two, so a handful of measurements covers every load), then corrected by what serving measures
    (`observe_verify`, per exact N; `online=False` keeps the start-up figures). `draft_seconds`
    holds the drafter pass's wall time per number of drafting rows D (same buckets), a running mean
    of what the engine measures while it drafts; `draft_cost_at` prices it in plain steps of the
    current load."""

    OBSERVE_RATE = 0.1      # weight of one served verify forward in the running means

    def __init__(self, target, max_k: int, capture=(), reps: int = 5, context: int = 128):
        self.target, self.max_k, self.capture = target, max_k, list(capture)
        self.reps, self.context = reps, context
        self._ratios: dict[int, list[float]] = {}     # bucket -> [ratio k=1..max_k] (index k-1)
        self.step_seconds: dict[int, float] = {}      # bucket -> t_N(1)
        self.draft_seconds: dict[int, float] = {}     # bucket of drafting rows D -> drafter seconds
        self.online = True
        self._observed: dict[int, _Observed] = {}     # exact rows -> served verify costs

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(rows - 1, 0).bit_length()

    def ratios(self, rows: int) -> list[float]:
        """[t_N(k)/t_N(1) for k = 1..max_k] at N = rows, non-decreasing in k."""
        if self.online and rows in self._observed:
            return self._monotone(self._observed[rows].ratios)
        return self._measured(rows)

    @staticmethod
    def _monotone(ratios: list[float]) -> list[float]:
        """Cost never decreases with k: the running max, so noise cannot invent free tokens."""
        out, run = [], 0.0
        for r in ratios:
            run = max(run, r)
            out.append(run)
        out[0] = 1.0
        return out

    def _measured(self, rows: int) -> list[float]:
        """The start-up measurement of rows' bucket (made now if it has none)."""
        b = self.bucket(rows)
        if b not in self._ratios:
            t = measure_forward_times(self.target, rows=b, ks=range(1, self.max_k + 1), context=self.context,
                                      reps=self.reps, warmup=1, capture=self.capture)
            self._ratios[b] = self._monotone([t[k] / t[1] for k in range(1, self.max_k + 1)])
            self.step_seconds[b] = t[1]
        return self._ratios[b]

    def observe_verify(self, rows: int, k: int, seconds: float) -> None:
        """Fold one served verify forward (k tokens for each of `rows` rows, `seconds` of wall) into
        the cost at exactly `rows` rows: t(1) when k = 1, else the ratio t(k)/t(1) against the
        current t(1). Served contexts, kernels warmed by real traffic and the machine's other load
        then price the next steps, not only the start-up's few samples."""
        if not self.online or not 1 <= k <= self.max_k:
            return
        obs = self._observed.get(rows)
        if obs is None:
            self._measured(rows)
            b = self.bucket(rows)
            obs = self._observed[rows] = _Observed(self.step_seconds[b], self._ratios[b])
        a = self.OBSERVE_RATE
        if k == 1:
            obs.base += a * (seconds - obs.base)
        else:
            obs.ratios[k - 1] += a * (seconds / obs.base - obs.ratios[k - 1])

    def ratio(self, rows: int, k: int) -> float:
        """Cost of verifying k tokens per row (k = drafted + 1) in plain steps at `rows` rows."""
        r = self.ratios(rows)
        return r[min(max(k, 1), len(r)) - 1]

    def draft_cost_at(self, rows: int, drafting: int | None = None) -> float:
        """The cost, in plain steps at `rows` rows, of a drafter pass over `drafting` of them (default:
        all): the running mean of its bucket's passes; before that bucket has seen a pass, the
        nearest such bucket's (in powers of two; the smaller on a tie); 0.0 before any pass."""
        d = self.bucket(rows if drafting is None else drafting)
        if d not in self.draft_seconds:
            seen = sorted(self.draft_seconds, key=lambda x: (abs(x.bit_length() - d.bit_length()), x > d))
            if not seen:
                return 0.0
            d = seen[0]
        return self.plain_steps(rows, self.draft_seconds[d])

    def plain_seconds(self, rows: int) -> float:
        """t_N(1) at N = rows: served (`observe_verify`) where there is any, else measured."""
        if self.online and rows in self._observed:
            return self._observed[rows].base
        self._measured(rows)
        return self.step_seconds[self.bucket(rows)]

    def plain_steps(self, rows: int, seconds: float) -> float:
        """`seconds` in plain steps (t_N(1)) at `rows` rows."""
        return seconds / self.plain_seconds(rows)

    def observe_draft(self, drafting: int, seconds: float, replace: bool = False) -> None:
        """Fold one measured drafter pass over `drafting` rows (context append + draft) into the
        drafter's cost: a running mean, where one pass counts for at most 3x the mean so far (a
        first call's one-off costs, or a long context catch-up, must not price drafting out for
        good); `replace` sets it (a controlled start-up measurement)."""
        d = self.bucket(drafting)
        old = self.draft_seconds.get(d)
        if old is None or replace:
            self.draft_seconds[d] = seconds
        else:
            self.draft_seconds[d] = 0.8 * old + 0.2 * min(seconds, 3 * old)


def best_length(expected: list[float], cost: list[float], draft_cost: float) -> tuple[int, float]:
    """Draft length L (0..S) maximising tokens per unit cost.

    expected[j] = expected tokens committed when j drafts are verified (expected[0] = 1, the plain
    step's one token); cost[j] = verify cost of j+1 tokens in plain steps. L = 0 costs one plain
    step and needs no draft; L > 0 adds `draft_cost`. Returns (L, tokens per plain step)."""
    best, rate = 0, expected[0] / cost[0]
    for j in range(1, len(expected)):
        r = expected[j] / (cost[j] + draft_cost)
        if r > rate * (1 + 1e-9):
            best, rate = j, r
    return best, rate
