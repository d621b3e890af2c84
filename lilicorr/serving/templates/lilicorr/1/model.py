"""lilicorr: decoupled Python model running ONE SpecEngine with in-flight batching.

execute() validates each request and hands it to the engine thread (lilicorr.serving.engine_loop),
which batches every active request into engine.step() calls and streams each step's new tokens
through the request's response sender. A FINAL flag always closes a request: with its last data,
with an INVALID_ARG/INTERNAL error (the message names the request id), or empty after the client
cancelled (sender.is_cancelled() -> engine.cancel(rid)), or after a `stop=true` request carrying
the job's secret `job_key` (an output of every response, so only the receiver of a request's
responses can stop it; how postprocessing cancels through the ensemble: Triton 2.51 does not
propagate a client's cancellation to an ensemble step that is already running).

Shutdown drain: the launcher writes `protocol.SHUTDOWN_FILE` (a wall-clock deadline) into this
model's directory; from then on new requests get UNAVAILABLE, running ones continue until the
deadline and then end with finish_reason "shutdown".

Outputs per response: output_ids (new tokens; all tokens when stream=false), context_ids (a
window of earlier tokens, for the detokenizer), is_final, cumulative num_accepted (incl. bonus),
num_drafted and num_steps (verify steps), finish_reason ("" until the end).
"""
import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from lilicorr.serving.engine_loop import EngineLoop, Job
from lilicorr.serving.protocol import (KNOBS, SHUTDOWN_FILE, RequestError, fit_params,
                                       parse_generation_params, parse_parameters, validate_prompt_ids)
from lilicorr.serving.repository import model_parameters, open_engine

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class SenderSink:
    """engine_loop.Sink over a Triton response sender."""

    def __init__(self, sender):
        self.sender = sender

    def send(self, outputs, final):
        tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)
        if final:
            self.sender = None

    def send_error(self, code, message):
        err = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL))
        self.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err), flags=FINAL)
        self.sender = None

    def send_final(self):
        self.sender.send(flags=FINAL)
        self.sender = None

    def is_cancelled(self):
        return self.sender is None or self.sender.is_cancelled()


# metrics sync at most this often while requests run (each sync is IPC to the server), and always
# after a step that finishes a request or changes the request counts
METRICS_EVERY_S = 0.1


class _Metrics:
    """Custom Prometheus metrics on the server's /metrics endpoint (synced after engine steps,
    at most every METRICS_EVERY_S while requests run, and whenever a request finishes)."""

    COUNTERS = {
        "output_tokens": "lilicorr_output_tokens",
        "accepted_tokens": "lilicorr_accepted_tokens",
        "drafted_tokens": "lilicorr_drafted_tokens",
        "verify_steps": "lilicorr_verify_steps",
        "steps": "lilicorr_engine_steps",
        "requests_ok": "lilicorr_requests_completed",
        "requests_failed": "lilicorr_requests_failed",
        "requests_cancelled": "lilicorr_requests_cancelled",
    }

    def __init__(self):
        self._lock = threading.Lock()
        self._families = []
        self._counters = {}
        for field, name in self.COUNTERS.items():
            fam = pb_utils.MetricFamily(name=name, description=f"LiLiCorr engine: {field.replace('_', ' ')}",
                                        kind=pb_utils.MetricFamily.COUNTER)
            self._families.append(fam)
            self._counters[field] = [fam.Metric(labels={"model": "lilicorr"}), 0]
        fam = pb_utils.MetricFamily(name="lilicorr_requests", description="LiLiCorr requests by state",
                                    kind=pb_utils.MetricFamily.GAUGE)
        self._families.append(fam)
        self._active = fam.Metric(labels={"model": "lilicorr", "state": "active"})
        self._waiting = fam.Metric(labels={"model": "lilicorr", "state": "waiting"})

    def enable_stages(self):
        from lilicorr.profiling import STAGES
        fam = pb_utils.MetricFamily(name="lilicorr_stage_seconds",
                                    description="LiLiCorr engine wall time per stage (Table 3 stages, profile=true)",
                                    kind=pb_utils.MetricFamily.COUNTER)
        self._families.append(fam)
        self._stages = {s: [fam.Metric(labels={"model": "lilicorr", "stage": s}), 0.0]
                        for s in STAGES + ("block",)}
        fam = pb_utils.MetricFamily(name="lilicorr_stage_blocks", description="LiLiCorr blocks timed",
                                    kind=pb_utils.MetricFamily.COUNTER)
        self._families.append(fam)
        self._blocks = [fam.Metric(labels={"model": "lilicorr"}), 0]

    def sync_stages(self, timer):
        with self._lock:
            values = dict(timer.totals)
            values["block"] = timer.block_wall
            for name, entry in self._stages.items():
                v = float(values.get(name, 0.0))
                if v > entry[1]:
                    entry[0].increment(v - entry[1])
                    entry[1] = v
            if timer.blocks > self._blocks[1]:
                self._blocks[0].increment(timer.blocks - self._blocks[1])
                self._blocks[1] = timer.blocks

    def sync(self, stats):
        with self._lock:
            for field, entry in self._counters.items():
                value = getattr(stats, field)
                if value > entry[1]:
                    entry[0].increment(value - entry[1])
                    entry[1] = value
            self._active.set(stats.active)
            self._waiting.set(stats.waiting)

    def close(self):
        # metrics before their family
        self._counters.clear()
        self._stages, self._blocks = {}, None
        self._active = self._waiting = None
        self._families.clear()


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(cfg):
            raise pb_utils.TritonModelException("the lilicorr model must be decoupled (model_transaction_policy)")
        params = model_parameters(cfg)
        self.engine, self.limits = open_engine(params, base_dir=args["model_repository"])
        self.metrics = _Metrics()
        timer = None
        if params.get("profile", "").lower() == "true":
            from lilicorr.profiling import StageTimer
            timer = StageTimer()
            self.metrics.enable_stages()

        # no IPC from the engine thread before initialize() has returned (metrics start with the
        # first request): a metrics update racing the stub's reply to initialize is the suspected
        # cause of one load that never completed on a heavily loaded machine
        self._serving = threading.Event()

        def on_step(stats, events):
            if not self._serving.is_set():
                return
            # stages first, request counters last: a scrape that sees a request ended then sees
            # every block of it (a publish can carry several steps' blocks: METRICS_EVERY_S)
            if timer is not None:
                self.metrics.sync_stages(timer)
            self.metrics.sync(stats)

        self.timer = timer
        self.loop = EngineLoop(
            self.engine,
            max_active=int(params.get("max_batch") or 32),
            cancel_check_period_s=int(params.get("cancellation_check_period_ms") or 20) / 1000.0,
            on_step=on_step,
            publish_every_s=METRICS_EVERY_S,
            log=pb_utils.Logger.log_error,
            stop_ids=self.limits.stop_ids,
            timer=timer,
        ).start()
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch_shutdown, name="lilicorr-shutdown-watch",
                                         args=(os.path.join(args["model_repository"], SHUTDOWN_FILE),),
                                         daemon=True)
        self._watcher.start()
        import sys

        import lilicorr
        pb_utils.Logger.log_info(f"lilicorr stub python {sys.version.split()[0]} prefix={sys.prefix} "
                                 f"lilicorr={lilicorr.__file__} numpy={np.__version__}")
        pb_utils.Logger.log_info(f"lilicorr engine ready: {params.get('engine_dir') or params.get('target_dir')} "
                                 f"(max_batch={params.get('max_batch')}, max_seq_len={self.limits.max_seq_len}, "
                                 f"vocab={self.limits.vocab_size})")

    def _job(self, request, sink):
        label = f"request {request.request_id()!r}" if request.request_id() else "request <no id>"
        try:
            parameters = parse_parameters(request.parameters())
            tensors = {}
            for name in KNOBS:
                t = pb_utils.get_input_tensor_by_name(request, name)
                tensors[name] = None if t is None else np.copy(t.as_numpy())
            gen = parse_generation_params(tensors, parameters, self.limits)
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
            if ids is None:
                raise RequestError("missing input_ids")
            arr = ids.as_numpy()
            gen = fit_params(gen, int(arr.size), self.limits)
            prompt = validate_prompt_ids(arr, self.limits, gen.max_tokens)
        except RequestError as e:
            self.loop.stats.requests_failed += 1
            sink.send_error("INVALID_ARG", f"{label}: {e}")
            return None
        return Job(request.request_id(), prompt, gen, sink)

    def execute(self, requests):
        self._serving.set()
        for request in requests:
            sink = SenderSink(request.get_response_sender())
            stop = pb_utils.get_input_tensor_by_name(request, "stop")
            if stop is not None and bool(stop.as_numpy().reshape(-1)[0]):
                key = pb_utils.get_input_tensor_by_name(request, "job_key")
                if key is not None and key.as_numpy().size == 1:
                    k = key.as_numpy().reshape(-1)[0]
                    self.loop.cancel_job(k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k))
                sink.send_final()
                continue
            try:
                job = self._job(request, sink)
            except Exception as e:  # noqa: BLE001 - never raise: that would fail the whole batch
                if sink.sender is not None:
                    sink.send_error("INTERNAL", f"request {request.request_id()!r}: {e}")
                continue
            if job is not None:
                self.loop.submit(job)
        return None

    def _watch_shutdown(self, path):
        """Start the drain once the launcher has written the shutdown file (see the docstring)."""
        while not self._closing.wait(0.1):
            try:
                with open(path) as f:
                    deadline = float(json.load(f)["deadline"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            self.loop.begin_drain(time.monotonic() + max(0.0, deadline - time.time()))
            pb_utils.Logger.log_info(f"lilicorr: draining, deadline in {max(0.0, deadline - time.time()):.1f} s")
            return

    def finalize(self):
        self._closing.set()
        self.loop.stop()
        self.metrics.sync(self.loop.stats)
        if self.timer is not None and self.timer.blocks:       # Table 3 decomposition in the server log
            pb_utils.Logger.log_info("lilicorr stage decomposition at shutdown:\n" +
                                     self.timer.markdown("LiLiCorr engine, all requests"))
        self.metrics.close()
