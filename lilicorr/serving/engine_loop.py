"""In-flight batching loop: one SpecEngine, one engine thread, every concurrent request.

``execute()`` of the decoupled Triton model only validates and `submit`s; this thread admits
waiting jobs (``engine.add_request``), checks cancellations (``sink.is_cancelled()`` or a stop
with the job's secret key -> ``engine.cancel(rid)``) and the shutdown drain deadline, runs
``engine.step()`` and streams each step's new tokens through the job's sink. Every job ends
with exactly one final response (data, error, or an empty FINAL after a cancellation), so no
client waits forever. Tests drive it with a real engine on a tiny target and a recording sink.

The pattern is TensorRT-LLM's Python-backend ``tensorrt_llm`` model (engine + awaiter +
cancellation threads), folded into one thread since our engine steps synchronously.
"""
from __future__ import annotations

import collections
import dataclasses
import queue
import secrets
import threading
import time
import traceback
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from lilicorr.profiling import end_request_range, request_range

from .protocol import CONTEXT_WINDOW, GenerationParams

INVALID_ARG = "INVALID_ARG"
INTERNAL = "INTERNAL"
UNAVAILABLE = "UNAVAILABLE"


class Sink(Protocol):
    """Where one request's responses go (a Triton response sender in production)."""

    def send(self, outputs: dict[str, np.ndarray], final: bool) -> None: ...
    def send_error(self, code: str, message: str) -> None: ...      # always final
    def send_final(self) -> None: ...                                # empty FINAL
    def is_cancelled(self) -> bool: ...


@dataclasses.dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    sink: Sink
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    rid: Any = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    accepted: int = 0
    drafted: int = 0
    steps: int = 0
    events: int = 0
    done: bool = False
    nvtx: Any = None          # per-request NVTX range (lilicorr.profiling.request_range)
    # secret per job: only whoever receives this job's responses can stop it (`cancel_job`)
    key: str = dataclasses.field(default_factory=lambda: secrets.token_hex(16))

    def finish(self) -> None:
        """Mark the job answered and close its NVTX request range."""
        self.done = True
        end_request_range(self.nvtx)
        self.nvtx = None

    def label(self) -> str:
        return f"request {self.request_id!r}" if self.request_id else "request <no id>"

    def outputs(self, new: list[int], final: bool, reason: str | None) -> dict[str, np.ndarray]:
        if self.params.stream:
            ctx = self.tokens[max(0, len(self.tokens) - len(new) - CONTEXT_WINDOW): len(self.tokens) - len(new)]
        else:
            new, ctx = self.tokens, []
        return {
            "output_ids": np.asarray(new, dtype=np.int32),
            "context_ids": np.asarray(ctx, dtype=np.int32),
            "is_final": np.asarray([final], dtype=bool),
            "num_accepted": np.asarray([self.accepted], dtype=np.int32),
            "num_drafted": np.asarray([self.drafted], dtype=np.int32),
            "num_steps": np.asarray([self.steps], dtype=np.int32),
            "finish_reason": np.asarray([(reason or "").encode()], dtype=np.object_),
            "job_key": np.asarray([self.key.encode()], dtype=np.object_),
        }


@dataclasses.dataclass
class LoopStats:
    steps: int = 0
    active: int = 0
    waiting: int = 0
    requests_ok: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0
    output_tokens: int = 0
    accepted_tokens: int = 0
    drafted_tokens: int = 0
    verify_steps: int = 0
    last_step_s: float = 0.0


class EngineLoop:
    """Owns the engine; only the loop thread touches it after `start()`."""

    def __init__(self, engine: Any, *, max_active: int = 32, cancel_check_period_s: float = 0.02,
                 idle_poll_s: float = 0.05, on_step: Callable[[LoopStats, list], None] | None = None,
                 log: Callable[[str], None] | None = None, stop_ids: Sequence[int] | None = None,
                 timer: Any = None, publish_every_s: float = 0.0):
        self.engine = engine
        # on_step after a step at most this often, except when a request finished or the active /
        # waiting / failed / cancelled counts changed (0: after every step)
        self.publish_every_s = publish_every_s
        self._published, self._published_at = None, float("-inf")   # the last published counts, when
        self.timer = timer      # lilicorr.profiling.StageTimer: stage times of every engine step
        self.stop_ids = list(stop_ids) if stop_ids else None
        self.max_active = max_active
        self.cancel_check_period_s = cancel_check_period_s
        self.idle_poll_s = idle_poll_s
        self.on_step = on_step
        self.log = log or (lambda msg: None)
        self.stats = LoopStats()
        self._inbox: "queue.Queue[Job]" = queue.Queue()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: dict[Any, Job] = {}
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_cancel_check = 0.0
        self._stop_lock = threading.Lock()
        self._stop_ids: set[str] = set()       # job keys to stop at the next check
        self._drain_deadline: float | None = None   # time.monotonic() at which a drain ends every job

    # ---------------------------------------------------------------- public
    def start(self) -> "EngineLoop":
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="lilicorr-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        if not self._running.is_set() or self._drain_deadline is not None:
            job.finish()
            self.stats.requests_failed += 1
            job.sink.send_error(UNAVAILABLE, f"{job.label()}: the server is shutting down")
            return
        self._inbox.put(job)

    def cancel_job(self, key: str) -> None:
        """Stop the waiting/active job whose secret `Job.key` this is (thread-safe, next check).
        A key is only known to whoever receives that job's responses, so no client can stop a
        request it did not send; an unknown key does nothing."""
        if key:
            with self._stop_lock:
                self._stop_ids.add(key)

    def begin_drain(self, deadline: float) -> None:
        """Shutdown: refuse new jobs from now on, let the others run until `deadline`
        (time.monotonic()), then end each with a final response whose finish_reason is "shutdown"."""
        if self._drain_deadline is None or deadline < self._drain_deadline:
            self._drain_deadline = deadline

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def stop(self, timeout: float = 30.0) -> None:
        self._running.clear()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        # whatever is left gets a final answer
        self._drain_inbox()
        for job in list(self._waiting) + list(self._active.values()):
            self._fail(job, UNAVAILABLE, f"{job.label()}: the server is shutting down")
        self._waiting.clear()
        self._active.clear()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        import contextlib
        with self.timer.active() if self.timer is not None else contextlib.nullcontext():
            self._loop()

    def _loop(self) -> None:
        while self._running.is_set():
            try:
                if not self._active and not self._waiting:
                    try:
                        self._waiting.append(self._inbox.get(timeout=self.idle_poll_s))
                    except queue.Empty:
                        self._publish([])
                        continue
                self._drain_inbox()
                self._check_cancelled(force=False)
                self._check_drain()
                self._admit()
                if self._active:
                    self._step()
                else:
                    self._publish([])
            except Exception:  # a bug in the loop must not kill the server: fail what is active
                msg = traceback.format_exc()
                self.log(f"engine loop error: {msg}")
                for job in list(self._active.values()):
                    self._cancel_in_engine(job)
                    self._fail(job, INTERNAL, f"{job.label()}: engine error: {msg.strip().splitlines()[-1]}")
                self._active.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.max_active:
            job = self._waiting.popleft()
            p = job.params
            try:
                job.rid = self.engine.add_request(job.prompt_ids, p.max_tokens, rule=p.decode_rule,
                                                  temperature=p.temperature, seed=p.seed,
                                                  stop_ids=None if p.ignore_eos else self.stop_ids)
                job.nvtx = request_range("request", payload=job.rid)
            except ValueError as e:
                self._fail(job, INVALID_ARG, f"{job.label()}: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - reported to the client, server keeps serving
                self.log(f"add_request failed: {traceback.format_exc()}")
                self._fail(job, INTERNAL, f"{job.label()}: engine could not admit the request: {e}")
                continue
            self._active[job.rid] = job
        self.stats.active, self.stats.waiting = len(self._active), len(self._waiting)

    def _check_cancelled(self, force: bool) -> None:
        now = time.monotonic()
        with self._stop_lock:
            stop_ids, self._stop_ids = self._stop_ids, set()
        if not stop_ids and not force and now - self._last_cancel_check < self.cancel_check_period_s:
            return
        self._last_cancel_check = now
        for job in list(self._waiting):
            stopped = job.key in stop_ids
            if stopped or self._is_cancelled(job):
                self._waiting.remove(job)
                self._finish_cancelled(job, with_data=stopped)
        for rid, job in list(self._active.items()):
            stopped = job.key in stop_ids
            if stopped or self._is_cancelled(job):
                del self._active[rid]
                self._cancel_in_engine(job)
                self._finish_cancelled(job, with_data=stopped)

    def _check_drain(self) -> None:
        """Past the drain deadline: free every job and end it with finish_reason "shutdown"."""
        if self._drain_deadline is None or time.monotonic() < self._drain_deadline:
            return
        jobs = list(self._waiting) + list(self._active.values())
        self._waiting.clear()
        self._active.clear()
        for job in jobs:
            self._cancel_in_engine(job)
            job.finish()
            self.stats.requests_cancelled += 1
            try:
                job.sink.send(job.outputs([], True, "shutdown"), True)
            except Exception:  # noqa: BLE001 - the client is gone; its sequence is freed anyway
                self.log(f"{job.label()}: could not send the shutdown response: {traceback.format_exc()}")

    def _step(self) -> None:
        t0 = time.perf_counter()
        events = self.engine.step()
        self.stats.last_step_s = time.perf_counter() - t0
        self.stats.steps += 1
        for ev in events:
            job = self._active.get(ev.rid)
            if job is None:
                continue
            new = [int(t) for t in ev.new_tokens]
            job.tokens.extend(new)
            job.events += 1
            self.stats.output_tokens += len(new)
            if job.events > 1:
                # the first event is the prefill's token: not a verify step (as in engine.Result.tau)
                acc, dr = int(getattr(ev, "accepted", 0) or 0), int(getattr(ev, "drafted", 0) or 0)
                job.accepted += acc
                job.drafted += dr
                job.steps += 1
                self.stats.accepted_tokens += acc
                self.stats.drafted_tokens += dr
                self.stats.verify_steps += 1
            final = bool(ev.finished)
            if final:
                del self._active[ev.rid]
            if not (final or (job.params.stream and new)):
                continue
            try:
                job.sink.send(job.outputs(new, final, ev.finish_reason if final else None), final)
            except Exception as e:  # noqa: BLE001 - usually the client is gone: free its sequence
                self.log(f"{job.label()}: send failed ({e}); cancelling")
                if not final:
                    self._active.pop(ev.rid, None)
                    self._cancel_in_engine(job)
                    self._finish_cancelled(job, send=False)
                try:   # if the sender still works, the request must still end with a FINAL
                    job.sink.send_error(INTERNAL, f"{job.label()}: could not send a response: {e}")
                except Exception:  # noqa: BLE001
                    pass
                continue
            if final:
                job.finish()
                self.stats.requests_ok += 1
        self._publish(events)

    def _publish(self, events: list) -> None:
        """Refresh the gauges and call the on_step hook (after a step, or when idle counts changed).
        With `publish_every_s`, a step that finished no request and changed no count waits for the
        next one past that interval: each call crosses to the server (the model's metrics), and the
        step that ends a request, or the idle loop after it, always publishes everything."""
        self.stats.active, self.stats.waiting = len(self._active), len(self._waiting)
        key = (self.stats.steps, self.stats.active, self.stats.waiting, self.stats.requests_failed,
               self.stats.requests_cancelled)
        last = self._published
        if self.on_step is None or (not events and key == last):
            return
        now = time.monotonic()
        if (events and last is not None and key[1:] == last[1:] and now - self._published_at < self.publish_every_s
                and not any(getattr(ev, "finished", False) for ev in events)):
            return
        self._published, self._published_at = key, now
        try:
            self.on_step(self.stats, events)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            self.log(f"on_step hook failed: {traceback.format_exc()}")

    # ---------------------------------------------------------------- helpers
    def _is_cancelled(self, job: Job) -> bool:
        try:
            return bool(job.sink.is_cancelled())
        except Exception:  # noqa: BLE001 - a closed sender counts as gone
            return True

    def _cancel_in_engine(self, job: Job) -> None:
        if job.rid is None:
            return
        try:
            self.engine.cancel(job.rid)
        except Exception:  # noqa: BLE001
            self.log(f"{job.label()}: engine.cancel failed: {traceback.format_exc()}")

    def _finish_cancelled(self, job: Job, send: bool = True, with_data: bool = False) -> None:
        """FINAL is still required after a cancellation. A job stopped by its key (its
        requester, e.g. an ensemble, is still listening) gets a last data response with
        finish_reason "cancelled"; a job whose client is gone gets an empty FINAL."""
        job.finish()
        self.stats.requests_cancelled += 1
        if not send:
            return
        try:
            if with_data:
                job.sink.send(job.outputs([], True, "cancelled"), True)
            else:
                job.sink.send_final()
        except Exception:  # noqa: BLE001
            pass

    def _fail(self, job: Job, code: str, message: str) -> None:
        job.finish()
        self.stats.requests_failed += 1
        try:
            job.sink.send_error(code, message)
        except Exception:  # noqa: BLE001
            self.log(f"{job.label()}: could not send error: {traceback.format_exc()}")
