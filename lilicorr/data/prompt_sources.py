"""Training prompt sources that do not overlap the evaluation suites.

Three kinds, all offline and deterministic:

* ``code`` - prompts built from the CPython standard library's own functions (the stdlib source is
  walked with :mod:`ast` from ``sysconfig.get_paths()['stdlib']``): "write a function with this
  signature and docstring", "explain this function", "write tests for it", "write its docstring".
  Functions named like a HumanEval entry point are skipped.
* ``math`` - word/arithmetic/logic problems from reasoning-gym task families *other than*
  ``gsm_symbolic`` (the eval family), with seeds disjoint from the eval seed.
* ``chat`` - chat-style prompts over documentation text: stdlib module / class / function
  docstrings ("Summarize what the module X does", "How do I use X.f ...?").

Two more kinds put the same sources in the forms users send (the instruction formats of the
evaluation suites, never their content). They are off in ``DEFAULT_MIX``, so the default lists
are unchanged:

* ``code_complete`` - "Complete the following Python function" over a top-level stdlib function's
  signature and docstring (its body removed), the answer being the whole function in a code block.
* ``math_reason`` - the ``math`` families with their own seeds, asking for step-by-step reasoning
  and a boxed or stated final answer, so the answers are worked solutions rather than one line.

``iter_training_prompts(n, seed, mix)`` returns ``n`` items ``{"id", "kind", "source", "prompt"}``;
the same arguments (and the same Python / reasoning-gym versions) give the same list. Any prompt
whose text equals an evaluation prompt is dropped. Capacity (Python 3.11 stdlib): about 10,800 code and
7,000 chat prompts; math is unbounded.
"""
from __future__ import annotations

import ast
import functools
import math as _math
import os
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass

from .suites import eval_prompt_texts, load_prompts

KINDS = ("code", "math", "chat", "code_complete", "math_reason")
DEFAULT_MIX = {"code": 0.4, "math": 0.4, "chat": 0.2}

# reasoning-gym families (present in 0.1.25, each generates 100 items in well under a second, output
# independent of PYTHONHASHSEED -- polynomial_multiplication is not, so it is left out).
# gsm_symbolic is the evaluation family and is never used here.
MATH_FAMILIES = (
    "basic_arithmetic", "chain_sum", "leg_counting", "fraction_simplification", "simple_equations",
    "decimal_arithmetic", "decimal_chain_sum", "gcd", "lcm", "prime_factorization", "products",
    "number_sorting", "calendar_arithmetic", "time_intervals", "coin_flip", "dice",
    "base_conversion", "letter_counting", "power_function", "simple_geometry", "count_primes",
    "complex_arithmetic", "bitwise_arithmetic", "count_bits", "number_sequence", "syllogism",
    "family_relationships", "aiw", "knights_knaves",
)
EVAL_FAMILIES = ("gsm_symbolic",)
# training seeds are TRAIN_SEED_BASE + 1000 * seed + family index (eval uses 20_250_101 for gsm_symbolic)
TRAIN_SEED_BASE = 7_000_000
REASON_SEED_BASE = 8_000_000   # math_reason's seeds: disjoint from math's and from the eval seed

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__",
              "turtledemo", "encodings", "pydoc_data", "ensurepip", "tkinter"}
_SKIP_MODULES = {"this", "antigravity", "__phello__", "__hello__"}
_MAX_SOURCE_CHARS = 2400
_MAX_DOC_CHARS = 1500
_MIN_DOC_CHARS = 40
_MIN_CHAT_DOC_CHARS = 80


# ----------------------------------------------------------------------------- stdlib walking
@dataclass(frozen=True)
class _Func:
    module: str
    qualname: str       # "f" or "Class.f"
    name: str
    cls: str | None
    signature: str      # "a, b=1, *args"
    doc: str
    source: str         # full source of the def (decorators included, dedented)

    @property
    def stub(self) -> str:
        """The def line(s) and docstring with the body removed, as written (decorators dropped)."""
        node = ast.parse(self.source).body[0]
        lines = self.source.splitlines(keepends=True)
        return "".join(lines[node.lineno - 1: node.body[0].end_lineno]).rstrip() + "\n"

    @property
    def source_nodoc(self) -> str:
        """The def with its docstring removed (via ast.unparse, so comments are lost)."""
        node = ast.parse(self.source).body[0]
        node.body = node.body[1:] or [ast.Pass()]
        return ast.unparse(node)


@dataclass(frozen=True)
class _Doc:
    what: str           # "module" | "class" | "function"
    target: str         # dotted name
    doc: str


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _stdlib_files(root: str) -> list[tuple[str, str]]:
    """(module name, path) of public stdlib modules, sorted."""
    out = []
    for dp, dns, fns in os.walk(root):
        dns[:] = sorted(d for d in dns if d not in _SKIP_DIRS and not d.startswith(("config-", "_", "."))
                        and d.isidentifier())
        for fn in sorted(fns):
            if not fn.endswith(".py") or fn.startswith(("test_", "_")) and fn != "__init__.py":
                continue
            rel = os.path.relpath(os.path.join(dp, fn), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            if not rel or not all(p.isidentifier() for p in rel):
                continue
            mod = ".".join(rel)
            if mod in _SKIP_MODULES:
                continue
            out.append((mod, os.path.join(dp, fn)))
    out.sort()
    return out


def _clean_doc(doc: str) -> str:
    doc = textwrap.dedent(doc).strip()
    if len(doc) > _MAX_DOC_CHARS:      # cut at a paragraph (or line) boundary
        cut = doc.rfind("\n\n", 0, _MAX_DOC_CHARS)
        if cut < _MAX_DOC_CHARS // 3:
            cut = doc.rfind("\n", 0, _MAX_DOC_CHARS)
        doc = doc[: cut if cut > 0 else _MAX_DOC_CHARS].rstrip()
    return doc


@functools.lru_cache(maxsize=4)
def _scan_stdlib(root: str) -> tuple[tuple[_Func, ...], tuple[_Doc, ...]]:
    funcs: list[_Func] = []
    docs: list[_Doc] = []
    for mod, path in _stdlib_files(root):
        try:
            with open(path, encoding="utf-8") as f:
                src = f.read()
            tree = ast.parse(src)
            lines = src.splitlines(keepends=True)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        mdoc = ast.get_docstring(tree)
        if mdoc and len(mdoc.strip()) >= _MIN_CHAT_DOC_CHARS:
            docs.append(_Doc("module", mod, _clean_doc(mdoc)))
        # top-level functions, and methods of top-level public classes
        todo = [(None, n) for n in tree.body]
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                cdoc = ast.get_docstring(node)
                if cdoc and len(cdoc.strip()) >= _MIN_CHAT_DOC_CHARS:
                    docs.append(_Doc("class", f"{mod}.{node.name}", _clean_doc(cdoc)))
                todo += [(node.name, n) for n in node.body]
        for cls, node in todo:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc.strip()) < _MIN_DOC_CHARS:
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            seg = textwrap.dedent("".join(lines[first - 1: node.end_lineno])).rstrip() + "\n"
            if len(seg) > _MAX_SOURCE_CHARS or len(node.body) < 2:
                continue   # too long, or nothing but the docstring
            try:   # dedent fails when a continuation line sits left of the def (column-0 strings)
                ast.parse(seg)
            except SyntaxError:
                continue
            qual = f"{cls}.{node.name}" if cls else node.name
            cdoc = _clean_doc(doc)
            funcs.append(_Func(mod, qual, node.name, cls, ast.unparse(node.args), cdoc, seg))
            if len(doc.strip()) >= _MIN_CHAT_DOC_CHARS:
                docs.append(_Doc("function", f"{mod}.{qual}", cdoc))
    return tuple(funcs), tuple(docs)


# ----------------------------------------------------------------------------- templates
_CODE_TEMPLATES = (   # (name, weight)
    ("write", 0.45), ("explain", 0.30), ("docstring", 0.15), ("tests", 0.10),
)


def _code_prompt(f: _Func, template: str) -> str:
    if template == "write":
        if f.cls:
            head = (f"Write the method `{f.name}({f.signature})` of a Python class `{f.cls}`. "
                    f"It should do the following:")
        else:
            head = f"Write a Python function `{f.name}({f.signature})` that does the following:"
        return f"{head}\n\n{f.doc}"
    if template == "explain":
        return (f"Explain what this function from Python's `{f.module}` module does and how it works:"
                f"\n\n```python\n{f.source}```")
    if template == "docstring":
        return f"Write a clear docstring for this Python function:\n\n```python\n{f.source_nodoc}\n```"
    if template == "tests":
        return (f"Write a few pytest unit tests for this function from Python's `{f.module}` module:"
                f"\n\n```python\n{f.source}```")
    raise ValueError(template)


def _chat_prompt(d: _Doc, template: int) -> str:
    first = re.split(r"\n\s*\n", d.doc, maxsplit=1)[0].replace("\n", " ").strip()
    if d.what == "module":
        opts = (
            f"Summarize what the Python module `{d.target}` does, based on its documentation:\n\n{d.doc}",
            f"I'm reading about Python's `{d.target}` module. Its documentation starts with:\n\n{first}\n\n"
            f"What is it for, and when would I use it? Give a short example.",
            f"Here is the documentation of the `{d.target}` module:\n\n{d.doc}\n\n"
            f"Explain it in plain words for a beginner.",
        )
    elif d.what == "class":
        opts = (
            f"Here is the documentation of the class `{d.target}`:\n\n{d.doc}\n\n"
            f"Explain what it is for and show a short usage example.",
            f"How do I use `{d.target}` in Python? The docs say:\n\n{d.doc}",
            f"Summarize this class documentation in two or three sentences:\n\n{d.doc}",
        )
    else:
        opts = (
            f"How do I use `{d.target}` in Python? The documentation says:\n\n{d.doc}\n\nShow a small example.",
            f"Summarize what `{d.target}` does, based on its documentation:\n\n{d.doc}",
            f"Explain this documentation to a beginner, and mention any pitfalls:\n\n{d.doc}",
        )
    return opts[template % len(opts)]


_MATH_SUFFIXES = ("", "", "\nExplain your reasoning step by step.")
# math_reason: the answer formats users ask for (the same instructions as the math500 and
# gsm-symbolic suites use)
_REASON_SUFFIXES = ("\nPlease reason step by step, and put your final answer within \\boxed{}.",
                    " Give the result as your final answer. Do not include units.")
_COMPLETE_HEAD = ("Complete the following Python function. Return the complete function (signature, "
                  "docstring and body) in a single ```python code block.")
_METHOD_COMPLETE_HEAD = ("Complete the following method of the Python class `{cls}`. Return the complete "
                         "method (signature, docstring and body) in a single ```python code block.")


# ----------------------------------------------------------------------------- per-kind pools
def _norm(s: str) -> str:
    return " ".join(s.split()).lower()


def _humaneval_names() -> set[str]:
    try:
        return {it.get("entry_point") for it in load_prompts("humaneval")} - {None}
    except FileNotFoundError:
        return set()


def _weighted(rng: random.Random, table) -> str:
    names, weights = zip(*table)
    return rng.choices(names, weights=weights, k=1)[0]


def _code_items(k: int, seed: int, banned: set[str]) -> list[dict]:
    if k <= 0:
        return []
    funcs, _ = _scan_stdlib(stdlib_dir())
    skip = _humaneval_names()
    pool = [f for f in funcs if f.name not in skip]
    rng = random.Random(f"lilicorr-code-{seed}")
    out, used = [], set()
    for rnd in range(len(_CODE_TEMPLATES)):          # each pass: every function at most once
        order = list(range(len(pool)))
        rng.shuffle(order)
        for i in order:
            f = pool[i]
            left = [(t, w) for t, w in _CODE_TEMPLATES if (i, t) not in used]
            t = _weighted(rng, left)       # a template this function has not had yet
            p = _code_prompt(f, t)
            if _norm(p) in banned:
                continue
            used.add((i, t))
            banned.add(_norm(p))
            out.append({"id": f"code/{f.module}.{f.qualname}/{t}", "kind": "code",
                        "source": f"stdlib:{f.module}.{f.qualname}", "prompt": p})
            if len(out) == k:
                return out
    raise ValueError(f"only {len(out)} distinct code prompts available, {k} requested")


def _code_complete_items(k: int, seed: int, banned: set[str]) -> list[dict]:
    """HumanEval-form prompts over stdlib functions: the top-level ones first, then methods shown
    inside their class (`_METHOD_COMPLETE_HEAD`), each group in its own seeded order, so a longer
    list keeps a shorter one as its prefix."""
    if k <= 0:
        return []
    funcs, _ = _scan_stdlib(stdlib_dir())
    skip = _humaneval_names()
    top = [f for f in funcs if f.cls is None and f.name not in skip]
    methods = [f for f in funcs if f.cls is not None and f.name not in skip]
    random.Random(f"lilicorr-code-complete-{seed}").shuffle(top)
    random.Random(f"lilicorr-code-complete-methods-{seed}").shuffle(methods)
    out = []
    for f in top + methods:
        if f.cls is None:
            p = f"{_COMPLETE_HEAD}\n\n```python\n{f.stub}```"
        else:
            p = (f"{_METHOD_COMPLETE_HEAD.format(cls=f.cls)}\n\n```python\nclass {f.cls}:\n"
                 f"{textwrap.indent(f.stub, '    ')}```")
        if _norm(p) in banned:
            continue
        banned.add(_norm(p))
        out.append({"id": f"code_complete/{f.module}.{f.qualname}", "kind": "code_complete",
                    "source": f"stdlib:{f.module}.{f.qualname}", "prompt": p})
        if len(out) == k:
            return out
    raise ValueError(f"only {len(out)} distinct code_complete prompts available, {k} requested")


def _chat_items(k: int, seed: int, banned: set[str]) -> list[dict]:
    if k <= 0:
        return []
    _, docs = _scan_stdlib(stdlib_dir())
    rng = random.Random(f"lilicorr-chat-{seed}")
    out, used = [], set()
    for rnd in range(3):
        order = list(range(len(docs)))
        rng.shuffle(order)
        for i in order:
            d = docs[i]
            t = rng.choice([t for t in range(3) if (i, t) not in used])
            p = _chat_prompt(d, t)
            if _norm(p) in banned:
                continue
            used.add((i, t))
            banned.add(_norm(p))
            out.append({"id": f"chat/{d.what}/{d.target}/{t}", "kind": "chat",
                        "source": f"stdlib-doc:{d.target}", "prompt": p})
            if len(out) == k:
                return out
    raise ValueError(f"only {len(out)} distinct chat prompts available, {k} requested")


def math_family_seed(seed: int, family: str, base: int = TRAIN_SEED_BASE) -> int:
    return base + 1000 * seed + MATH_FAMILIES.index(family)


def _math_items(k: int, seed: int, banned: set[str], families=MATH_FAMILIES, kind: str = "math",
                suffixes=_MATH_SUFFIXES, seed_base: int = TRAIN_SEED_BASE) -> list[dict]:
    if k <= 0:
        return []
    import logging
    import reasoning_gym
    bad = set(families) & set(EVAL_FAMILIES)
    if bad:
        raise ValueError(f"evaluation families cannot be training sources: {sorted(bad)}")
    rng = random.Random(f"lilicorr-{kind}-{seed}")
    size = max(4, _math.ceil(1.3 * k / len(families)) + 2)
    for _attempt in range(6):
        per_family = []
        for fam in families:
            fseed = math_family_seed(seed, fam, seed_base)
            logging.disable(logging.WARNING)
            try:
                ds = reasoning_gym.create_dataset(fam, seed=fseed, size=size)
                qs = [(i, ds[i]["question"]) for i in range(size)]
            finally:
                logging.disable(logging.NOTSET)
            per_family.append([(fam, fseed, i, q) for i, q in qs])
        out, seen = [], set(banned)
        for j in range(size):                    # round robin over families
            for lst in per_family:
                fam, fseed, i, q = lst[j]
                p = q.rstrip() + suffixes[rng.randrange(len(suffixes))]
                if _norm(p) in seen or _norm(q) in seen:
                    continue
                seen.add(_norm(p))
                out.append({"id": f"{kind}/{fam}/{fseed}/{i}", "kind": kind,
                            "source": f"reasoning_gym:{fam}", "prompt": p})
                if len(out) == k:
                    banned |= seen
                    return out
        size *= 2
    raise ValueError(f"could not make {k} distinct {kind} prompts")


# ----------------------------------------------------------------------------- public API
def _split(n: int, mix: dict) -> dict[str, int]:
    unknown = set(mix) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown prompt kinds in mix: {sorted(unknown)} (known: {KINDS})")
    w = {k: float(mix.get(k, 0.0)) for k in KINDS}
    if any(v < 0 for v in w.values()) or sum(w.values()) <= 0:
        raise ValueError(f"mix weights must be >= 0 and not all zero: {mix}")
    tot = sum(w.values())
    exact = {k: n * v / tot for k, v in w.items()}
    counts = {k: int(_math.floor(x)) for k, x in exact.items()}
    rest = n - sum(counts.values())   # largest remainders, ties in KINDS order
    for k in sorted(KINDS, key=lambda k: (-(exact[k] - counts[k]), KINDS.index(k)))[:rest]:
        counts[k] += 1
    return counts


def iter_training_prompts(n: int, seed: int = 0, mix: dict | None = None) -> list[dict]:
    """``n`` training prompts ``{"id", "kind", "source", "prompt"}``, deterministic in (n, seed, mix).

    ``mix`` weights the kinds in ``KINDS`` (normalised; default
    ``DEFAULT_MIX``); counts are split by largest remainder and the kinds are interleaved in a
    seeded random order, so any prefix is mixed too. Ids are unique; no prompt equals an
    evaluation-suite prompt (exactly, or after collapsing whitespace and case).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    counts = _split(n, DEFAULT_MIX if mix is None else mix)
    banned = {_norm(p) for p in eval_prompt_texts()}
    pools = {
        "code": _code_items(counts["code"], seed, banned),
        "math": _math_items(counts["math"], seed, banned),
        "chat": _chat_items(counts["chat"], seed, banned),
        "code_complete": _code_complete_items(counts["code_complete"], seed, banned),
        "math_reason": _math_items(counts["math_reason"], seed, banned, kind="math_reason",
                                   suffixes=_REASON_SUFFIXES, seed_base=REASON_SEED_BASE),
    }
    order = [k for k in KINDS for _ in range(counts[k])]
    random.Random(f"lilicorr-mix-{seed}").shuffle(order)
    its = {k: iter(v) for k, v in pools.items()}
    out = [next(its[k]) for k in order]
    ids = [x["id"] for x in out]
    assert len(set(ids)) == len(ids), "duplicate training prompt ids"
    return out
