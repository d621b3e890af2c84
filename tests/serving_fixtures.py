"""Fixtures and helpers for tests/test_serving.py (imported there; conftest.py stays untouched).

One real tritonserver, session-scoped, on free loopback ports: ``engine_server`` serves the full
repository (pre/post-processing with the tiny target's tokenizer, the ``lilicorr`` model, the
ensemble) with the real SpecEngine on the tiny random target: the engine directory built by
lilicorr.export from an untrained checkpoint (block size 4, ONNX Runtime drafter), or an untrained
torch drafter where the converter cannot run. ``offline_engine`` is the same engine in the test
process: the reference for every greedy output. `engine_repository` writes the same repository
for tests that start (and stop) their own server.
"""
from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from lilicorr.serving.client import LiLiCorrClient
from lilicorr.serving.launcher import TritonServer, find_tritonserver
from lilicorr.serving.repository import ServeOptions, generate_repository

BLOCK_SIZE = 4
MAX_SEQ_LEN = 128          # the tiny target's max_position_embeddings
# what a request may use on the server: the engine keeps room for one block (repository.open_engine)
SERVED_SEQ_LEN = MAX_SEQ_LEN - BLOCK_SIZE
ADMIN_KEY = "test-admin-key"   # engine_server's operator key for the (otherwise closed) control APIs


def have_tritonserver() -> bool:
    try:
        find_tritonserver()
        return True
    except FileNotFoundError:
        return False


def start_server(repo: Path, **kwargs) -> TritonServer:
    if not have_tritonserver():
        pytest.skip("no tritonserver (install the serve extra)")
    srv = TritonServer(repo, startup_timeout=300, **kwargs)
    srv.start()
    return srv


def engine_options(**kw) -> ServeOptions:
    """Serving options of the test server; the draft backend is the engine manifest's."""
    return ServeOptions(max_batch=32, max_seq_len=MAX_SEQ_LEN, default_max_tokens=16, num_threads=1,
                        device="cpu", **kw)


@pytest.fixture(scope="session")
def serving_target(tiny_target_dir) -> Path:
    return tiny_target_dir("llama")


@pytest.fixture(scope="session")
def tiny_engine_dir(serving_target, tmp_path_factory) -> Path:
    """An onnxruntime engine directory (convert/build_engine.py's code) from an untrained
    checkpoint (block size 4) on the tiny target."""
    from lilicorr import checkpoint as ckpt_io
    from lilicorr.export import BuildOptions, build_engine_dir
    from lilicorr.model import untrained_model
    from lilicorr.target import load_target

    base = tmp_path_factory.mktemp("serving-engine")
    target = load_target(serving_target)
    model = untrained_model(target, seed=0, block_size=BLOCK_SIZE)
    ckpt = ckpt_io.save_checkpoint(base / "ckpt", model.cfg, model.state_dict(), target.config, {"step": 0})
    return build_engine_dir(ckpt, serving_target, base / "engines" / "tiny-onnxruntime", BuildOptions(log=None))


def engine_repository(serving_target: Path, engine_dir: Path, out: Path, **kw) -> Path:
    """The model repository of the real SpecEngine on the built engine dir (ONNX Runtime drafter;
    max_batch 32: 32 concurrent streams). `serving_target` is the dir the manifest points at."""
    from lilicorr.serving.repository import read_engine_manifest
    return generate_repository(read_engine_manifest(engine_dir), out, engine_options(**kw))


@pytest.fixture(scope="session")
def engine_server(serving_target, tiny_engine_dir, tmp_path_factory):
    """One server for every integration test that does not stop its own server (profile=true:
    the stage metrics are on /metrics; the control APIs open with the header admin-key: ADMIN_KEY)."""
    repo = engine_repository(serving_target, tiny_engine_dir, tmp_path_factory.mktemp("engine-repo"), profile=True)
    srv = start_server(repo, admin_key=ADMIN_KEY)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def offline_engine(serving_target, tiny_engine_dir):
    """The same engine the server runs, in the test process (the reference for greedy outputs): the
    target in the precision the server picks ("auto", the manifest's serving choice)."""
    from lilicorr.engine import SpecEngine
    from lilicorr.engine_dir import read_manifest
    lookup = read_manifest(tiny_engine_dir)["serving"]["prompt_lookup"]      # as the server serves it
    return SpecEngine.from_paths(serving_target, engine_dir=tiny_engine_dir, draft_backend="onnxruntime",
                                 max_batch=8, max_seq_len=MAX_SEQ_LEN, dtype="auto", prompt_lookup=lookup)


@pytest.fixture(scope="session")
def tokenizer(serving_target):
    from lilicorr.tokenizer import Tokenizer
    return Tokenizer.from_dir(serving_target)


def client_for(srv: TritonServer, **kw) -> LiLiCorrClient:
    return LiLiCorrClient(srv.grpc_url, timeout=120, **kw)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0.0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if not m:
            continue
        lab = m.group(1) or ""
        if all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(m.group(2))
    return total


def metrics_text(srv: TritonServer) -> str:
    status, text = http_get(srv.metrics_url)
    assert status == 200
    return text


def chat_ids(tokenizer, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
    """The token ids the ensemble's preprocessing makes of a text prompt (a user message) or chat."""
    return tokenizer.encode_chat(messages if messages is not None else [{"role": "user", "content": prompt}])


@pytest.fixture(scope="session")
def reference(offline_engine, tokenizer):
    """reference(ids, max_tokens, rule, ignore_eos=False) -> the offline engine's `Result` for one
    request run alone, with the server's stop ids (cached per argument set)."""
    eos = sorted(tokenizer.eos_ids)
    done: dict[tuple, object] = {}

    def ref(ids, max_tokens: int, rule: str = "ar", ignore_eos: bool = False):
        key = (tuple(ids), max_tokens, rule, ignore_eos)
        if key not in done:
            done[key] = offline_engine.generate([list(ids)], max_tokens, rule=rule,
                                                stop_ids=None if ignore_eos else eos)[0]
        return done[key]

    return ref
