"""Serving: protocol, engine loop, repository, launcher (fast) and a real tritonserver (integration).

Integration tests start the nvidia-pytriton wheel's tritonserver 2.51 on free loopback ports
(session-scoped; see serving_fixtures.py) and talk gRPC streams to it.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lilicorr.serving import protocol
from lilicorr.serving.benchmark import (add_comparisons, markdown_table, percentile, plot_speedup,
                                        summarize_cell)
from lilicorr.serving.client import GenerationError, GenerationResult, LiLiCorrClient, run_concurrent
from lilicorr.serving.engine_loop import EngineLoop, Job
from lilicorr.serving.launcher import (SHM_BASE_PREFIX, free_port, leftover_shm,
                                       live_group_members, make_backend_dir, server_env, venv_root)
from lilicorr.serving.protocol import GenerationParams, Limits, RequestError
from lilicorr.serving.repository import (EngineSpec, ServeOptions, generate_repository, model_parameters,
                                         read_engine_manifest)
from lilicorr.serving.testing import EchoEngine

from serving_fixtures import (BLOCK_SIZE, MAX_SEQ_LEN, client_for, echo_options, echo_server,  # noqa: F401
                              engine_server, have_tritonserver, http_get, metric, metrics_text,
                              offline_engine, serving_target, start_server, tiny_engine_dir, tokenizer)

REPO = Path(__file__).resolve().parents[1]


# =============================================================================== protocol
LIM = Limits(max_seq_len=100, max_tokens_limit=64, default_max_tokens=16, vocab_size=96)


def params(**tensors):
    return protocol.parse_generation_params({k: np.asarray([v]) for k, v in tensors.items()}, {}, LIM)


def test_params_defaults_and_parameters():
    p = protocol.parse_generation_params({}, {}, LIM)
    assert p == GenerationParams(max_tokens=16, temperature=0.0, seed=None, decode_rule="lilicorr",
                                 stream=True, max_tokens_given=False)
    p = protocol.parse_generation_params({}, {"max_tokens": 5, "decode_rule": "AR", "temperature": 0.5,
                                              "seed": 3, "stream": False}, LIM)
    assert (p.max_tokens, p.decode_rule, p.temperature, p.seed, p.stream) == (5, "ar", 0.5, 3, False)
    # a tensor wins over a parameter
    p = protocol.parse_generation_params({"max_tokens": np.asarray([7], np.int32)}, {"max_tokens": 5}, LIM)
    assert p.max_tokens == 7
    assert params(decode_rule=b"viterbi").decode_rule == "viterbi"


@pytest.mark.parametrize("kw, msg", [
    (dict(max_tokens=0), "positive"), (dict(max_tokens=-3), "positive"), (dict(max_tokens=65), "limit"),
    (dict(temperature=-0.1), ">= 0"), (dict(temperature=float("nan")), "finite"),
    (dict(temperature=float("inf")), "finite"), (dict(decode_rule=b"beam"), "unknown decode_rule"),
    (dict(seed=-1), "seed"),
])
def test_params_rejected(kw, msg):
    with pytest.raises(RequestError, match=msg):
        params(**kw)


def test_params_rejects_wrong_parameter_types():
    with pytest.raises(RequestError, match="integer"):
        protocol.parse_generation_params({}, {"max_tokens": "lots"}, LIM)
    with pytest.raises(RequestError, match="boolean"):
        protocol.parse_generation_params({}, {"stream": "maybe"}, LIM)
    with pytest.raises(RequestError, match="exactly one"):
        protocol.parse_generation_params({"max_tokens": np.asarray([1, 2])}, {}, LIM)


def test_prompt_validation():
    assert protocol.validate_prompt_ids(np.asarray([1, 2, 3], np.int32), LIM, 10) == [1, 2, 3]
    for ids, max_tokens, msg in [([], 1, "empty prompt"), ([1, 96], 1, "outside the vocabulary"),
                                 ([-1], 1, "outside the vocabulary"), ([1] * 100, 1, "context holds"),
                                 ([1] * 90, 20, "exceeds the context")]:
        with pytest.raises(RequestError, match=msg):
            protocol.validate_prompt_ids(np.asarray(ids, np.int64), LIM, max_tokens)
    with pytest.raises(RequestError, match="1-D"):
        protocol.validate_prompt_ids(np.ones((2, 2), np.int32), LIM, 1)
    # a defaulted max_tokens shrinks to the room left; an explicit one does not
    p = protocol.parse_generation_params({}, {}, LIM)
    assert protocol.fit_params(p, 95, LIM).max_tokens == 5
    p = protocol.parse_generation_params({}, {"max_tokens": 16}, LIM)
    assert protocol.fit_params(p, 95, LIM).max_tokens == 16


class ByteTokenizer:
    """ids are bytes; decode = utf-8 with replacement (like byte-level BPE)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("chunks", [[1], [2, 3], [1, 1, 1, 1], [5, 7]])
def test_text_delta_concatenates_to_full_decode(chunks):
    text = "héllo wörld ✓ 😀 end"
    ids = list(text.encode())
    tok = ByteTokenizer()
    out, pos, k = [], 0, 0
    while pos < len(ids):
        n = chunks[k % len(chunks)]
        k += 1
        new = ids[pos:pos + n]
        ctx = ids[max(0, pos - protocol.CONTEXT_WINDOW):pos]
        pos += n
        delta = protocol.text_delta(tok, ctx, new, final=pos >= len(ids))
        assert "\ufffd" not in delta
        out.append(delta)
    assert "".join(out) == text


def test_text_delta_word_boundaries(tokenizer):
    ids = tokenizer.encode("hello world how are you")
    deltas = [protocol.text_delta(tokenizer, ids[:i][-protocol.CONTEXT_WINDOW:], ids[i:i + 1], i == len(ids) - 1)
              for i in range(len(ids))]
    assert "".join(deltas) == tokenizer.decode(ids)


# =============================================================================== engine loop
class FakeSink:
    def __init__(self, cancel_after: int | None = None):
        self.responses, self.errors, self.finals = [], [], 0
        self.cancel_after = cancel_after
        self.done = threading.Event()

    def send(self, outputs, final):
        self.responses.append(outputs)
        if final:
            self.finals += 1
            self.done.set()

    def send_error(self, code, message):
        self.errors.append((code, message))
        self.finals += 1
        self.done.set()

    def send_final(self):
        self.finals += 1
        self.done.set()

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.responses) >= self.cancel_after

    def tokens(self):
        return [int(t) for r in self.responses for t in r["output_ids"]]


def run_jobs(engine, jobs, **kw):
    loop = EngineLoop(engine, cancel_check_period_s=0.0, idle_poll_s=0.01, **kw).start()
    try:
        for j in jobs:
            loop.submit(j)
        for j in jobs:
            assert j.sink.done.wait(10), f"{j.request_id} never finished"
    finally:
        loop.stop()
    return loop


def gp(max_tokens=10, rule="lilicorr", stream=True):
    return GenerationParams(max_tokens=max_tokens, decode_rule=rule, stream=stream)


def test_engine_loop_streams_and_batches():
    eng = EchoEngine(block_size=4)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    jobs = [Job(f"r{i}", p, gp(9, rule=["ar", "argmax", "lilicorr", "viterbi"][i]), FakeSink())
            for i, p in enumerate(prompts)]
    loop = run_jobs(eng, jobs)
    for j, p in zip(jobs, prompts):
        assert j.sink.tokens() == eng.expected(p, 9)
        assert j.sink.finals == 1 and not j.sink.errors
        last = j.sink.responses[-1]
        assert bool(last["is_final"][0]) and last["finish_reason"][0] == b"length"
        assert int(last["num_steps"][0]) == j.steps and int(last["num_accepted"][0]) == j.accepted
        # context window = the tokens emitted before each chunk
        seen = []
        for r in j.sink.responses:
            assert list(r["context_ids"]) == seen[-protocol.CONTEXT_WINDOW:]
            seen += list(r["output_ids"])
    assert max(eng.batch_sizes) >= 2          # requests were stepped together
    assert loop.stats.requests_ok == 4
    ar = jobs[0]
    assert ar.drafted == 0 and ar.accepted == ar.steps   # tau == 1 for ar


def test_engine_loop_non_streaming_sends_once():
    eng = EchoEngine()
    job = Job("r", [3, 4], gp(7, stream=False), FakeSink())
    run_jobs(eng, [job])
    assert len(job.sink.responses) == 1
    assert job.sink.tokens() == eng.expected([3, 4], 7)


def test_engine_loop_cancel_frees_sequence():
    eng = EchoEngine(step_delay_s=0.005)
    job = Job("r", [3, 4], gp(100, rule="ar"), FakeSink(cancel_after=2))
    ok = Job("ok", [5], gp(5), FakeSink())
    loop = run_jobs(eng, [job, ok])
    assert eng.cancelled == [job.rid] and not eng.seqs
    assert job.sink.finals == 1 and len(job.sink.tokens()) < 100
    assert loop.stats.requests_cancelled == 1
    assert ok.sink.tokens() == eng.expected([5], 5)


def test_engine_loop_errors_are_final_and_loop_survives():
    eng = EchoEngine(max_seq_len=20)
    bad = Job("bad", [1] * 18, gp(10), FakeSink())          # engine raises ValueError
    good = Job("good", [1, 2], gp(4), FakeSink())
    run_jobs(eng, [bad, good])
    assert bad.sink.errors and bad.sink.errors[0][0] == "INVALID_ARG" and "'bad'" in bad.sink.errors[0][1]
    assert good.sink.tokens() == eng.expected([1, 2], 4)

    class Exploding(EchoEngine):
        calls = 0

        def step(self):
            Exploding.calls += 1
            if Exploding.calls == 2:
                raise RuntimeError("boom")
            return super().step()

    eng = Exploding()
    j1 = Job("j1", [1], gp(50), FakeSink())
    run_jobs(eng, [j1])
    assert j1.sink.errors and j1.sink.errors[0][0] == "INTERNAL" and "boom" in j1.sink.errors[0][1]
    j2 = Job("j2", [2], gp(3), FakeSink())
    run_jobs(eng, [j2])
    assert j2.sink.tokens() == eng.expected([2], 3)


def test_engine_loop_admits_at_most_max_active():
    eng = EchoEngine(max_batch=3)
    jobs = [Job(f"r{i}", [i + 1], gp(4), FakeSink()) for i in range(8)]
    run_jobs(eng, jobs, max_active=3)
    assert max(eng.batch_sizes) <= 3
    assert all(j.sink.tokens() == eng.expected([i + 1], 4) for i, j in enumerate(jobs))


def test_engine_loop_stop_answers_everything():
    eng = EchoEngine(step_delay_s=0.01, max_seq_len=100_000, max_batch=2)
    loop = EngineLoop(eng, idle_poll_s=0.01, max_active=2).start()
    sinks = [FakeSink() for _ in range(3)]     # two active, one waiting
    for i, s in enumerate(sinks):
        loop.submit(Job(f"r{i}", [1], gp(10_000), s))
    time.sleep(0.1)
    loop.stop()
    assert all(s.finals == 1 for s in sinks)
    assert all(s.errors and s.errors[0][0] == "UNAVAILABLE" for s in sinks)
    late = FakeSink()
    loop.submit(Job("late", [1], gp(1), late))
    assert late.errors and late.errors[0][0] == "UNAVAILABLE"


# =============================================================================== repository / launcher
def test_read_engine_manifest_relative_paths(tmp_path):
    target = tmp_path / "targets" / "tiny"
    target.mkdir(parents=True)
    eng = tmp_path / "engines" / "e1"
    eng.mkdir(parents=True)
    (eng / "manifest.json").write_text(json.dumps({"target_dir": "../../targets/tiny", "ckpt": None,
                                                   "block_size": 8, "top_k": 4, "backend": "onnxruntime"}))
    spec = read_engine_manifest(eng)
    assert spec.target_dir == target.resolve() and spec.engine_dir == eng.resolve()
    assert (spec.draft_backend, spec.block_size, spec.top_k, spec.ckpt_dir) == ("onnxruntime", 8, 4, None)
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        read_engine_manifest(tmp_path)


def test_generate_repository(tmp_path):
    spec = EngineSpec(target_dir=tmp_path / "t", engine_dir=tmp_path / "e", draft_backend="onnxruntime")
    repo = generate_repository(spec, tmp_path / "repo", ServeOptions(max_batch=7, max_seq_len=300))
    for m in ("preprocessing", "lilicorr", "postprocessing", "ensemble"):
        cfg = (repo / m / "config.pbtxt").read_text()
        assert "${" not in cfg and f'name: "{m}"' in cfg
        assert (repo / m / "1").is_dir()
    cfg = (repo / "lilicorr" / "config.pbtxt").read_text()
    assert "decoupled: true" in cfg and '"7"' in cfg and "onnxruntime" in cfg
    assert (repo / "lilicorr" / "1" / "model.py").is_file()
    if venv_root() is not None:
        assert f'"EXECUTION_ENV_PATH" value: {{ string_value: "{venv_root()}" }}' in cfg
    assert model_parameters({"parameters": {"a": {"string_value": "x"}, "b": {"string_value": "${b}"}}}) == \
        {"a": "x", "b": ""}


def test_server_env_and_backend_dir(tmp_path):
    import sysconfig
    env = server_env({"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"})
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[:2] == [sysconfig.get_config_var("LIBDIR"), "/opt/x"]
    first = env["PATH"].split(os.pathsep)[0]
    assert os.path.exists(os.path.join(first, "python3"))
    if venv_root() is not None:
        assert first == str(venv_root() / "bin")
    if not have_tritonserver():
        pytest.skip("no tritonserver")
    from lilicorr.serving.launcher import find_tritonserver
    binary = find_tritonserver()
    if binary.kind != "wheel":
        pytest.skip("system tritonserver keeps its own backends")
    d = make_backend_dir(tmp_path / "b", binary) / "python"
    names = sorted(p.name for p in d.iterdir())
    assert names == ["libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]
    assert all((d / n).is_symlink() for n in names)
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"python_backend_stubs/{ver}/" in os.readlink(d / "triton_python_backend_stub")


def test_benchmark_summaries(tmp_path):
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None

    def res(ids, acc, steps, t0):
        return GenerationResult("r", "", ids, acc, 3 * steps, steps, "length", t0, t0 + 1,
                                [t0 + 0.1 * i for i in range(len(ids))])
    ar = [res([1, 2, 3], 2, 2, 0.1), res([4, 5], 1, 1, 0.2)]
    sp = [res([1, 2, 3], 4, 1, 0.1), RuntimeError("x")]
    cells = [summarize_cell("ar", 2, ar, 1.0), summarize_cell("lilicorr", 2, sp, 0.5)]
    add_comparisons(cells, {("ar", 2): ar, ("lilicorr", 2): sp})
    assert cells[0]["tau"] == 1.0 and cells[1]["tau"] == 4.0
    assert cells[1]["errors"] == 1 and cells[1]["matches_ar"] == 1.0
    assert math.isclose(cells[1]["speedup"], (3 / 0.5) / (5 / 1.0))
    table = markdown_table(cells)
    assert "| lilicorr | 2 |" in table and "1.20x" in table
    plot_speedup(cells, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_run_concurrent_keeps_order_and_errors():
    out = run_concurrent(lambda x: 1 / x, [1, 2, 0, 4], 3)
    assert out[:2] == [1.0, 0.5] and isinstance(out[2], ZeroDivisionError) and out[3] == 0.25


# =============================================================================== integration: mechanics
integration = pytest.mark.integration


@integration
def test_stub_runs_our_venv(echo_server):
    """The stub's embedded Python is this interpreter's venv, with the editable lilicorr install."""
    import lilicorr
    log = echo_server.log_text()
    line = next((ln for ln in log.splitlines() if "lilicorr stub python" in ln), None)
    assert line is not None, echo_server.log_tail()
    assert f"prefix={sys.prefix} " in line
    assert f"lilicorr={lilicorr.__file__}" in line
    assert "numpy=1." in line


@integration
def test_health_metadata_and_metrics(echo_server):
    base = f"http://{echo_server.http_url}"
    assert http_get(base + "/v2/health/live")[0] == 200
    assert http_get(base + "/v2/health/ready")[0] == 200
    for m in ("preprocessing", "lilicorr", "postprocessing", "ensemble"):
        assert http_get(f"{base}/v2/models/{m}/ready")[0] == 200
    status, body = http_get(base + "/v2/models/ensemble/config")
    assert status == 200 and json.loads(body)["model_transaction_policy"]["decoupled"] is True
    client = client_for(echo_server)
    assert client.server_ready()
    before = metric(metrics_text(echo_server), "lilicorr_output_tokens")
    res = client.generate("hello world", max_tokens=5)
    assert res.num_tokens == 5
    text = metrics_text(echo_server)
    assert metric(text, "nv_inference_request_success", model="ensemble") >= 1
    assert metric(text, "lilicorr_output_tokens") >= before + 5
    assert metric(text, "lilicorr_requests", state="active") == 0


@integration
def test_ensemble_streams_text_deltas(echo_server, tokenizer):
    client = client_for(echo_server)
    eng = EchoEngine()
    ids = tokenizer.encode_chat([{"role": "user", "content": "what is the answer"}])
    deltas = list(client.stream("what is the answer", max_tokens=12, decode_rule="argmax"))
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == eng.expected(ids, 12)
    assert len(deltas) > 1 and deltas[-1].final
    assert "".join(d.text for d in deltas) == tokenizer.decode(tokens)
    times = [d.t for d in deltas]
    assert times == sorted(times) and times[-1] - times[0] > 0     # really streamed, step by step
    # chat messages and stream=false
    msgs = [{"role": "system", "content": "please answer"}, {"role": "user", "content": "why"}]
    res = client.generate(messages=msgs, max_tokens=6, stream=False)
    assert res.token_ids == eng.expected(tokenizer.encode_chat(msgs), 6)
    assert len(set(res.token_times)) == 1 and res.finish_reason == "length"


@integration
def test_direct_token_id_model(echo_server):
    client = client_for(echo_server)
    res = client.generate(input_ids=[1, 7, 9], max_tokens=9, decode_rule="lilicorr")
    assert res.token_ids == EchoEngine().expected([1, 7, 9], 9)
    assert res.steps >= 1 and res.drafted == 3 * res.steps and res.accepted >= res.steps
    ar = client.generate(input_ids=[1, 7, 9], max_tokens=9, decode_rule="ar")
    assert ar.token_ids == res.token_ids and ar.tau == 1.0 and ar.drafted == 0


def _raw_engine_inputs(ids_arr, dtype):
    import tritonclient.grpc as g
    inp = g.InferInput("input_ids", list(ids_arr.shape), dtype)
    inp.set_data_from_numpy(ids_arr)
    return [inp]


BAD_REQUESTS = {
    "empty prompt": dict(prompt="", match="empty prompt"),
    "blank prompt": dict(prompt="   ", match="empty prompt"),
    "empty ids": dict(input_ids=[], match="empty prompt"),
    "prompt too long": dict(prompt="hello " * 200, match="context"),
    "ids too long": dict(input_ids=[1] * 200, match="context"),
    "id above vocab": dict(input_ids=[1, 2, 96], match="outside the vocabulary"),
    "negative id": dict(input_ids=[1, -5], match="outside the vocabulary"),
    "max_tokens 0": dict(prompt="hi", max_tokens=0, match="positive"),
    "max_tokens negative": dict(prompt="hi", max_tokens=-4, match="positive"),
    "max_tokens beyond limit": dict(prompt="hi", max_tokens=100_000, match="limit"),
    "prompt + max_tokens": dict(input_ids=[1] * 100, max_tokens=100, match="exceeds the context"),
    "negative temperature": dict(prompt="hi", temperature=-1.0, match=">= 0"),
    "nan temperature": dict(prompt="hi", temperature=float("nan"), match="finite"),
    "unknown rule": dict(prompt="hi", decode_rule="beam", match="unknown decode_rule"),
    "bad messages": dict(messages=[{"role": "user"}], match="messages_json"),
}


@integration
@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_then_good_one(echo_server, case):
    kw = dict(BAD_REQUESTS[case])
    match = kw.pop("match")
    client = client_for(echo_server)
    rid = f"bad-{case.replace(' ', '-')}"
    with pytest.raises(GenerationError, match=match) as ei:
        client.generate(request_id=rid, **kw)
    assert rid in str(ei.value)                  # the message names the request
    assert client.generate("hello", max_tokens=3).num_tokens == 3


@integration
@pytest.mark.parametrize("case", ["fp32 ids", "2-D ids", "wrong knob dtype", "knob shape"])
def test_wrong_dtype_or_shape_then_good_one(echo_server, case):
    import tritonclient.grpc as g
    client = client_for(echo_server)
    if case == "fp32 ids":
        inputs, match = _raw_engine_inputs(np.asarray([1.0, 2.0], np.float32), "FP32"), "data-type"
    elif case == "2-D ids":
        inputs, match = _raw_engine_inputs(np.asarray([[1, 2]], np.int32), "INT32"), "shape"
    else:
        inputs = _raw_engine_inputs(np.asarray([1, 2], np.int32), "INT32")
        arr = np.asarray([5.0], np.float32) if case == "wrong knob dtype" else np.asarray([5, 6], np.int32)
        knob = g.InferInput("max_tokens", list(arr.shape), "FP32" if arr.dtype == np.float32 else "INT32")
        knob.set_data_from_numpy(arr)
        inputs.append(knob)
        match = "data-type" if case == "wrong knob dtype" else "shape"
    with pytest.raises(GenerationError, match=match):
        client.generate(model="lilicorr", inputs=inputs)
    assert client.generate(input_ids=[1, 2], max_tokens=2).num_tokens == 2


@integration
def test_client_disconnect_frees_sequence(echo_server):
    client = client_for(echo_server)
    before = metric(metrics_text(echo_server), "lilicorr_requests_cancelled")
    gs = client.stream("hello", max_tokens=100, decode_rule="ar")      # ~100 steps of 20 ms
    got = []
    for d in gs:
        got += d.token_ids
        if len(got) >= 3:
            break
    gs.cancel()
    deadline = time.time() + 10
    while time.time() < deadline:
        text = metrics_text(echo_server)
        if (metric(text, "lilicorr_requests_cancelled") > before
                and metric(text, "lilicorr_requests", state="active") == 0):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the cancelled request was not freed:\n" + echo_server.log_tail())
    assert client.generate("hello", max_tokens=3).num_tokens == 3


@integration
def test_32_concurrent_streams_lose_nothing(echo_server, tokenizer):
    client = client_for(echo_server)
    eng = EchoEngine()
    words = "the a is of to and in on for with it this".split()
    prompts = [" ".join(words[i % 12:] + words[:i % 5]) for i in range(32)]
    rules = ["ar", "argmax", "lilicorr", "viterbi"]
    res = run_concurrent(lambda i: client.generate(prompts[i], max_tokens=10 + i % 7, decode_rule=rules[i % 4]),
                         list(range(32)), 32)
    for i, r in enumerate(res):
        assert isinstance(r, GenerationResult), r
        ids = tokenizer.encode_chat([{"role": "user", "content": prompts[i]}])
        assert r.token_ids == eng.expected(ids, 10 + i % 7)
        assert r.text == tokenizer.decode(r.token_ids)


# =============================================================================== integration: real engine
@integration
def test_engine_stream_equals_offline(engine_server, offline_engine, tokenizer):
    client = client_for(engine_server)
    eos = sorted(tokenizer.eos_ids)
    prompt = "hello world how are you"
    ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    ref = offline_engine.generate([ids], 12, rule="ar", stop_ids=eos)[0].tokens
    for rule in ("ar", "argmax", "lilicorr", "viterbi"):
        deltas = list(client.stream(prompt, max_tokens=12, decode_rule=rule))
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == ref, rule
        assert "".join(d.text for d in deltas) == tokenizer.decode(ref)
    res = client.generate(input_ids=ids, max_tokens=12, decode_rule="lilicorr")
    off = offline_engine.generate([ids], 12, rule="lilicorr", stop_ids=eos)[0]
    assert res.token_ids == off.tokens
    assert (res.accepted, res.steps) == (off.accepted_tokens, off.num_steps)
    assert res.drafted == (BLOCK_SIZE - 1) * res.steps


@integration
def test_engine_concurrent_greedy_equals_one_at_a_time(engine_server, offline_engine, tokenizer):
    client = client_for(engine_server)
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(6, 96, size=int(rng.integers(2, 12))).tolist() for _ in range(32)]
    rules = ["ar", "argmax", "lilicorr", "viterbi"]
    kw = [dict(input_ids=p, max_tokens=6 + i % 4, decode_rule=rules[i % 4]) for i, p in enumerate(prompts)]
    one_at_a_time = [client.generate(**k).token_ids for k in kw[:8]]
    together = run_concurrent(lambda k: client.generate(**k), kw, 32)
    assert all(isinstance(r, GenerationResult) for r in together), [r for r in together if not isinstance(r, GenerationResult)]
    assert [r.token_ids for r in together[:8]] == one_at_a_time
    eos = sorted(tokenizer.eos_ids)
    for k, r in zip(kw, together):
        ref = offline_engine.generate([k["input_ids"]], k["max_tokens"], rule="ar", stop_ids=eos)[0].tokens
        assert r.token_ids == ref


@integration
def test_engine_sampling_is_seeded_and_cancel_frees(engine_server):
    client = client_for(engine_server)
    a = client.generate(input_ids=[1, 9, 12], max_tokens=8, temperature=0.8, seed=5, decode_rule="lilicorr")
    b = client.generate(input_ids=[1, 9, 12], max_tokens=8, temperature=0.8, seed=5, decode_rule="lilicorr")
    assert a.token_ids == b.token_ids
    full = client.generate(input_ids=[1, 9, 12], max_tokens=30, decode_rule="argmax", ignore_eos=True)
    assert full.num_tokens == 30 and full.finish_reason == "length"
    gs = client.stream(input_ids=[1, 9, 12], max_tokens=120, decode_rule="ar", ignore_eos=True)
    next(iter(gs))
    gs.cancel()
    deadline = time.time() + 20
    while time.time() < deadline:
        text = metrics_text(engine_server)
        if metric(text, "lilicorr_requests_cancelled") >= 1 and metric(text, "lilicorr_requests", state="active") == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail("cancelled request not freed")
    text = metrics_text(engine_server)
    assert metric(text, "lilicorr_stage_blocks") > 0                  # profile=true in the fixture
    assert metric(text, "lilicorr_stage_seconds", stage="target_verify") > 0


# =============================================================================== integration: shutdown
def _our_tmp_dirs() -> set[str]:
    import glob
    import tempfile
    base = tempfile.gettempdir()
    return set(glob.glob(os.path.join(base, "lilicorr-triton-*")) + glob.glob(os.path.join(base, "lilicorr-repo-*")))


@integration
def test_clean_shutdown_leaves_nothing(serving_target, tmp_path):
    dirs_before = _our_tmp_dirs()
    repo = generate_repository(EngineSpec(target_dir=serving_target), tmp_path / "repo", echo_options())
    srv = start_server(repo)
    pgid = srv.proc.pid
    workdir = srv.workdir
    prefix = srv.shm_prefix
    assert leftover_shm(prefix), "the python backend should have shm regions while running"
    client = client_for(srv)
    # failed and cancelled ensemble requests must not leave the ensemble "in flight"
    for bad in (dict(prompt=""), dict(prompt="hi", max_tokens=0)):
        with pytest.raises(GenerationError):
            client.generate(**bad)
    gs = client.stream("hello", max_tokens=100, decode_rule="ar")
    next(iter(gs))
    gs.cancel()
    # a request still streaming at shutdown completes (stop() drains the ensemble first)
    gs = client.stream("hello", max_tokens=60, decode_rule="ar")
    next(iter(gs))                      # really in flight
    out = {}
    def read():
        try:
            out["res"] = gs.result()
        except Exception as e:  # noqa: BLE001
            out["res"] = e
    reader = threading.Thread(target=read)
    reader.start()
    t0 = time.time()
    rc = srv.stop()
    reader.join(30)
    assert isinstance(out["res"], GenerationResult), out["res"]
    assert out["res"].finish_reason == "length" and out["res"].num_tokens == 60
    assert time.time() - t0 < 15
    assert rc == 0, srv.log_tail()
    assert leftover_shm(prefix) == []
    assert not workdir.exists()
    assert live_group_members(pgid) == []
    assert _our_tmp_dirs() <= dirs_before


@integration
def test_shutdown_with_a_client_holding_its_stream_open(serving_target, tmp_path):
    """tritonserver 2.51 cannot exit while a client keeps a gRPC stream open; stop() still ends
    it (SIGKILL after the exit timeout) and cleans up shared memory, processes and temp dirs."""
    dirs_before = _our_tmp_dirs()
    repo = generate_repository(EngineSpec(target_dir=serving_target), tmp_path / "repo", echo_options())
    srv = start_server(repo, exit_timeout=2)
    pgid, workdir, prefix = srv.proc.pid, srv.workdir, srv.shm_prefix
    import tritonclient.grpc as g
    raw = g.InferenceServerClient(srv.grpc_url)
    raw.start_stream(callback=lambda result, error: None)
    inputs = LiLiCorrClient(srv.grpc_url).build_inputs("lilicorr", input_ids=[1, 2], max_tokens=2)
    raw.async_stream_infer("lilicorr", inputs)
    time.sleep(1.0)                     # answered, but the stream stays open
    t0 = time.time()
    srv.stop()
    assert time.time() - t0 < 2 * 2 + 5 + 10
    assert leftover_shm(prefix) == [] and not workdir.exists()
    assert live_group_members(pgid) == []
    assert _our_tmp_dirs() <= dirs_before
    raw.stop_stream(cancel_requests=True)
    raw.close()


@integration
def test_serve_script_sigterm(serving_target, tiny_engine_dir):
    """deploy/serve.py --engine DIR end to end: ready line, a request, SIGTERM -> exit 0, nothing
    left behind (the echo engine stands in where the converter cannot build an engine dir)."""
    if not have_tritonserver():
        pytest.skip("no tritonserver")
    dirs_before = _our_tmp_dirs()
    ports = [free_port() for _ in range(3)]
    if tiny_engine_dir is not None:
        what = ["--engine", str(tiny_engine_dir), "--num-threads", "1"]
    else:
        what = ["--target", str(serving_target), "--engine-factory", "lilicorr.serving.testing:echo_engine"]
    cmd = [sys.executable, str(REPO / "deploy" / "serve.py"), *what, "--max-seq-len", str(MAX_SEQ_LEN),
           "--grpc-port", str(ports[0]), "--http-port", str(ports[1]), "--metrics-port", str(ports[2])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    lines = []
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if line.startswith("[serve] ready"):
                break
        assert lines and lines[-1].startswith("[serve] ready"), "".join(lines[-40:])
        res = LiLiCorrClient(f"127.0.0.1:{ports[0]}", timeout=60).generate("hello", max_tokens=4, ignore_eos=True)
        assert res.num_tokens == 4
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "[serve] stopped (tritonserver exit code 0)" in out
    assert leftover_shm(f"{SHM_BASE_PREFIX}lilicorr_{proc.pid}_") == []
    assert _our_tmp_dirs() <= dirs_before


# =============================================================================== integration: CLIs
@integration
def test_client_cli_streams(echo_server):
    proc = subprocess.run([sys.executable, str(REPO / "deploy" / "client.py"), "--url", echo_server.grpc_url,
                           "--max-tokens", "6", "--rule", "argmax", "--stats", "hello world"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "6 tokens" in proc.stderr and "tau=" in proc.stderr
    bad = subprocess.run([sys.executable, str(REPO / "deploy" / "client.py"), "--url", echo_server.grpc_url,
                          "--rule", "beam", "hello"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown decode_rule" in bad.stderr


@integration
def test_bench_cli(echo_server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ["hello world", "how are you", "what is the answer", "write code"]) + "\n")
    out = tmp_path / "bench" / "b.json"
    proc = subprocess.run([sys.executable, str(REPO / "deploy" / "bench.py"), "--url", echo_server.grpc_url,
                           "--metrics-url", echo_server.metrics_url, "--prompts", str(prompts), "--limit", "4",
                           "--concurrency", "1,4", "--rules", "lilicorr,ar,argmax", "--max-tokens", "8",
                           "--json", str(out), "--profile"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    cells = report["cells"]
    assert [(c["concurrency"], c["rule"]) for c in cells] == [(1, "ar"), (1, "lilicorr"), (1, "argmax"),
                                                              (4, "ar"), (4, "lilicorr"), (4, "argmax")]
    for c in cells:
        assert c["errors"] == 0 and c["output_tokens"] == 4 * 8 and c["tokens_per_s"] > 0
        assert c["ttft_p50_ms"] is not None and c["tpot_p99_ms"] is not None and c["speedup"] > 0
        if c["rule"] == "ar":
            assert c["tau"] == 1.0 and c["speedup"] == 1.0
        else:
            assert c["tau"] > 1.0 and c["matches_ar"] == 1.0
    assert "| lilicorr | 4 |" in proc.stdout
    assert out.with_suffix(".png").stat().st_size > 1000
