"""Regenerate the assistant turns of training prompts with the target model (greedy, rule "ar").

Used by ``train/regen.py``. Every token comes from the project's one engine,
``lilicorr.engine.SpecEngine`` with ``rule="ar"`` (plain greedy autoregressive decoding through the
same continuous-batching path as speculative decoding).

Output: JSONL, one object per prompt, written as one ``os.write`` of one complete line on an
``O_APPEND`` descriptor, so an interrupted run leaves at most a trailing partial line; on start a
trailing partial line is dropped and ids already present are skipped (resume). Lines::

    {"id", "kind", "source",
     "messages": [...prompt messages..., {"role": "assistant", "content": "..."}],
     "prompt_ids": [...],        # tokenizer.encode_chat(prompt messages) (with generation prompt)
     "completion_ids": [...],    # generated ids as the engine emitted them (a final stop id included)
     "finish_reason": "stop" | "length" | ...}

A sidecar ``FILE.meta.json`` records the generation settings; resuming with different settings is
refused (``allow_mismatch=True`` overrides).
"""
from __future__ import annotations

import errno
import inspect
import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Iterable

from .data.suites import to_messages

META_KEYS = ("target", "max_new_tokens", "seed", "mix", "prompts", "rule")


# ----------------------------------------------------------------------------- output file
def parse_record(line: str | bytes, where: str) -> dict:
    """One complete line of this format -> its record (an object with an "id"). Anything else is
    corruption: ``ValueError`` naming ``where`` (file:line)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON in a complete line ({e.msg}); "
                         f"the file is corrupt, fix or remove that line") from None
    if not isinstance(rec, dict) or "id" not in rec:
        raise ValueError(f"{where}: line is not an object with an \"id\"")
    return rec


def iter_id_lines(path: str | os.PathLike):
    """(id, line) for each line of a finished JSONL file of this format, plain or gzipped (``.gz``),
    each line ending in a newline. A line that is not JSON or has no "id" raises ``ValueError``
    naming it (`parse_record`)."""
    import gzip
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                rec = parse_record(line, f"{path}:{lineno}")
                yield rec["id"], line if line.endswith("\n") else line + "\n"


def read_ids(path: str | os.PathLike) -> set[str]:
    """The ids of a finished JSONL file (`iter_id_lines`): what an earlier round wrote."""
    return {i for i, _ in iter_id_lines(path)}


def repair_and_read(path: str | os.PathLike) -> dict[str, dict]:
    """Drop a trailing partial line of ``path`` (in place) and return {id: record} of its lines.

    A complete line that is not valid JSON (or has no "id") is corruption, not interruption:
    raises ``ValueError`` naming the line.
    """
    path = Path(path)
    if not path.exists():
        return {}
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1          # 0 when there is no complete line at all
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
            print(f"[regen] {path}: dropped a trailing partial line ({len(data) - cut} bytes)",
                  file=sys.stderr)
            data = data[:cut]
    done: dict[str, dict] = {}
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if line.strip():
            rec = parse_record(line, f"{path}:{lineno}")
            done[rec["id"]] = rec
    return done


class LineWriter:
    """Appends whole lines with single ``os.write`` calls (O_APPEND) under an exclusive lock."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            import fcntl
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:   # not POSIX
            pass
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RuntimeError(f"{self.path} is being written by another process") from None
            raise

    def write(self, obj: dict) -> None:
        buf = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(buf)
        while view:                      # a regular-file write is whole except on errors (ENOSPC)
            n = os.write(self.fd, view)
            view = view[n:]

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.fsync(self.fd)
            finally:
                os.close(self.fd)
                self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_meta(out: Path, meta: dict, allow_mismatch: bool, have_lines: bool) -> None:
    mpath = out.with_name(out.name + ".meta.json")
    if mpath.exists() and have_lines:
        old = json.loads(mpath.read_text(encoding="utf-8"))
        diff = {k: (old.get(k), meta.get(k)) for k in META_KEYS if old.get(k) != meta.get(k)}
        if diff and not allow_mismatch:
            raise ValueError(f"{out} was made with other settings {diff} (old, new); use another "
                             f"--out or pass --allow-mismatch")
    tmp = mpath.with_name(mpath.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, mpath)


# ----------------------------------------------------------------------------- tokenizer glue
def _encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    fn = tokenizer.encode_chat
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    ids = fn(messages, add_generation_prompt=True) if "add_generation_prompt" in params else fn(messages)
    return [int(t) for t in ids]


def _decode(tokenizer, ids: list[int]) -> str:
    fn = tokenizer.decode
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    return fn(ids, skip_special_tokens=True) if "skip_special_tokens" in params else fn(ids)


def _progress(total: int, initial: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:   # pragma: no cover
        tqdm = None
    if tqdm is None or not enabled:
        class _Null:
            def update(self, n=1): pass
            def set_postfix(self, *a, **k): pass
            def close(self): pass
        return _Null()
    return tqdm(total=total, initial=initial, unit="prompt", desc="regen", dynamic_ncols=True)


# ----------------------------------------------------------------------------- main loop
def regenerate(target_dir: str | os.PathLike | None, out: str | os.PathLike, *,
               num_prompts: int = 1000, max_new_tokens: int = 256, batch_size: int = 8, seed: int = 0,
               mix: dict | None = None, prompts: Iterable[dict] | None = None,
               prompts_name: str | None = None,
               device: str = "cpu", dtype=None, max_seq_len: int = 2048,
               engine=None, tokenizer=None, progress: bool = True, allow_mismatch: bool = False,
               max_prompts_this_run: int | None = None, shard: tuple[int, int] | None = None,
               exclude: Iterable[str] = ()) -> dict:
    """Generate the assistant turn of each training prompt into ``out`` (resumable JSONL).

    ``prompts`` defaults to ``iter_training_prompts(num_prompts, seed, mix)``. ``engine`` /
    ``tokenizer`` may be passed in (tests); otherwise ``SpecEngine.from_paths(target_dir, ...)``
    and ``Tokenizer.from_dir(target_dir)`` are built. ``max_prompts_this_run`` stops after that
    many new lines (for tests of resume). ``shard=(i, n)`` keeps the i-th of n contiguous blocks of
    the prompt list, so n processes (one per core, each its own ``out``) split one list. ``exclude``:
    ids dropped from the list before it is sharded (a grown list minus what an earlier round wrote,
    `read_ids`), so the shards split only the new work. Returns counts:
    ``{"total", "already_done", "written", "skipped_too_long", "new_tokens", "seconds"}``.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    out = Path(out)
    if prompts is None:
        from .data.prompt_sources import iter_training_prompts
        prompts = iter_training_prompts(num_prompts, seed=seed, mix=mix)
    prompts = list(prompts)
    exclude = set(exclude)
    if exclude:
        prompts = [p for p in prompts if p["id"] not in exclude]
    if shard is not None:
        i, n = shard
        if not 0 <= i < n:
            raise ValueError(f"shard {i}/{n}: need 0 <= i < n")
        prompts = prompts[i * len(prompts) // n: (i + 1) * len(prompts) // n]
    ids = [p["id"] for p in prompts]
    if len(set(ids)) != len(ids):
        raise ValueError("prompt ids are not unique")

    done = repair_and_read(out)
    meta = {"target": str(Path(target_dir).resolve()) if target_dir is not None else None,
            "max_new_tokens": max_new_tokens, "seed": seed, "mix": mix,
            "prompts": prompts_name, "rule": "ar"}
    if shard is not None:
        meta["shard"] = f"{shard[0]}/{shard[1]}"
    _check_meta(out, meta, allow_mismatch, bool(done))
    todo = deque(p for p in prompts if p["id"] not in done)
    stats = {"total": len(prompts), "already_done": len(prompts) - len(todo), "written": 0,
             "skipped_too_long": 0, "new_tokens": 0, "seconds": 0.0}
    if not todo:
        return stats

    if tokenizer is None:
        from .tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(target_dir)
    if engine is None:
        import torch
        from .engine import SpecEngine
        engine = SpecEngine.from_paths(target_dir, ckpt_dir=None, max_batch=batch_size,
                                       max_seq_len=max_seq_len, device=device,
                                       dtype=dtype if dtype is not None else torch.float32,
                                       # the serving kernels: 2.2x faster in bf16 on AMX (results/regen_throughput_amx)
                                       batch_invariant=None)
    stop_ids = sorted({int(t) for t in (tokenizer.eos_ids or [])})
    if hasattr(engine, "keep_results"):
        engine.keep_results = False       # results are written out; don't keep them in memory
    # the engine's own context rule: prompt + max_tokens <= max_seq_len - block_size
    room = getattr(engine, "max_seq_len", max_seq_len) - getattr(engine, "block_size", 0)

    bar = _progress(len(prompts), stats["already_done"], progress)
    t0 = time.perf_counter()
    active: dict = {}     # rid -> [item, messages, prompt_ids, completion_ids]
    idle_steps = 0
    limit = max_prompts_this_run
    with LineWriter(out) as writer:
        try:
            while todo or active:
                while todo and len(active) < batch_size and (limit is None or stats["written"] + len(active) < limit):
                    item = todo.popleft()
                    msgs = to_messages(item)
                    pids = _encode_chat(tokenizer, msgs)
                    if len(pids) + max_new_tokens > room:
                        stats["skipped_too_long"] += 1
                        print(f"[regen] skip {item['id']}: {len(pids)} prompt tokens + {max_new_tokens} "
                              f"new > {room} (context)", file=sys.stderr)
                        bar.update(1)
                        continue
                    rid = engine.add_request(pids, max_tokens=max_new_tokens, rule="ar",
                                             stop_ids=stop_ids)
                    active[rid] = [item, msgs, pids, []]
                if not active:
                    break
                events = engine.step()
                idle_steps = 0 if events else idle_steps + 1
                if idle_steps > 10_000:
                    raise RuntimeError("engine.step() returned no events for 10000 steps with "
                                       f"{len(active)} active requests")
                for ev in events:
                    st = active.get(ev.rid)
                    if st is None:
                        continue
                    st[3].extend(int(t) for t in ev.new_tokens)
                    stats["new_tokens"] += len(ev.new_tokens)
                    if ev.finished:
                        item, msgs, pids, comp = active.pop(ev.rid)
                        text_ids = comp[:-1] if comp and comp[-1] in stop_ids else comp
                        reason = ev.finish_reason or ("length" if len(comp) >= max_new_tokens else "stop")
                        rec = {"id": item["id"]}
                        for k in ("kind", "source"):
                            if k in item:
                                rec[k] = item[k]
                        rec.update({
                            "messages": msgs + [{"role": "assistant",
                                                 "content": _decode(tokenizer, text_ids)}],
                            "prompt_ids": pids, "completion_ids": comp, "finish_reason": reason})
                        writer.write(rec)
                        stats["written"] += 1
                        bar.update(1)
                        dt = time.perf_counter() - t0
                        bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(dt, 1e-9):.1f}")
                if limit is not None and stats["written"] >= limit and not active:
                    break
        except KeyboardInterrupt:
            for rid in list(active):
                try:
                    engine.cancel(rid)
                except Exception:
                    pass
            bar.close()
            print(f"\n[regen] interrupted after {stats['written']} new lines; rerun the same command "
                  f"to resume", file=sys.stderr)
            raise
        finally:
            stats["seconds"] = time.perf_counter() - t0
    bar.close()
    return stats
