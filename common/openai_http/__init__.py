"""OpenAI-compatible HTTP front: `/v1/completions`, `/v1/chat/completions` (with server-sent
event streaming) and `/v1/models`, served by the decode node or the router (`--openai-port`).

The front runs in API-server processes of its own beside the daemon's (`--api-server-count`,
common/openai_http/api_processes.py), on aiohttp (common/openai_http/server.py). Each renders a
request's prompt to token ids and calls the daemon's own gRPC `Generate` over a Unix socket, so
both daemons share this one implementation.
May import common.serving, common.model and common.engine (sampling limits); never a node package.
"""
from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.model.default_model import default_model_path
from common.openai_http.api_keys import ENV_VAR, configured_keys
from common.openai_http.api_processes import OpenAIFront, default_api_server_count
from common.openai_http.api_server import ApiServerSettings
from common.openai_http.messages_api import BILLING_HEADER, BILLING_HEADER_CHOICES
from common.openai_http.tool_output import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS
from common.serving.tls import TlsFiles

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from common.serving.daemon import GrpcDaemon

__all__ = ["OpenAIFront", "add_openai_args", "attach_openai_front", "served_model_name"]

# A GGUF file name's quantisation suffix: "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct".
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|BF16|F32)$", re.IGNORECASE)


def add_openai_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--openai-port", type=int, default=None, metavar="PORT",
                        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models) on this port, 0 = any free port (default: off)")
    parser.add_argument("--api-server-count", type=_positive, default=None, metavar="N",
                        help="processes serving --openai-port beside the engine's, accepting on the one socket "
                        "(default: one per 8 CPUs the daemon may run on, 1 to 4)")
    parser.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                        help="a model name the HTTP API answers to (repeatable: aliases; the first is the one "
                        "/v1/models lists and answers report; default: derived from --model)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require `Authorization: Bearer KEY` on every /v1/* request, else 401 (repeatable: "
                        f"any of the keys; the {ENV_VAR} environment variable adds one, and keeps it off the "
                        "command line; default: no key)")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=DEFAULT_TOOL_CALL_PARSER,
                        help="how a chat answer under tool_choice 'auto' is read for calls: 'hermes' = "
                        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> blocks (default %(default)s)")
    parser.add_argument("--anthropic-billing-header", choices=BILLING_HEADER_CHOICES, default="strip",
                        help=f"/v1/messages: 'strip' drops a system prompt's '{BILLING_HEADER}' lines (Claude Code "
                        "sends one that changes every request) before the prompt is rendered, so an agent's turns "
                        "share their prefix in the prefix cache; 'keep' renders them (default %(default)s)")


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def served_model_name(model: Path | None) -> str:
    """A model's public name: its Hugging Face directory's name, or its GGUF file's without the
    quantisation suffix (None: the embedded default model's)."""
    model = Path(model or default_model_path())
    if model.suffix.lower() != ".gguf":
        return model.name
    return _QUANT_SUFFIX.sub("", model.stem)


def attach_openai_front(daemon: GrpcDaemon, tls: TlsFiles, port: int, served_names: Sequence[str] | str,
                        model: Path | None, api_keys: Sequence[str] = (),
                        tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER, *,
                        registry: CollectorRegistry | None = None, max_model_len: int | None = None,
                        api_server_count: int | None = None, max_generations: int | None = None,
                        drain_seconds: float = 10.0, strip_billing_header: bool = True,
                        log_level: str = "info") -> OpenAIFront:
    """Bind the HTTP port now and have `daemon` run its API servers once gRPC serves; they call
    the daemon's own `Generate` over a Unix socket and read its health, and `registry` as /metrics.
    With TLS on, the front serves HTTPS with the daemon's certificate, requiring client
    certificates signed by the CA when there is one (as the gRPC port does).
    No `served_names` answers to the name of `model` (None = the embedded default model), whose
    tokenizer renders prompts; `max_model_len` is what /tokenize reports.
    `api_keys` (with DUET_API_KEY) are the Bearer keys /v1/* requires; none = no key.
    `tool_call_parser` reads tool calls out of "auto" answers. `api_server_count` processes serve
    the port (None: `default_api_server_count`); `max_generations` is the daemon's cap on the
    requests it holds, which an API server holding as many refuses itself (None: no cap).
    `strip_billing_header`: /v1/messages drops Claude Code's billing line from system prompts."""
    names = (served_names,) if isinstance(served_names, str) else tuple(served_names)  # a config file's string
    names = tuple(n for n in names if n) or (served_model_name(model),)
    keys = (api_keys,) if isinstance(api_keys, str) else tuple(api_keys)
    settings = ApiServerSettings(
        listen_fd=-1, grpc_target="", model_names=names,
        api_keys=configured_keys(keys), tool_call_parser=tool_call_parser,
        tokenizer_path=str(model or default_model_path()), max_model_len=max_model_len, metrics_url=None,
        created=int(time.time()), tls_cert=_path(tls.cert), tls_key=_path(tls.key), tls_ca=_path(tls.ca),
        max_generations=max_generations, drain_seconds=drain_seconds, strip_billing_header=strip_billing_header,
        log_level=log_level)
    front = OpenAIFront(daemon.address.rsplit(":", 1)[0], port, api_server_count or default_api_server_count(),
                        settings, daemon.server, registry)
    daemon.add_front(front)
    return front


def _path(path: Path | None) -> str | None:
    return None if path is None else str(path)
