"""OpenAI-compatible HTTP front: `/v1/completions`, `/v1/chat/completions` (with server-sent
event streaming) and `/v1/models`, served by the decode node or the router (`--openai-port`).

The front translates each request into a duet.v1.GenerateRequest and calls the daemon's own
gRPC `Generate` over a loopback channel, so both daemons share this one implementation.
May import common.serving, common.model and common.engine (sampling limits); never a node package.
"""
from __future__ import annotations

import argparse
import re
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.model.default_model import default_model_path
from common.openai_http.api_keys import ENV_VAR, ApiKeys
from common.openai_http.gateway_routes import GatewayRoutes
from common.openai_http.server import OpenAIFront
from common.openai_http.tool_output import DEFAULT_TOOL_CALL_PARSER, TOOL_CALL_PARSERS
from common.serving.tls import TlsFiles
from protos.duet.v1 import duet_pb2_grpc

if TYPE_CHECKING:
    from common.serving.daemon import GrpcDaemon

__all__ = ["OpenAIFront", "add_openai_args", "attach_openai_front", "served_model_name"]

_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}
# A GGUF file name's quantisation suffix: "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct".
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|BF16|F32)$", re.IGNORECASE)


def add_openai_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--openai-port", type=int, default=None, metavar="PORT",
                        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models) on this port, 0 = any free port (default: off)")
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


def served_model_name(model: Path | None) -> str:
    """A model's public name: its Hugging Face directory's name, or its GGUF file's without the
    quantisation suffix (None: the embedded default model's)."""
    model = Path(model or default_model_path())
    if model.suffix.lower() != ".gguf":
        return model.name
    return _QUANT_SUFFIX.sub("", model.stem)


def attach_openai_front(daemon: GrpcDaemon, tls: TlsFiles, port: int, served_names: Sequence[str] | str,
                        model: Path | None, api_keys: Sequence[str] = (),
                        tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER,
                        gateway: GatewayRoutes = GatewayRoutes(ready=lambda: True)) -> OpenAIFront:
    """Bind the HTTP port now and have `daemon` serve it alongside gRPC, calling its own
    `Generate` over a loopback channel. With TLS on, the loopback presents the daemon's
    certificate and the front serves HTTPS with it, requiring client certificates signed by
    the CA when there is one (as the gRPC port does).
    No `served_names` answers to the name of `model` (None = the embedded default model).
    `api_keys` (with DUET_API_KEY) are the Bearer keys /v1/* requires; none = no key.
    `tool_call_parser` reads tool calls out of "auto" answers. `gateway`: the inference gateway's
    routes (health, metrics, tokenize, render: common/openai_http/gateway_routes.py)."""
    host = daemon.address.rsplit(":", 1)[0]
    loopback = "127.0.0.1" if host in _WILDCARD_HOSTS else host
    stub = duet_pb2_grpc.DecodeNodeStub(tls.channel(f"{loopback}:{daemon.port}"))
    names = (served_names,) if isinstance(served_names, str) else tuple(served_names)  # a config file's string
    names = tuple(n for n in names if n) or (served_model_name(model),)
    front = OpenAIFront(host, port, names, stub, https_context(tls) if tls.enabled else None,
                        ApiKeys.from_flags((api_keys,) if isinstance(api_keys, str) else api_keys), tool_call_parser,
                        gateway)
    daemon.add_front(front)
    return front


def https_context(tls: TlsFiles) -> ssl.SSLContext:
    """The HTTPS side of the daemon's TLS settings: its certificate, and mutual TLS with a CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # trusts no CA but --tls-ca for client certificates
    context.load_cert_chain(tls.cert, tls.key)
    if tls.ca is not None:
        context.load_verify_locations(tls.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context
