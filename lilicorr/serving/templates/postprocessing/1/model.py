"""postprocessing: streamed token deltas -> text deltas (stateless, see protocol.text_delta).

Concatenating every text_output of a request gives tokenizer.decode(all output tokens).

Cancellation through the ensemble: when a client cancels an ensemble request, Triton 2.51 marks
only the ensemble's *next* step request as cancelled (core "Ensemble scheduler request
cancellation"), never the `lilicorr` request that is already streaming. That next step is this
model, so a cancelled request here sends `stop=true` with the job's secret `job_key` (an output
of every `lilicorr` response, mapped here by the ensemble and never returned to the ensemble's
client) to `lilicorr` (BLS), which frees the sequence in the engine. This works whether or not
the client sent a request id, and no client can stop another client's request.

This model never answers with an error: in 2.51 an error from a step downstream of a still
streaming decoupled step leaves the ensemble request in flight forever (observed: the server then
cannot shut down). Failures are logged and answered with an empty text delta.
"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from lilicorr.serving.protocol import text_delta
from lilicorr.serving.repository import model_parameters, model_path
from lilicorr.tokenizer import Tokenizer


def _ids(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return [] if t is None else [int(x) for x in t.as_numpy().reshape(-1)]


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(json.loads(args["model_config"]))
        self.tokenizer = Tokenizer.from_dir(model_path(params, "target_dir", args["model_repository"]))
        self.engine_model = params.get("engine_model") or "lilicorr"

    def stop_upstream(self, key):
        if not key:
            return
        stop = pb_utils.InferenceRequest(
            model_name=self.engine_model, requested_output_names=[],
            inputs=[pb_utils.Tensor("input_ids", np.zeros([1], dtype=np.int32)),
                    pb_utils.Tensor("stop", np.ones([1], dtype=bool)),
                    pb_utils.Tensor("job_key", np.array([key], dtype=np.object_))])
        for _ in stop.exec(decoupled=True):
            pass

    def execute(self, requests):
        responses = []
        for request in requests:
            if request.is_cancelled():
                try:
                    key = pb_utils.get_input_tensor_by_name(request, "job_key")
                    self.stop_upstream(None if key is None else key.as_numpy().reshape(-1)[0])
                except Exception as e:  # noqa: BLE001
                    pb_utils.Logger.log_warn(f"could not stop request {request.request_id()!r}: {e}")
                responses.append(self.text_response(""))
                continue
            try:
                new = _ids(request, "output_ids")
                ctx = _ids(request, "context_ids")
                fin = pb_utils.get_input_tensor_by_name(request, "is_final")
                final = True if fin is None else bool(fin.as_numpy().reshape(-1)[0])
                text = text_delta(self.tokenizer, ctx, new, final)
            except Exception as e:  # noqa: BLE001 - see the module docstring: never an error response
                pb_utils.Logger.log_error(f"request {request.request_id()!r}: detokenization failed: {e}")
                text = ""
            responses.append(self.text_response(text))
        return responses

    @staticmethod
    def text_response(text):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))])
