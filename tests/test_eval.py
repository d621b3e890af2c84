"""`python -m lilicorr.eval` on a tiny target with an untrained checkpoint, and lilicorr.report."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from lilicorr import report
from lilicorr.checkpoint import save_checkpoint
from lilicorr.engine import SpecEngine
from lilicorr.eval import main
from lilicorr.model import untrained_model
from lilicorr.target import load_target

from spec_helpers import REPO_ROOT, load_script

pytest.importorskip("transformers")

PNG = b"\x89PNG\r\n\x1a\n"
RULES = ["ar", "argmax", "lilicorr", "viterbi"]


@pytest.fixture(scope="module")
def setup(tiny_target_dir, tmp_path_factory):
    path = tiny_target_dir("llama")
    target = load_target(path)
    root = tmp_path_factory.mktemp("eval")
    model = untrained_model(target, block_size=4)
    ckpt = save_checkpoint(root / "ckpt", model.cfg, model.state_dict(), target.config, meta={"step": 0})
    vanilla = untrained_model(target, block_size=4, vanilla=True)
    vckpt = save_checkpoint(root / "vanilla", vanilla.cfg, vanilla.state_dict(), target.config, meta={"step": 0})
    other = tiny_target_dir("qwen2")
    words = ["hello world how are you", "write python code please", "what is the answer to this question",
             "one two three four five", "why is the code in python"]
    a = root / "chat.jsonl"
    a.write_text("".join(json.dumps({"prompt": w}) + "\n" for w in words))
    b = root / "multi.jsonl"
    b.write_text("".join(json.dumps({"id": f"m{i}", "messages": [{"role": "system", "content": "be fine"},
                                                                    {"role": "user", "content": w}]}) + "\n"
                         for i, w in enumerate(words[:3])))
    return dict(path=path, ckpt=ckpt, vanilla=vckpt, other=other, a=a, b=b, root=root)


@pytest.fixture
def generated(monkeypatch):
    """Records what every `SpecEngine.generate` call of the eval produced: a spy around the real
    method (it returns the real results unchanged). One dict per call: rule, seed, temperature,
    max_tokens, prompts (tuple of tuples) and tokens (one list per prompt)."""
    calls = []
    real = SpecEngine.generate

    def spy(self, prompts, max_tokens, *args, **kw):
        res = real(self, prompts, max_tokens, *args, **kw)
        calls.append(dict(rule=kw.get("rule"), seed=kw.get("seed"), temperature=kw.get("temperature"),
                          max_tokens=max_tokens, prompts=tuple(tuple(p) for p in prompts),
                          tokens=[list(r.tokens) for r in res]))
        return res

    monkeypatch.setattr(SpecEngine, "generate", spy)
    return calls


def _tokens_by_rule(calls, max_tokens):
    """{(prompts, seed): {rule: tokens}} of the measured calls (the warm-up runs fewer tokens)."""
    out: dict = {}
    for c in calls:
        if c["max_tokens"] == max_tokens:
            rules = out.setdefault((c["prompts"], c["seed"]), {})
            assert c["rule"] not in rules, f"rule {c['rule']} measured twice on the same prompts and seed"
            rules[c["rule"]] = c["tokens"]
    return out


def _assert_rules_generate_the_same_tokens(calls, max_tokens, rules, suites):
    """Greedy verification: every rule generates the same tokens as `ar`, prompt by prompt, and the
    JSON's token counts are those of these generations."""
    runs = _tokens_by_rule(calls, max_tokens)
    assert len(runs) == len(suites), runs.keys()
    for (prompts, _), by_rule in runs.items():
        assert sorted(by_rule) == sorted(rules)
        for rule in rules:
            assert by_rule[rule] == by_rule[rules[0]], f"{rule} differs from {rules[0]}"
        assert all(len(t) > 0 for t in by_rule[rules[0]])
    counts = sorted(sum(map(len, by_rule[rules[0]])) for by_rule in runs.values())
    assert counts == sorted(s[rules[0]]["generated_tokens"] for s in suites.values())


def _run(setup, tmp_path, *extra, rules="ar,argmax,lilicorr,viterbi", prompts=None, ckpt="ckpt"):
    out = tmp_path / "res" / "eval.json"
    argv = ["--target", str(setup["path"]), "--prompts", prompts or f"{setup['a']},{setup['b']}",
            "--rules", rules, "--max-tokens", "10", "--json", str(out), "--batch-size", "3", "--no-progress",
            *extra]
    if ckpt:
        argv[0:0] = ["--ckpt", str(setup[ckpt])]
    return main(argv), out


def test_eval_writes_all_rules_side_by_side(setup, tmp_path, capsys, generated):
    rc, out = _run(setup, tmp_path, "--profile", "--limit", "4")
    assert rc == 0
    doc = json.loads(out.read_text())
    printed = capsys.readouterr().out
    meta = doc["meta"]
    for key in ("command", "date", "target", "ckpt", "versions", "rules", "max_tokens", "temperature",
                "seeds", "batch_size", "block_size", "stop_ids", "git_commit"):
        assert key in meta, key
    assert meta["rules"] == RULES and meta["block_size"] == 4 and meta["ckpt"].endswith("ckpt")
    assert "torch" in meta["versions"] and "lilicorr.eval" in meta["command"]
    assert meta["stop_ids"] == [2, 5]                    # the tokenizer's </s> and the template's <|im_end|>
    assert set(doc["results"]) == {"chat", "multi"}
    for suite, n in (("chat", 4), ("multi", 3)):
        res = doc["results"][suite]
        assert list(res) == RULES
        assert len({res[r]["generated_tokens"] for r in RULES}) == 1
        for rule in RULES:
            m = res[rule]
            assert m["num_prompts"] == n and 0 < m["generated_tokens"] <= 10 * n
            assert m["tokens_per_s"] > 0 and m["speedup_vs_ar"] > 0
            assert sum(m["finish_reasons"].values()) == n
            if rule == "ar":
                assert m["tau"] == 1.0 and m["oracle_tau"] is None and m["speedup_vs_ar"] == 1.0
                assert m["slot_acceptance"] == []
                continue
            assert 1.0 <= m["tau"] <= m["oracle_tau"] <= 4
            assert m["tau"] == pytest.approx(sum(k * c for k, c in enumerate(m["accept_hist"])) / m["verify_steps"])
            assert len(m["slot_acceptance"]) == 3 and len(m["accept_hist"]) == 5
            for rate, a, r in zip(m["slot_acceptance"], m["slot_accepted"], m["slot_reached"]):
                assert (rate is None and r == 0) or rate == pytest.approx(a / r)
            assert m["slot_reached"][0] == m["verify_steps"]
    # greedy verification: every rule generates the same tokens (compared token by token)
    _assert_rules_generate_the_same_tokens(generated, 10, RULES, doc["results"])
    assert set(doc["overall"]) == set(RULES)
    assert doc["overall"]["lilicorr"]["num_prompts"] == 7
    # profile: a stage table per rule, printed too
    assert set(doc["profile"]) == set(RULES)
    for rule, t in doc["profile"].items():
        assert t["blocks"] > 0 and t["per_block_wall_ms"] > 0
        assert abs(t["stage_sum_ms"] - t["per_block_wall_ms"]) <= 0.1 * t["per_block_wall_ms"], (rule, t)
    assert "Target verify" in printed and "Head share" in printed
    # the markdown table and the plots
    assert "| suite | rule |" in printed and "| chat | lilicorr |" in printed
    for name in doc["plots"].values():
        f = out.parent / name
        assert f.is_file() and f.read_bytes()[:8] == PNG
    assert (out.parent / "eval_accept_hist.png").is_file() and (out.parent / "eval_slot_accept.png").is_file()


def test_eval_several_seeds_at_temperature(setup, tmp_path, generated):
    rc, out = _run(setup, tmp_path, "--temperature", "0.8", "--seed", "0,1,2", "--limit", "3",
                   rules="ar,lilicorr", prompts=str(setup["a"]))
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["seeds"] == [0, 1, 2] and doc["meta"]["temperature"] == 0.8
    m = doc["results"]["chat"]["lilicorr"]
    assert m["num_seeds"] == 3 and set(m["per_seed"]) == {"0", "1", "2"}
    for key in ("tau", "tokens_per_s", "speedup_vs_ar", "oracle_tau"):
        vals = [m["per_seed"][s][key] for s in "012"]
        assert m[key] == pytest.approx(sum(vals) / 3)
        assert m["std"][key] == pytest.approx(torch.tensor(vals, dtype=torch.float64).std().item())
    assert "per_seed" not in json.loads(out.read_text())["meta"]
    first = _tokens_by_rule(generated, 10)
    assert sorted(seed for _, seed in first) == [0, 1, 2]
    generated.clear()
    # same seeds -> the same tokens (per-request seeds); a different seed -> different samples
    rc, out2 = _run(setup, tmp_path / "again", "--temperature", "0.8", "--seed", "0,1,2", "--limit", "3",
                    rules="ar,lilicorr", prompts=str(setup["a"]))
    doc2 = json.loads(out2.read_text())
    again = _tokens_by_rule(generated, 10)
    assert again == first
    for s in "012":
        for rule in ("ar", "lilicorr"):
            a, b = doc["results"]["chat"][rule]["per_seed"][s], doc2["results"]["chat"][rule]["per_seed"][s]
            assert a["generated_tokens"] == b["generated_tokens"] and a["tau"] == b["tau"]
            assert a["slot_acceptance"] == b["slot_acceptance"]
    for rule in ("ar", "lilicorr"):
        by_seed = {seed: runs[rule] for (_, seed), runs in first.items()}
        assert len({repr(t) for t in by_seed.values()}) == 3, f"{rule}: two seeds gave the same samples"


def test_eval_greedy_with_several_seeds_runs_once(setup, tmp_path, capsys):
    rc, out = _run(setup, tmp_path, "--seed", "3,4", "--limit", "2", "--no-plots", rules="ar,argmax",
                   prompts=str(setup["a"]), ckpt="vanilla")
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["seeds"] == [3] and "plots" not in doc
    assert "deterministic" in capsys.readouterr().out
    assert doc["results"]["chat"]["argmax"]["num_seeds"] == 1


def test_eval_repeats_interleave_the_rules_and_keep_the_first_pass(setup, tmp_path, generated):
    """--repeats 3 times every rule three times per suite in the order A B, B A, A B, and reports
    tau and token counts of the first pass (a greedy pass decodes the same tokens every time)."""
    rc, out = _run(setup, tmp_path, "--repeats", "3", "--no-plots", "--warmup", "0", rules="ar,lilicorr",
                   prompts=str(setup["a"]))
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["repeats"] == 3
    timed = [c for c in generated if c["max_tokens"] == 10]
    assert [c["rule"] for c in timed] == ["ar", "lilicorr", "lilicorr", "ar", "ar", "lilicorr"]
    for rule in ("ar", "lilicorr"):
        runs = [c["tokens"] for c in timed if c["rule"] == rule]
        assert runs[0] == runs[1] == runs[2]
        assert doc["results"]["chat"][rule]["generated_tokens"] == sum(map(len, runs[0]))
    assert doc["results"]["chat"]["lilicorr"]["tokens_per_s"] > 0


def test_eval_untrained_ar_only_and_skipped_prompts(setup, tmp_path, capsys):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "hello " * 200}) + "\n" + json.dumps({"prompt": "hello world"}) + "\n")
    rc, out = _run(setup, tmp_path, "--untrained", "--block-size", "3", rules="ar,lilicorr",
                   prompts=str(long), ckpt=None)
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["untrained"] and doc["meta"]["block_size"] == 3 and doc["meta"]["ckpt"] is None
    assert doc["meta"]["skipped_prompts"] == {"long": ["long/1"]}
    assert doc["results"]["long"]["lilicorr"]["num_prompts"] == 1
    assert "too long" in capsys.readouterr().out
    rc, out = _run(setup, tmp_path / "ar", rules="ar", prompts=str(setup["a"]), ckpt=None)
    assert rc == 0 and list(json.loads(out.read_text())["results"]["chat"]) == ["ar"]


@pytest.mark.parametrize("argv_change,message", [
    (("--target", "/nonexistent/dir"), "--target /nonexistent/dir: no such directory"),
    (("--ckpt", "/nonexistent/ckpt"), "--ckpt /nonexistent/ckpt: no such directory"),
    (("--rules", "ar,beam"), "unknown decode rule"),
    (("--rules", "ar,ar"), "lists a rule twice"),
    (("--max-tokens", "0"), "--max-tokens must be positive"),
    (("--seed", "1,x"), "--seed must be an integer"),
    (("--temperature", "-1"), "--temperature must be a finite number"),
    (("--block-size", "4"), "--block-size only applies with --untrained"),
    (("--repeats", "0"), "--repeats must be positive"),
])
def test_eval_rejects_bad_arguments(setup, tmp_path, capsys, argv_change, message):
    argv = {"--target": str(setup["path"]), "--ckpt": str(setup["ckpt"]), "--prompts": str(setup["a"]),
            "--rules": "ar,lilicorr", "--max-tokens": "5", "--json": str(tmp_path / "x.json")}
    argv[argv_change[0]] = argv_change[1]
    with pytest.raises(SystemExit) as e:
        main([x for kv in argv.items() for x in kv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_eval_needs_a_drafter_for_speculative_rules(setup, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--target", str(setup["path"]), "--prompts", str(setup["a"]), "--rules", "ar,argmax",
              "--json", str(tmp_path / "x.json")])
    assert "need a drafter: pass --ckpt DIR" in capsys.readouterr().err


@pytest.mark.parametrize("case,message", [
    ("missing_prompts", "prompt file not found"),
    ("bad_jsonl", "invalid JSON"),
    ("vanilla_with_head_rule", "vanilla DFlash"),
    ("other_target", "trained for another target"),
    ("builtin_too_long", "no prompt fits the context"),
    ("not_an_engine", "is not an engine directory"),
])
def test_eval_runtime_errors_are_clear(setup, tmp_path, capsys, case, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hello"}\n{oops\n')
    kw = dict(prompts=str(setup["a"]), rules="ar,lilicorr", ckpt="ckpt")
    extra = ()
    if case == "missing_prompts":
        kw["prompts"] = str(tmp_path / "nope.jsonl")
    elif case == "bad_jsonl":
        kw["prompts"] = str(bad)
    elif case == "vanilla_with_head_rule":
        kw["ckpt"] = "vanilla"
    elif case == "builtin_too_long":
        kw["prompts"], extra = "humaneval", ("--limit", "2")
    if case in ("other_target", "not_an_engine"):
        out = tmp_path / "o.json"
        source = ["--ckpt", str(setup["ckpt"])] if case == "other_target" else ["--engine", str(setup["root"])]
        target = setup["other"] if case == "other_target" else setup["path"]
        rc = main(["--target", str(target), *source, "--prompts", str(setup["a"]),
                   "--rules", "ar,lilicorr", "--json", str(out), "--no-progress"])
    else:
        rc, out = _run(setup, tmp_path, *extra, **kw)
    assert rc == 2 and not out.exists()
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


def test_eval_module_entry_point(setup, tmp_path):
    """`python -m lilicorr.eval` as a subprocess (the documented command line)."""
    out = tmp_path / "cli.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lilicorr.eval", "--target", str(setup["path"]), "--ckpt", str(setup["ckpt"]),
         "--prompts", str(setup["a"]), "--rules", "ar,lilicorr", "--max-tokens", "6", "--limit", "2",
         "--json", str(out), "--threads", "1"],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["results"]["chat"]["lilicorr"]["num_prompts"] == 2
    assert "| chat | lilicorr |" in proc.stdout
    assert (tmp_path / "cli_accept_hist.png").is_file() and (tmp_path / "cli_slot_accept.png").is_file()
    bad = subprocess.run([sys.executable, "-m", "lilicorr.eval", "--target", str(setup["path"]),
                          "--prompts", "x", "--json", str(out), "--rules", "nope"],
                         capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert bad.returncode == 2 and "unknown decode rule 'nope'" in bad.stderr


# ------------------------------------------------------------------------------------- report
def test_report_tables_and_plots(tmp_path):
    t = report.markdown_table(["a", "b"], [["x", 1.23456], ["y|z", None]], align="lr", digits=3)
    assert t.splitlines() == ["| a | b |", "|:---|---:|", "| x | 1.235 |", "| y\\|z | — |"]
    with pytest.raises(ValueError):
        report.markdown_table(["a"], [[1, 2]])
    assert report.fmt(float("nan")) == "—" and report.fmt(True) == "yes" and report.fmt(3) == "3"
    assert report.mean_std([1.0, None, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))
    assert report.mean_std([None]) == (None, None)
    assert report.slot_rates([1, 0], [2, 0]) == [0.5, None]
    res = {"s": {"ar": {"tau": 1.0, "oracle_tau": None, "tokens_per_s": 10.0, "speedup_vs_ar": 1.0,
                        "num_prompts": 2, "generated_tokens": 20},
                 "lilicorr": {"tau": 2.0, "oracle_tau": 2.5, "tokens_per_s": 15.0, "speedup_vs_ar": 1.5,
                              "num_prompts": 2, "generated_tokens": 20, "num_seeds": 2,
                              "std": {"tau": 0.1, "tokens_per_s": 1.0, "speedup_vs_ar": 0.05, "oracle_tau": 0.0}}}}
    table = report.eval_table(res)
    assert "| s | lilicorr | 2 | 20 | 2.000 ± 0.100 | 2.500 ± 0.000 | 0.800 | 15.0 ± 1.0 | 1.50 ± 0.05 |" in table
    assert "| s | ar | 2 | 20 | 1.000 | — | — | 10.0 | 1.00 |" in table
    h = report.plot_acceptance_histogram({"lilicorr": [0, 3, 2, 1], "argmax": [0, 5, 1, 0], "empty": [0, 0]},
                                         tmp_path / "h.png")
    s = report.plot_slot_acceptance({"lilicorr": [0.5, None, 0.2], "ar": []}, tmp_path / "s.png")
    assert h.read_bytes()[:8] == PNG and s.read_bytes()[:8] == PNG
    from lilicorr.profiling import StageTimer
    tables = {"a": StageTimer().table(), "b": StageTimer().table()}
    assert "| Target verify |" in report.stage_tables(tables)
    assert "Per-block wall" in report.stage_table(tables["a"], "x")


@pytest.mark.slow
def test_eval_smollm2_builtin_suite(smollm2_dir, tmp_path, generated):
    """The real target and a built-in suite through the chat template, untrained drafter."""
    out = tmp_path / "smol.json"
    rc = main(["--target", str(smollm2_dir), "--untrained", "--prompts", "gsm-symbolic,humaneval", "--limit", "2",
               "--rules", "ar,argmax,lilicorr", "--max-tokens", "12", "--json", str(out), "--batch-size", "2",
               "--no-progress", "--profile"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"gsm-symbolic", "humaneval"}
    for suite in doc["results"].values():
        assert suite["lilicorr"]["tau"] >= 1.0 and suite["ar"]["speedup_vs_ar"] == 1.0
    _assert_rules_generate_the_same_tokens(generated, 12, ["ar", "argmax", "lilicorr"], doc["results"])
    assert doc["meta"]["stop_ids"] and set(doc["profile"]) == {"ar", "argmax", "lilicorr"}
    assert all((tmp_path / f).is_file() for f in doc["plots"].values())


def test_evaluate_for_scripts_runs_tree_beside_the_others(setup, generated):
    """`evaluate(argv)` (the measurement scripts' entry) returns the JSON document without leaving
    files; rule `tree` runs with its node budget beside `ar` and `lilicorr` and, greedy, generates
    the same tokens."""
    from lilicorr.eval import evaluate
    rules = ["ar", "lilicorr", "tree"]
    doc = evaluate(["--target", str(setup["path"]), "--ckpt", str(setup["ckpt"]), "--prompts", str(setup["a"]),
                    "--rules", ",".join(rules), "--max-tokens", "10", "--batch-size", "2", "--tree-nodes", "6",
                    "--no-progress"], log=lambda m: None)
    assert doc["meta"]["rules"] == rules and doc["meta"]["tree_nodes"] == 6 and "plots" not in doc
    assert list(doc["results"]) == ["chat"] and list(doc["results"]["chat"]) == rules
    _assert_rules_generate_the_same_tokens(generated, 10, rules, doc["results"])


def _draft_length_script():
    return load_script(REPO_ROOT / "scripts" / "draft_length_cpu.py", "draft_length_cpu")


def test_draft_length_script_prices_the_block_from_the_stage_timer(setup, tmp_path):
    """scripts/draft_length_cpu.py with --profile: each cell's block cost is the stage timer's
    lilicorr block wall over the `ar` step's wall of the same run, the drafter's part is its three
    stages, and the report shows both; prompt lookup reaches the evaluation."""
    script = _draft_length_script()
    out = tmp_path / "dl"
    rc = script.main(["--target", str(setup["path"]), "--ckpt", str(setup["ckpt"]), "--suites", str(setup["a"]),
                      "--limit", "2", "--max-tokens", "8", "--concurrency", "1", "--lengths", "1,block",
                      "--prompt-lookup", "2", "--profile", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert [c["draft_length"] for c in doc["cells"]] == ["1", "block"]
    for c in doc["cells"]:
        b = c["block"]
        assert c["prompt_lookup"] == 2
        assert b["block_ms"] > 0 and b["ar_step_ms"] > 0 and 0 < b["drafter_ms"] < b["block_ms"]
        assert math.isclose(b["block_plain_steps"], b["block_ms"] / b["ar_step_ms"])
        assert math.isclose(b["drafter_plain_steps"], b["drafter_ms"] / b["ar_step_ms"])
    text = out.with_suffix(".md").read_text()
    assert "block in plain steps (break-even tau)" in text and "prompt lookup over 2..2-grams" in text
    assert script.table(doc["cells"]) in text


def test_draft_length_engine_tables_come_from_their_json():
    """The committed tables of results/draft_length_engine_epyc are what the script's table makes
    of the cells in the JSON beside them."""
    script = _draft_length_script()
    folder = REPO_ROOT / "results" / "draft_length_engine_epyc"
    runs = sorted(folder.glob("*.json"))
    assert len(runs) == 4
    for path in runs:
        cells = json.loads(path.read_text())["cells"]
        assert all("block" in c for c in cells)
        assert script.table(cells) in path.with_suffix(".md").read_text(), path.name
