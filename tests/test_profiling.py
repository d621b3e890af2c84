"""Profiling (issue 6): NVTX ranges nest and close (also on errors), the stage timer's aggregation,
the global switch (off leaves engine outputs unchanged and opens nothing), LILICORR_PROFILE=1 in a
process, snapshot/reset, request ranges, the nsys nvtx_sum CSV parser and deploy/stage_profile.py.

NVTX is observed through `_SpyDomain`, swapped in for `profiling._DOMAIN`: it keeps the stack of
open ranges, so balance and nesting are checked exactly without a profiler attached.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from lilicorr import profiling
from lilicorr.draft_runner import TorchDraftRunner
from lilicorr.engine import SpecEngine
from lilicorr.model import untrained_model
from lilicorr.profiling import (BLOCK, STAGE_ACCEPT, STAGE_DRAFT, STAGE_HEAD, STAGE_LM_HEAD, STAGE_VERIFY,
                                STAGES, StageTimer, current_timer, nvtx_range, stage)

from spec_helpers import load_script, random_prompts, target_of

REPO = Path(__file__).resolve().parents[1]


class _SpyDomain:
    """Stands in for the NVTX domain: a stack of open push/pop ranges, a log of events, the
    enclosing ranges of every push, and start/end ranges by id."""

    def __init__(self, log=None):
        self.stack: list[str] = []
        self.pushes: list[tuple[str, tuple[str, ...]]] = []   # (name, enclosing ranges)
        self.log = log if log is not None else []
        self.open_ids: dict[int, str] = {}
        self._next = 1

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        return (message, payload)

    def push_range(self, attrs):
        self.pushes.append((attrs[0], tuple(self.stack)))
        self.stack.append(attrs[0])
        self.log.append(("push", attrs[0]))

    def pop_range(self):
        assert self.stack, "pop without a push"
        self.log.append(("pop", self.stack.pop()))

    def start_range(self, attrs):
        rid, self._next = self._next, self._next + 1
        self.open_ids[rid] = attrs
        return rid

    def end_range(self, rid):
        del self.open_ids[rid]


@pytest.fixture
def spy(monkeypatch):
    d = _SpyDomain()
    monkeypatch.setattr(profiling, "_DOMAIN", d)
    monkeypatch.setattr(profiling, "_enabled", True)
    monkeypatch.setattr(profiling, "_GLOBAL_TIMER", None)
    return d


@pytest.fixture
def tiny_engine(tiny_target_dir):
    target = target_of(tiny_target_dir("llama"))

    def make(max_batch=4, block_size=4):
        return SpecEngine(target, TorchDraftRunner(untrained_model(target, block_size=block_size), max_batch),
                          max_batch=max_batch)
    return make


# ------------------------------------------------------------------------------------ ranges
def test_engine_ranges_nest_inside_blocks_and_balance(spy, tiny_engine):
    """Every stage range opens inside a `block` range, never inside another stage; blocks never
    nest; prefill is outside blocks; everything pushed is popped. A mixed batch (spec + ar rows)."""
    engine = tiny_engine()
    vocab = engine.vocab_size
    prompts = random_prompts((5, 3, 8), vocab, seed=3)
    for use_timer in (False, True):
        spy.pushes.clear()
        ctx = StageTimer().active() if use_timer else profiling.profiling_enabled(True)
        with ctx:
            for p, rule in zip(prompts, ("lilicorr", "ar", "argmax")):
                engine.add_request(p, 6, rule=rule)
            while engine.num_active:
                engine.step()
                assert spy.stack == []
        names = [n for n, _ in spy.pushes]
        assert set(STAGES) <= set(names) and BLOCK in names and "engine/prefill" in names
        for name, parents in spy.pushes:
            if name in STAGES:
                assert BLOCK in parents, (name, parents)
                assert not set(parents) & set(STAGES), f"{name} nested in {parents}"
            if name == BLOCK:
                assert parents == (), parents
            if name == "engine/prefill":
                assert BLOCK not in parents
        # the runner's stages follow the engine order of Table 3 within each spec block
        first = [n for n, _ in spy.pushes if n in (STAGE_LM_HEAD, STAGE_HEAD, STAGE_VERIFY, STAGE_ACCEPT)][:4]
        assert first == [STAGE_LM_HEAD, STAGE_HEAD, STAGE_VERIFY, STAGE_ACCEPT]


def test_stage_closes_and_records_on_errors(spy):
    timer = StageTimer()
    with pytest.raises(KeyError):
        with timer.active():
            with stage(BLOCK):
                with stage(STAGE_VERIFY):
                    pass
                with stage(STAGE_HEAD):
                    with nvtx_range("inner"):
                        raise KeyError("boom")
    assert spy.stack == [] and len(spy.pushes) == 4
    assert current_timer() is None
    assert timer.blocks == 1 and timer.block_wall > 0
    assert timer.counts[STAGE_VERIFY] == 1 and timer.counts[STAGE_HEAD] == 1
    assert 0 < timer.totals[STAGE_HEAD] <= timer.block_wall
    # a plain range closes on errors too, without a timer
    with pytest.raises(ValueError):
        with nvtx_range("train/forward"):
            raise ValueError
    assert spy.stack == []


def test_timer_syncs_inside_the_range_and_times_with_the_clock(spy, monkeypatch):
    """sync -> clock -> push ... sync -> pop -> clock, so the NVTX range contains the device wait."""
    clock = iter(range(0, 1000, 1))
    monkeypatch.setattr(profiling.time, "perf_counter", lambda: float(next(clock)))
    timer = StageTimer(sync=lambda: spy.log.append(("sync", None)))
    with timer.active():
        with stage(STAGE_VERIFY):
            spy.log.append(("work", None))
    assert [e for e, _ in spy.log] == ["sync", "push", "work", "sync", "pop"]
    assert timer.totals[STAGE_VERIFY] == 1.0            # clock read once at enter, once at exit


def test_timer_aggregation_math():
    t = StageTimer(sync=lambda: None)
    for _ in range(4):
        t.record(STAGE_VERIFY, 0.006)
        t.record(STAGE_DRAFT, 0.001)
        t.record(STAGE_DRAFT, 0.0005)       # two draft ranges per block (context + forward)
        t.record(STAGE_LM_HEAD, 0.0005)
        t.record(STAGE_HEAD, 0.001)
        t.record(STAGE_ACCEPT, 0.0005)
        t.record(BLOCK, 0.010)
    tab = t.table()
    assert tab["blocks"] == 4
    assert tab["stages_ms"][STAGE_VERIFY] == pytest.approx(6.0)
    assert tab["stages_ms"][STAGE_DRAFT] == pytest.approx(1.5)
    assert tab["per_block_wall_ms"] == pytest.approx(10.0)
    assert tab["stage_sum_ms"] == pytest.approx(9.5)
    assert tab["unattributed_ms"] == pytest.approx(0.5)
    assert tab["head_share_pct"] == pytest.approx(10.0)
    assert tab["ranges_per_block"][STAGE_DRAFT] == 2 and tab["max_block_ms"] == pytest.approx(10.0)
    md = t.markdown("x")
    assert "| Speculative head | 1.000 |" in md and "| Head share | 10.0% |" in md
    side = profiling.format_tables({"a": tab, "b": tab}, {"tau": {"a": "1.0", "b": "2.0"}})
    assert "| Per-block wall | 10.00 | 10.00 |" in side and "| tau | 1.0 | 2.0 |" in side
    empty = StageTimer().table()
    assert empty["blocks"] == 0 and empty["head_share_pct"] == 0.0


def test_stage_holding_others_is_titled_by_what_it_holds():
    """A backend that runs backbone, LM head and head as one graph times it under STAGE_DRAFT with
    `includes`: the table keeps the numbers but titles the row as the sum, and the held stages
    and the head share read "(in Draft backbone)" / "n/a" instead of a misleading ~0."""
    t = StageTimer(sync=lambda: None)
    with t.active():
        for _ in range(3):
            with stage(STAGE_DRAFT, includes=(STAGE_HEAD, STAGE_LM_HEAD), label="one TensorRT plan"):
                pass
            with stage(STAGE_HEAD):
                pass
            t.record(BLOCK, 0.004)
    tab = t.table()
    assert tab["includes"] == {STAGE_DRAFT: {"stages": [STAGE_LM_HEAD, STAGE_HEAD], "label": "one TensorRT plan"}}
    assert tab["ranges_per_block"][STAGE_DRAFT] == 1 and tab["stages_ms"][STAGE_DRAFT] > 0
    md = t.markdown()
    assert "| Draft backbone + LM-head projection + Speculative head (one TensorRT plan) |" in md
    assert "| LM-head projection | (in Draft backbone) |" in md
    assert "| Speculative head | (in Draft backbone) |" in md and "| Head share | n/a (in Draft backbone) |" in md
    plain = StageTimer(sync=lambda: None)
    with plain.active(), stage(STAGE_HEAD):
        pass
    side = profiling.format_tables({"trt": tab, "ort": plain.table()})
    assert "| Draft backbone | " in side and "* |" in side
    assert "trt: Draft backbone + LM-head projection + Speculative head (one TensorRT plan)" in side
    assert "includes" not in plain.table()
    t.reset()
    assert "includes" not in t.table()


def test_snapshot_reset_and_threads():
    t = StageTimer(sync=lambda: None)

    def work():
        for _ in range(2000):
            t.record(STAGE_HEAD, 0.001)
            t.record(BLOCK, 0.002)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    snaps = [t.snapshot() for _ in range(50)]               # concurrent readers see consistent sums
    for th in threads:
        th.join()
    for s in snaps:      # atomic: each thread records its head range before its block
        assert s["totals_s"][STAGE_HEAD] >= 0.001 * s["blocks"] - 1e-9
    s = t.snapshot(reset=True)
    assert s["blocks"] == 8000 and s["totals_s"][STAGE_HEAD] == pytest.approx(8.0)
    assert s["head_share_pct"] == pytest.approx(50.0)
    assert t.blocks == 0 and not t.totals and t.table()["blocks"] == 0


def test_log_at_exit_hook_and_nested_activation():
    lines = []
    t = StageTimer(sync=lambda: None, name="srv").log_at_exit(log=lines.append)
    t._exit_hook()
    assert lines == []                                       # nothing timed: nothing printed
    t.record(BLOCK, 0.004)
    t.record(STAGE_VERIFY, 0.003)
    t._exit_hook()
    assert "LiLiCorr stage breakdown (srv)" in lines[0] and "| Target verify | 3.000 |" in lines[0]
    import atexit
    atexit.unregister(t._exit_hook)
    outer, inner = StageTimer(), StageTimer()
    with outer.active():
        with inner.active():
            assert current_timer() is inner
        assert current_timer() is outer
    assert current_timer() is None


# ------------------------------------------------------------------------------------ switch
def test_disabled_opens_nothing_and_times_nothing(spy):
    timer = StageTimer()
    with profiling.profiling_enabled(False), timer.active():
        assert not profiling.enabled()
        assert stage(STAGE_VERIFY) is stage(BLOCK) is nvtx_range("x")      # one shared no-op
        with stage(BLOCK), stage(STAGE_VERIFY), nvtx_range("train/forward"):
            pass
        assert profiling.request_range(payload=3) is None
        profiling.end_request_range(None)
    assert profiling.enabled()
    assert spy.pushes == [] and timer.blocks == 0 and not timer.totals


def test_disabling_profiling_leaves_engine_outputs_unchanged(spy, tiny_engine):
    prompts = random_prompts((4, 9, 2), 96, seed=7)
    rules = ("lilicorr", "viterbi", "argmax", "ar")
    outs = {}
    for mode in ("off", "nvtx", "timer"):
        engine = tiny_engine(max_batch=4, block_size=4)
        for rule in rules:
            timer = StageTimer()
            with profiling.profiling_enabled(mode != "off"), \
                    (timer.active() if mode == "timer" else contextlib.nullcontext()):
                res = engine.generate(prompts, 7, rule=rule)
            outs[mode, rule] = [(r.tokens, r.num_steps, r.accepted_tokens, r.oracle_accepted, r.slot_accepted)
                                for r in res]
            assert (timer.blocks > 0) == (mode == "timer")
    for rule in rules:
        assert outs["off", rule] == outs["nvtx", rule] == outs["timer", rule], rule
    assert spy.stack == []


def _run_py(code: str, env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != profiling.ENV_VAR}
    if env_value is not None:
        env[profiling.ENV_VAR] = env_value
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=REPO)


def test_env_switch_in_a_process():
    code = """
        import time
        from lilicorr import profiling as p
        print("enabled", p.enabled(), "global", p.global_timer() is not None)
        for _ in range(3):
            with p.stage(p.BLOCK):
                with p.stage(p.STAGE_VERIFY):
                    time.sleep(0.002)
        t = p.global_timer()
        print("blocks", t.blocks if t else 0)
    """
    on = _run_py(code, "1")
    assert on.returncode == 0, on.stderr
    assert "enabled True global True" in on.stdout and "blocks 3" in on.stdout
    assert "LiLiCorr stage breakdown" in on.stderr and "| Blocks timed | 3 |" in on.stderr   # printed at exit
    off = _run_py(code, "0")
    assert "enabled False global False" in off.stdout and "blocks 0" in off.stdout and off.stderr == ""
    default = _run_py(code, None)
    assert "enabled True global False" in default.stdout and default.stderr == ""


def test_request_ranges_cross_threads(spy):
    h = profiling.request_range(payload=42)
    assert spy.open_ids == {h[1]: ("request", 42)}
    th = threading.Thread(target=profiling.end_request_range, args=(h,))   # ended by another thread
    th.start()
    th.join()
    assert spy.open_ids == {}


# ------------------------------------------------------------------------------------ nsys CSV
# The layout of `nsys stats --report nvtx_sum --format csv` (Nsight Systems 2023-2025; the report
# script's columns "Time:ratio_%", "Total Time:dur_ns", "Instances", "Avg:dur_ns", "Med:dur_ns",
# "Min:dur_ns", "Max:dur_ns", "StdDev:dur_ns", "Style", "Range", rendered with units; ranges named
# "<domain>:<message>", ":<message>" in the default domain), after the progress lines it prints.
NVTX_SUM_CSV = """\
Generating SQLite file /tmp/p/profile_lilicorr.sqlite from /tmp/p/profile_lilicorr.nsys-rep
Processing [/tmp/p/profile_lilicorr.sqlite] with [/opt/nvidia/nsight-systems/2024.5.1/host-linux-x64/reports/nvtx_sum.py]...

"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)","StdDev (ns)","Style","Range"
"49.6","1053000000","100","10530000.0","10490000.0","10100000","12010000","210000.5","PushPop","lilicorr:block"
"35.7","752000000","100","7520000.0","7500000.0","7400000","7900000","50000.1","PushPop","lilicorr:target_verify"
"6.1","129000000","200","645000.0","640000.0","300000","1000000","300000.0","PushPop","lilicorr:draft_backbone"
"2.8","59000000","100","590000.0","588000.0","570000","650000","5000.0","PushPop","lilicorr:accept_residual"
"2.4","50000000","100","500000.0","500000.0","490000","520000","3000.0","PushPop","lilicorr:lm_head_projection"
"1.3","28000000","100","280000.0","280000.0","270000","300000","2000.0","PushPop","lilicorr:speculative_head"
"1.0","21000000","8","2625000.0","2600000.0","2500000","2800000","100000.0","PushPop","lilicorr:engine/prefill"
"0.9","19000000","3","6333333.3","6000000.0","5000000","8000000","1000000.0","StartEnd","lilicorr:request"
"0.2","5000000","1","5000000.0","5000000.0","5000000","5000000","0.0","PushPop",":target_verify"
"0.1","2000000","40","50000.0","50000.0","40000","60000","1000.0","PushPop","NCCL:ncclAllReduce"
"""

# older `nvtxsum` / `nvtxppsum` (2021-2022): no Style, 'Time(%)', 'Average', ranges without domain
NVTXSUM_OLD_CSV = """\
"Time(%)","Total Time (ns)","Instances","Average","Minimum","Maximum","Range"
60.0,3000000,2,1500000.0,1400000,1600000,"block"
40.0,2000000,2,1000000.0,900000,1100000,"target_verify"
"""


def test_parse_nvtx_sum_csv():
    rows = profiling.parse_nvtx_sum_csv(NVTX_SUM_CSV)
    assert len(rows) == 10
    r = rows[0]
    assert (r["domain"], r["name"], r["style"], r["instances"], r["total_ns"]) == \
        ("lilicorr", "block", "PushPop", 100, 1053000000.0)
    assert rows[8]["domain"] == "" and rows[8]["name"] == "target_verify"
    assert rows[9]["domain"] == "NCCL"
    t = profiling.table_from_nvtx(rows)
    assert t["blocks"] == 100
    assert t["per_block_wall_ms"] == pytest.approx(10.53)
    assert t["stages_ms"][STAGE_VERIFY] == pytest.approx(7.52 + 0.05)    # default-domain row counted too
    assert t["stages_ms"][STAGE_DRAFT] == pytest.approx(1.29)
    assert t["stages_ms"][STAGE_HEAD] == pytest.approx(0.28)
    assert t["ranges_per_block"][STAGE_DRAFT] == 2
    assert t["head_share_pct"] == pytest.approx(100 * 0.28 / 10.53)
    assert "| Speculative head | 0.280 |" in profiling.format_table(t)
    # another domain's ranges of the same name are not ours
    assert profiling.table_from_nvtx(rows, domain="other")["stages_ms"][STAGE_DRAFT] == 0.0


def test_parse_older_and_unit_variants():
    old = profiling.table_from_nvtx(profiling.parse_nvtx_sum_csv(NVTXSUM_OLD_CSV))
    assert old["blocks"] == 2 and old["per_block_wall_ms"] == pytest.approx(1.5)
    assert old["stages_ms"][STAGE_VERIFY] == pytest.approx(1.0)
    us = NVTX_SUM_CSV.replace("(ns)", "(us)")                  # nsys stats --timeunit usec
    t = profiling.table_from_nvtx(profiling.parse_nvtx_sum_csv(us))
    assert t["per_block_wall_ms"] == pytest.approx(10530.0)
    with pytest.raises(ValueError, match="no NVTX summary header"):
        profiling.parse_nvtx_sum_csv("Processing [x.sqlite] with [nvtx_sum.py]...\nSKIPPED: no NVTX data\n")


# ------------------------------------------------------------------------------------ deploy/stage_profile.py
def _load_script(name: str):
    return load_script(REPO / "deploy" / f"{name}.py", f"lilicorr_deploy_{name}")


def test_profile_script_without_nsys(tiny_target_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(profiling, "_GLOBAL_TIMER", None)
    prof = _load_script("stage_profile")
    suite = tmp_path / "p.jsonl"
    suite.write_text("\n".join(json.dumps({"prompt": p}) for p in ("hello world how are you", "write code please")))
    out = tmp_path / "sb.md"
    argv = ["--target", str(tiny_target_dir("llama")), "--suite", str(suite), "--num-prompts", "2",
            "--max-tokens", "5", "--rules", "lilicorr,argmax,ar", "--warmup-tokens", "2", "--nsys",
            "--nsys-bin", "no-such-nsys-binary", "--out", str(out)]
    assert prof.main(argv) == 0
    err = capsys.readouterr().err
    assert "`no-such-nsys-binary` not found on PATH" in err
    text = out.read_text()
    assert "python deploy/stage_profile.py --target" in text and "UNTRAINED" in text
    assert "| Stage (ms / block) | lilicorr | argmax | ar |" in text and "Speedup over ar" in text
    raw = json.loads(out.with_suffix(".json").read_text())
    for rule in ("lilicorr", "argmax", "ar"):
        t = raw["runs"][rule]["table"]
        # the 5% accounting check lives in test_engine (GC off, longer blocks); here only sanity:
        # a few-millisecond tiny-model block on a loaded machine carries proportionally more noise
        assert t["blocks"] > 0 and 0 < t["stage_sum_ms"] <= 1.05 * t["per_block_wall_ms"]
    assert raw["runs"]["ar"]["table"]["stages_ms"][STAGE_HEAD] == 0
    assert prof._strip_options(["--rules", "ar", "--nsys", "--out=x", "--max-tokens", "3"],
                               {"--rules", "--out"}, {"--nsys"}) == ["--max-tokens", "3"]


FAKE_NSYS = """\
#!{python}
# stands in for nsys: `profile ... -o REP CMD...` runs CMD and writes REP.nsys-rep;
# `stats ... --output PREFIX REP` writes PREFIX_nvtx_sum.csv (a canned summary)
import subprocess, sys
args = sys.argv[1:]
if args[0] == "--version":
    print("NVIDIA Nsight Systems version fake"); sys.exit(0)
if args[0] == "profile":
    i = args.index("-o"); rep = args[i + 1]; cmd = args[i + 2:]
    rc = subprocess.call(cmd)
    open(rep + ".nsys-rep", "w").write("fake")
    sys.exit(rc)
if args[0] == "stats":
    prefix = args[args.index("--output") + 1]
    open(prefix + "_nvtx_sum.csv", "w").write(open({csv!r}).read())
    sys.exit(0)
sys.exit(2)
"""


@pytest.mark.slow
def test_profile_script_with_a_stand_in_nsys(tiny_target_dir, tmp_path):
    """The --nsys orchestration end to end (child process per rule, stats export, parse, side-by-side
    table) with a stand-in `nsys` executable; the real one is only on GPU boxes."""
    csv_path = tmp_path / "canned.csv"
    csv_path.write_text(NVTX_SUM_CSV)
    fake = tmp_path / "nsys"
    fake.write_text(FAKE_NSYS.format(python=sys.executable, csv=str(csv_path)))
    fake.chmod(0o755)
    suite = tmp_path / "p.jsonl"
    suite.write_text(json.dumps({"prompt": "hello world"}) + "\n")
    out = tmp_path / "sb.md"
    env = {k: v for k, v in os.environ.items() if k != profiling.ENV_VAR}
    proc = subprocess.run([sys.executable, str(REPO / "deploy" / "stage_profile.py"), "--target", str(tiny_target_dir("llama")),
                           "--suite", str(suite), "--num-prompts", "1", "--max-tokens", "4", "--rules", "argmax",
                           "--warmup-tokens", "0", "--nsys", "--nsys-bin", str(fake), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert "| Stage (ms / block) | argmax timer | argmax nsys |" in text
    assert "| Speculative head |" in text and "0.28 |" in text          # the canned nsys column
    raw = json.loads(out.with_suffix(".json").read_text())
    assert raw["nsys"]["argmax"]["table"]["blocks"] == 100 and raw["runs"]["argmax"]["table"]["blocks"] > 0
    assert "--child-json" not in raw["command"]
