"""What the Kubernetes inference gateway (the Gateway API Inference Extension and its endpoint
picker, llm-d's router) asks of a model server's HTTP port beside the OpenAI API, in vLLM's shapes:

- `GET /health`: 200 while the daemon serves, 503 while it starts or drains (readiness), and
  `GET /metrics`: the daemon's Prometheus registry, duet's metrics and the `vllm:*` gauges the
  picker scrapes (common/serving/pool_metrics.py `register_gateway_gauges`), both answered by
  the server (common/openai_http/server.py) from the daemon itself;
- `POST /tokenize` (`prompt`, or chat `messages`) -> `{"count", "max_model_len", "tokens", "token_strs"}`,
  `POST /detokenize` (`tokens`) -> `{"prompt"}`;
- `POST /v1/completions/render` -> `[{"token_ids": [...]}]` and `POST /v1/chat/completions/render`
  -> `{"token_ids": [...]}`: the prompt a completions or chat request would run, as the node
  tokenizes it (chat template and tools included), which the picker's prefix scorer hashes.
"""
from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from common.errors import RequestError
from common.model.tokenizer import Tokenizer
from common.openai_http.api_errors import ApiError
from common.openai_http.request_mapping import Endpoint, map_request
from common.serving.prompts import prompt_token_ids

# The picker names the prefill node of a disaggregated request in this header; the front passes it
# on to Generate as gRPC metadata, and a decode node that has that node among its --prefill nodes
# hands the prompt to it first.
PREFILLER_HEADER = "x-prefiller-host-port"
MAX_HEADER_CHARS = 255
POST_PATHS = ("/tokenize", "/detokenize", "/v1/completions/render", "/v1/chat/completions/render")


@dataclass(frozen=True)
class Reply:
    status: HTTPStatus
    body: Any  # JSON


@dataclass(frozen=True)
class GatewayRoutes:
    """`tokenizer`: how the daemon reads prompts (None: no tokenize or render here);
    `max_model_len`: the longest context it serves, reported by /tokenize (None: unknown)."""

    tokenizer: Tokenizer | None = None
    max_model_len: int | None = None

    def post(self, path: str, body: Any, model_names: tuple[str, ...]) -> Reply:
        if self.tokenizer is None:
            raise ApiError(HTTPStatus.NOT_FOUND, f"{path} is not served by this daemon")
        if not isinstance(body, dict):
            raise ApiError.invalid("the request body must be a JSON object")
        if path == "/detokenize":
            return Reply(HTTPStatus.OK, {"prompt": self.tokenizer.decode(self._token_ids(body))})
        if path == "/tokenize":
            endpoint = Endpoint.CHAT if "messages" in body else Endpoint.COMPLETIONS
            tokens = self.render(endpoint, _generation_fields(body), model_names)
            return Reply(HTTPStatus.OK, {"count": len(tokens), "max_model_len": self.max_model_len,
                                         "tokens": tokens, "token_strs": None})
        if path == "/v1/completions/render":
            return Reply(HTTPStatus.OK, [{"token_ids": self.render(Endpoint.COMPLETIONS, body, model_names)}])
        return Reply(HTTPStatus.OK, {"token_ids": self.render(Endpoint.CHAT, body, model_names)})

    def render(self, endpoint: Endpoint, body: dict, model_names: tuple[str, ...]) -> list[int]:
        """The prompt's token ids a request of `endpoint` with `body` would run."""
        if self.tokenizer is None:
            raise ApiError(HTTPStatus.NOT_FOUND, "this daemon has no tokenizer here: it counts no tokens")
        request = map_request(endpoint, body, model_names).generate
        try:
            return prompt_token_ids(request, self.tokenizer)
        except RequestError as exc:
            raise ApiError.invalid(str(exc)) from None

    def _token_ids(self, body: dict) -> list[int]:
        tokens, vocab = body.get("tokens"), self.tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise ApiError.invalid(f"tokens must be a list of token ids from 0 to {vocab - 1}", param="tokens")
        return tokens


def prefiller_metadata(value: str | None) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata that carries `value` of the prefiller header on (none for a value that
    cannot be a host:port)."""
    if value is None or not 0 < len(value) <= MAX_HEADER_CHARS or not value.isascii() or not value.isprintable():
        return ()
    return ((PREFILLER_HEADER, value.strip()),)


def _generation_fields(body: dict) -> dict:
    """A /tokenize body as the completions or chat request it describes: its own fields
    (`add_generation_prompt`, `add_special_tokens`, ...) are not a generation's."""
    return {k: v for k, v in body.items() if k in ("model", "prompt", "messages", "tools", "tool_choice")}
