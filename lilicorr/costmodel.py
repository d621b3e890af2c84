"""Verify cost model: how much a target forward of k new tokens per row costs against a plain step.

    t = measure_forward_times(target, rows=1, ks=range(1, 17))   # {k: median seconds}
    model = CostModel.measure(target, max_k=8)                    # lazily per number of rows
    model.ratio(rows, k)                                          # t_rows(k) / t_rows(1)

The engine verifies packed (`lilicorr.target.Packing`: each row only its own drafts), so a step's
cost is a function of the drafts verified in all (`VerifyCost`, `model.verify_cost(rows)`):
piecewise linear through one extra token (measured on its own: the first one carries the step
from one token per row to two) and every row verifying k tokens.

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
                          warmup: int = 2, capture=(), one_extra: bool = False) -> dict:
    """Median wall seconds of one target forward of k new tokens for each of `rows` rows, each row
    holding `context` cached tokens (random ids). The cache is rolled back after every forward, so
    every measurement sees the same context. Reps are interleaved over k (drift hits every k alike).
    `one_extra` adds key "one_extra": a packed forward in which one row verifies 2 tokens and the
    others 1 (`lilicorr.target.Packing`)."""
    ks = list(ks) + (["one_extra"] if one_extra else [])
    dev = target.embed_tokens.weight.device
    vocab = target.config.vocab_size
    cache = target.new_cache(rows, capacity=context + max([k for k in ks if isinstance(k, int)] + [2]) + 1)
    slots = torch.tensor([cache.allocate() for _ in range(rows)], device=dev)
    gen = torch.Generator().manual_seed(0)
    width = max([k for k in ks if isinstance(k, int)] + [2])
    ids = torch.randint(0, vocab, (rows, context + width), generator=gen).to(dev)
    pos = torch.arange(context + width, device=dev).expand(rows, -1)
    target(ids[:, :context], pos[:, :context], cache=cache, rows=slots, logits=False)
    base = torch.full((rows,), context, dtype=torch.long, device=dev)
    capture = list(capture)

    extra = torch.ones(rows, dtype=torch.long, device=dev)
    extra[0] = 2                                                        # one row verifies 2 tokens

    def one(k) -> float:
        valid = extra if k == "one_extra" else None
        k = 2 if k == "one_extra" else k
        t0 = time.perf_counter()
        out = target(ids[:, context: context + k], pos[:, context: context + k], cache=cache, rows=slots,
                     capture=capture, valid=valid)
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
    """The verify cost at one exact number of rows as serving measures it: t(1) in seconds, the
    ratios t(k)/t(1) and the one-extra-token ratio, each a running mean, started from the start-up
    measurement of its bucket."""

    def __init__(self, base: float, ratios: list[float], one_extra: float):
        self.base, self.ratios, self.one_extra = base, list(ratios), one_extra
        self.packed: dict[int, float] = {}      # drafts verified in all -> ratio, packed forwards


class VerifyCost:
    """The cost, in plain steps at one number of rows N, of a packed verify forward (every row
    verifies its own number of drafts, `lilicorr.target.Packing`) as a function of the drafts
    verified in all, E = sum of the rows' lengths: piecewise linear through measured points (E, cost),
    (0, 1.0) first, non-decreasing. The points are E = 1 (one row verifies one draft) and E = N (k - 1)
    (every row verifies k tokens); past the last point the last segment's slope goes on.

        cost = model.verify_cost(rows)
        cost([2, 0, 1])      # three rows verifying 2, 0 and 1 drafts
        cost.extra(3)        # the same: 3 drafts in all
    """

    def __init__(self, points: list[tuple[int, float]]):
        pts = sorted(dict([(0, 1.0)] + [(int(e), float(c)) for e, c in points if e > 0]).items())
        run, self.points = 1.0, []
        for e, c in pts:                         # noise must not make a longer verify cheaper
            run = max(run, c)
            self.points.append((e, run))

    def extra(self, e: int) -> float:
        """Cost of verifying `e` drafts in all, in plain steps."""
        pts = self.points
        if e <= 0 or len(pts) == 1:
            return 1.0 if e <= 0 else pts[-1][1]
        for (e0, c0), (e1, c1) in zip(pts, pts[1:]):
            if e <= e1:
                return c0 + (c1 - c0) * (e - e0) / (e1 - e0)
        (e0, c0), (e1, c1) = pts[-2], pts[-1]
        return c1 + (c1 - c0) * (e - e1) / (e1 - e0)

    def __call__(self, lengths) -> float:
        return self.extra(sum(lengths))


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
        self._one_extra: dict[int, float] = {}        # bucket -> t_N(1 + one draft) / t_N(1)
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
                                      reps=self.reps, warmup=1, capture=self.capture, one_extra=b > 1)
            self._ratios[b] = self._monotone([t[k] / t[1] for k in range(1, self.max_k + 1)])
            if b > 1:
                self._one_extra[b] = t["one_extra"] / t[1]
            self.step_seconds[b] = t[1]
        return self._ratios[b]

    def _extra_of(self, bucket: int) -> float:
        """The start-up one-extra-token ratio of a measured bucket (its k = 2 ratio where none)."""
        r = self._ratios[bucket]
        return self._one_extra.get(bucket, r[min(1, len(r) - 1)])

    def verify_cost(self, rows: int) -> VerifyCost:
        """The packed verify's cost at `rows` rows (`VerifyCost`): one extra token, then every row
        verifying k = 2..max_k tokens (served figures where there are any, else measured)."""
        ratios = self.ratios(rows)
        obs = self._observed.get(rows) if self.online else None
        one = obs.one_extra if obs is not None else self._extra_of(self.bucket(rows))
        points = dict([(1, one)] if rows > 1 else [])
        points.update((rows * (k - 1), ratios[k - 1]) for k in range(2, len(ratios) + 1))
        if obs is not None:        # what packed verifies of a mix of lengths have cost while serving
            points.update(obs.packed)
        return VerifyCost(list(points.items()))

    def observe_verify(self, rows: int, k: int, seconds: float, extra: int | None = None) -> None:
        """Fold one served verify forward (k tokens for each of `rows` rows, `seconds` of wall) into
        the cost at exactly `rows` rows: t(1) when k = 1, else the ratio t(k)/t(1) against the
        current t(1). `extra`: a packed forward (rows verifying different numbers of drafts, k the
        longest) that verified `extra` drafts in all: its ratio becomes a point of `verify_cost` at
        that count (one draft: the start-up's one-extra point). Served contexts, kernels warmed by
        real traffic, the mixes of lengths serving verifies and the machine's other load then price
        the next steps, not only the start-up's few samples."""
        if not self.online or not 1 <= k <= self.max_k:
            return
        obs = self._observed.get(rows)
        if obs is None:
            self._measured(rows)
            b = self.bucket(rows)
            obs = self._observed[rows] = _Observed(self.step_seconds[b], self._ratios[b], self._extra_of(b))
        a = self.OBSERVE_RATE
        if extra == 1 and rows > 1:
            obs.one_extra += a * (seconds / obs.base - obs.one_extra)
        elif extra is not None and extra > 0:
            before = obs.packed.get(extra)
            if before is None:                 # starts from what the model priced it at
                before = self.verify_cost(rows).extra(extra)
            obs.packed[extra] = before + a * (seconds / obs.base - before)
        elif k == 1:
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


def row_costs(cost: VerifyCost, slots: int) -> list[float]:
    """[cost of one row verifying j drafts while the others verify none, j = 0..slots]: what
    `best_length` weighs a row's own length against."""
    return [cost.extra(j) for j in range(slots + 1)]


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
