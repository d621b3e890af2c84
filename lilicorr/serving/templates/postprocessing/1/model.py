"""postprocessing: streamed token deltas -> text deltas (stateless, see protocol.text_delta).

Concatenating every text_output of a request gives tokenizer.decode(all output tokens).
"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from lilicorr.serving.protocol import text_delta
from lilicorr.serving.repository import model_parameters
from lilicorr.tokenizer import Tokenizer


def _ids(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return [] if t is None else [int(x) for x in t.as_numpy().reshape(-1)]


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(json.loads(args["model_config"]))
        self.tokenizer = Tokenizer.from_dir(params["target_dir"])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                new = _ids(request, "output_ids")
                ctx = _ids(request, "context_ids")
                fin = pb_utils.get_input_tensor_by_name(request, "is_final")
                final = True if fin is None else bool(fin.as_numpy().reshape(-1)[0])
                text = text_delta(self.tokenizer, ctx, new, final)
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]))
            except Exception as e:  # noqa: BLE001 - one bad chunk must not fail the batch
                rid = request.request_id()
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"request {rid!r}: detokenization failed: {e}", pb_utils.TritonError.INTERNAL)))
        return responses
