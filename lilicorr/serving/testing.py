"""A deterministic stand-in for SpecEngine, to exercise the server mechanics without a model.

Select it in a generated repository with the ``lilicorr`` model parameter
``engine_factory = "lilicorr.serving.testing:echo_engine"`` (`ServeOptions.engine_factory`).
It implements the SpecEngine serving API (add_request / step / cancel) with the same
StepEvent fields; output token t of a request is ``(sum(prompt) + 7 * t) % vocab`` (greedy) so
results are reproducible and independent of batching, like a correct engine's greedy output.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Mapping

RULES = ("lilicorr", "viterbi", "argmax", "ar")


@dataclasses.dataclass
class StepEvent:
    rid: int
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    accepted: int
    drafted: int


@dataclasses.dataclass
class _Seq:
    prompt: list[int]
    max_tokens: int
    rule: str
    temperature: float
    rng: random.Random
    produced: int = 0


class EchoEngine:
    def __init__(self, vocab_size: int = 96, block_size: int = 4, max_batch: int = 32,
                 max_seq_len: int = 128, step_delay_s: float = 0.0, eos_id: int | None = None):
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.step_delay_s = step_delay_s
        self.eos_id = eos_id
        self._ids = itertools.count()
        self.seqs: dict[int, _Seq] = {}
        self.cancelled: list[int] = []
        self.batch_sizes: list[int] = []

    def token(self, seq: _Seq, t: int) -> int:
        if seq.temperature > 0:
            return seq.rng.randrange(self.vocab_size)
        return (sum(seq.prompt) + 7 * t) % self.vocab_size

    def add_request(self, prompt_ids, max_tokens, rule="lilicorr", temperature=0.0, seed=None, stop_ids=None):
        if not prompt_ids:
            raise ValueError("empty prompt")
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}")
        if any(not 0 <= int(t) < self.vocab_size for t in prompt_ids):
            raise ValueError("token id outside the vocabulary")
        if len(prompt_ids) + max_tokens > self.max_seq_len:
            raise ValueError("prompt + max_tokens exceeds max_seq_len")
        if len(self.seqs) >= self.max_batch:
            raise RuntimeError("engine full")
        rid = next(self._ids)
        self.seqs[rid] = _Seq(list(map(int, prompt_ids)), int(max_tokens), rule, float(temperature),
                              random.Random(seed))
        return rid

    def step(self):
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.batch_sizes.append(len(self.seqs))
        events = []
        for rid, seq in list(self.seqs.items()):
            if seq.rule == "ar":
                k, drafted = 1, 0
            else:   # accept a rule- and position-dependent number of the block's drafted tokens + bonus
                drafted = self.block_size - 1
                k = 1 + (seq.produced + len(seq.rule)) % self.block_size
            k = min(k, seq.max_tokens - seq.produced)
            new = [self.token(seq, seq.produced + i) for i in range(k)]
            seq.produced += k
            finished = seq.produced >= seq.max_tokens
            reason = "length" if finished else None
            if self.eos_id is not None and self.eos_id in new:
                new = new[: new.index(self.eos_id) + 1]
                finished, reason = True, "stop"
            events.append(StepEvent(rid, new, finished, reason, accepted=len(new), drafted=drafted))
            if finished:
                del self.seqs[rid]
        return events

    def cancel(self, rid):
        if self.seqs.pop(rid, None) is not None:
            self.cancelled.append(rid)

    def expected(self, prompt_ids, max_tokens) -> list[int]:
        seq = _Seq(list(prompt_ids), max_tokens, "ar", 0.0, random.Random(0))
        return [self.token(seq, t) for t in range(max_tokens)]


def echo_engine(params: Mapping[str, str]) -> EchoEngine:
    """engine_factory for the ``lilicorr`` model (parameters as strings)."""
    return EchoEngine(vocab_size=int(params.get("echo_vocab_size") or 96),
                      max_batch=int(params.get("max_batch") or 32),
                      max_seq_len=int(params.get("max_seq_len") or 128),
                      step_delay_s=float(params.get("echo_step_delay_s") or 0.0))
