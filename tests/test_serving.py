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
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from lilicorr.serving import protocol
from lilicorr.serving.benchmark import (add_comparisons, markdown_table, percentile, plot_speedup,
                                        summarize_cell)
from lilicorr.serving.client import GenerationError, GenerationResult, LiLiCorrClient, run_concurrent
from lilicorr.serving.engine_loop import EngineLoop, Job
from lilicorr.serving.launcher import (SHM_BASE_PREFIX, free_port, hide_option_value, leftover_shm,
                                       live_group_members, make_backend_dir, server_env, venv_root)
from lilicorr.serving.protocol import GenerationParams, Limits, RequestError
from lilicorr.serving.repository import (EngineSpec, ServeOptions, generate_repository, model_parameters,
                                         read_engine_manifest)

from serving_fixtures import (BLOCK_SIZE, MAX_SEQ_LEN, SERVED_SEQ_LEN, chat_ids, client_for,  # noqa: F401
                              engine_repository, engine_server, have_tritonserver, http_get, metric,
                              metrics_text, offline_engine, reference, serving_target, start_server,
                              tiny_engine_dir, tokenizer)

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


def test_engine_threads_leave_the_server_a_core(monkeypatch):
    """num_threads 0 in the model config: the engine takes every core it may run on but one (the
    server's own threads need it), never fewer than one and at most MAX_ENGINE_THREADS; the
    server's stubs get the same number in OMP_NUM_THREADS unless the caller set one."""
    from lilicorr.serving import launcher, repository
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cores, want in ((1, 1), (2, 1), (4, 3), (16, launcher.MAX_ENGINE_THREADS)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: set(range(cores)), raising=False)
        assert repository.engine_threads() == want
        assert launcher.server_env()["OMP_NUM_THREADS"] == str(want)
    assert launcher.server_env({"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


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
# EngineLoop driving a real SpecEngine (tiny target, untrained drafter + head, block size 4). The
# sink records what the loop would send through a Triton response sender (the transport).
class RecordingSink:
    def __init__(self, cancel_after: int | None = None, on_send=None):
        self.responses, self.errors, self.finals = [], [], 0
        self.cancel_after = cancel_after
        self.on_send = on_send
        self.done = threading.Event()

    def send(self, outputs, final):
        self.responses.append(outputs)
        if self.on_send is not None:
            self.on_send(self)
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

    def last(self, name):
        v = self.responses[-1][name][0]
        return v.decode() if isinstance(v, bytes) else int(v)


@pytest.fixture(scope="module")
def make_engine(serving_target):
    """make_engine(max_batch) -> a fresh SpecEngine (untrained drafter + head, seed 0)."""
    from lilicorr.engine import SpecEngine

    def make(max_batch: int = 8, cls=SpecEngine):
        return cls.from_paths(serving_target, untrained_seed=0, block_size=BLOCK_SIZE, max_batch=max_batch,
                              max_seq_len=MAX_SEQ_LEN)
    return make


@pytest.fixture(scope="module")
def loop_reference(make_engine):
    """loop_reference(prompt, max_tokens, rule) -> the engine's Result for the request run alone."""
    eng = make_engine(1)
    done = {}

    def ref(prompt, max_tokens, rule="ar"):
        key = (tuple(prompt), max_tokens, rule)
        if key not in done:
            done[key] = eng.generate([list(prompt)], max_tokens, rule=rule)[0]
        return done[key]
    return ref


def run_jobs(engine, jobs, **kw):
    loop = EngineLoop(engine, cancel_check_period_s=0.0, idle_poll_s=0.01, **kw).start()
    try:
        for j in jobs:
            loop.submit(j)
        for j in jobs:
            assert j.sink.done.wait(60), f"{j.request_id} never finished"
    finally:
        loop.stop()
    return loop


def gp(max_tokens=10, rule="lilicorr", stream=True):
    return GenerationParams(max_tokens=max_tokens, decode_rule=rule, stream=stream)


RULES = ["ar", "argmax", "lilicorr", "viterbi"]


def test_engine_loop_streams_and_batches(make_engine, loop_reference):
    eng = make_engine()
    prompts = [[1, 12, 20, 33], [1, 40, 41], [1, 7], [1, 50, 60, 70, 80]]
    jobs = [Job(f"r{i}", p, gp(9, rule=RULES[i]), RecordingSink()) for i, p in enumerate(prompts)]
    stepped = []          # rids of the events of every engine step
    loop = run_jobs(eng, jobs, on_step=lambda stats, events: stepped.append({ev.rid for ev in events}))
    for j, p in zip(jobs, prompts):
        assert j.sink.tokens() == loop_reference(p, 9, j.params.decode_rule).tokens, j.params.decode_rule
        assert j.sink.finals == 1 and not j.sink.errors
        assert bool(j.sink.responses[-1]["is_final"][0]) and j.sink.last("finish_reason") == "length"
        assert j.sink.last("num_steps") == j.steps >= 1 and j.sink.last("num_accepted") == j.accepted
        assert j.sink.last("num_drafted") == j.drafted == (0 if j.params.decode_rule == "ar" else
                                                           (BLOCK_SIZE - 1) * j.steps)
        # context window = the tokens emitted before each chunk
        seen = []
        for r in j.sink.responses:
            assert list(r["context_ids"]) == seen[-protocol.CONTEXT_WINDOW:]
            seen += list(r["output_ids"])
    assert max(len(s) for s in stepped) >= 2          # requests were stepped together
    assert loop.stats.requests_ok == 4 and eng.num_active == 0
    ar = jobs[0]
    assert ar.accepted == ar.steps                    # tau == 1 for ar


def test_engine_loop_non_streaming_sends_once(make_engine, loop_reference):
    eng = make_engine()
    job = Job("r", [1, 30, 31], gp(7, stream=False), RecordingSink())
    run_jobs(eng, [job])
    ref = loop_reference([1, 30, 31], 7, "lilicorr")
    assert len(job.sink.responses) == 1
    assert job.sink.tokens() == ref.tokens
    assert (job.sink.last("num_accepted"), job.sink.last("num_steps")) == (ref.accepted_tokens, ref.num_steps)


def test_engine_loop_cancel_frees_sequence(make_engine, loop_reference):
    eng = make_engine(max_batch=4)
    gone = Job("gone", [1, 9, 12], gp(100, rule="ar"), RecordingSink(cancel_after=2))   # client went away
    ok = Job("ok", [1, 5], gp(5), RecordingSink())
    loop = EngineLoop(eng, cancel_check_period_s=0.0, idle_poll_s=0.01).start()
    # stop by the job's secret key (how the ensemble cancels): a last data response, finish_reason
    # "cancelled"; the key travels in every response (job_key), a request id or a wrong key does nothing
    def stop_by_key(sink):
        loop.cancel_job("stopped")                       # its request id is not its key
        loop.cancel_job("0" * 32)
        if len(sink.responses) >= 2:
            loop.cancel_job(sink.responses[-1]["job_key"][0].decode())
    stopped = Job("stopped", [1, 44], gp(100, rule="lilicorr"), RecordingSink(on_send=stop_by_key))
    try:
        for j in (gone, ok, stopped):
            loop.submit(j)
        for j in (gone, ok, stopped):
            assert j.sink.done.wait(60), j.request_id
    finally:
        loop.stop()
    assert gone.sink.finals == 1 and not gone.sink.errors and len(gone.sink.tokens()) < 100
    assert stopped.sink.finals == 1 and stopped.sink.last("finish_reason") == "cancelled"
    assert 2 <= len(stopped.sink.responses) and len(stopped.sink.tokens()) < 100
    assert {r["job_key"][0] for r in stopped.sink.responses} == {stopped.key.encode()}
    assert len(stopped.key) == 32 and stopped.key != gone.key
    assert loop.stats.requests_cancelled == 2 and loop.stats.requests_ok == 1
    assert ok.sink.tokens() == loop_reference([1, 5], 5, "lilicorr").tokens
    # both sequences are gone from the engine and their cache slots are free again
    assert eng.num_active == 0
    rids = [eng.add_request([1, 2], 1) for _ in range(eng.max_batch)]
    for rid in rids:
        eng.cancel(rid)


def test_engine_loop_errors_are_final_and_loop_survives(make_engine, loop_reference):
    from lilicorr.engine import SpecEngine
    eng = make_engine()
    bad = {"too long": Job("too long", [1] * 120, gp(10), RecordingSink()),       # the engine's ValueError
           "vocab": Job("vocab", [1, 96], gp(3), RecordingSink()),
           "rule": Job("rule", [1, 2], gp(3, rule="beam"), RecordingSink())}
    good = Job("good", [1, 2], gp(4), RecordingSink())
    run_jobs(eng, [*bad.values(), good])
    for name, job in bad.items():
        assert job.sink.finals == 1 and not job.sink.responses
        code, msg = job.sink.errors[0]
        assert code == "INVALID_ARG" and f"'{name}'" in msg, msg
    assert good.sink.tokens() == loop_reference([1, 2], 4, "lilicorr").tokens
    assert eng.num_active == 0

    # an exception while admitting (here: the engine has one slot and the loop admits two) fails
    # only that request
    eng = make_engine(max_batch=1)
    a, b = Job("a", [1, 3], gp(6), RecordingSink()), Job("b", [1, 4], gp(6), RecordingSink())
    run_jobs(eng, [a, b], max_active=2)
    assert a.sink.tokens() == loop_reference([1, 3], 6, "lilicorr").tokens
    assert b.sink.errors and b.sink.errors[0][0] == "INTERNAL" and "could not admit" in b.sink.errors[0][1]

    class FaultOnSecondStep(SpecEngine):
        """The real engine with one injected fault: its second step() raises."""
        steps = 0

        def step(self):
            FaultOnSecondStep.steps += 1
            if FaultOnSecondStep.steps == 2:
                raise RuntimeError("boom")
            return super().step()

    eng = make_engine(cls=FaultOnSecondStep)
    j1 = Job("j1", [1, 6], gp(50), RecordingSink())
    run_jobs(eng, [j1])
    assert j1.sink.errors and j1.sink.errors[0][0] == "INTERNAL" and "boom" in j1.sink.errors[0][1]
    assert j1.sink.finals == 1 and eng.num_active == 0          # the failed sequence was freed
    j2 = Job("j2", [1, 7], gp(3), RecordingSink())
    run_jobs(eng, [j2])
    assert j2.sink.tokens() == loop_reference([1, 7], 3, "lilicorr").tokens


def test_engine_loop_publishes_at_most_every_interval_and_always_the_end(make_engine, loop_reference):
    """With publish_every_s the on_step hook skips steps inside the interval (every step without
    it), but the step that finishes a request always publishes, so the hook's last view holds
    every token and the completed request."""
    calls = {}
    for every in (0.0, 3600.0):
        eng = make_engine()
        job = Job("long", [1, 12, 20], gp(24, rule="ar"), RecordingSink())
        seen = []
        loop = run_jobs(eng, [job], publish_every_s=every,
                        on_step=lambda stats, events: seen.append((stats.steps, stats.output_tokens,
                                                                   stats.requests_ok)))
        assert job.sink.tokens() == loop_reference([1, 12, 20], 24, "ar").tokens
        assert seen[-1] == (loop.stats.steps, 24, 1)                 # the end is always published
        calls[every] = len(seen)
        steps = loop.stats.steps
    assert calls[0.0] >= steps >= 24 and calls[3600.0] <= 3, calls   # prefill, the end, the idle loop


def test_engine_loop_admits_at_most_max_active(make_engine, loop_reference):
    eng = make_engine(max_batch=3)
    active = []
    jobs = [Job(f"r{i}", [1, 10 + i], gp(4, rule=RULES[i % 4]), RecordingSink()) for i in range(8)]
    run_jobs(eng, jobs, max_active=3, on_step=lambda stats, events: active.append((stats.active, eng.num_active)))
    assert 2 <= max(a for a, _ in active) <= 3 and max(n for _, n in active) <= 3
    for i, j in enumerate(jobs):
        assert j.sink.tokens() == loop_reference([1, 10 + i], 4, RULES[i % 4]).tokens


def test_engine_loop_stop_answers_everything(make_engine):
    eng = make_engine(max_batch=2)
    stopping = threading.Event()
    stopper = threading.Thread(target=lambda: (stopping.set(), loop.stop()))

    def on_step(stats, events):       # runs on the engine thread: stop the loop after its first step
        if events and not stopper.is_alive() and not stopping.is_set():
            stopper.start()
            stopping.wait(10)

    loop = EngineLoop(eng, idle_poll_s=0.01, max_active=2, on_step=on_step)
    sinks = [RecordingSink() for _ in range(3)]     # two active, one waiting
    loop.start()
    for i, s in enumerate(sinks):
        loop.submit(Job(f"r{i}", [1, 20 + i], gp(100, rule="ar"), s))
    assert stopping.wait(60), "the engine never stepped"
    stopper.join(60)
    assert not loop.alive
    assert all(s.finals == 1 for s in sinks)
    assert all(s.errors and s.errors[0][0] == "UNAVAILABLE" for s in sinks)
    assert all(len(s.tokens()) < 100 for s in sinks)
    late = RecordingSink()
    loop.submit(Job("late", [1], gp(1), late))
    assert late.errors and late.errors[0][0] == "UNAVAILABLE"


def test_engine_loop_drain(make_engine, loop_reference):
    """begin_drain: new jobs are refused at once; running (and already waiting) ones continue
    until the deadline, then each ends with a final data response, finish_reason "shutdown",
    and its sequence is freed."""
    eng = make_engine(max_batch=2)
    loop = EngineLoop(eng, idle_poll_s=0.01, max_active=2, cancel_check_period_s=0.0)
    short = Job("short", [1, 8], gp(3, rule="ar"), RecordingSink())
    drained = threading.Event()

    def on_step(stats, events):     # engine thread: drain once the short job has finished
        time.sleep(0.01)            # >= 1 s for 100 steps: the long jobs surely outlive the deadline
        if short.sink.done.is_set() and not drained.is_set():
            drained.set()
            loop.begin_drain(time.monotonic() + 0.3)
            loop.submit(Job("new", [1, 9], gp(2), refused))
    refused = RecordingSink()
    loop.on_step = on_step
    long_jobs = [Job(f"long{i}", [1, 30 + i], gp(100, rule="ar", stream=i == 0), RecordingSink())
                 for i in range(3)]                          # two active, one waiting
    loop.start()
    try:
        for j in [short, *long_jobs]:
            loop.submit(j)
        for j in [short, *long_jobs]:
            assert j.sink.done.wait(60), j.request_id
    finally:
        loop.stop()
    assert short.sink.tokens() == loop_reference([1, 8], 3, "ar").tokens
    assert refused.errors and refused.errors[0][0] == "UNAVAILABLE" and "shutting down" in refused.errors[0][1]
    for j in long_jobs:
        assert j.sink.finals == 1 and not j.sink.errors
        assert j.sink.last("finish_reason") == "shutdown" and bool(j.sink.responses[-1]["is_final"][0])
        assert 0 < len(j.sink.tokens()) < 100 if j.request_id != "long2" else len(j.sink.tokens()) < 100
    # the non-streaming job gets every token it generated in its one (final) response
    assert len(long_jobs[1].sink.responses) == 1 and len(long_jobs[1].sink.tokens()) > 0
    assert eng.num_active == 0 and loop.stats.requests_cancelled == 3

# =============================================================================== repository / launcher
def _copy_engine(src: Path, dst: Path, **manifest_changes) -> Path:
    """A verbatim copy of an engine directory, optionally with manifest fields changed."""
    import shutil
    shutil.copytree(src, dst)
    if manifest_changes:
        m = json.loads((dst / "manifest.json").read_text())
        m.update(manifest_changes)
        (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def test_engine_dir_is_relocatable_and_checked(tiny_engine_dir, serving_target, tmp_path):
    """A copied engine dir serves: its target is the manifest's target_dir relative to the
    manifest, or --target; every problem is one EngineDirError line naming what is wrong."""
    from lilicorr.engine_dir import EngineDirError
    # a relative target path that does not resolve from the copy's new place
    moved = _copy_engine(tiny_engine_dir, tmp_path / "elsewhere" / "engine", target_dir="../../targets/tiny")
    with pytest.raises(EngineDirError, match="--target") as ei:
        read_engine_manifest(moved)
    assert "\n" not in str(ei.value)
    spec = read_engine_manifest(moved, target=serving_target)
    assert spec.target_dir == serving_target.resolve() and spec.engine_dir == moved.resolve()
    assert (spec.draft_backend, spec.block_size) == ("onnxruntime", BLOCK_SIZE)
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "tiny").symlink_to(serving_target)       # resolved relative to the manifest
    assert read_engine_manifest(moved).target_dir == (tmp_path / "targets" / "tiny").resolve()
    with pytest.raises(EngineDirError, match="config.json"):
        read_engine_manifest(moved, target=tmp_path)                   # not a target folder
    # files are checked against the manifest's size and sha256; the message names the file
    bad = _copy_engine(tiny_engine_dir, tmp_path / "truncated")
    data = (bad / "draft.ort.onnx").read_bytes()
    (bad / "draft.ort.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineDirError, match=r"draft\.ort\.onnx has \d+ bytes"):
        read_engine_manifest(bad)
    (bad / "draft.ort.onnx").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(EngineDirError, match=r"draft\.ort\.onnx does not match its sha256"):
        read_engine_manifest(bad)
    # manifest fields are validated against the config and the draft graph
    for field, value in (("block_size", BLOCK_SIZE + 4), ("top_k", 3)):
        wrong = _copy_engine(tiny_engine_dir, tmp_path / f"wrong-{field}", **{field: value})
        with pytest.raises(EngineDirError, match=f"{field} is {value}"):
            read_engine_manifest(wrong)
    with pytest.raises(EngineDirError, match="manifest.json is missing"):
        read_engine_manifest(tmp_path)


def test_serve_cli_engine_errors_are_one_line(tiny_engine_dir, tmp_path):
    """deploy/serve.py: a missing manifest or an unresolvable target is one clear line, exit 2."""
    moved = _copy_engine(tiny_engine_dir, tmp_path / "moved", target_dir="../no-such-target")
    for engine, want in ((tmp_path, "manifest.json is missing"), (moved, "--target")):
        proc = subprocess.run([sys.executable, str(REPO / "deploy" / "serve.py"), "--engine", str(engine)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("serve: error:") and want in lines[0], proc.stderr


def test_serve_cli_checks_prompt_lookup_when_parsing(capsys):
    """--prompt-lookup is checked as it is parsed (a usage error naming the range); the text is
    kept as given, "" meaning the manifest's choice."""
    from lilicorr.serving.serve import build_parser
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--target", "x", "--prompt-lookup", "1"])
    assert exc.value.code == 2 and "outside [2, 64]" in capsys.readouterr().err
    assert [build_parser().parse_args(["--target", "x", *extra]).prompt_lookup
            for extra in ((), ("--prompt-lookup", "off"), ("--prompt-lookup", "4"))] == ["", "off", "4"]


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
    # no absolute path in any config (clients can read them): symlinks in the model directories
    for m in ("preprocessing", "lilicorr", "postprocessing", "ensemble"):
        text = (repo / m / "config.pbtxt").read_text()
        assert str(tmp_path) not in text and 'string_value: "/' not in text, m
    assert os.readlink(repo / "lilicorr" / "target") == str((tmp_path / "t").resolve())
    assert os.readlink(repo / "lilicorr" / "engine") == str((tmp_path / "e").resolve())
    assert 'key: "target_dir" value: { string_value: "target" }' in cfg
    assert 'key: "engine_dir" value: { string_value: "engine" }' in cfg
    assert "EXECUTION_ENV_PATH" not in cfg and not (repo / "lilicorr" / "pyenv").exists()
    assert not (repo / "ensemble" / "target").exists()
    assert model_parameters({"parameters": {"a": {"string_value": "x"}, "b": {"string_value": "${b}"}}}) == \
        {"a": "x", "b": ""}
    # prompt lookup: the option, else the manifest's serving choice, else off; bad values refused
    assert 'key: "prompt_lookup" value: { string_value: "0" }' in cfg
    spec.manifest = {"serving": {"prompt_lookup": "3"}}
    for opt, want in (("", "3"), ("5", "5"), ("off", "0")):
        repo = generate_repository(spec, tmp_path / f"repo-{want}", ServeOptions(prompt_lookup=opt))
        assert f'key: "prompt_lookup" value: {{ string_value: "{want}" }}' in (repo / "lilicorr" / "config.pbtxt").read_text()
    with pytest.raises(ValueError, match="prompt lookup"):
        generate_repository(spec, tmp_path / "repo-bad", ServeOptions(prompt_lookup="1"))


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


def test_hide_option_value_after_the_options_are_parsed():
    """The value disappears from /proc/PID/cmdline only once the child runs a second thread (it
    has read its options by then: the child still sees the value), and only after `prefix`; a
    process that exits first is reported, not waited on."""
    child = ("import sys, threading, time\n"
             "opt = sys.argv[1]\n"                    # parsed before the first thread starts
             "time.sleep(0.3)\n"
             "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
             "sys.stdin.readline()\n"
             "print(opt, flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-c", child, "--key=s3cret", "s3cret"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        assert hide_option_value(proc, "--key=", "s3cret", timeout=20)
        assert time.monotonic() - t0 >= 0.25                # waited for the second thread
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[-3:] == [b"--key=******", b"s3cret", b""]
        out, _ = proc.communicate("go\n", timeout=20)
        assert out.strip() == "--key=s3cret"
    finally:
        proc.kill()
        proc.wait()
    gone = subprocess.Popen([sys.executable, "-c", "pass", "--key=x"])
    gone.wait()
    assert not hide_option_value(gone, "--key=", "x", timeout=20)


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
# Everything below runs the real SpecEngine behind tritonserver (serving_fixtures.engine_server):
# greedy outputs are compared with the same engine run offline in this process (`reference`).
integration = pytest.mark.integration


@integration
def test_stub_runs_our_venv(engine_server):
    """The stub's embedded Python is this interpreter's venv, with the editable lilicorr install."""
    import lilicorr
    log = engine_server.log_text()
    line = next((ln for ln in log.splitlines() if "lilicorr stub python" in ln), None)
    assert line is not None, engine_server.log_tail()
    assert f"prefix={sys.prefix} " in line
    assert f"lilicorr={lilicorr.__file__}" in line
    assert "numpy=1." in line


@integration
def test_health_metadata_and_metrics(engine_server, tokenizer, reference):
    base = f"http://{engine_server.http_url}"
    assert http_get(base + "/v2/health/live")[0] == 200
    assert http_get(base + "/v2/health/ready")[0] == 200
    for m in ("preprocessing", "lilicorr", "postprocessing", "ensemble"):
        assert http_get(f"{base}/v2/models/{m}/ready")[0] == 200
    status, body = http_get(base + "/v2/models/ensemble/config")
    assert status == 200 and json.loads(body)["model_transaction_policy"]["decoupled"] is True
    client = client_for(engine_server)
    assert client.server_ready()
    before = metrics_text(engine_server)
    res = client.generate("hello world", max_tokens=5, decode_rule="lilicorr", ignore_eos=True)
    ref = reference(chat_ids(tokenizer, "hello world"), 5, "lilicorr", ignore_eos=True)
    assert res.token_ids == ref.tokens and res.num_tokens == 5
    text = metrics_text(engine_server)
    assert metric(text, "nv_inference_request_success", model="ensemble") >= 1
    for name, grew in [("lilicorr_output_tokens", 5), ("lilicorr_requests_completed", 1),
                       ("lilicorr_verify_steps", res.steps), ("lilicorr_accepted_tokens", res.accepted),
                       ("lilicorr_drafted_tokens", res.drafted)]:
        assert metric(text, name) >= metric(before, name) + grew, name
    assert metric(text, "lilicorr_requests", state="active") == 0
    assert metric(text, "lilicorr_requests", state="waiting") == 0


@integration
def test_ensemble_streams_text_deltas(engine_server, tokenizer, reference):
    client = client_for(engine_server)
    ids = chat_ids(tokenizer, "what is the answer")
    deltas = list(client.stream("what is the answer", max_tokens=12, decode_rule="argmax", ignore_eos=True))
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == reference(ids, 12, "argmax", ignore_eos=True).tokens
    assert len(deltas) > 1 and deltas[-1].final
    assert "".join(d.text for d in deltas) == tokenizer.decode(tokens)
    times = [d.t for d in deltas]
    assert times == sorted(times) and times[-1] - times[0] > 0     # really streamed, step by step
    # chat messages and stream=false
    msgs = [{"role": "system", "content": "please answer"}, {"role": "user", "content": "why"}]
    res = client.generate(messages=msgs, max_tokens=6, stream=False, ignore_eos=True)
    assert res.token_ids == reference(chat_ids(tokenizer, messages=msgs), 6, "lilicorr", ignore_eos=True).tokens
    assert len(set(res.token_times)) == 1 and res.finish_reason == "length"


@integration
def test_engine_stream_equals_offline(engine_server, tokenizer, reference):
    """Every rule streams the offline engine's greedy output (== ar: lossless), stop ids included."""
    client = client_for(engine_server)
    prompt = "hello world how are you"
    ids = chat_ids(tokenizer, prompt)
    ref_ar = reference(ids, 12, "ar").tokens
    for rule in RULES:
        deltas = list(client.stream(prompt, max_tokens=12, decode_rule=rule))
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == reference(ids, 12, rule).tokens == ref_ar, rule
        assert "".join(d.text for d in deltas) == tokenizer.decode(ref_ar)


@integration
def test_direct_token_id_model(engine_server, reference):
    client = client_for(engine_server)
    ids = [1, 7, 9]
    res = client.generate(input_ids=ids, max_tokens=9, decode_rule="lilicorr", ignore_eos=True)
    off = reference(ids, 9, "lilicorr", ignore_eos=True)
    assert res.token_ids == off.tokens and res.finish_reason == "length"
    assert (res.accepted, res.steps) == (off.accepted_tokens, off.num_steps)
    assert res.steps >= 1 and res.drafted == off.drafted_tokens and res.accepted >= res.steps
    ar = client.generate(input_ids=ids, max_tokens=9, decode_rule="ar", ignore_eos=True)
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
    "ids fill the context": dict(input_ids=[1] * SERVED_SEQ_LEN, max_tokens=1, match="context"),
    "id above vocab": dict(input_ids=[1, 2, 96], match="outside the vocabulary"),
    "negative id": dict(input_ids=[1, -5], match="outside the vocabulary"),
    "max_tokens 0": dict(prompt="hi", max_tokens=0, match="positive"),
    "max_tokens negative": dict(prompt="hi", max_tokens=-4, match="positive"),
    "max_tokens beyond limit": dict(prompt="hi", max_tokens=100_000, match="limit"),
    "max_tokens 0 ids": dict(input_ids=[1, 2], max_tokens=0, match="positive"),
    "prompt + max_tokens": dict(input_ids=[1] * 100, max_tokens=100, match="exceeds the context"),
    "negative temperature": dict(prompt="hi", temperature=-1.0, match=">= 0"),
    "nan temperature": dict(prompt="hi", temperature=float("nan"), match="finite"),
    "nan temperature ids": dict(input_ids=[1, 2], temperature=float("nan"), match="finite"),
    "unknown rule": dict(prompt="hi", decode_rule="beam", match="unknown decode_rule"),
    "unknown rule ids": dict(input_ids=[1, 2], decode_rule="beam", match="unknown decode_rule"),
    "bad messages": dict(messages=[{"role": "user"}], match="messages_json"),
}


@pytest.fixture(scope="module")
def good_request(engine_server, tokenizer, reference):
    """good_request(client): a request that must succeed, checked against the offline engine."""
    want = reference(chat_ids(tokenizer, "hello"), 3, "lilicorr", ignore_eos=True).tokens

    def check(client):
        res = client.generate("hello", max_tokens=3, ignore_eos=True)
        assert res.token_ids == want and res.finish_reason == "length"
    return check


@integration
@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_then_good_one(engine_server, good_request, case):
    kw = dict(BAD_REQUESTS[case])
    match = kw.pop("match")
    client = client_for(engine_server)
    rid = f"bad-{case.replace(' ', '-')}"
    with pytest.raises(GenerationError, match=match) as ei:
        client.generate(request_id=rid, **kw)
    assert rid in str(ei.value)                  # the message names the request
    good_request(client)


@integration
@pytest.mark.parametrize("case", ["fp32 ids", "2-D ids", "wrong knob dtype", "knob shape"])
def test_wrong_dtype_or_shape_then_good_one(engine_server, good_request, case):
    import tritonclient.grpc as g
    client = client_for(engine_server)
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
    good_request(client)


def _wait_freed(srv, cancelled_before: float, timeout: float = 20.0) -> str:
    """Wait until the server counted one more cancelled request and has no active/waiting one."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = metrics_text(srv)
        if (metric(text, "lilicorr_requests_cancelled") > cancelled_before
                and metric(text, "lilicorr_requests", state="active") == 0
                and metric(text, "lilicorr_requests", state="waiting") == 0):
            return text
        time.sleep(0.1)
    pytest.fail("the cancelled request was not freed:\n" + srv.log_tail())


# the longest generation a short request can ask for: a cancelled stream is still running then
LONG = SERVED_SEQ_LEN - 16


@integration
@pytest.mark.parametrize("model", ["ensemble", "lilicorr"])
def test_client_disconnect_frees_sequence(engine_server, good_request, model):
    """A client that cancels its stream (closes it) mid-generation: the engine drops the sequence
    (lilicorr_requests_cancelled + 1, no active request) and the server keeps serving."""
    client = client_for(engine_server)
    good_request(client)        # warm: the first requests of a fresh server are slow to stream
    before = _idle_metrics(engine_server)   # once the warm request's completion is published
    what = dict(prompt="hello") if model == "ensemble" else dict(input_ids=[1, 9, 12])
    gs = client.stream(**what, max_tokens=LONG, decode_rule="lilicorr", ignore_eos=True)
    got = []
    for d in gs:
        got += d.token_ids
        if len(got) >= 3:
            break
    gs.cancel()
    text = _wait_freed(engine_server, metric(before, "lilicorr_requests_cancelled"))
    # it did not run to the end: no request completed and fewer tokens than asked were generated
    assert metric(text, "lilicorr_requests_completed") == metric(before, "lilicorr_requests_completed")
    assert metric(text, "lilicorr_output_tokens") - metric(before, "lilicorr_output_tokens") < LONG
    good_request(client)


def _idle_metrics(server, timeout: float = 10.0) -> str:
    """/metrics once the engine holds no active request (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics_text(server)
        if metric(text, "lilicorr_requests", state="active") == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


@integration
def test_32_concurrent_streams_lose_nothing(engine_server, tokenizer, reference):
    """32 concurrent greedy streams (max_batch 32; text and token-id requests, all four rules,
    with and without stop ids) each get exactly the offline engine's output for its rule."""
    client = client_for(engine_server)
    words = "the a is of to and in on for with it this".split()
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(32):
        rule, n, ignore_eos = RULES[i % 4], 8 + i % 9, i % 3 != 0
        if i % 2 == 0:
            prompt = " ".join(words[i % 12:] + words[:i % 5])
            reqs.append((dict(prompt=prompt), chat_ids(tokenizer, prompt), rule, n, ignore_eos))
        else:
            ids = [1] + rng.integers(6, 96, size=int(rng.integers(2, 12))).tolist()
            reqs.append((dict(input_ids=ids), ids, rule, n, ignore_eos))
    expected = [reference(ids, n, rule, ignore_eos) for _, ids, rule, n, ignore_eos in reqs]
    before = _idle_metrics(engine_server)       # earlier tests' cancelled streams have drained
    peak = []
    stop_polling = threading.Event()

    def poll():                     # how many sequences the engine held at once
        while not stop_polling.is_set():
            peak.append(metric(metrics_text(engine_server), "lilicorr_requests", state="active"))
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        res = run_concurrent(lambda r: client.generate(**r[0], max_tokens=r[3], decode_rule=r[2],
                                                       ignore_eos=r[4]), reqs, 32)
    finally:
        stop_polling.set()
        poller.join(10)
    errors = [r for r in res if not isinstance(r, GenerationResult)]
    assert not errors, errors
    exact = 0
    for (kw, ids, rule, n, ignore_eos), r, ref in zip(reqs, res, expected):
        assert r.token_ids == ref.tokens, (kw, rule, n, ignore_eos)
        assert r.finish_reason == ref.finish_reason
        if "prompt" in kw:
            assert r.text == tokenizer.decode(r.token_ids)
        assert r.token_times == sorted(r.token_times) and len(r.token_times) == len(r.token_ids)
        # whole-block serving with the manifest's prompt lookup: each row's steps and drafts are its
        # own, the row alone's, except that the float sums behind a draft (the target's captured
        # features, the drafter graph) depend on which rows share a call: a near-tie among the
        # untrained drafter's candidates can flip one draft token, and the row takes one step more or
        # fewer (offline at batch 32 against alone: a few percent of drafting rows, never more than
        # one step, every token equal). So: every row within one step, nearly all exact.
        counts, want = (r.steps, r.accepted, r.drafted), (ref.num_steps, ref.accepted_tokens, ref.drafted_tokens)
        exact += counts == want
        assert abs(r.steps - ref.num_steps) <= 1 and abs(r.accepted - ref.accepted_tokens) <= 1, (rule, counts, want)
        assert r.drafted <= (BLOCK_SIZE - 1) * r.steps and r.accepted - r.steps <= r.drafted
    assert exact >= 26, f"{exact} of 32 rows drafted and accepted exactly as alone"
    # some rows verified prompt-lookup copies (shorter than a block) through the server
    assert any(0 < r.drafted < (BLOCK_SIZE - 1) * r.steps for r in res), [(r.drafted, r.steps) for r in res]
    text = _idle_metrics(engine_server)         # the gauges are published after the engine step
    assert metric(text, "lilicorr_requests_completed") - metric(before, "lilicorr_requests_completed") == 32
    assert (metric(text, "lilicorr_output_tokens") - metric(before, "lilicorr_output_tokens")
            == sum(len(r.token_ids) for r in res))
    assert metric(text, "lilicorr_requests", state="active") == 0
    assert max(peak) >= 8, peak            # the engine really batched concurrent streams


@integration
def test_engine_sampling_is_seeded(engine_server):
    client = client_for(engine_server)
    a = client.generate(input_ids=[1, 9, 12], max_tokens=8, temperature=0.8, seed=5, decode_rule="lilicorr")
    b = client.generate(input_ids=[1, 9, 12], max_tokens=8, temperature=0.8, seed=5, decode_rule="lilicorr")
    assert a.token_ids == b.token_ids
    full = client.generate(input_ids=[1, 9, 12], max_tokens=30, decode_rule="argmax", ignore_eos=True)
    assert full.num_tokens == 30 and full.finish_reason == "length"
    text = metrics_text(engine_server)
    assert metric(text, "lilicorr_stage_blocks") > 0                  # profile=true in the fixture
    assert metric(text, "lilicorr_stage_seconds", stage="target_verify") > 0

# =============================================================================== integration: shutdown
def _our_tmp_dirs(pid: int | None = None) -> set[str]:
    """Temp folders of launchers (and serve.py repositories) started by process `pid` (default:
    this one); other processes' folders (e.g. a concurrent test run) are not ours to judge."""
    import glob
    import tempfile
    base, pid = tempfile.gettempdir(), pid or os.getpid()
    return set(glob.glob(os.path.join(base, f"lilicorr-triton-{pid}-*"))
               + glob.glob(os.path.join(base, f"lilicorr-repo-{pid}-*")))


@integration
def test_clean_shutdown_leaves_nothing(serving_target, tiny_engine_dir, tokenizer, reference, tmp_path):
    dirs_before = _our_tmp_dirs()
    srv = start_server(engine_repository(serving_target, tiny_engine_dir, tmp_path / "repo"))
    try:
        _clean_shutdown(srv, tokenizer, reference, dirs_before)
    finally:
        if srv.proc is not None:        # failed half-way: stop it, and show its log
            srv.stop(drain_timeout=0)
            print(srv.log_tail(200))


def _clean_shutdown(srv, tokenizer, reference, dirs_before):
    pgid = srv.proc.pid
    workdir = srv.workdir
    prefix = srv.shm_prefix
    assert leftover_shm(prefix), "the python backend should have shm regions while running"
    client = client_for(srv)
    # failed and cancelled ensemble requests must not leave the ensemble "in flight"
    for bad in (dict(prompt=""), dict(prompt="hi", max_tokens=0)):
        with pytest.raises(GenerationError):
            client.generate(**bad)
    gs = client.stream("hello", max_tokens=LONG, decode_rule="ar", ignore_eos=True)
    next(iter(gs))
    gs.cancel()
    # requests Triton itself rejects (unknown input, wrong dtype or shape) release everything
    import tritonclient.grpc as g

    def tensor(name, arr, dt):
        t = g.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        return t
    text = tensor("text_input", np.array([b"hi"], dtype=np.object_), "BYTES")
    for model, inputs in [("lilicorr", [tensor("input_ids", np.array([1, 2], np.int64), "INT64")]),
                          ("lilicorr", [tensor("input_ids", np.array([[1, 2]], np.int32), "INT32")]),
                          ("lilicorr", [tensor("input_ids", np.array([1, 2], np.int32), "INT32"),
                                        tensor("bogus", np.array([1], np.int32), "INT32")]),
                          ("ensemble", [text, tensor("bogus", np.array([1], np.int32), "INT32")]),
                          ("ensemble", [text, tensor("max_tokens", np.array([3], np.int64), "INT64")])]:
        c, q = _raw_stream(srv, model, inputs)
        assert q.get(timeout=60)[1] is not None
        c.stop_stream()
        c.close()
    # requests still streaming at shutdown complete (stop() drains the ensemble first)
    prompts = ["hello", "how are you", "write code", "what is the answer"]
    streams = [client.stream(p, max_tokens=LONG, decode_rule=RULES[i], ignore_eos=True)
               for i, p in enumerate(prompts)]
    for gs in streams:
        next(iter(gs))                  # really in flight
    out: dict[int, object] = {}

    ended: list[float] = []

    def read(i):
        try:
            out[i] = streams[i].result()
        except Exception as e:  # noqa: BLE001
            out[i] = e
        ended.append(time.time())
    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
    for r in readers:
        r.start()
    t0 = time.time()
    in_flight = sum(1 for i in range(len(streams)) if i not in out)
    rc = srv.stop()
    t_stopped = time.time()
    for r in readers:
        r.join(60)
    assert in_flight >= 1, "every stream ended before stop(): the drain was not exercised"
    for i, p in enumerate(prompts):
        res = out[i]
        assert isinstance(res, GenerationResult), res
        assert res.finish_reason == "length" and res.num_tokens == LONG
        assert res.token_ids == reference(chat_ids(tokenizer, p), LONG, RULES[i], ignore_eos=True).tokens
    # the streams ran to their end within the drain deadline (default 30 s); then the models
    # unloaded and the server exited promptly
    assert max(ended) - t0 < srv.drain_timeout and t_stopped - max(ended) < 30
    assert rc == 0, srv.log_tail()
    assert leftover_shm(prefix) == []
    assert not workdir.exists()
    assert live_group_members(pgid) == []
    assert _our_tmp_dirs() <= dirs_before


@integration
def test_shutdown_with_a_client_holding_its_stream_open(serving_target, tiny_engine_dir, tmp_path):
    """tritonserver 2.51 cannot exit while a client keeps a gRPC stream open; stop() still ends
    it (SIGKILL after the exit timeout) and cleans up shared memory, processes and temp dirs."""
    dirs_before = _our_tmp_dirs()
    srv = start_server(engine_repository(serving_target, tiny_engine_dir, tmp_path / "repo"), exit_timeout=2)
    pgid, workdir, prefix = srv.proc.pid, srv.workdir, srv.shm_prefix
    import tritonclient.grpc as g
    raw = g.InferenceServerClient(srv.grpc_url)
    answered = threading.Event()
    raw.start_stream(callback=lambda result, error: answered.set())
    inputs = LiLiCorrClient(srv.grpc_url).build_inputs("lilicorr", input_ids=[1, 2], max_tokens=2)
    raw.async_stream_infer("lilicorr", inputs)
    assert answered.wait(60)            # answered, but the stream stays open
    t0 = time.time()
    srv.stop()
    assert time.time() - t0 < 2 * 2 + 5 + 10
    assert leftover_shm(prefix) == [] and not workdir.exists()
    assert live_group_members(pgid) == []
    assert _our_tmp_dirs() <= dirs_before
    raw.stop_stream(cancel_requests=True)
    raw.close()


def _serve_cmd(engine: Path, ports: list[int], *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "deploy" / "serve.py"), "--engine", str(engine), "--num-threads", "1",
            "--device", "cpu", "--max-seq-len", str(MAX_SEQ_LEN), "--grpc-port", str(ports[0]),
            "--http-port", str(ports[1]), "--metrics-port", str(ports[2]), "--startup-timeout", "240", *extra]


def _wait_serve_ready(proc, timeout: float = 240) -> list[str]:
    lines = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if line.startswith("[serve] ready"):
            return lines
    pytest.fail("serve.py did not become ready:\n" + "".join(lines[-40:]))


@integration
def test_serve_script_sigterm_drains(serving_target, tiny_engine_dir, tokenizer, reference, tmp_path):
    """deploy/serve.py end to end on a *copied* engine dir (its relative target path broken,
    --target given): ready, a request, then SIGTERM with four streams in the engine (--max-batch 1:
    one generating, the others waiting) and --drain-timeout 0: every stream gets a final response,
    those cut short with finish_reason "shutdown"; a new request is refused; tritonserver exits
    cleanly, serve.py exits 0 and leaves nothing behind."""
    if not have_tritonserver():
        pytest.skip("no tritonserver")
    moved = _copy_engine(tiny_engine_dir, tmp_path / "copy" / "engine", target_dir="../../nowhere")
    ports = [free_port() for _ in range(3)]
    proc = subprocess.Popen(_serve_cmd(moved, ports, "--target", str(serving_target), "--drain-timeout", "0",
                                       "--admin-key", "k", "--max-batch", "1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        _wait_serve_ready(proc)
        client = LiLiCorrClient(f"127.0.0.1:{ports[0]}", timeout=60)
        res = client.generate("hello", max_tokens=4, ignore_eos=True)
        assert res.token_ids == reference(chat_ids(tokenizer, "hello"), 4, "lilicorr", ignore_eos=True).tokens
        metrics_url = f"http://127.0.0.1:{ports[2]}/metrics"
        done_before = metric(http_get(metrics_url)[1], "lilicorr_requests_completed")
        # token ids (no tokenizer step: they reach the engine at once); the first stream drafts, so
        # it holds the engine's one slot longest
        streams = [client.stream(input_ids=ids, max_tokens=LONG, decode_rule=rule, ignore_eos=True)
                   for ids, rule in (([1, 9, 12], "lilicorr"), ([1, 7], "ar"), ([1, 5, 3], "ar"), ([1, 2], "ar"))]
        next(iter(streams[0]))                                # generating
        deadline = time.time() + 60
        while True:     # all four in the engine (a finished one counted too) and one still waiting
            text = http_get(metrics_url)[1]
            waiting = metric(text, "lilicorr_requests", state="waiting")
            seen = metric(text, "lilicorr_requests", state="active") + waiting \
                + metric(text, "lilicorr_requests_completed") - done_before
            if seen >= len(streams) and waiting >= 1:
                break
            assert time.time() < deadline, f"the streams never waited in the engine ({seen} seen, {waiting} waiting)"
            time.sleep(0.01)
        out: dict[int, object] = {}

        def read(i):
            try:
                out[i] = streams[i].result()
            except Exception as e:  # noqa: BLE001
                out[i] = e
        readers = [threading.Thread(target=read, args=(i,)) for i in range(len(streams))]
        for r in readers:
            r.start()
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(Exception):          # refused: UNAVAILABLE from the engine, or the model is gone
            LiLiCorrClient(f"127.0.0.1:{ports[0]}", timeout=30).generate(input_ids=[1, 5], max_tokens=2)
        for r in readers:
            r.join(60)
        output, _ = proc.communicate(timeout=60)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for i in range(len(streams)):
        res = out[i]
        assert isinstance(res, GenerationResult), res
        assert (res.finish_reason, res.num_tokens == LONG) in (("shutdown", False), ("length", True)), \
            (i, res.finish_reason, res.num_tokens)
    # one was waiting when the signal went: it ends cut short, with a final response
    assert sum(out[i].finish_reason == "shutdown" for i in range(len(streams))) >= 1
    assert proc.returncode == 0, output[-3000:]
    assert "[serve] stopped (tritonserver exit code 0)" in output
    assert took < 30
    assert leftover_shm(f"{SHM_BASE_PREFIX}lilicorr_{proc.pid}_") == []
    assert _our_tmp_dirs(proc.pid) == set()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@integration
def test_sigkill_of_the_launcher_leaves_no_orphan(tiny_engine_dir):
    """SIGKILL of deploy/serve.py takes tritonserver and its stubs with it (parent-death signal +
    reaper): the ports are free again and no shared memory or temp folder stays behind."""
    from lilicorr.serving.launcher import port_in_use
    if not have_tritonserver():
        pytest.skip("no tritonserver")
    ports = [free_port() for _ in range(3)]
    proc = subprocess.Popen(_serve_cmd(tiny_engine_dir, ports), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO)
    try:
        _wait_serve_ready(proc)
        triton = [c for c in _children(proc.pid)
                  if "tritonserver" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]
        assert len(triton) == 1
        pgid = triton[0]
        assert len(live_group_members(pgid)) >= 2                 # the server and its stubs
        shm = f"{SHM_BASE_PREFIX}lilicorr_{proc.pid}_"
        assert leftover_shm(shm)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline:
        left = dict(procs=live_group_members(pgid), ports=[p for p in ports if port_in_use("127.0.0.1", p)],
                    shm=leftover_shm(shm), tmp=sorted(_our_tmp_dirs(proc.pid)))
        if not any(left.values()):
            break
        time.sleep(0.2)
    assert not any(left.values()), left


@integration
def test_serve_checks_ports_and_warns_beyond_loopback(tiny_engine_dir):
    """A port in use stops the launch before tritonserver starts, in one clear line; binding
    beyond loopback without an admin key prints a warning first (not with a key)."""
    import socket
    if not have_tritonserver():
        pytest.skip("no tritonserver")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "LILICORR_ADMIN_KEY"}
        runs = {extra: subprocess.run(_serve_cmd(tiny_engine_dir, [busy, free_port(), free_port()], *extra),
                                      capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
                for extra in [(), ("--host", "0.0.0.0"), ("--host", "0.0.0.0", "--admin-key", "k")]}
    for extra, res in runs.items():
        host = "0.0.0.0" if extra else "127.0.0.1"
        assert res.returncode == 1, res.stderr[-2000:]
        assert f"serve: error: grpc port {busy} on {host} is already in use" in res.stderr, res.stderr[-2000:]
        assert ("beyond loopback, without an admin key" in res.stderr) == (extra == ("--host", "0.0.0.0"))


def test_serve_has_no_engine_factory_hook():
    """The server always runs the real SpecEngine: no option swaps in another engine."""
    from lilicorr.serving.serve import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--target", "x", "--engine-factory", "m:f"])
    assert not hasattr(ServeOptions(), "engine_factory")


# =============================================================================== integration: CLIs
@integration
def test_client_cli_streams(engine_server, tokenizer, reference):
    ref = reference(chat_ids(tokenizer, "hello world"), 6, "argmax")
    proc = subprocess.run([sys.executable, str(REPO / "deploy" / "client.py"), "--url", engine_server.grpc_url,
                           "--max-tokens", "6", "--rule", "argmax", "--stats", "hello world"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"{len(ref.tokens)} tokens, finish={ref.finish_reason}" in proc.stderr and "tau=" in proc.stderr
    assert proc.stdout.rstrip("\n") == tokenizer.decode(ref.tokens)
    bad = subprocess.run([sys.executable, str(REPO / "deploy" / "client.py"), "--url", engine_server.grpc_url,
                          "--rule", "beam", "hello"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown decode_rule" in bad.stderr


@integration
def test_bench_cli(engine_server, tokenizer, reference, tmp_path):
    texts = ["hello world", "how are you", "what is the answer", "write code"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in texts) + "\n")
    out = tmp_path / "bench" / "b.json"
    proc = subprocess.run([sys.executable, str(REPO / "deploy" / "bench.py"), "--url", engine_server.grpc_url,
                           "--metrics-url", engine_server.metrics_url, "--prompts", str(prompts), "--limit", "4",
                           "--concurrency", "1,4", "--rules", "lilicorr,ar,argmax", "--max-tokens", "8",
                           "--json", str(out), "--profile", "--repeats", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    cells = report["cells"]
    assert [(c["concurrency"], c["rule"]) for c in cells] == [(1, "ar"), (1, "lilicorr"), (1, "argmax"),
                                                              (4, "ar"), (4, "lilicorr"), (4, "argmax")]
    for c in cells:
        refs = [reference(chat_ids(tokenizer, p), 8, c["rule"]) for p in texts]
        # two passes per cell (the rules in turn, then in reverse), summed
        assert c["requests"] == 2 * len(texts) and c["errors"] == 0
        assert c["output_tokens"] == 2 * sum(len(r.tokens) for r in refs)
        assert c["stages"]["blocks"] > 0
        if c["concurrency"] == 1:    # one request at a time: a block per verify step, both passes
            # (the server publishes a step's blocks before its ended requests, and the closing
            # scrape waits for those: a pass's last request's blocks are in its table)
            assert c["verify_steps"] == 2 * sum(r.num_steps for r in refs)
            assert c["stages"]["blocks"] >= c["verify_steps"]
        assert c["tokens_per_s"] > 0 and c["speedup"] > 0
        assert c["ttft_p50_ms"] is not None and c["tpot_p99_ms"] is not None
        if c["rule"] == "ar":
            assert c["tau"] == 1.0 and c["speedup"] == 1.0
        else:               # greedy speculative decoding is lossless: the same text as ar
            assert c["tau"] >= 1.0 and c["matches_ar"] == 1.0
        if c["concurrency"] == 1:    # one request at a time: the offline engine's acceptance
            steps = sum(r.num_steps for r in refs)
            assert c["tau"] == pytest.approx(sum(r.accepted_tokens for r in refs) / steps if steps else None)
    assert "| lilicorr | 4 |" in proc.stdout
    assert out.with_suffix(".png").stat().st_size > 1000


# =============================================================================== hardening
def test_messages_json_depth_and_prompt_checks():
    assert protocol.json_depth('[{"role": "user", "content": "[[[{\\"]"}]') == 2
    assert protocol.parse_messages_json('[{"role": "user", "content": "hi"}]') == [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError, match="nested 20000 levels deep"):
        protocol.parse_messages_json("[" * 20000 + "]" * 20000)
    with pytest.raises(RequestError, match="not valid JSON"):
        protocol.parse_messages_json('[{"role": "user"')


def _raw_stream(srv, model: str, inputs: list, request_id: str = "", outputs=None, **params):
    """A tritonclient gRPC stream as a plain client opens it (no request id by default);
    returns (client, queue of (result, error))."""
    import queue

    import tritonclient.grpc as g
    c = g.InferenceServerClient(srv.grpc_url)
    q: "queue.Queue" = queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    c.async_stream_infer(model, inputs, request_id=request_id, outputs=outputs, parameters=params or None,
                         enable_empty_final_response=True)
    return c, q


def _is_final(result) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def _read_until_final(q, timeout: float = 120.0) -> list:
    out = []
    while True:
        result, error = q.get(timeout=timeout)
        assert error is None, error
        out.append(result)
        if _is_final(result):
            return out


def _ids_of(results) -> list[int]:
    return [int(t) for r in results if r.as_numpy("output_ids") is not None
            for t in r.as_numpy("output_ids").reshape(-1)]


def _reason(results) -> str:
    for r in reversed(results):
        fr = r.as_numpy("finish_reason")
        if fr is not None:
            return fr.reshape(-1)[0].decode()
    return ""


def _http(method: str, url: str, body=None, headers=None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                         **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@integration
def test_control_apis_need_the_admin_key(engine_server, good_request, tmp_path, serving_target, tiny_engine_dir):
    """Model load/unload (incl. uploading a model.py), logging, shared memory and trace settings are
    refused without the admin header on HTTP and gRPC; inference and health stay open; the model
    configs a client can read carry no absolute path."""
    import base64

    import tritonclient.grpc as g
    from tritonclient.utils import InferenceServerException

    from lilicorr.serving.launcher import GRPC_ADMIN_HEADER
    from serving_fixtures import ADMIN_KEY
    base = f"http://{engine_server.http_url}"
    marker = tmp_path / "uploaded-code-ran"
    model_py = (f"open({str(marker)!r}, 'w').write('x')\n"
                "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n")
    config = json.dumps({"name": "evil", "backend": "python", "max_batch_size": 0,
                         "input": [{"name": "x", "data_type": "TYPE_INT32", "dims": [1]}],
                         "output": [{"name": "y", "data_type": "TYPE_INT32", "dims": [1]}]})
    upload = {"parameters": {"config": config, "file:1/model.py": base64.b64encode(model_py.encode()).decode()}}
    region = {"key": "/" + SHM_BASE_PREFIX + "x", "offset": 0, "byte_size": 64}
    for method, path, body in [
            ("POST", "/v2/repository/index", {}), ("POST", "/v2/repository/models/evil/load", upload),
            ("POST", "/v2/repository/models/lilicorr/unload", {}),
            ("POST", "/v2/repository/models/ensemble/unload", {}),
            ("POST", "/v2/repository/models/lilicorr/load", {"parameters": {"config": '{"max_batch_size": 4096}'}}),
            ("GET", "/v2/logging", None), ("POST", "/v2/logging", {"log_error": False}),
            ("GET", "/v2/systemsharedmemory/status", None),
            ("POST", "/v2/systemsharedmemory/region/r/register", region),
            ("GET", "/v2/trace/setting", None), ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]})]:
        status, text = _http(method, base + path, body)
        assert status != 200 and "restricted" in text and "admin-key" in text, (method, path, status, text)
        status, text = _http(method, base + path, body, {"admin-key": "wrong"})
        assert status != 200 and "restricted" in text, (method, path, status, text)
    c = g.InferenceServerClient(engine_server.grpc_url)
    try:
        for name, call in [
                ("unload", lambda **h: c.unload_model("lilicorr", **h)),
                ("load", lambda **h: c.load_model("evil", config=config, files={"1/model.py": model_py.encode()}, **h)),
                ("index", lambda **h: c.get_model_repository_index(**h)),
                ("log get", lambda **h: c.get_log_settings(**h)),
                ("log set", lambda **h: c.update_log_settings({"log_error": False}, **h)),
                ("shm status", lambda **h: c.get_system_shared_memory_status(**h)),
                ("shm register", lambda **h: c.register_system_shared_memory("r", region["key"], 64, **h)),
                ("trace", lambda **h: c.get_trace_settings(**h))]:
            with pytest.raises(InferenceServerException, match="restricted"):
                call()
            with pytest.raises(InferenceServerException, match="restricted"):
                call(headers={GRPC_ADMIN_HEADER: "wrong"})
        # nothing was loaded, unloaded or reconfigured; no uploaded code ran
        assert not marker.exists()
        for m in ("preprocessing", "lilicorr", "postprocessing", "ensemble"):
            assert http_get(f"{base}/v2/models/{m}/ready")[0] == 200
        assert http_get(f"{base}/v2/models/evil/ready")[0] != 200
        good_request(client_for(engine_server))
        # the operator's key opens them (read-only calls here)
        index = c.get_model_repository_index(headers={GRPC_ADMIN_HEADER: ADMIN_KEY}, as_json=True)
        assert {m["name"] for m in index["models"]} >= {"lilicorr", "ensemble"}
        assert c.get_log_settings(headers={GRPC_ADMIN_HEADER: ADMIN_KEY}, as_json=True)["settings"]
        status, text = _http("POST", base + "/v2/repository/index", {}, {"admin-key": ADMIN_KEY})
        assert status == 200 and "lilicorr" in text
        # ... which local users cannot read off the server's command line
        cmdline = Path(f"/proc/{engine_server.proc.pid}/cmdline").read_bytes().decode()
        assert engine_server.admin_key_hidden and ADMIN_KEY not in cmdline
        assert cmdline.count("admin-key=" + "*" * len(ADMIN_KEY)) == 2
    finally:
        c.close()
    # model configs are readable by any client: no absolute paths of this machine
    secrets = {str(p) for p in (tiny_engine_dir, serving_target, engine_server.model_repository, Path(sys.prefix))}
    secrets |= {os.path.realpath(p) for p in secrets}
    for m in ("preprocessing", "lilicorr", "postprocessing", "ensemble"):
        status, body = http_get(f"{base}/v2/models/{m}/config")
        assert status == 200
        leaked = [p for p in secrets if p in body]
        assert not leaked and '"string_value":"/' not in body.replace(" ", ""), (m, leaked)


def _engine_inputs(model: str, **kw) -> list:
    return LiLiCorrClient("unused").build_inputs(model, **kw)


@integration
@pytest.mark.parametrize("model", ["ensemble", "lilicorr"])
def test_cancel_without_request_id_frees_row(engine_server, good_request, model):
    """tritonclient's default stream (no request id) cancelled mid-generation: the engine frees
    the row within a few engine steps (ensemble: the next response reaches postprocessing, which
    stops the job with its secret key; lilicorr: the sender reports is_cancelled())."""
    client = client_for(engine_server)
    good_request(client)
    before = _idle_metrics(engine_server)
    what = dict(prompt="hello") if model == "ensemble" else dict(input_ids=[1, 9, 12])
    c, q = _raw_stream(engine_server, model, _engine_inputs(model, **what, max_tokens=LONG, decode_rule="lilicorr"),
                       ignore_eos=True)
    got = 0
    while got < 3:
        result, error = q.get(timeout=120)
        assert error is None, error
        got += len(result.as_numpy("output_ids").reshape(-1))
    steps_at_cancel = metric(metrics_text(engine_server), "lilicorr_engine_steps")
    c.stop_stream(cancel_requests=True)
    c.close()
    text = _wait_freed(engine_server, metric(before, "lilicorr_requests_cancelled"))
    assert metric(text, "lilicorr_requests_completed") == metric(before, "lilicorr_requests_completed")
    assert metric(text, "lilicorr_output_tokens") - metric(before, "lilicorr_output_tokens") < LONG
    # freed within a few engine steps: the lilicorr model sees is_cancelled() at its next check once
    # the cancel has crossed from the gRPC frontend to the backend stub (milliseconds, while a step of
    # the tiny engine takes about one: up to 5 seen on a quiet 2-core machine); the ensemble only when
    # the next response reaches postprocessing (another model's queue, a few more steps under load)
    assert metric(text, "lilicorr_engine_steps") - steps_at_cancel <= (16 if model == "ensemble" else 8)
    good_request(client)


@integration
@pytest.mark.parametrize("model", ["ensemble", "lilicorr"])
def test_http_stream_abort_frees_row(engine_server, good_request, model):
    """A client that closes its HTTP generate_stream connection mid-generation: the row is freed."""
    import http.client
    client = client_for(engine_server)
    good_request(client)
    before = _idle_metrics(engine_server)
    body = {"max_tokens": LONG, "decode_rule": "lilicorr", "parameters": {"ignore_eos": True}}
    body.update({"text_input": "hello"} if model == "ensemble" else {"input_ids": [1, 9, 12]})
    host, port = engine_server.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", f"/v2/models/{model}/generate_stream", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:
        line = resp.fp.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data:"):
            assert b"error" not in line, line
            events += 1
    conn.sock.shutdown(2)
    conn.close()
    text = _wait_freed(engine_server, metric(before, "lilicorr_requests_cancelled"))
    assert metric(text, "lilicorr_requests_completed") == metric(before, "lilicorr_requests_completed")
    assert metric(text, "lilicorr_output_tokens") - metric(before, "lilicorr_output_tokens") < LONG
    good_request(client)


@integration
def test_stop_needs_the_job_key(engine_server):
    """stop=true stops only the job whose secret job_key it carries: another client reusing the
    victim's request id, or guessing a key, stops nothing; the owner (who received the key in its
    responses) can stop its own request. The ensemble never hands the key to its clients."""
    import tritonclient.grpc as g
    outputs = [g.InferRequestedOutput(n) for n in ("output_ids", "finish_reason", "job_key")]

    def start(rid):
        c, q = _raw_stream(engine_server, "lilicorr",
                           _engine_inputs("lilicorr", input_ids=[1, 9, 12], max_tokens=LONG, decode_rule="ar"),
                           request_id=rid, outputs=outputs, ignore_eos=True)
        first, error = q.get(timeout=120)
        assert error is None, error
        return c, q, first

    def stop(rid, key=None):
        inputs = _engine_inputs("lilicorr", input_ids=[0])
        for name, arr, dt in [("stop", np.array([True]), "BOOL")] + (
                [("job_key", np.array([key.encode()], dtype=np.object_), "BYTES")] if key else []):
            inp = g.InferInput(name, [1], dt)
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        c, q = _raw_stream(engine_server, "lilicorr", inputs, request_id=rid)
        _read_until_final(q)
        c.stop_stream()
        c.close()

    c, q, first = start("victim")
    key = first.as_numpy("job_key").reshape(-1)[0].decode()
    assert len(key) == 32
    stop("victim")                          # the victim's request id, no key
    stop("victim", "0" * 32)                # a guessed key
    stop("", key[::-1])
    rest = _read_until_final(q)
    c.stop_stream()
    c.close()
    assert _reason(rest) == "length" and len(_ids_of([first] + rest)) == LONG
    # the owner stops its own job
    c, q, first = start("owner")
    stop("", first.as_numpy("job_key").reshape(-1)[0].decode())
    rest = _read_until_final(q)
    c.stop_stream()
    c.close()
    assert _reason(rest) == "cancelled" and len(_ids_of([first] + rest)) < LONG
    status, body = http_get(f"http://{engine_server.http_url}/v2/models/ensemble/config")
    assert status == 200 and "job_key" not in {o["name"] for o in json.loads(body)["output"]}


@integration
def test_prompt_and_messages_limits(engine_server, good_request):
    """A prompt over max_prompt_bytes is refused before it is tokenised; a deeply nested or
    oversized messages_json is INVALID_ARG with a one-line message (no traceback, no paths)."""
    import tritonclient.grpc as g
    client = client_for(engine_server)
    t0 = time.monotonic()
    with pytest.raises(GenerationError, match=r"has 4200000 bytes; the server accepts at most 65536") as ei:
        client.generate("hello " * 700_000, request_id="huge")
    assert "huge" in str(ei.value) and time.monotonic() - t0 < 10

    def messages_json(text: str, rid: str) -> GenerationError:
        inp = g.InferInput("messages_json", [1], "BYTES")
        inp.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        with pytest.raises(GenerationError) as ei:
            client.generate(model="ensemble", inputs=[inp], request_id=rid)
        msg = str(ei.value)
        assert rid in msg and "Traceback" not in msg and ".py" not in msg and "\n" not in msg.strip(), msg
        return ei.value

    assert "nested 20000 levels deep" in str(messages_json("[" * 20000 + "]" * 20000, "deep"))
    big = json.dumps([{"role": "user", "content": "hello " * 20_000}])
    assert "bytes; the server accepts at most 65536" in str(messages_json(big, "big"))
    assert "not valid JSON" in str(messages_json('[{"role": ', "broken"))
    # the code is INVALID_ARG: HTTP 400 (INTERNAL would be 500)
    for body, want in [({"messages_json": "[" * 20000 + "]" * 20000}, "nested 20000 levels deep"),
                       ({"text_input": "x" * 70000}, "has 70000 bytes")]:
        status, text = _http("POST", f"http://{engine_server.http_url}/v2/models/ensemble/generate", body)
        assert status == 400 and want in text, (status, text)
    good_request(client)
