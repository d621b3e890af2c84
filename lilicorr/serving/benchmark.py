"""Closed-loop load benchmark against the LiLiCorr server (library part of deploy/bench.py).

One *cell* = one decode rule at one concurrency: ``concurrency`` client threads, each sending its
next prompt as soon as its previous request finished, each request on its own gRPC stream.
At every concurrency the rules run one after another in the same run (ar first), so speedup over
``ar`` is always measured on the same machine minutes apart, never across runs (DESIGN.md §6).

Per cell: output tokens/s (all tokens / cell wall time), tau (sum of accepted incl. bonus / sum of
verify steps over the cell's requests), p50/p99 TTFT and per-token latency (TPOT: time from the
first to the last token / (tokens - 1), per request), errors, and whether greedy outputs equal
``ar``'s for the same prompts (they must: speculative decoding is lossless).
"""
from __future__ import annotations

import math
import re
import time
import urllib.request
from typing import Any, Sequence

from .client import GenerationResult, LiLiCorrClient, run_concurrent


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default); None for no values."""
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return None
    if len(vals) == 1:
        return vals[0]
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def summarize_cell(rule: str, concurrency: int, results: Sequence[Any], wall_s: float) -> dict:
    ok = [r for r in results if isinstance(r, GenerationResult)]
    errors = [r for r in results if not isinstance(r, GenerationResult)]
    tokens = sum(r.num_tokens for r in ok)
    accepted = sum(r.accepted for r in ok)
    steps = sum(r.steps for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    lat = [r.latency for r in ok]
    ms = lambda v: None if v is None else 1e3 * v  # noqa: E731
    return {
        "rule": rule, "concurrency": concurrency, "requests": len(results), "errors": len(errors),
        "error_messages": sorted({str(e)[:200] for e in errors})[:5],
        "output_tokens": tokens, "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "accepted_tokens": accepted, "verify_steps": steps, "drafted_tokens": sum(r.drafted for r in ok),
        "tau": accepted / steps if steps else None,
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
        "tpot_p50_ms": ms(percentile(tpot, 50)), "tpot_p99_ms": ms(percentile(tpot, 99)),
        "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
    }


def request_kwargs(item: dict) -> dict:
    if "messages" in item:
        return {"messages": item["messages"]}
    return {"prompt": item["prompt"]}


def run_cell(client: LiLiCorrClient, prompts: Sequence[dict], rule: str, concurrency: int,
             max_tokens: int, num_requests: int | None = None, temperature: float | None = None,
             seed: int | None = None) -> tuple[dict, list]:
    """Run one cell; returns (summary, per-request results in prompt order)."""
    n = num_requests or max(len(prompts), concurrency)
    items = [prompts[i % len(prompts)] for i in range(n)]

    def one(item: dict) -> GenerationResult:
        return client.generate(max_tokens=max_tokens, decode_rule=rule, temperature=temperature,
                               seed=seed, stream=True, **request_kwargs(item))

    t0 = time.perf_counter()
    results = run_concurrent(one, items, concurrency)
    wall = time.perf_counter() - t0
    return summarize_cell(rule, concurrency, results, wall), results


def add_comparisons(cells: list[dict], outputs: dict[tuple[str, int], list]) -> None:
    """speedup = tokens/s over ar's at the same concurrency; matches_ar = greedy outputs identical."""
    by_c = {c["concurrency"]: c for c in cells if c["rule"] == "ar"}
    for c in cells:
        base = by_c.get(c["concurrency"])
        c["speedup"] = (c["tokens_per_s"] / base["tokens_per_s"]
                        if base and base["tokens_per_s"] > 0 else None)
        ar_out = outputs.get(("ar", c["concurrency"]))
        mine = outputs.get((c["rule"], c["concurrency"]))
        if ar_out is None or mine is None or c["rule"] == "ar":
            c["matches_ar"] = None
            continue
        pairs = [(a, b) for a, b in zip(ar_out, mine)
                 if isinstance(a, GenerationResult) and isinstance(b, GenerationResult)]
        c["matches_ar"] = (sum(a.token_ids == b.token_ids for a, b in pairs) / len(pairs)) if pairs else None


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown_table(cells: list[dict]) -> str:
    lines = ["| rule | conc | req | err | tok/s | speedup vs ar | tau | TTFT p50 ms | TTFT p99 ms | "
             "TPOT p50 ms | TPOT p99 ms | = ar |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in sorted(cells, key=lambda c: (c["concurrency"], c["rule"] != "ar", c["rule"])):
        lines.append(
            f"| {c['rule']} | {c['concurrency']} | {c['requests']} | {c['errors']} | "
            f"{_fmt(c['tokens_per_s'], '.1f')} | {_fmt(c.get('speedup'), '.2f')}x | {_fmt(c['tau'], '.2f')} | "
            f"{_fmt(c['ttft_p50_ms'], '.0f')} | {_fmt(c['ttft_p99_ms'], '.0f')} | "
            f"{_fmt(c['tpot_p50_ms'], '.1f')} | {_fmt(c['tpot_p99_ms'], '.1f')} | "
            f"{_fmt(None if c.get('matches_ar') is None else 100 * c['matches_ar'], '.0f')}"
            f"{'' if c.get('matches_ar') is None else '%'} |")
    return "\n".join(lines)


def plot_speedup(cells: list[dict], path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for rule in sorted({c["rule"] for c in cells}, key=lambda r: (r != "ar", r)):
        pts = sorted((c["concurrency"], c["speedup"]) for c in cells if c["rule"] == rule and c.get("speedup"))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linestyle="--" if rule == "ar" else "-", label=rule)
    concs = sorted({c["concurrency"] for c in cells})
    ax.set_xscale("log", base=2)
    ax.set_xticks(concs)
    ax.set_xticklabels([str(c) for c in concs])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (closed-loop clients)")
    ax.set_ylabel("output tokens/s speedup over ar")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.grid(True, alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------ server metrics (--profile)
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfaN]+)')


def scrape_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels as written by the server)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


_REQUESTS_ENDED = ("lilicorr_requests_completed", "lilicorr_requests_failed", "lilicorr_requests_cancelled")


def settled_metrics(url: str, before: dict[str, float], requests: int, timeout: float = 5.0) -> dict[str, float]:
    """The closing scrape of a pass of `requests` requests: the server publishes a step's metrics
    after it has sent that step's responses, so scrape until its ended-request counters have risen by
    `requests` since `before` (the step that ended the last one is then counted), or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        after = scrape_metrics(url)
        ended = [k for k in after if k.startswith(_REQUESTS_ENDED)]
        if not ended or sum(after[k] - before.get(k, 0.0) for k in ended) >= requests \
                or time.monotonic() > deadline:
            return after
        time.sleep(0.02)


def stage_delta(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """Table 3 decomposition (ms per block) of what the engine did between two scrapes."""
    from lilicorr.profiling import STAGES

    def total(prefix: str, stage: str | None = None) -> float:
        s = 0.0
        for k, v in after.items():
            if k.startswith(prefix + "{") and (stage is None or f'stage="{stage}"' in k):
                s += v - before.get(k, 0.0)
        return s

    blocks = total("lilicorr_stage_blocks")
    if not any(k.startswith("lilicorr_stage_seconds") for k in after):
        return None
    n = max(blocks, 1.0)
    rows = {s: 1e3 * total("lilicorr_stage_seconds", s) / n for s in STAGES}
    wall = 1e3 * total("lilicorr_stage_seconds", "block") / n
    return {"blocks": int(blocks), "stages_ms": rows, "per_block_wall_ms": wall,
            "stage_sum_ms": sum(rows.values()),
            "head_share_pct": 100.0 * rows["speculative_head"] / wall if wall > 0 else 0.0}
