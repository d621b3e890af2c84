"""Markdown tables and plots shared by `python -m lilicorr.eval` and the benchmarks.

Plots use matplotlib's object API with the Agg canvas (no pyplot global state, no display needed).

    print(markdown_table(["rule", "tau"], [["lilicorr", 3.2]], align="lr"))
    print(eval_table(summary))                           # the eval JSON's `results`
    plot_acceptance_histogram({"lilicorr": hist}, "out_accept_hist.png")
    plot_slot_acceptance({"lilicorr": rates}, "out_slot_accept.png")
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["fmt", "markdown_table", "eval_table", "stage_table", "stage_tables",
           "plot_acceptance_histogram", "plot_slot_acceptance", "slot_rates", "mean_std"]


# ------------------------------------------------------------------------------------- numbers
def fmt(x: Any, digits: int = 2) -> str:
    """A table cell: floats with `digits` decimals, None / NaN as an em dash, the rest as str."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return "—"
        return f"{x:.{digits}f}"
    return str(x)


def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the non-None values (None if there are none)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


def slot_rates(accepted: Sequence[int], reached: Sequence[int]) -> list[float | None]:
    """Per-slot acceptance rate: accepted / reached (None where the slot was never reached)."""
    return [a / r if r else None for a, r in zip(accepted, reached)]


# ------------------------------------------------------------------------------------- tables
def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None,
                   digits: int = 2) -> str:
    """A GitHub markdown table. align: one of 'l', 'r', 'c' per column (default: first column
    left, the rest right)."""
    headers = [str(h) for h in headers]
    align = align or ("l" + "r" * (len(headers) - 1))
    if len(align) != len(headers):
        raise ValueError(f"align has {len(align)} entries for {len(headers)} columns")
    marks = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    for row in rows:
        cells = [fmt(c, digits).replace("|", "\\|") for c in row]
        if len(cells) != len(headers):
            raise ValueError(f"row {row!r} has {len(cells)} cells for {len(headers)} columns")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pm(mean: float | None, std: float | None, digits: int, seeds: int) -> str:
    if mean is None:
        return "—"
    if seeds > 1 and std is not None:
        return f"{mean:.{digits}f} ± {std:.{digits}f}"
    return f"{mean:.{digits}f}"


def eval_table(results: dict, rules: Sequence[str] | None = None) -> str:
    """The eval summary as one table: a row per suite and rule.

    results: {suite: {rule: metrics}} as written by lilicorr.eval (metrics hold tau, oracle_tau,
    tokens_per_s, speedup_vs_ar, num_prompts, generated_tokens and, with several seeds, `std`
    and `num_seeds`)."""
    headers = ["suite", "rule", "prompts", "tokens", "tau", "oracle tau", "tau / oracle",
               "tokens/s", "speedup vs ar"]
    rows = []
    for suite, per_rule in results.items():
        order = [r for r in (rules or per_rule) if r in per_rule]
        for rule in order:
            m = per_rule[rule]
            std = m.get("std", {})
            seeds = int(m.get("num_seeds", 1))
            eff = None
            if m.get("tau") is not None and m.get("oracle_tau"):
                eff = m["tau"] / m["oracle_tau"]
            rows.append([suite, rule, m.get("num_prompts"), m.get("generated_tokens"),
                         _pm(m.get("tau"), std.get("tau"), 3, seeds),
                         _pm(m.get("oracle_tau"), std.get("oracle_tau"), 3, seeds),
                         fmt(eff, 3),
                         _pm(m.get("tokens_per_s"), std.get("tokens_per_s"), 1, seeds),
                         _pm(m.get("speedup_vs_ar"), std.get("speedup_vs_ar"), 2, seeds)])
    return markdown_table(headers, rows, align="llrrrrrrr")


def stage_table(table: dict, title: str = "") -> str:
    """One StageTimer.table() in the paper's Table 3 format."""
    from lilicorr.profiling import format_table

    return format_table(table, title)


def stage_tables(tables: dict[str, dict], extra_rows: dict | None = None) -> str:
    """Stage decomposition of several runs side by side (ms per block; lilicorr.profiling's
    format), e.g. {rule: StageTimer.table()}; extra_rows: {row label: {column: text}}."""
    from lilicorr.profiling import format_tables

    return format_tables(tables, extra_rows, digits=3)


# ------------------------------------------------------------------------------------- plots
def _figure(width: float = 6.4, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def plot_acceptance_histogram(hists: dict[str, Sequence[int]], path, title: str = "Acceptance length") -> Path:
    """Grouped bars: fraction of verify steps that committed k tokens (k = 1..B), one colour per
    rule. hists[rule][k] = number of steps that committed k tokens (index 0 unused)."""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    rules = [r for r, h in hists.items() if sum(h)]
    width = 0.8 / max(len(rules), 1)
    kmax = max((len(h) for h in hists.values()), default=2) - 1
    for i, rule in enumerate(rules):
        h = list(hists[rule])
        total = sum(h)
        xs = [k + (i - (len(rules) - 1) / 2) * width for k in range(1, len(h))]
        ys = [c / total for c in h[1:]]
        mean = sum(k * c for k, c in enumerate(h)) / total
        ax.bar(xs, ys, width=width, label=f"{rule} (tau {mean:.2f})")
    ax.set_xlabel("tokens committed per verify step (accepted drafts + bonus)")
    ax.set_ylabel("fraction of steps")
    ax.set_xticks(range(1, kmax + 1))
    ax.set_title(title)
    if rules:
        ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


def plot_slot_acceptance(rates: dict[str, Sequence[float | None]], path,
                         title: str = "Per-slot acceptance") -> Path:
    """Acceptance rate of each drafted slot given that it was reached, one line per rule."""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    smax = 1
    for rule, r in rates.items():
        pts = [(j + 1, v) for j, v in enumerate(r) if v is not None]
        if not pts:
            continue
        smax = max(smax, len(r))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=rule)
    ax.set_xlabel("slot (1 = first drafted token)")
    ax.set_ylabel("P(accepted | reached)")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(0.5, smax + 0.5)
    ax.set_xticks(range(1, smax + 1))
    ax.set_title(title)
    if ax.lines:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
