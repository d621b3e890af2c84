"""General-chat training prompts written by the target itself (the Magpie method).

The target's chat template is rendered up to the start of a user turn (system turn included, as the
template writes it) and the target *samples* the user message until its end-of-turn token. The
texts are cleaned, deduplicated and filtered against every evaluation prompt; `train/regen.py`
then regenerates the assistant answers from them like any other prompt file.

Every token comes from the project's one engine (`SpecEngine`, rule "ar", temperature > 0), so a
run is deterministic in (target, n, seed, temperature, openers).

Openers: a small model started at a bare user turn writes mostly one kind of request (SmolLM2-135M:
"Can you ..."). With ``openers``, each attempt starts the user turn with one opening phrase drawn
from the list (seeded per attempt) and the target writes the rest, so the turns spread over the
forms users actually open with (instructions, how-to questions, first-person situations). The
phrase is part of the prompt text; everything after it is the target's.
"""
from __future__ import annotations

import random
import re
from typing import Callable, Sequence

from .suites import eval_prompt_texts

_SENTINEL = "\u2063MAGPIE\u2063"          # an invisible separator the template will not alter


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to (and including) the header of the first user turn."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    cut = text.find(_SENTINEL)
    if cut < 0:
        raise ValueError("the chat template does not render the user message verbatim")
    return tokenizer.encode(text[:cut], add_special_tokens=False)


# Opening phrases of user requests (generic forms, no evaluation prompt's content).
OPENERS = (
    "Write", "Explain", "How do I", "How can I", "How does", "What is", "What are", "What should I",
    "Why does", "Why do", "Give me", "Help me", "Suggest", "Summarize", "Compare", "Describe",
    "List", "Create", "Plan", "Draft", "Recommend", "I'm", "I have", "I want to", "I need", "My",
    "Is it", "Should I", "Can you", "Could you", "Please", "Tell me", "Which", "When should",
    "Where can I", "Rewrite", "Make", "Design", "Teach me", "Outline", "Brainstorm", "Imagine",
    "If", "Analyze", "Propose", "Translate", "Is there", "Do you",
)


def opener_for(openers: Sequence[str], seed: int, attempt: int) -> str:
    """The opening phrase of attempt `attempt` (fixed by seed and attempt, so runs resume exactly)."""
    return openers[random.Random(f"magpie-opener-{seed}-{attempt}").randrange(len(openers))]


def normalise(text: str) -> str:
    """Key for deduplication: lower case, collapsed whitespace, no trailing punctuation."""
    return re.sub(r"\s+", " ", text).strip().lower().rstrip(".?! ")


def acceptable(text: str, min_words: int = 4, max_chars: int = 1200) -> bool:
    """A usable user turn: a few words, not a fragment of template markup, not mostly repeated."""
    words = text.split()
    if len(words) < min_words or len(text) > max_chars:
        return False
    if "<|" in text or "|>" in text:
        return False
    return len(set(words)) >= 0.5 * len(words)      # degenerate loops repeat the same words


def generate_user_turns(engine, tokenizer, n: int, seed: int = 0, temperature: float = 1.0,
                        max_tokens: int = 96, batch_size: int = 32,
                        progress: Callable[[dict], None] | None = None,
                        max_attempts: int | None = None, done: list[dict] | None = None,
                        openers: Sequence[str] | None = None) -> list[dict]:
    """Sample user turns until `n` distinct acceptable ones are found (or `max_attempts` samples,
    default 4n, were drawn). Returns items {"id", "kind": "chat", "source", "prompt"} in completion
    order, source "magpie" ("magpie:opener" with `openers`); ids are "magpie-<seed>-<attempt>" and
    attempt k always samples with seed (seed, k) after the opener `opener_for(openers, seed, k)`.
    `done`: items of an interrupted run to continue from (kept, and sampling resumes after their
    last attempt). `progress(item)` is called for every new item."""
    if openers is not None and (not openers or any(not o.strip() for o in openers)):
        raise ValueError("openers must be a non-empty list of non-empty phrases")
    prefix = user_turn_prefix(tokenizer)
    source = "magpie:opener" if openers else "magpie"
    stops = sorted({int(t) for t in (tokenizer.eos_ids or [])})
    banned = {normalise(t) for t in eval_prompt_texts()}
    out: list[dict] = list(done or [])
    seen: set[str] = {normalise(it["prompt"]) for it in out}
    attempts = 1 + max((int(it["id"].rsplit("-", 1)[1]) for it in out), default=-1)
    active: dict = {}
    limit = max_attempts if max_attempts is not None else attempts + 4 * (n - len(out))
    while len(out) < n and (active or attempts < limit):
        while len(active) + len(out) < n + batch_size // 2 and len(active) < batch_size and attempts < limit:
            head = tokenizer.encode(opener_for(openers, seed, attempts)) if openers else []
            rid = engine.add_request(prefix + head, max_tokens=max_tokens, rule="ar", temperature=temperature,
                                     seed=seed * 1_000_003 + attempts, stop_ids=stops)
            active[rid] = (attempts, list(head))                  # the turn's ids, opener first
            attempts += 1
        for ev in engine.step():
            if ev.rid not in active:
                continue
            active[ev.rid][1].extend(int(t) for t in ev.new_tokens)
            if not ev.finished:
                continue
            attempt, ids = active.pop(ev.rid)
            if not ids or ids[-1] not in stops:          # cut off at max_tokens: not a whole turn
                continue
            text = tokenizer.decode(ids[:-1]).strip()
            key = normalise(text)
            if not acceptable(text) or key in seen or key in banned:
                continue
            seen.add(key)
            if len(out) < n:
                out.append({"id": f"magpie-{seed}-{attempt}", "kind": "chat", "source": source,
                            "prompt": text})
                if progress:
                    progress(out[-1])
    for rid in list(active):
        engine.cancel(rid)
    return out
