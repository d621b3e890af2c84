"""Stream equality through a real tritonserver at tau well above 1 (multi-token steps).

The drafter of tests/test_serving.py is untrained (tau about 1), so multi-token steps, the rollback
after a partial acceptance and multi-token text deltas barely reach the server there. Here a
drafter that really accepts is served: a small drafter + head trained (lilicorr.trainer, the real
training loop) on the tiny target's own greedy continuations of the chat prompts below, which the
test then sends. It is served from its checkpoint directory through the whole repository
(preprocessing with the chat template, the ``lilicorr`` model with the real SpecEngine and torch
drafter, postprocessing, the ensemble), and every stream must equal the offline engine on the same
checkpoint token for token, with tau > 1.5 on the server's own counts.
"""
from __future__ import annotations

import pytest

from lilicorr.serving.client import GenerationResult, run_concurrent

from serving_fixtures import (MAX_SEQ_LEN, chat_ids, client_for, engine_options, serving_target,  # noqa: F401
                              start_server, tokenizer)

pytestmark = [pytest.mark.slow, pytest.mark.integration]

BLOCK = 4
COMPLETION = 40             # trained continuation length (tokens after the prompt)
TRAIN_STEPS = 80
TEXTS = ["hello world how are you", "write python code please", "what is the answer", "one two three four five",
         "why is the code in python", "please write a number", "the answer is yes", "how are you fine"]
RULES = ("lilicorr", "viterbi", "argmax", "tree")


@pytest.fixture(scope="module")
def trained_ckpt(serving_target, tokenizer, tmp_path_factory):
    """A drafter + head (block size 4) trained on the target's greedy continuations of TEXTS."""
    import torch

    from lilicorr.config import DrafterConfig, HeadConfig, LiLiCorrConfig, LossConfig, TrainConfig
    from lilicorr.engine import SpecEngine
    from lilicorr.target import load_target
    from lilicorr.trainer import Trainer
    from lilicorr.training import Sequence

    target = load_target(serving_target)
    prompts = [chat_ids(tokenizer, t) for t in TEXTS]
    greedy = SpecEngine(target, None, max_batch=len(prompts)).generate(prompts, COMPLETION, rule="ar")
    seqs = [Sequence(p + r.tokens, [0] * len(p) + [1] * COMPLETION) for p, r in zip(prompts, greedy)]
    cfg = LiLiCorrConfig(
        drafter=DrafterConfig(num_layers=1, block_size=BLOCK, target_layer_ids=[0, 2]),
        head=HeadConfig(top_k=4, width=32, num_layers=1, num_heads=2, ffn_width=64, embed_dim=16),
        loss=LossConfig(),
        train=TrainConfig(lr_drafter=3e-3, lr_head=3e-3, global_batch=4, seq_len=64, epochs=1, num_anchors=16,
                          max_steps=TRAIN_STEPS, warmup_ratio=0.05, seed=0))
    cfg.drafter = cfg.drafter.for_target(target.config)
    torch.manual_seed(0)
    trainer = Trainer(cfg, target, seqs, tmp_path_factory.mktemp("trained") / "ckpt",
                      pad_id=target.config.pad_token_id)
    for _ in range(TRAIN_STEPS):
        trainer.train_step()
    return trainer.save()


@pytest.fixture(scope="module")
def offline(serving_target, trained_ckpt):
    """The offline engine on the same checkpoint and target precision ("auto", as the server picks):
    the reference."""
    from lilicorr.engine import SpecEngine
    return SpecEngine.from_paths(serving_target, ckpt_dir=trained_ckpt, max_batch=8, max_seq_len=MAX_SEQ_LEN,
                                 dtype="auto")


@pytest.fixture(scope="module")
def trained_server(serving_target, trained_ckpt, tmp_path_factory):
    """tritonserver serving the trained checkpoint (torch drafter) through the full repository."""
    from lilicorr.serving.repository import EngineSpec, generate_repository

    spec = EngineSpec(target_dir=serving_target, ckpt_dir=trained_ckpt, draft_backend="torch")
    repo = generate_repository(spec, tmp_path_factory.mktemp("trained-repo"), engine_options())
    srv = start_server(repo)
    try:
        yield srv
    finally:
        srv.stop()


def _reference(offline, tokenizer, ids, rule, ignore_eos):
    stops = None if ignore_eos else sorted(tokenizer.eos_ids)
    return offline.generate([ids], COMPLETION, rule=rule, stop_ids=stops)[0]


def test_trained_drafter_streams_equal_offline_with_multi_token_steps(trained_server, offline, tokenizer):
    """One stream at a time (text prompts through the ensemble, every speculative rule and `ar`):
    the token ids, the text deltas and the server's accepted / step counts equal the offline
    engine's; the streams carry multi-token deltas, full blocks and partial acceptances (rollback),
    at tau > 1.5."""
    client = client_for(trained_server)
    accepted = steps = multi_deltas = 0
    hist = [0] * (BLOCK + 1)
    for text in TEXTS:
        ids = chat_ids(tokenizer, text)
        ar = _reference(offline, tokenizer, ids, "ar", True).tokens
        for rule in RULES + ("ar",):
            ref = _reference(offline, tokenizer, ids, rule, True)
            deltas = []
            res = client.generate(text, max_tokens=COMPLETION, decode_rule=rule, ignore_eos=True,
                                  on_delta=deltas.append)
            tokens = [t for d in deltas for t in d.token_ids]
            assert tokens == res.token_ids == ref.tokens == ar, (text, rule)
            assert "".join(d.text for d in deltas) == res.text == tokenizer.decode(ref.tokens), (text, rule)
            assert (res.accepted, res.steps) == (ref.accepted_tokens, ref.num_steps), (text, rule)
            if rule != "ar":
                accepted += res.accepted
                steps += res.steps
                multi_deltas += sum(len(d.token_ids) > 1 for d in deltas)
                hist = [a + b for a, b in zip(hist, ref.accept_hist)]
    assert accepted / steps > 1.5, (accepted, steps)
    assert multi_deltas > len(TEXTS) * len(RULES)            # several multi-token deltas per stream
    assert hist[BLOCK] > 0 and sum(hist[2:BLOCK]) > 0 and hist[1] > 0, hist   # full, partial, none


def test_trained_drafter_concurrent_streams_equal_offline(trained_server, offline, tokenizer):
    """Every prompt x rule at once (text and token-id requests, with and without stop tokens): each
    stream equals the offline engine's output for its request, run alone."""
    client = client_for(trained_server)
    reqs = []
    for i, text in enumerate(TEXTS):
        for j, rule in enumerate(RULES + ("ar",)):
            ids = chat_ids(tokenizer, text)
            kw = dict(prompt=text) if (i + j) % 2 == 0 else dict(input_ids=ids)
            reqs.append((kw, ids, rule, (i + j) % 3 != 0))
    expected = [_reference(offline, tokenizer, ids, rule, ignore_eos) for _, ids, rule, ignore_eos in reqs]
    res = run_concurrent(lambda r: client.generate(**r[0], max_tokens=COMPLETION, decode_rule=r[2],
                                                   ignore_eos=r[3]), reqs, len(reqs))
    errors = [r for r in res if not isinstance(r, GenerationResult)]
    assert not errors, errors
    accepted = steps = 0
    for (kw, ids, rule, ignore_eos), r, ref in zip(reqs, res, expected):
        assert r.token_ids == ref.tokens, (kw, rule, ignore_eos)
        assert r.finish_reason == ref.finish_reason
        if "prompt" in kw:
            assert r.text == tokenizer.decode(r.token_ids)
        if rule != "ar":
            accepted += r.accepted
            steps += r.steps
    assert accepted / steps > 1.5, (accepted, steps)
