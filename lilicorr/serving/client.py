"""Small Python client for the LiLiCorr Triton server (gRPC streaming).

    client = LiLiCorrClient("127.0.0.1:8001")
    for delta in client.stream("Write a haiku", max_tokens=64):      # text deltas as they arrive
        print(delta.text, end="", flush=True)
    res = client.generate("Write a haiku", max_tokens=64, decode_rule="lilicorr")
    res.text, res.token_ids, res.accepted, res.drafted, res.steps, res.tau, res.ttft, res.token_times

Each request gets its own gRPC stream (decoupled models only answer on streams, and a stream is
the unit the server can cancel), so `GenerationStream.cancel()` / leaving the ``with`` block early
cancels exactly that request; the server then frees its sequence. A bad request raises
`GenerationError` with the server's message, which names the request id. (The
``triton_grpc_error`` stream header, which would add the gRPC status code, is not used: the 2.51
server segfaulted on the second failed stream with it.)

Two entry points on the server:
* ``model="ensemble"`` (default): text in (``prompt`` or chat ``messages``), text deltas out;
* ``model="lilicorr"``: token ids in (``input_ids``), token ids out (``text`` stays empty unless a
  `lilicorr.tokenizer.Tokenizer` is given to decode them client-side).
"""
from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .protocol import MODEL_ENGINE, MODEL_ENSEMBLE

_DONE = object()


class GenerationError(RuntimeError):
    """The server rejected or failed a request. ``status`` is the gRPC status name when known."""

    def __init__(self, message: str, status: str | None = None, request_id: str = ""):
        super().__init__(message)
        self.status = status
        self.request_id = request_id


@dataclasses.dataclass
class Delta:
    text: str                 # text delta ("" for model="lilicorr" without a tokenizer)
    token_ids: list[int]      # new token ids
    t: float                  # seconds since the request was sent
    final: bool = False


@dataclasses.dataclass
class GenerationResult:
    request_id: str
    text: str
    token_ids: list[int]
    accepted: int             # accepted tokens incl. the bonus token (server count)
    drafted: int              # drafted tokens proposed to the verifier
    steps: int                # verify steps of this request
    finish_reason: str
    ttft: float | None        # seconds from send to the first token
    latency: float            # seconds from send to the final response
    token_times: list[float]  # arrival time (s since send) of every token
    cancelled: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tau(self) -> float:
        """Accepted tokens (incl. bonus) per verify step."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first one (s)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


def _grpc():
    try:
        import tritonclient.grpc as grpcclient
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the client needs tritonclient[grpc] (pip install -e .[serve])") from e
    return grpcclient


def _status_name(err: Any) -> str | None:
    try:
        s = err.status()
    except Exception:  # noqa: BLE001
        return None
    return None if s is None else str(s)


class GenerationStream:
    """One request on its own gRPC stream. Iterate for `Delta`s; `result()` drains and summarises."""

    def __init__(self, client: "LiLiCorrClient", model: str, inputs: list, outputs: list,
                 request_id: str, timeout: float | None, tokenizer: Any = None,
                 parameters: dict | None = None):
        grpcclient = _grpc()
        self.request_id = request_id
        self.model = model
        self.timeout = timeout
        self._tokenizer = tokenizer
        self._q: "queue.Queue[Any]" = queue.Queue()
        self._client = grpcclient.InferenceServerClient(client.url, verbose=False)
        self._closed = False
        self._finished = False
        self.cancelled = False
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.text_parts: list[str] = []
        self.counts = {"num_accepted": 0, "num_drafted": 0, "num_steps": 0}
        self.finish_reason = ""
        self.error: GenerationError | None = None
        self._decoder = tokenizer.stream() if tokenizer is not None and model == MODEL_ENGINE else None
        self.t0 = time.perf_counter()
        self.t_end: float | None = None
        # No {"triton_grpc_error": "true"} header: with it, tritonserver 2.51 answers the first error
        # with a real status but then segfaults (observed on the second failed stream). Errors
        # therefore arrive as messages (status None) and the message names the request id.
        self._client.start_stream(callback=self._callback)
        self._client.async_stream_infer(model, inputs, outputs=outputs, request_id=request_id,
                                        enable_empty_final_response=True, parameters=parameters or None)

    # called on the stream's reader thread
    def _callback(self, result=None, error=None):
        t = time.perf_counter() - self.t0
        if error is not None:
            self._q.put(("error", error, t))
        else:
            self._q.put(("result", result, t))

    def _handle(self, result: Any, t: float) -> Delta | None:
        resp = result.get_response()
        final = bool(resp.parameters["triton_final_response"].bool_param) if "triton_final_response" in resp.parameters else False
        names = {o.name for o in resp.outputs}
        ids = [int(x) for x in result.as_numpy("output_ids").reshape(-1)] if "output_ids" in names else []
        text = ""
        if "text_output" in names:
            arr = result.as_numpy("text_output").reshape(-1)
            text = b"".join(x if isinstance(x, bytes) else str(x).encode() for x in arr).decode("utf-8", "replace")
        elif self._decoder is not None:
            text = self._decoder.push(ids) + (self._decoder.flush() if final else "")
        for key in self.counts:
            if key in names:
                self.counts[key] = int(result.as_numpy(key).reshape(-1)[0])
        if "finish_reason" in names:
            fr = result.as_numpy("finish_reason").reshape(-1)[0]
            self.finish_reason = fr.decode() if isinstance(fr, bytes) else str(fr)
        self.token_ids.extend(ids)
        self.token_times.extend([t] * len(ids))
        self.text_parts.append(text)
        if final:
            self._finished = True
            self.t_end = t
        if not ids and not text and not final:
            return None
        return Delta(text=text, token_ids=ids, t=t, final=final)

    def __iter__(self) -> Iterator[Delta]:
        try:
            while not self._finished:
                try:
                    kind, payload, t = self._q.get(timeout=self.timeout)
                except queue.Empty:
                    self.cancel()
                    raise GenerationError(f"request {self.request_id!r}: no response within {self.timeout} s",
                                          "DEADLINE_EXCEEDED", self.request_id) from None
                if kind == "error":
                    status = _status_name(payload)
                    msg = payload.message() if hasattr(payload, "message") else str(payload)
                    if status and "CANCELLED" in status and self.cancelled:
                        self._finished = True
                        break
                    self.error = GenerationError(msg or str(payload), status, self.request_id)
                    self._finished = True
                    raise self.error
                delta = self._handle(payload, t)
                if self._finished:
                    # close the gRPC stream before handing out the last delta: an open stream
                    # keeps server resources (tritonserver 2.51 cannot even shut down past it)
                    self.close()
                if delta is not None:
                    yield delta
        finally:
            if self._finished or self.error is not None:
                self.close()

    def result(self) -> GenerationResult:
        for _ in self:
            pass
        return GenerationResult(
            request_id=self.request_id, text="".join(self.text_parts), token_ids=list(self.token_ids),
            accepted=self.counts["num_accepted"], drafted=self.counts["num_drafted"],
            steps=self.counts["num_steps"], finish_reason=self.finish_reason or ("cancelled" if self.cancelled else ""),
            ttft=self.token_times[0] if self.token_times else None,
            latency=self.t_end if self.t_end is not None else time.perf_counter() - self.t0,
            token_times=list(self.token_times), cancelled=self.cancelled)

    def cancel(self) -> None:
        """Cancel this request (closes its gRPC stream; the server frees the sequence)."""
        if self._closed:
            return
        self.cancelled = True
        self._closed = True
        try:
            self._client.stop_stream(cancel_requests=True)
        finally:
            self._client.close()

    def close(self) -> None:
        if self._closed:
            return
        if not self._finished:
            self.cancel()
            return
        self._closed = True
        try:
            self._client.stop_stream(cancel_requests=False)
        finally:
            self._client.close()

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class LiLiCorrClient:
    def __init__(self, url: str, model: str = MODEL_ENSEMBLE, timeout: float | None = 600.0,
                 tokenizer: Any = None):
        self.url = url.replace("grpc://", "")
        self.model = model
        self.timeout = timeout
        self.tokenizer = tokenizer

    # ------------------------------------------------------------------ inputs
    def build_inputs(self, model: str, prompt: str | None = None, messages: Sequence[dict] | None = None,
                     input_ids: Sequence[int] | None = None, max_tokens: int | None = None,
                     decode_rule: str | None = None, temperature: float | None = None,
                     seed: int | None = None, stream: bool | None = None) -> list:
        grpcclient = _grpc()
        inputs = []

        def add(name: str, arr: np.ndarray, dtype: str) -> None:
            inp = grpcclient.InferInput(name, list(arr.shape), dtype)
            inp.set_data_from_numpy(arr)
            inputs.append(inp)

        if model == MODEL_ENGINE:
            if input_ids is None:
                raise ValueError("model='lilicorr' takes input_ids (token ids); use the ensemble for text")
            add("input_ids", np.asarray(input_ids, dtype=np.int32).reshape(-1), "INT32")
        else:
            if messages is not None:
                add("messages_json", np.array([json.dumps(list(messages)).encode()], dtype=np.object_), "BYTES")
            if prompt is not None:
                add("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES")
        if max_tokens is not None:
            add("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32")
        if temperature is not None:
            add("temperature", np.array([temperature], dtype=np.float32), "FP32")
        if seed is not None:
            add("seed", np.array([seed], dtype=np.int64), "INT64")
        if decode_rule is not None:
            add("decode_rule", np.array([decode_rule.encode()], dtype=np.object_), "BYTES")
        if stream is not None:
            add("stream", np.array([bool(stream)], dtype=bool), "BOOL")
        return inputs

    def outputs(self, model: str) -> list:
        grpcclient = _grpc()
        names = ["output_ids", "num_accepted", "num_drafted", "num_steps", "finish_reason"]
        if model != MODEL_ENGINE:
            names.append("text_output")
        return [grpcclient.InferRequestedOutput(n) for n in names]

    # ------------------------------------------------------------------ requests
    def stream(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
               input_ids: Sequence[int] | None = None, max_tokens: int | None = None,
               decode_rule: str | None = None, temperature: float | None = None, seed: int | None = None,
               stream: bool = True, model: str | None = None, request_id: str | None = None,
               inputs: list | None = None, ignore_eos: bool | None = None,
               parameters: dict | None = None) -> GenerationStream:
        """Send one request on its own stream; iterate the returned object for deltas.

        ``ignore_eos=True`` generates exactly max_tokens tokens (request parameter);
        ``parameters`` are sent as request parameters (knobs may go there too)."""
        parameters = dict(parameters or {})
        if ignore_eos is not None:
            parameters["ignore_eos"] = bool(ignore_eos)
        model = model or (MODEL_ENGINE if input_ids is not None and prompt is None and messages is None
                          else self.model)
        if inputs is None:
            inputs = self.build_inputs(model, prompt, messages, input_ids, max_tokens, decode_rule,
                                       temperature, seed, stream)
        return GenerationStream(self, model, inputs, self.outputs(model), request_id or uuid.uuid4().hex[:12],
                                self.timeout, self.tokenizer, parameters)

    def generate(self, prompt: str | None = None, *, on_delta: Callable[[Delta], None] | None = None,
                 **kwargs: Any) -> GenerationResult:
        """Blocking generation; ``stream=True`` (default) has the server stream every step, so
        ttft and token_times are per step; ``on_delta`` sees each delta as it arrives."""
        gs = self.stream(prompt, **kwargs)
        with gs:
            for delta in gs:
                if on_delta is not None:
                    on_delta(delta)
            return gs.result()

    # ------------------------------------------------------------------ server info
    def server_ready(self) -> bool:
        c = _grpc().InferenceServerClient(self.url)
        try:
            return bool(c.is_server_ready())
        except Exception:  # noqa: BLE001
            return False
        finally:
            c.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server_ready():
                return
            time.sleep(0.25)
        raise TimeoutError(f"server at {self.url} not ready after {timeout:.0f} s")


def run_concurrent(fn: Callable[[Any], Any], items: Sequence[Any], concurrency: int) -> list[Any]:
    """Closed-loop load: `concurrency` workers, each taking the next item as soon as it is done.
    Returns results in item order (exceptions are returned in place of results)."""
    results: list[Any] = [None] * len(items)
    lock = threading.Lock()
    nxt = iter(range(len(items)))

    def worker() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except Exception as e:  # noqa: BLE001
                results[i] = e

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, min(concurrency, len(items))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
