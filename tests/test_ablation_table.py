"""scripts/ablation_table.py on the committed self-distillation ablation: every figure in its table
comes from the runs' own eval JSONs, a run that is unfinished or not yet evaluated is named instead
of tabulated, and runs of different lengths are refused."""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ABLATION = REPO / "results" / "self_distill_ablation"
SEEDS = ["42", "7", "1"]
BASE = [REPO / "results" / "cpu_smollm2_v12" / "eval-lilicorr.json",
        REPO / "results" / "cpu_smollm2_v12" / "eval-lilicorr-chat.json"]


def _table(tmp_path: Path, runs: list[Path]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "scripts" / "ablation_table.py"), "--runs", *map(str, runs),
           "--arms", "lilicorr", "distill", "--base-eval", *map(str, BASE), "--out", str(tmp_path / "t")]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)


def _pooled_tau(path: Path) -> float:
    return json.loads(path.read_text())["overall"]["lilicorr"]["tau"]


def test_ablation_table_figures_come_from_the_runs(tmp_path):
    runs = [tmp_path / f"seed-{s}" for s in SEEDS]
    for s, run in zip(SEEDS, runs):
        shutil.copytree(ABLATION / f"seed-{s}", run)
    r = _table(tmp_path, runs)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    assert sorted((x["arm"], str(x["seed"])) for x in doc["runs"]) == sorted(
        (a, s) for a in ("lilicorr", "distill") for s in SEEDS)
    assert (tmp_path / "t.png").stat().st_size > 0
    pooled = next(l for l in (tmp_path / "t.md").read_text().splitlines() if l.startswith("| suites pooled |"))
    cells = [c.strip() for c in pooled.strip("|").split("|")]
    ref = {s: _pooled_tau(run / "eval-lilicorr.json") for s, run in zip(SEEDS, runs)}
    dis = {s: _pooled_tau(run / "eval-distill.json") for s, run in zip(SEEDS, runs)}
    assert cells[1] == f"{_pooled_tau(BASE[0]):.3f}"                                   # start
    assert cells[2:8] == [f"{ref[s]:.3f}" for s in SEEDS] + [f"{dis[s]:.3f}" for s in SEEDS]
    assert cells[8:11] == [f"{100 * (dis[s] / ref[s] - 1):+.1f}%" for s in SEEDS]     # per seed
    spread = lambda v: f"{100 * (max(v) - min(v)) / statistics.mean(v):.1f}%"
    assert cells[11:] == [spread(list(ref.values())), spread(list(dis.values()))]

    # an unevaluated arm and an unfinished run are named, not tabulated; the rest still is
    (runs[1] / "eval-distill-chat.json").unlink()
    meta = runs[2] / "ckpt-lilicorr" / "meta.json"
    m = json.loads(meta.read_text())
    m["step"] = m["total_steps"] - 50
    meta.write_text(json.dumps(m))
    r = _table(tmp_path, runs)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "t.md").read_text()
    assert "no eval-distill-chat.json" in md and f"step {m['step']} of {m['total_steps']}" in md
    assert len(json.loads((tmp_path / "t.json").read_text())["runs"]) == 4

    # runs of different lengths do not compare: refused
    m["step"] = m["total_steps"] = m["total_steps"] - 50
    m["history"][-1]["step"] = m["step"]
    meta.write_text(json.dumps(m))
    r = _table(tmp_path, runs)
    assert r.returncode == 2 and "different numbers of steps" in r.stderr


GAIN = REPO / "results" / "vanilla_gain_seeds"


def _row(md: str, first: str) -> list[str]:
    line = next(l for l in md.splitlines() if l.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_arms_read_with_their_rules_from_their_starts(tmp_path):
    """The committed LiLiCorr-against-vanilla runs: an arm NAME:RULE is that run's RULE, each arm's
    start is its own checkpoint's evaluation, and an arm whose evaluation lacks the rule is named."""
    runs = [tmp_path / f"seed-{s}" for s in SEEDS]
    for s, run in zip(SEEDS, runs):
        shutil.copytree(GAIN / f"seed-{s}", run)
    start = GAIN / "start"
    cmd = [sys.executable, str(REPO / "scripts" / "ablation_table.py"), "--runs", *map(str, runs),
           "--arms", "vanilla:argmax", "lilicorr", "lilicorr:argmax", "vanilla:lilicorr", "--base-eval",
           *(f"{arm}={start / f'eval-{arm}{chat}.json'}" for arm in ("vanilla", "lilicorr") for chat in ("", "-chat")),
           "--out", str(tmp_path / "t")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "t.md").read_text()
    tau = lambda path, rule: json.loads(path.read_text())["overall"][rule]["tau"]
    cells = _row(md, "suites pooled")
    assert cells[1:4] == [f"{tau(start / 'eval-vanilla.json', 'argmax'):.3f}",       # each arm's start
                          f"{tau(start / 'eval-lilicorr.json', 'lilicorr'):.3f}",
                          f"{tau(start / 'eval-lilicorr.json', 'argmax'):.3f}"]
    van = [tau(run / "eval-vanilla.json", "argmax") for run in runs]
    walk = [tau(run / "eval-lilicorr.json", "lilicorr") for run in runs]
    arg = [tau(run / "eval-lilicorr.json", "argmax") for run in runs]
    assert cells[4:13] == [f"{v:.3f}" for v in van + walk + arg]
    assert cells[13:16] == [f"{100 * (w / v - 1):+.1f}%" for w, v in zip(walk, van)]   # the gain per seed
    assert cells[16:19] == [f"{100 * (a / v - 1):+.1f}%" for a, v in zip(arg, van)]
    assert "eval-vanilla*.json has no `lilicorr` rule" in md                           # named, not tabulated
    assert "vanilla (lilicorr)" not in md.split("Not in the table")[0]
    assert {x["arm"] for x in json.loads((tmp_path / "t.json").read_text())["runs"]} == {
        "vanilla (argmax)", "lilicorr", "lilicorr (argmax)"}
