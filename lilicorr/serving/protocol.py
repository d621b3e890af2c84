"""Request protocol of the served models: names, defaults and validation (pure Python, no Triton).

Every sampling knob can arrive as an optional ``[1]`` input tensor (TensorRT-LLM's convention, and
what an ensemble can map) or as a request parameter (``parameters={"max_tokens": 64}`` on the
client); a tensor wins over a parameter. Invalid values raise `RequestError` (a ValueError) whose
message the models return as an INVALID_ARG error, prefixed with the request id.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Mapping, Sequence

DECODE_RULES = ("lilicorr", "viterbi", "argmax", "ar", "tree")

# names shared by the templates, the client and the tests
MODEL_ENGINE = "lilicorr"
MODEL_PRE = "preprocessing"
MODEL_POST = "postprocessing"
MODEL_ENSEMBLE = "ensemble"

KNOBS = ("max_tokens", "temperature", "seed", "decode_rule", "stream")
ENGINE_OUTPUTS = ("output_ids", "context_ids", "is_final", "num_accepted", "num_drafted",
                  "num_steps", "finish_reason", "job_key")
CONTEXT_WINDOW = 8       # previously emitted tokens sent along for stateless detokenization
DEFAULT_MAX_PROMPT_BYTES = 65536   # text_input / messages_json bytes, checked before tokenising
MAX_JSON_DEPTH = 16      # nesting depth of messages_json (a chat list needs 2)
# written by the launcher into each model directory to start the shutdown drain:
# {"deadline": <unix time>}; the lilicorr model then refuses new requests and ends running ones
# at the deadline with finish_reason "shutdown"
SHUTDOWN_FILE = "shutdown.json"


class RequestError(ValueError):
    """A bad request: reported to the client as INVALID_ARG, the server keeps serving."""


@dataclasses.dataclass(frozen=True)
class Limits:
    max_seq_len: int = 2048          # prompt + generated tokens must fit (engine context minus a block)
    max_tokens_limit: int = 2048     # largest max_tokens a request may ask for
    default_max_tokens: int = 128
    vocab_size: int | None = None    # token ids must lie in [0, vocab_size)
    default_rule: str = "lilicorr"
    stop_ids: tuple[int, ...] = ()   # end-of-sequence ids (the tokenizer's EOS / end-of-turn)


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    decode_rule: str = "lilicorr"
    stream: bool = True
    max_tokens_given: bool = True    # False: the default, clamped to the room left in the context
    ignore_eos: bool = False         # request parameter only: generate exactly max_tokens tokens


def parse_parameters(raw: str | bytes | Mapping | None) -> dict[str, Any]:
    """``request.parameters()`` is a JSON string in the Python backend."""
    if raw is None or raw == "" or raw == b"":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        val = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise RequestError(f"request parameters are not valid JSON: {e}") from None
    return val if isinstance(val, dict) else {}


def _scalar(name: str, arr: Any) -> Any:
    """The single element of a ``[1]`` input tensor."""
    if arr is None:
        return None
    try:
        size = arr.size
        flat = arr.reshape(-1)
    except AttributeError:
        return arr
    if size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got shape {list(arr.shape)}")
    val = flat[0]
    if isinstance(val, bytes):
        val = val.decode("utf-8", errors="strict")
    elif hasattr(val, "item"):
        val = val.item()
    return val


def _as_int(name: str, v: Any) -> int:
    if isinstance(v, bool):
        raise RequestError(f"{name} must be an integer, got a boolean")
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            raise RequestError(f"{name} must be an integer, got {v!r}")
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            raise RequestError(f"{name} must be an integer, got {v!r}") from None
    raise RequestError(f"{name} must be an integer, got {type(v).__name__}")


def _as_float(name: str, v: Any) -> float:
    if isinstance(v, bool):
        raise RequestError(f"{name} must be a number, got a boolean")
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            raise RequestError(f"{name} must be a number, got {v!r}") from None
    raise RequestError(f"{name} must be a number, got {type(v).__name__}")


def _as_bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.strip().lower() in ("true", "1", "yes")
    raise RequestError(f"{name} must be a boolean, got {v!r}")


def json_depth(text: str) -> int:
    """Deepest nesting of JSON arrays/objects in `text` (strings skipped), without parsing it."""
    depth = deepest = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_messages_json(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads for a client's messages_json, with the nesting depth checked first (a deeply
    nested document would otherwise exhaust the parser's recursion)."""
    d = json_depth(text)
    if d > max_depth:
        raise RequestError(f"messages_json is nested {d} levels deep; at most {max_depth} are accepted")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"messages_json is not valid JSON: {str(e)[:200]}") from None


def parse_generation_params(tensors: Mapping[str, Any], parameters: Mapping[str, Any],
                            limits: Limits) -> GenerationParams:
    """Validate the knobs of one request. ``tensors[name]`` is a numpy array or None."""
    def get(name: str) -> Any:
        v = _scalar(name, tensors.get(name))
        return parameters.get(name) if v is None else v

    mt = get("max_tokens")
    max_tokens = min(limits.default_max_tokens, limits.max_tokens_limit) if mt is None else _as_int("max_tokens", mt)
    if max_tokens <= 0:
        raise RequestError(f"max_tokens must be a positive integer, got {max_tokens}")
    if max_tokens > limits.max_tokens_limit:
        raise RequestError(f"max_tokens={max_tokens} is beyond the server limit of {limits.max_tokens_limit}")

    t = get("temperature")
    temperature = 0.0 if t is None else _as_float("temperature", t)
    if math.isnan(temperature) or math.isinf(temperature):
        raise RequestError(f"temperature must be a finite number, got {temperature}")
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")

    s = get("seed")
    seed = None if s is None else _as_int("seed", s)
    if seed is not None and not (0 <= seed < 2**63):
        raise RequestError(f"seed must be a non-negative 64-bit integer, got {seed}")

    r = get("decode_rule")
    rule = limits.default_rule if r is None or r == "" else r
    if not isinstance(rule, str) or rule.strip().lower() not in DECODE_RULES:
        raise RequestError(f"unknown decode_rule {rule!r}; expected one of {', '.join(DECODE_RULES)}")
    rule = rule.strip().lower()

    st = get("stream")
    stream = True if st is None else _as_bool("stream", st)
    ie = parameters.get("ignore_eos")
    ignore_eos = False if ie is None else _as_bool("ignore_eos", ie)
    return GenerationParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                            decode_rule=rule, stream=stream, max_tokens_given=mt is not None,
                            ignore_eos=ignore_eos)


def fit_params(params: GenerationParams, prompt_len: int, limits: Limits) -> GenerationParams:
    """A defaulted max_tokens shrinks to the room left in the context (an explicit one is checked)."""
    if params.max_tokens_given or prompt_len + params.max_tokens <= limits.max_seq_len:
        return params
    return dataclasses.replace(params, max_tokens=max(1, limits.max_seq_len - prompt_len))


def validate_prompt_ids(ids: Any, limits: Limits, max_tokens: int) -> list[int]:
    """Check a 1-D token-id array against the vocabulary and the context; return a list of ints."""
    import numpy as np

    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise RequestError(f"input_ids must be 1-D, got shape {list(arr.shape)}")
    if arr.size == 0:
        raise RequestError("empty prompt: input_ids has no tokens")
    if not np.issubdtype(arr.dtype, np.integer):
        raise RequestError(f"input_ids must be integers, got {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or (limits.vocab_size is not None and hi >= limits.vocab_size):
        bad = lo if lo < 0 else hi
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    n = int(arr.size)
    if n >= limits.max_seq_len:
        raise RequestError(f"prompt has {n} tokens but the context holds {limits.max_seq_len} "
                           f"(prompt + generated tokens)")
    if n + max_tokens > limits.max_seq_len:
        raise RequestError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                           f"{limits.max_seq_len} tokens; lower max_tokens to at most {limits.max_seq_len - n}")
    return [int(x) for x in arr.tolist()]


def decode_text(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode([int(i) for i in ids]) if len(ids) else ""


def _emitted(text: str, final: bool) -> str:
    """Text that is safe to emit: without a trailing partial UTF-8 character unless final."""
    if final:
        return text
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    return text[:end]


def text_delta(tokenizer: Any, context_ids: Sequence[int], new_ids: Sequence[int], final: bool) -> str:
    """Stateless incremental detokenization (what the postprocessing model does per response).

    ``context_ids`` are the previously emitted tokens (a window of them is enough). The text of
    ``new_ids`` is decode(context + new) minus decode(context); a trailing incomplete UTF-8
    sequence is held back until the tokens that complete it arrive (or the request ends), so
    concatenating every delta of a request gives exactly decode(all tokens).
    """
    prev = _emitted(decode_text(tokenizer, context_ids), False)
    full = _emitted(decode_text(tokenizer, list(context_ids) + list(new_ids)), final)
    if full.startswith(prev):
        return full[len(prev):]
    # decoders that rewrite the boundary: fall back to the longest common prefix
    i = 0
    for a, b in zip(prev, full):
        if a != b:
            break
        i += 1
    return full[i:]
