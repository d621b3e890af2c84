#!/usr/bin/env python
"""Held-out tau against training steps, for every snapshot of every arm (issue: a drafter that accepts).

    python scripts/tau_vs_steps.py --target .cache/smollm2-135m-instruct-float32 \
        --arm vanilla=work/cpu_smollm2/ckpt-vanilla.snapshots \
        --arm lilicorr=work/cpu_smollm2/ckpt-lilicorr.snapshots \
        --prompts humaneval,math500,gsm-symbolic,lilicorr/data/chat_first_turn.jsonl \
        --limit 20 --max-tokens 128 --out results/cpu_smollm2_v2/tau_vs_steps

Each arm's folder holds the weights-only snapshots that `train.py --snapshot-every N` keeps
(step-NNNNN/); a rerun reuses OUT.json's figures and measures only new snapshots. The held-out text is the target's own greedy continuation of each evaluation prompt
(the engine's `ar` rule, cached in --heldout); none of these prompts is in the training data.

tau is measured teacher-forced: every completion position is an anchor, the drafter drafts its
block from the target's features of everything before it (the same features the engine feeds it),
and a block's accepted length is its leading run of drafted tokens equal to the target's greedy
tokens. Greedy decoding accepts exactly that run at the anchors it visits, so this is the engine's
greedy tau averaged over every position instead of the visited ones; `argmax` drafts each slot's
top-1 and `lilicorr` commits the head's greedy walk (Eq. 8), as the engine's rules do. `oracle` is
the longest prefix covered by the top-K pools.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from lilicorr.results_io import save_figure, write_report  # noqa: E402

STEP_DIR = re.compile(r"step-(\d+)$")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target HF folder")
    ap.add_argument("--arm", action="append", required=True, metavar="NAME=DIR",
                    help="an arm and its snapshots folder (step-NNNNN/ checkpoints); repeatable")
    ap.add_argument("--prompts", default="humaneval,math500,gsm-symbolic,lilicorr/data/chat_first_turn.jsonl")
    ap.add_argument("--limit", type=int, default=20, help="prompts per suite")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", required=True, type=Path, help="writes OUT.md, OUT.json, OUT.png")
    ap.add_argument("--heldout", type=Path, default=None,
                    help="cache of the held-out greedy text (default OUT.heldout.jsonl; made when absent or stale)")
    ap.add_argument("--data-suite", action="append", default=[], metavar="NAME=FILE:START:STOP",
                    help="also a suite NAME of regenerated training records (train/regen.py JSONL), lines "
                         "START..STOP (1-based, inclusive), each completion cut to --max-tokens: e.g. lines a "
                         "snapshot trained on against lines it never saw; repeatable")
    args = ap.parse_args(argv)
    args.data_suites = [_data_suite(ap, spec) for spec in args.data_suite]
    arms = {}
    for spec in args.arm:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not Path(folder).is_dir():
            ap.error(f"--arm {spec!r}: want NAME=DIR with an existing folder of step-NNNNN snapshots")
        arms[name] = Path(folder)
    args.arms = arms
    return args


def _data_suite(ap, spec: str) -> tuple[str, Path, int, int]:
    name, sep, rest = spec.partition("=")
    path, _, span = rest.partition(":")
    start, _, stop = span.partition(":")
    try:
        first, last = int(start), int(stop)
    except ValueError:
        first = last = 0
    if not sep or not name or not Path(path).is_file() or not 1 <= first <= last:
        ap.error(f"--data-suite {spec!r}: want NAME=FILE:START:STOP with an existing file and 1 <= START <= STOP")
    return name, Path(path), first, last


def data_rows(suites, max_tokens: int) -> list[dict]:
    """[{suite, id, prompt, completion}] from regenerated records: (name, file, first, last) each."""
    rows = []
    for name, path, first, last in suites:
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if first <= lineno <= last and line.strip():
                    rec = json.loads(line)
                    rows.append({"suite": name, "id": f"{path.name}:{lineno}", "prompt": list(rec["prompt_ids"]),
                                 "completion": list(rec["completion_ids"])[:max_tokens]})
        if not any(r["suite"] == name for r in rows):
            raise SystemExit(f"--data-suite {name}: {path} has no record in lines {first}..{last}")
    return rows


def snapshots(folder: Path) -> list[tuple[int, Path]]:
    """[(step, dir)] of the step-NNNNN checkpoints in `folder`, by step."""
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.search(p.name))
             and (p / "model.safetensors").is_file()]
    if not found:
        raise SystemExit(f"{folder}: no step-NNNNN snapshot (train with --snapshot-every)")
    return sorted(found)


def heldout(args, target) -> list[dict]:
    """[{suite, id, prompt, completion}]: the target's greedy continuations, cached next to OUT."""
    from lilicorr.engine import SpecEngine
    from lilicorr.eval import load_suites
    from lilicorr.tokenizer import Tokenizer

    cache = args.heldout or args.out.with_suffix(".heldout.jsonl")
    key = {"prompts": args.prompts, "limit": args.limit, "max_tokens": args.max_tokens}
    if cache.is_file():
        lines = cache.read_text().splitlines()
        if lines and json.loads(lines[0]) == key:
            return [json.loads(line) for line in lines[1:]]
    tok = Tokenizer.from_dir(args.target)
    suites = load_suites(args.prompts, tok, args.limit)
    engine = SpecEngine(target, None, max_batch=16)
    items = [(name, p) for name, ps in suites.items() for p in ps]
    with tqdm(total=len(items) * args.max_tokens, desc="held-out greedy text", unit="tok") as bar:
        results = engine.generate([p["ids"] for _, p in items], args.max_tokens, rule="ar",
                                  stop_ids=sorted(tok.eos_ids), progress=bar.update)
    rows = [{"suite": name, "id": p["id"], "prompt": p["ids"], "completion": r.tokens}
            for (name, p), r in zip(items, results)]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text("\n".join(json.dumps(x) for x in [key, *rows]) + "\n")
    return rows


def teacher_forced(model, target, rows: list[dict], feats: list[tuple]) -> dict:
    """{suite: {blocks, argmax, lilicorr, oracle}} accepted-length sums over every completion anchor."""
    from lilicorr.training import training_forward

    sums: dict[str, dict[str, float]] = {}
    for row, f in zip(rows, feats):
        p, c = len(row["prompt"]), len(row["completion"])
        if c < 2:
            continue
        ids = torch.tensor([row["prompt"] + row["completion"]])             # [1, T]
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[0, p:] = True
        anchors = torch.arange(p, p + c - 1)[None]                          # [1, A] every completion position
        valid = torch.ones_like(anchors, dtype=torch.bool)
        with torch.no_grad():
            m = training_forward(model, target, ids, mask, anchors, valid, f).metrics
        acc = sums.setdefault(row["suite"], {"blocks": 0.0, "argmax": 0.0, "lilicorr": 0.0, "oracle": 0.0})
        acc["blocks"] += float(m["blocks"])
        acc["argmax"] += float(m["argmax_accept"])
        acc["oracle"] += float(m["oracle_prefix_len"])
        if "lilicorr_accept" in m:
            acc["lilicorr"] += float(m["lilicorr_accept"])
    return sums


def previous_points(args) -> dict[tuple, list[dict]]:
    """{(arm, step): points} of an earlier OUT.json made on the same held-out text, so a rerun
    measures only the snapshots that are new (a snapshot's weights never change)."""
    try:
        doc = json.loads(args.out.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}
    if [doc.get(k) for k in ("prompts", "limit", "max_tokens", "data_suites")] != [
            args.prompts, args.limit, args.max_tokens, _suite_specs(args) or None]:
        return {}
    out: dict[tuple, list[dict]] = {}
    for p in doc.get("points", []):
        out.setdefault((p["arm"], p["step"]), []).append(p)
    return out


def _suite_specs(args) -> list[str]:
    return [f"{name}={path}:{first}:{last}" for name, path, first, last in args.data_suites]


def taus(sums: dict[str, float], has_head: bool) -> dict:
    b = max(sums["blocks"], 1.0)
    out = {"argmax": 1 + sums["argmax"] / b, "oracle": 1 + sums["oracle"] / b}
    if has_head:
        out["lilicorr"] = 1 + sums["lilicorr"] / b
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from lilicorr.model import load_model
    from lilicorr.target import load_target

    target = load_target(args.target, dtype=torch.float32)
    rows = heldout(args, target) + data_rows(args.data_suites, args.max_tokens)
    layer_sets: dict[tuple, list] = {}
    points = []                            # {arm, step, suite, argmax, lilicorr?, oracle}
    done = previous_points(args)
    todo = []
    for arm, folder in args.arms.items():
        for step, d in snapshots(folder):
            if (arm, step) in done:        # measured by an earlier run on the same held-out text
                points += done[arm, step]
            else:
                todo.append((arm, step, d))
    for arm, step, d in tqdm(todo, desc="snapshots"):
        model = load_model(d, target, dtype=torch.float32)
        layers = tuple(model.cfg.drafter.target_layer_ids)
        if layers not in layer_sets:       # the target's features, once per captured-layer set
            with torch.no_grad():
                layer_sets[layers] = [
                    (o.captured, o.last_hidden) for o in (
                        target(torch.tensor([r["prompt"] + r["completion"]]),
                               torch.arange(len(r["prompt"]) + len(r["completion"]))[None],
                               capture=list(layers), logits=False) for r in rows)]
        sums = teacher_forced(model, target, rows, layer_sets[layers])
        extra = {d[0] for d in args.data_suites}             # `all` pools the evaluation suites only
        pooled = {k: sum(s[k] for name, s in sums.items() if name not in extra)
                  for k in ("blocks", "argmax", "lilicorr", "oracle")}
        for suite, s in [*sums.items(), ("all", pooled)]:
            points.append({"arm": arm, "step": step, "suite": suite, "blocks": s["blocks"],
                           **taus(s, model.head is not None)})
    points.sort(key=lambda p: (list(args.arms).index(p["arm"]), p["step"]))
    suites = list(dict.fromkeys(p["suite"] for p in points))
    held = [s for s in suites if s != "all" and s not in {d[0] for d in args.data_suites}]
    md = [f"Held-out text: the target's greedy continuations ({args.max_tokens} tokens) of {args.limit} prompts "
          f"per suite ({', '.join(held)}); every completion position is an anchor "
          "(teacher-forced, see the script's docstring)."
          + "".join(f" Suite {name}: lines {first}-{last} of the training records {path} (completions cut to "
                    f"{args.max_tokens} tokens)." for name, path, first, last in args.data_suites), "",
          "| arm | step | suite | blocks | tau argmax | tau lilicorr | oracle tau |", "|---|---:|---|---:|---:|---:|---:|"]
    for p in points:
        lili = f"{p['lilicorr']:.3f}" if "lilicorr" in p else "—"
        md.append(f"| {p['arm']} | {p['step']} | {p['suite']} | {p['blocks']:.0f} | {p['argmax']:.3f} | {lili} | "
                  f"{p['oracle']:.3f} |")
    md += ["", "![tau vs steps]({png})", ""]

    def plot(path: Path) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if len({p["step"] for p in points}) == 1:          # one step: bars per suite, not lines
            fig, ax = plt.subplots(figsize=(1.2 * len(suites) + 2, 3.6))
            bars = [(arm, rule) for arm in args.arms for rule in ("argmax", "lilicorr", "oracle")
                    if any(p["arm"] == arm and rule in p for p in points)]
            width = 0.8 / len(bars)
            for j, (arm, rule) in enumerate(bars):
                by_suite = {p["suite"]: p.get(rule) for p in points if p["arm"] == arm}
                ax.bar([i + j * width for i in range(len(suites))], [by_suite.get(s) or 0 for s in suites],
                       width, label=f"{arm} {rule}")
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(suites))], suites, rotation=30, ha="right")
            ax.set_ylabel(f"teacher-forced tau, step {points[0]['step']}")
            ax.set_ylim(1, None)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            save_figure(fig, path)
            return
        fig, axes = plt.subplots(1, len(suites), figsize=(4 * len(suites), 3.4), sharey=True, squeeze=False)
        for ax, suite in zip(axes[0], suites):
            for arm in args.arms:
                pts = [p for p in points if p["arm"] == arm and p["suite"] == suite]
                steps = [p["step"] for p in pts]
                ax.plot(steps, [p["argmax"] for p in pts], "o-", label=f"{arm} argmax")
                if pts and "lilicorr" in pts[0]:
                    ax.plot(steps, [p["lilicorr"] for p in pts], "s-", label=f"{arm} lilicorr")
            ax.set_title(suite)
            ax.set_xlabel("training step")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("held-out tau (teacher-forced)")
        axes[0][-1].legend(fontsize=7)
        save_figure(fig, path)

    write_report(args.out, "scripts/tau_vs_steps.py", argv, "Held-out tau against training steps",
                 "\n".join(md), {"points": points, "prompts": args.prompts, "limit": args.limit,
                                 "max_tokens": args.max_tokens, "data_suites": _suite_specs(args) or None}, plot)
    print("\n".join(md[2:-3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
