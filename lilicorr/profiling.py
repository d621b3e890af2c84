"""NVTX ranges (domain `lilicorr`) and a stage timer that aggregates the same ranges per block into
the paper's Table 3 decomposition. This module owns the stage names.

    with stage(STAGE_VERIFY):      # NVTX push/pop, plus wall time when a StageTimer is active
        ...
    with nvtx_range("convert/export_onnx"):   # a plain NVTX range (training, conversion, ...)
        ...

Three levels, cheapest first:

* off (``LILICORR_PROFILE=0`` or ``set_enabled(False)``): ``stage`` / ``nvtx_range`` return one
  shared no-op context manager; no NVTX call, no clock read, no device sync.
* on, no timer (the default): NVTX push/pop only. Without a profiler attached the `nvtx` package
  hands out a dummy domain and a push/pop costs well under a microsecond.
* on, timer active (``with StageTimer().active():`` on the thread that runs the engine, or
  ``LILICORR_PROFILE=1`` for one process-wide timer printed at exit): wall time per stage and per
  block. The timer synchronises the device (where CUDA is initialised) at both ends of every
  stage, inside the NVTX range, so GPU stages are timed rather than just launched and the NVTX
  durations nsys reports match the timer's (``deploy/stage_profile.py --nsys`` compares the two).

``block`` (BLOCK) is one engine step over the running rows; the five stages nest inside it and add
up to its wall time (prefill is outside blocks). ``parse_nvtx_sum_csv`` / ``table_from_nvtx`` turn
``nsys stats --report nvtx_sum --format csv`` output into the same Table 3 dict as
``StageTimer.table()``; ``format_table`` / ``format_tables`` render either as markdown.
"""
from __future__ import annotations

import atexit
import contextlib
import csv
import io
import os
import re
import sys
import threading
import time
from collections import defaultdict

try:  # the `nvtx` package; absent -> ranges are plain no-ops
    import nvtx as _nvtx
    _DOMAIN = _nvtx.get_domain("lilicorr")
except Exception:  # pragma: no cover - nvtx is a declared dependency
    _nvtx = None
    _DOMAIN = None

DOMAIN_NAME = "lilicorr"
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
REQUEST = "request"          # start/end range of one served request (`request_range`)

ENV_VAR = "LILICORR_PROFILE"
_OFF_VALUES = ("0", "off", "false", "no")
_ON_VALUES = ("1", "on", "true", "yes")

_local = threading.local()


def _env_mode() -> str:
    v = os.environ.get(ENV_VAR, "").strip().lower()
    if v in _OFF_VALUES:
        return "off"
    if v in _ON_VALUES:
        return "on"
    return "default"


_enabled = _env_mode() != "off"


# ------------------------------------------------------------------------------ global switch
def enabled() -> bool:
    """Whether NVTX ranges and stage timing are on (LILICORR_PROFILE=0 turns them off)."""
    return _enabled


def set_enabled(flag: bool) -> bool:
    """Turn every range and timer on or off process-wide; returns the previous setting."""
    global _enabled
    prev, _enabled = _enabled, bool(flag)
    return prev


@contextlib.contextmanager
def profiling_enabled(flag: bool):
    """`with profiling_enabled(False):` runs a block with profiling off (e.g. a warm-up)."""
    prev = set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(prev)


# ------------------------------------------------------------------------------ NVTX ranges
class _Null:
    """The shared no-op context manager of the `off` level."""
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()


class _Range:
    """NVTX push on enter, pop on exit (also on exceptions). `_DOMAIN` is looked up at enter so
    tests can swap in a counting spy."""
    __slots__ = ("name", "domain")

    def __init__(self, name: str):
        self.name = name
        self.domain = None

    def __enter__(self):
        d = self.domain = _DOMAIN
        if d is not None:
            d.push_range(d.get_event_attributes(message=self.name))
        return None

    def __exit__(self, *exc):
        if self.domain is not None:
            self.domain.pop_range()
        return False


class _TimedStage:
    """sync -> clock -> NVTX push ... sync -> NVTX pop -> clock, recorded into a StageTimer."""
    __slots__ = ("name", "timer", "domain", "t0")

    def __init__(self, name: str, timer: "StageTimer"):
        self.name, self.timer = name, timer
        self.domain = None
        self.t0 = 0.0

    def __enter__(self):
        self.timer.sync()                      # earlier queued work is not charged to this stage
        self.t0 = time.perf_counter()
        d = self.domain = _DOMAIN
        if d is not None:
            d.push_range(d.get_event_attributes(message=self.name))
        return None

    def __exit__(self, *exc):
        try:
            self.timer.sync()                  # this stage's device work, inside its NVTX range
        finally:
            if self.domain is not None:
                self.domain.pop_range()
            self.timer.record(self.name, time.perf_counter() - self.t0)
        return False


def nvtx_range(name: str):
    """An NVTX push/pop range in the `lilicorr` domain (closes on exceptions too); a no-op when
    profiling is off. Use for phases outside the engine: ``train/forward``, ``convert/export``..."""
    if not _enabled:
        return _NULL
    return _Range(name)


def stage(name: str, includes: tuple = (), label: str = ""):
    """NVTX range + (if a StageTimer is active on this thread, or the process-wide one of
    LILICORR_PROFILE=1 exists) wall time under `name`. `name` is one of STAGES or BLOCK.

    `includes`: other stages whose work runs inside this one and cannot be timed apart (a draft
    backend that runs backbone, LM head and head as one graph); the timer notes it and the stage
    table titles the row as the sum (`label` says why, e.g. "one TensorRT plan") instead of
    showing those stages as ~0."""
    if not _enabled:
        return _NULL
    timer = getattr(_local, "timer", None) or _GLOBAL_TIMER
    if timer is None:
        return _Range(name)
    if includes:
        timer.note_includes(name, includes, label)
    return _TimedStage(name, timer)


def request_range(label: str = REQUEST, payload: int | None = None):
    """Start an NVTX start/end range for one request (may end on another thread, e.g. the engine
    loop): returns a handle for `end_request_range`, or None when profiling is off. nsys sums them
    under `lilicorr:<label>`; `payload` (an int such as the request's engine id) tells them apart
    on the timeline."""
    d = _DOMAIN
    if not _enabled or d is None:
        return None
    if payload is None:
        attrs = d.get_event_attributes(message=label)
    else:
        attrs = d.get_event_attributes(message=label, payload=int(payload))
    return (d, d.start_range(attrs))


def end_request_range(handle) -> None:
    """End a range from `request_range` (None is ignored, so callers need no checks)."""
    if handle is not None:
        d, rid = handle
        d.end_range(rid)


# ------------------------------------------------------------------------------ stage timer
def _default_sync():
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StageTimer:
    """Accumulates wall time per stage and per block (Table 3). Activate with
    ``with timer.active():`` on the thread that steps the engine. Thread-safe: a long-running
    process (the Triton model) may read `snapshot()` from another thread while the engine runs.

    Attributes kept for readers of the raw sums: `totals` (seconds per stage), `counts` (ranges per
    stage), `blocks`, `block_wall` (seconds)."""

    def __init__(self, sync=None, name: str = ""):
        self.sync = sync or _default_sync
        self.name = name
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.blocks = 0
        self.block_wall = 0.0
        self.block_max = 0.0
        self.includes: dict[str, dict] = {}    # stage -> {"stages": [...], "label": ...} (see `stage`)
        self._lock = threading.Lock()
        self._exit_hook = None

    # -- recording -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self):
        """Make this the timer of the current thread (nests; restores the previous one)."""
        prev = getattr(_local, "timer", None)
        _local.timer = self
        try:
            yield self
        finally:
            _local.timer = prev

    def record(self, name: str, seconds: float) -> None:
        with self._lock:
            if name == BLOCK:
                self.blocks += 1
                self.block_wall += seconds
                if seconds > self.block_max:
                    self.block_max = seconds
            else:
                self.totals[name] += seconds
                self.counts[name] += 1

    def note_includes(self, name: str, includes, label: str = "") -> None:
        """Record that stage `name` also holds the work of the stages in `includes`."""
        entry = {"stages": [s for s in STAGES if s in includes], "label": label}
        if self.includes.get(name) != entry:
            with self._lock:
                self.includes[name] = entry

    def reset(self) -> None:
        with self._lock:
            self._reset_locked()

    def _reset_locked(self) -> None:
        self.totals.clear()
        self.counts.clear()
        self.includes.clear()
        self.blocks, self.block_wall, self.block_max = 0, 0.0, 0.0

    # -- reading -------------------------------------------------------------------------------
    def table(self) -> dict:
        """ms per block for each stage, per-block wall and the head's share (Table 3 format)."""
        with self._lock:
            return self._table_locked()

    def _table_locked(self) -> dict:
        return make_table({s: self.totals.get(s, 0.0) for s in STAGES}, self.blocks, self.block_wall,
                          counts={s: self.counts.get(s, 0) for s in STAGES}, block_max_s=self.block_max,
                          includes=self.includes)

    def snapshot(self, reset: bool = False) -> dict:
        """The Table 3 dict plus the raw sums, taken atomically; `reset=True` starts a new window
        (e.g. one per metrics scrape or per benchmark cell)."""
        with self._lock:
            t = self._table_locked()
            t["totals_s"] = {s: self.totals.get(s, 0.0) for s in STAGES}
            t["block_wall_s"] = self.block_wall
            if reset:
                self._reset_locked()
        return t

    def markdown(self, title: str = "") -> str:
        return format_table(self.table(), title)

    def log_at_exit(self, title: str | None = None, stream=None, log=None) -> "StageTimer":
        """Print the table when the process exits (if any block was timed): to `log(text)` when
        given (e.g. a server logger), else to `stream` (default stderr). Returns self."""
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
        heading = title or f"LiLiCorr stage breakdown{f' ({self.name})' if self.name else ''}"

        def _hook():
            if self.blocks == 0:
                return
            text = self.markdown(heading)
            if log is not None:
                log(text)
            else:
                print(text, file=stream or sys.stderr, flush=True)

        self._exit_hook = _hook
        atexit.register(_hook)
        return self


def current_timer() -> StageTimer | None:
    """The timer activated on this thread (not the process-wide one), or None."""
    return getattr(_local, "timer", None)


_GLOBAL_TIMER: StageTimer | None = None


def global_timer() -> StageTimer | None:
    """The process-wide timer of LILICORR_PROFILE=1 (used by threads without an active timer),
    or None."""
    return _GLOBAL_TIMER


def install_global_timer(log_at_exit: bool = True) -> StageTimer:
    """Create (once) the process-wide timer; LILICORR_PROFILE=1 does this at import."""
    global _GLOBAL_TIMER
    if _GLOBAL_TIMER is None:
        _GLOBAL_TIMER = StageTimer(name=f"LILICORR_PROFILE=1, pid {os.getpid()}")
        if log_at_exit:
            _GLOBAL_TIMER.log_at_exit()
    return _GLOBAL_TIMER


def uninstall_global_timer() -> None:
    global _GLOBAL_TIMER
    if _GLOBAL_TIMER is not None and _GLOBAL_TIMER._exit_hook is not None:
        atexit.unregister(_GLOBAL_TIMER._exit_hook)
    _GLOBAL_TIMER = None


if _env_mode() == "on":
    install_global_timer()


# ------------------------------------------------------------------------------ tables
def make_table(stage_seconds: dict, blocks: int, block_wall_s: float, counts: dict | None = None,
               block_max_s: float | None = None, includes: dict | None = None) -> dict:
    """Table 3 dict from total seconds per stage, the number of blocks and their total wall.
    `includes` ({stage: {"stages": [...], "label": ...}}, see `stage`) is kept under "includes"
    when a stage holds others' work; the rendered tables title such rows by what they contain."""
    n = max(int(blocks), 1)
    rows = {s: 1e3 * float(stage_seconds.get(s, 0.0)) / n for s in STAGES}
    wall = 1e3 * float(block_wall_s) / n
    ssum = sum(rows.values())
    t = {"blocks": int(blocks), "stages_ms": rows, "per_block_wall_ms": wall, "stage_sum_ms": ssum,
         "unattributed_ms": wall - ssum,
         "head_share_pct": 100.0 * rows[STAGE_HEAD] / wall if wall > 0 else 0.0}
    if counts is not None:
        t["ranges_per_block"] = {s: counts.get(s, 0) / n for s in STAGES}
    if block_max_s is not None:
        t["max_block_ms"] = 1e3 * block_max_s
    if includes:
        t["includes"] = {k: {"stages": list(v["stages"]), "label": v.get("label", "")}
                         for k, v in includes.items() if v.get("stages")}
    return t


def _inside(t: dict, s: str) -> str | None:
    """The stage whose time holds stage `s` in table `t` (None when `s` is timed on its own)."""
    for outer, v in (t.get("includes") or {}).items():
        if s in v["stages"]:
            return outer
    return None


def stage_title(t: dict, s: str) -> str:
    """Row title of stage `s` in table `t`: 'Draft backbone + LM-head projection + Speculative
    head (one TensorRT plan)' for a stage that holds others."""
    v = (t.get("includes") or {}).get(s)
    if not v:
        return STAGE_TITLES[s]
    title = " + ".join(STAGE_TITLES[x] for x in [s] + list(v["stages"]))
    return f"{title} ({v['label']})" if v.get("label") else title


def _cell(t: dict, s: str, digits: int) -> str:
    outer = _inside(t, s)
    if outer is not None:
        return f"(in {STAGE_TITLES[outer]})"
    return f"{t['stages_ms'][s]:.{digits}f}"


def _head_share(t: dict) -> str:
    outer = _inside(t, STAGE_HEAD)
    return f"n/a (in {STAGE_TITLES[outer]})" if outer else f"{t['head_share_pct']:.1f}%"


def format_table(t: dict, title: str = "") -> str:
    lines = [f"### {title}", ""] if title else []
    lines += ["| Stage (ms / block) | time |", "|---|---:|"]
    for s in STAGES:
        lines.append(f"| {stage_title(t, s)} | {_cell(t, s, 3)} |")
    lines.append(f"| Per-block wall | {t['per_block_wall_ms']:.3f} |")
    lines.append(f"| Head share | {_head_share(t)} |")
    lines.append(f"| Blocks timed | {t['blocks']} |")
    return "\n".join(lines)


def format_tables(columns: dict, extra_rows: dict | None = None, digits: int = 2) -> str:
    """Several Table 3 dicts side by side: {column label: table}. `extra_rows` adds rows below
    ({row label: {column label: text}}), e.g. tau or tokens/s."""
    labels = list(columns)
    lines = ["| Stage (ms / block) | " + " | ".join(labels) + " |",
             "|---|" + "---:|" * len(labels)]

    def row(name, cells):
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    notes = []
    for s in STAGES:
        cells = []
        for c in labels:
            t = columns[c]
            cell = _cell(t, s, digits)
            if (t.get("includes") or {}).get(s):
                cell += "*"
                notes.append(f"{c}: {stage_title(t, s)}")
            cells.append(cell)
        row(STAGE_TITLES[s], cells)
    row("Per-block wall", [f"{columns[c]['per_block_wall_ms']:.{digits}f}" for c in labels])
    row("(sum of stages)", [f"{columns[c]['stage_sum_ms']:.{digits}f}" for c in labels])
    row("Head share", [_head_share(columns[c]) for c in labels])
    row("Blocks", [str(columns[c]["blocks"]) for c in labels])
    for name, cells in (extra_rows or {}).items():
        row(name, [str(cells.get(c, "")) for c in labels])
    if notes:
        lines += [""] + [f"\\* {n}" for n in notes]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ nsys NVTX summary
_UNIT_NS = {"ns": 1.0, "us": 1e3, "μs": 1e3, "ms": 1e6, "s": 1e9}
_UNIT_RE = re.compile(r"\((ns|us|μs|ms|s)\)\s*$")


def _number(text: str) -> float:
    t = text.strip().replace(",", "")
    return float(t) if t not in ("", "-") else 0.0


def parse_nvtx_sum_csv(text: str) -> list[dict]:
    """Rows of `nsys stats --report nvtx_sum --format csv` (also the older `nvtxsum` /
    `nvtxppsum` layouts: 'Time(%)', 'Average', no 'Style'). Leading progress lines
    ('Generating SQLite file ...', 'Processing [...] with [...]') are skipped.

    Each row: {"range" (as printed, e.g. 'lilicorr:block'), "domain" ('' for the default domain
    or when the report gives no domain), "name", "style" ('PushPop'/'StartEnd'/''), "instances",
    "total_ns", "avg_ns" (None if absent)}. Times are converted to ns from the unit in the header."""
    lines = text.splitlines()
    start = None
    for i, line in enumerate(lines):
        cells = next(csv.reader([line]), [])
        names = [c.strip() for c in cells]
        if "Instances" in names and any(c.startswith("Total Time") for c in names) and \
                ("Range" in names or "Name" in names):
            start = i
            break
    if start is None:
        raise ValueError("no NVTX summary header (Total Time / Instances / Range) in the nsys output")
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    header = [h.strip() for h in next(reader)]
    col = {h: j for j, h in enumerate(header)}
    total_h = next(h for h in header if h.startswith("Total Time"))
    avg_h = next((h for h in header if h.startswith(("Avg", "Average"))), None)
    range_h = "Range" if "Range" in col else "Name"

    def scale(h):
        m = _UNIT_RE.search(h)
        return _UNIT_NS[m.group(1)] if m else 1.0       # the old layouts print bare ns

    rows = []
    for cells in reader:
        if not cells or all(not c.strip() for c in cells):
            continue
        if len(cells) < len(header):
            continue                                      # a trailing note, not a data row
        rng = cells[col[range_h]]
        domain, name = ("", rng)
        if ":" in rng:
            domain, name = rng.split(":", 1)
        rows.append({"range": rng, "domain": domain, "name": name,
                     "style": cells[col["Style"]].strip() if "Style" in col else "",
                     "instances": int(_number(cells[col["Instances"]])),
                     "total_ns": _number(cells[col[total_h]]) * scale(total_h),
                     "avg_ns": _number(cells[col[avg_h]]) * scale(avg_h) if avg_h else None})
    return rows


def table_from_nvtx(rows: list[dict], domain: str = DOMAIN_NAME) -> dict:
    """Table 3 dict from parsed nvtx_sum rows: ranges of `domain` (or domain-less rows with a
    stage name, as older reports print them) named like the stages; blocks = `block` instances."""
    seconds = defaultdict(float)
    counts = defaultdict(int)
    wanted = set(STAGES) | {BLOCK}
    for r in rows:
        if r["name"] not in wanted or r["domain"] not in (domain, ""):
            continue
        seconds[r["name"]] += r["total_ns"] * 1e-9
        counts[r["name"]] += r["instances"]
    return make_table(seconds, counts.get(BLOCK, 0), seconds.get(BLOCK, 0.0),
                      counts={s: counts.get(s, 0) for s in STAGES})
