"""preprocessing: chat template + tokenizer (text_input or messages_json -> input_ids INT32[-1]).

text_input is one user message, rendered with the target's chat template (request parameter
``chat_template=false`` tokenizes it raw); messages_json is a JSON chat list of {role, content}.
Bad input -> INVALID_ARG naming the request id; the model keeps serving. Prompts larger than the
``max_prompt_bytes`` parameter are refused before they are decoded or tokenised, and
messages_json is checked for size and nesting depth before it is parsed.
"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from lilicorr.serving.protocol import (DEFAULT_MAX_PROMPT_BYTES, RequestError, parse_messages_json,
                                       parse_parameters)
from lilicorr.serving.repository import model_parameters, model_path
from lilicorr.tokenizer import Tokenizer


def _label(request):
    rid = request.request_id()
    return f"request {rid!r}" if rid else "request <no id>"


def _string_input(request, name, max_bytes):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    arr = t.as_numpy()
    if arr.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one string, got shape {list(arr.shape)}")
    v = arr.reshape(-1)[0]
    if len(v) > max_bytes:          # before decoding or tokenising anything
        raise RequestError(f"input '{name}' has {len(v)} bytes; the server accepts at most {max_bytes}")
    try:
        return v.decode("utf-8") if isinstance(v, bytes) else str(v)
    except UnicodeDecodeError as e:
        raise RequestError(f"input '{name}' is not valid UTF-8: {e}") from None


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(json.loads(args["model_config"]))
        self.tokenizer = Tokenizer.from_dir(model_path(params, "target_dir", args["model_repository"]))
        self.chat_default = params.get("chat_template", "true").lower() != "false"
        self.max_prompt_bytes = int(params.get("max_prompt_bytes") or DEFAULT_MAX_PROMPT_BYTES)

    def encode(self, request):
        parameters = parse_parameters(request.parameters())
        text = _string_input(request, "text_input", self.max_prompt_bytes)
        messages_json = _string_input(request, "messages_json", self.max_prompt_bytes)
        use_chat = parameters.get("chat_template", self.chat_default)
        if not isinstance(use_chat, bool):
            raise RequestError(f"parameter chat_template must be a boolean, got {use_chat!r}")
        if messages_json:
            messages = parse_messages_json(messages_json)
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise RequestError("messages_json must be a non-empty list of {\"role\", \"content\"} objects")
            if not any(m["content"].strip() for m in messages):
                raise RequestError("empty prompt: every message content is empty")
            return self.tokenizer.encode_chat(messages)
        if text is None:
            raise RequestError("empty prompt: send text_input or messages_json")
        if not text.strip():
            raise RequestError("empty prompt: text_input is empty")
        if use_chat and self.tokenizer.chat_template:
            return self.tokenizer.encode_chat([{"role": "user", "content": text}])
        return self.tokenizer.encode(text, add_special_tokens=True)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids = self.encode(request)
                if not ids:
                    raise RequestError("empty prompt: it tokenizes to no tokens")
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32))]))
            except (RequestError, ValueError, TypeError) as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"{_label(request)}: {e}", pb_utils.TritonError.INVALID_ARG)))
            except Exception as e:  # noqa: BLE001 - one line, no traceback or paths to the client
                pb_utils.Logger.log_error(f"{_label(request)}: preprocessing failed: {e!r}")
                # the chat template's raise_exception (e.g. an unknown role) speaks to the user
                why = str(e) if type(e).__name__ == "TemplateError" else type(e).__name__
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"{_label(request)}: the prompt could not be processed ({why})",
                    pb_utils.TritonError.INVALID_ARG)))
        return responses
