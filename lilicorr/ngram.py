"""Prompt lookup: a draft copied from the sequence itself (the n-gram proposer of vLLM's spec_decode,
HF's `prompt_lookup_num_tokens`).

Where the last n tokens of a sequence (prompt + committed tokens, the anchor included) occurred
before, the tokens that followed their most recent earlier occurrence are the draft, trying n from
`max_ngram` down to `min_ngram`. It costs no network pass, so on steps where it finds a match the
engine verifies it instead of running the drafter (`SpecEngine(prompt_lookup=...)`); verification is
unchanged, so the output is still the target's.

The index is incremental: `extend` is O(max_ngram) dict updates per token, `propose` one lookup per
n; the sequence is never rescanned.
"""
from __future__ import annotations

MIN_NGRAM = 2      # 1-token matches: on SmolLM2's held-out text their drafts are accepted far less
                   # often than the drafter's (results/prompt_lookup_ngrams.md)


class NgramIndex:
    """Most recent earlier occurrence of every n-gram (min_ngram <= n <= max_ngram) of one sequence."""

    def __init__(self, max_ngram: int, min_ngram: int = MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # n-gram -> start of its most recent occurrence that is followed by at least one token
        self._start: dict[tuple[int, ...], int] = {}

    def extend(self, new_tokens) -> None:
        """Append tokens; every n-gram that now has a continuation points at its latest start."""
        toks = self.tokens
        for t in new_tokens:
            end = len(toks)                      # the n-grams ending just before t gain t as continuation
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._start[tuple(toks[end - n:end])] = end - n
            toks.append(int(t))

    def propose(self, length: int) -> list[int]:
        """Up to `length` tokens that followed the latest earlier occurrence of the longest matching
        suffix ([] when no suffix of min_ngram..max_ngram tokens occurred before)."""
        toks = self.tokens
        for n in range(min(self.max_ngram, len(toks)), self.min_ngram - 1, -1):
            start = self._start.get(tuple(toks[-n:]))
            if start is not None:
                return toks[start + n: start + n + length]
        return []


def parse_prompt_lookup(value) -> int:
    """None / 0 / "" / "off" -> 0 (off); N >= 2 -> N, the longest n-gram prompt lookup matches."""
    if value in (None, "", "off", 0, "0"):
        return 0
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"prompt lookup must be 'off' or the longest n-gram to match (>= {MIN_NGRAM}), "
                         f"got {value!r}") from None
    if isinstance(value, bool) or not MIN_NGRAM <= n <= 64:
        raise ValueError(f"prompt lookup n-gram {value!r} outside [{MIN_NGRAM}, 64] (0 or 'off' turns it off)")
    return n


def replay_lookup(truth: list[int], prompt_len: int, max_ngram: int, slots: int, min_ngram: int = MIN_NGRAM,
                  limit: int | None = None) -> tuple[int, int, int, int]:
    """Greedy decoding with prompt lookup alone, replayed over a known continuation: `truth` is the
    prompt (its first `prompt_len` tokens) followed by the target's greedy tokens. Each step verifies
    the first `slots` tokens of the lookup draft (none where nothing matched) and commits the
    accepted ones plus the bonus token; it stops after `limit` generated tokens (the prefill's token
    counts as the first; default: the whole continuation). Returns (steps, committed tokens, steps
    with a match, drafts accepted on those steps)."""
    idx = NgramIndex(max_ngram, min_ngram)
    idx.extend(truth[: prompt_len + 1])       # the prompt and the prefill's token (the first anchor)
    end = len(truth) - 1 if limit is None else min(len(truth) - 1, prompt_len + limit - 1)
    pos = prompt_len                          # the anchor's position
    steps = tokens = matched = gained = 0
    while pos < end:
        draft = idx.propose(slots)
        a = 0
        while a < len(draft) and pos + 1 + a < len(truth) and draft[a] == truth[pos + 1 + a]:
            a += 1
        step = min(a + 1, len(truth) - 1 - pos)
        steps, tokens = steps + 1, tokens + step
        matched, gained = matched + bool(draft), gained + (a if draft else 0)
        idx.extend(truth[pos + 1: pos + 1 + step])
        pos += step
    return steps, tokens, matched, gained
