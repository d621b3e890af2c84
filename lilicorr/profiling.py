"""NVTX ranges (domain `lilicorr`) and a stage timer that aggregates the same ranges per block into
the paper's Table 3 decomposition. This module owns the stage names.

    with stage(STAGE_VERIFY):      # NVTX push/pop, plus wall time when a StageTimer is active
        ...

NVTX calls are no-ops without a profiler attached (and on CPU). The timer synchronises the device
(when one is in use) at range boundaries so GPU stages are timed, not just launched.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict

try:  # the `nvtx` package; absent -> ranges are plain no-ops
    import nvtx as _nvtx
    _DOMAIN = _nvtx.get_domain("lilicorr")
except Exception:  # pragma: no cover - nvtx is a declared dependency
    _nvtx = None
    _DOMAIN = None

STAGE_VERIFY = "target_verify"
STAGE_DRAFT = "draft_backbone"
STAGE_LM_HEAD = "lm_head_projection"
STAGE_HEAD = "speculative_head"
STAGE_ACCEPT = "accept_residual"
STAGES = (STAGE_VERIFY, STAGE_DRAFT, STAGE_LM_HEAD, STAGE_HEAD, STAGE_ACCEPT)
STAGE_TITLES = {
    STAGE_VERIFY: "Target verify",
    STAGE_DRAFT: "Draft backbone",
    STAGE_LM_HEAD: "LM-head projection",
    STAGE_HEAD: "Speculative head",
    STAGE_ACCEPT: "Accept and residual",
}
BLOCK = "block"

_local = threading.local()


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX push/pop range in the `lilicorr` domain (closes on exceptions too)."""
    if _DOMAIN is None:
        yield
        return
    attrs = _DOMAIN.get_event_attributes(message=name)
    _DOMAIN.push_range(attrs)
    try:
        yield
    finally:
        _DOMAIN.pop_range()


class StageTimer:
    """Accumulates wall time per stage and per block. Activate with `with timer.active():`."""

    def __init__(self, sync=None):
        self.sync = sync or _default_sync
        self.totals: dict[str, float] = defaultdict(float)
        self.blocks = 0
        self.block_wall = 0.0
        self._depth = 0

    @contextlib.contextmanager
    def active(self):
        prev = getattr(_local, "timer", None)
        _local.timer = self
        try:
            yield self
        finally:
            _local.timer = prev

    def reset(self):
        self.totals.clear()
        self.blocks, self.block_wall = 0, 0.0

    def table(self) -> dict:
        """ms per block for each stage, per-block wall and the head's share (Table 3 format)."""
        n = max(self.blocks, 1)
        rows = {s: 1e3 * self.totals.get(s, 0.0) / n for s in STAGES}
        wall = 1e3 * self.block_wall / n
        return {"blocks": self.blocks, "stages_ms": rows, "per_block_wall_ms": wall,
                "stage_sum_ms": sum(rows.values()),
                "head_share_pct": 100.0 * rows[STAGE_HEAD] / wall if wall > 0 else 0.0}

    def markdown(self, title: str = "") -> str:
        return format_table(self.table(), title)


def format_table(t: dict, title: str = "") -> str:
    lines = [f"### {title}", ""] if title else []
    lines += ["| Stage (ms / block) | time |", "|---|---:|"]
    for s in STAGES:
        lines.append(f"| {STAGE_TITLES[s]} | {t['stages_ms'][s]:.3f} |")
    lines.append(f"| Per-block wall | {t['per_block_wall_ms']:.3f} |")
    lines.append(f"| Head share | {t['head_share_pct']:.1f}% |")
    lines.append(f"| Blocks timed | {t['blocks']} |")
    return "\n".join(lines)


def _default_sync():
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def current_timer() -> StageTimer | None:
    return getattr(_local, "timer", None)


@contextlib.contextmanager
def stage(name: str):
    """NVTX range + (if a StageTimer is active on this thread) wall time under `name`."""
    timer = current_timer()
    if timer is None:
        with nvtx_range(name):
            yield
        return
    timer.sync()
    t0 = time.perf_counter()
    try:
        with nvtx_range(name):
            yield
    finally:
        timer.sync()
        dt = time.perf_counter() - t0
        if name == BLOCK:
            timer.blocks += 1
            timer.block_wall += dt
        else:
            timer.totals[name] += dt
