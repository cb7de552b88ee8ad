"""The HTTP server: routes, JSON bodies, server-sent events, cancellation on disconnect.

Standard library only (`http.server`), one thread per connection, HTTPS when given an SSL
context. Every request becomes one gRPC `Generate` call on `stub`; a client that goes away
cancels that call, so the node aborts the request and frees its pages.
"""
from __future__ import annotations

import itertools
import json
import logging
import select
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import grpc

from common.openai_http.api_errors import ApiError
from common.openai_http.api_keys import ApiKeys
from common.openai_http.gateway_routes import (GET_PATHS, POST_PATHS, PREFILLER_HEADER, GatewayRoutes, Reply,
                                               prefiller_metadata)
from common.openai_http.request_mapping import Endpoint, MappedRequest, map_request
from common.openai_http.response_shaping import ResponseShaper
from common.openai_http.tool_output import DEFAULT_TOOL_CALL_PARSER
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

log = logging.getLogger("openai_http")

MAX_BODY_BYTES = 16 * 1024 * 1024
TLS_HANDSHAKE_SECONDS = 30.0
IDLE_SECONDS = 120.0  # a connection that sends or takes nothing this long is closed
MAX_CONNECTIONS = 256  # beyond it new connections are closed at once, each holds a thread
DISCONNECT_POLL_SECONDS = 0.5
_ROUTES = {"/v1/completions": Endpoint.COMPLETIONS, "/v1/chat/completions": Endpoint.CHAT}


class ClientGone(Exception):
    """The HTTP client closed its connection before the answer was complete."""


class OpenAIFront:
    """Serves the OpenAI API for the model named `model_names` (a name, or a name and its
    aliases) by calling `stub.Generate`, over HTTPS with `ssl_context`, to requests that present
    one of `api_keys`, reading "auto" tool calls with `tool_call_parser`. The port is bound at
    construction (a taken port fails fast); `start` begins serving in a background thread."""

    def __init__(self, host: str, port: int, model_names: str | tuple[str, ...], stub: duet_pb2_grpc.DecodeNodeStub,
                 ssl_context: ssl.SSLContext | None = None, api_keys: ApiKeys = ApiKeys(),
                 tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER,
                 gateway: GatewayRoutes = GatewayRoutes(ready=lambda: True)) -> None:
        self.api_keys = api_keys
        self.gateway = gateway
        self.tool_call_parser = tool_call_parser
        self.model_names = (model_names,) if isinstance(model_names, str) else tuple(model_names)
        self.model_name = self.model_names[0]
        self.stub = stub
        self.created = int(time.time())
        self._http = _HttpServer((host, port), _Handler)
        self._http.front = self
        self._http.ssl_context = ssl_context
        self._thread = threading.Thread(target=self._http.serve_forever, name="openai-http", daemon=True)

    @property
    def port(self) -> int:
        return self._http.server_address[1]

    def start(self) -> None:
        self._thread.start()
        log.info("openai http serving", extra={"fields": {"openai_port": self.port, "model": self.model_name,
                                                          "https": self._http.ssl_context is not None,
                                                          "api_key_required": self.api_keys.required}})

    def stop(self) -> None:
        """Stop accepting requests; calls already in flight finish with the gRPC drain."""
        self._http.shutdown()
        self._http.server_close()

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_entry(name) for name in self.model_names]}

    def model_entry(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "duet"}


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    front: OpenAIFront
    ssl_context: ssl.SSLContext | None

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        host = address[0].strip("[]")
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__((host, address[1]), handler)

    def process_request(self, request: socket.socket, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            log.warning("too many http connections: closing a new one", extra={"fields": {"client": client_address[0]}})
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: socket.socket, client_address) -> None:
        """With TLS, the handshake runs here, in the connection's own thread, so a slow or
        failing client delays no one else."""
        if self.ssl_context is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(TLS_HANDSHAKE_SECONDS)
        try:
            tls_socket = self.ssl_context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as exc:
            log.info("tls handshake failed", extra={"fields": {"client": client_address[0], "error": str(exc)}})
            return
        with tls_socket:
            tls_socket.settimeout(None)
            super().finish_request(tls_socket, client_address)

    def handle_error(self, request, client_address) -> None:
        """A client hanging up between requests is routine; anything else is logged."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            log.exception("http request failed", extra={"fields": {"client": client_address[0]}})


class _Handler(BaseHTTPRequestHandler):
    server: _HttpServer

    protocol_version = "HTTP/1.1"  # keep-alive; streams use chunked transfer encoding
    server_version = "duet"
    timeout = IDLE_SECONDS

    @property
    def front(self) -> OpenAIFront:
        return self.server.front

    def log_message(self, format: str, *args) -> None:
        log.debug("http " + format % args)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        if not self._authorized(path):
            return
        if path in GET_PATHS:
            self._answer(lambda: self.front.gateway.get(path))
        elif path == "/v1/models":
            self._send_json(HTTPStatus.OK, self.front.models())
        elif path.startswith("/v1/models/") and path[len("/v1/models/"):] in self.front.model_names:
            self._send_json(HTTPStatus.OK, self.front.model_entry(path[len("/v1/models/"):]))
        elif path.startswith("/v1/models/"):
            self._send_error(ApiError(HTTPStatus.NOT_FOUND, f"the model '{path[len('/v1/models/'):]}' does not "
                                      "exist", param="model", code="model_not_found"))
        else:
            self._not_found(path)

    def do_POST(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        endpoint = _ROUTES.get(path)
        try:
            body = self._read_body()  # also for an unknown route: the connection stays clean for the next request
            if not self._authorized(path):
                return
            if path in POST_PATHS:
                self._answer(lambda: self.front.gateway.post(path, _parse_json(body), self.front.model_names))
                return
            if endpoint is None:
                self._not_found(path)
                return
            request = map_request(endpoint, _parse_json(body), self.front.model_names)
        except ApiError as exc:
            self._send_error(exc)
            return
        metadata = prefiller_metadata(self.headers.get(PREFILLER_HEADER))
        call = self.front.stub.Generate(request.generate, metadata=metadata)
        answered = threading.Event()
        threading.Thread(target=_cancel_when_client_leaves, args=(self.connection, call, answered),
                         name="openai-http-watch", daemon=True).start()
        try:
            if request.stream:
                self._stream(request, call)
            else:
                self._respond(request, call)
        except (ClientGone, ConnectionError, TimeoutError):
            call.cancel()
            self.close_connection = True
            log.info("client disconnected: request cancelled", extra={"fields": {"request_id": request.request_id}})
        finally:
            answered.set()

    def _authorized(self, path: str) -> bool:
        """Whether the request may go on; if not, it was answered 401 (the key it presented, if
        any, is neither logged nor echoed)."""
        if not (path == "/v1" or path.startswith("/v1/")) or self.front.api_keys.admits(
                self.headers.get("Authorization")):
            return True
        log.info("http request without a valid api key", extra={"fields": {"client": self.client_address[0],
                                                                            "path": path}})
        self._send_json(HTTPStatus.UNAUTHORIZED, ApiError(
            HTTPStatus.UNAUTHORIZED, "a valid API key is required: send the header 'Authorization: Bearer KEY' "
            "with a key this server was started with (--api-key)", code="invalid_api_key").body(),
            {"WWW-Authenticate": "Bearer"})
        return False

    def _respond(self, request: MappedRequest, call: grpc.Call) -> None:
        try:
            shaper = ResponseShaper(request, self.front.model_name, self.front.tool_call_parser)
            body = shaper.response(self._watch(call))
        except ApiError as exc:
            self._send_error(exc)
            return
        self._send_json(HTTPStatus.OK, body)

    def _stream(self, request: MappedRequest, call: grpc.Call) -> None:
        chunks = self._watch(call)
        try:  # the node's refusal (bad prompt, no room) comes before any chunk: answer it as an HTTP error
            first = list(itertools.islice(chunks, 1))
        except ApiError as exc:
            self._send_error(exc)
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            shaper = ResponseShaper(request, self.front.model_name, self.front.tool_call_parser)
            for event in shaper.stream(itertools.chain(first, chunks)):
                self._write_chunk(f"data: {json.dumps(event)}\n\n")
        except ApiError as exc:  # failed mid-stream: the status line is sent, so report it in-band
            self._write_chunk(f"data: {json.dumps(exc.body())}\n\n")
        self._write_chunk("data: [DONE]\n\n")
        self._write_chunk("")

    def _watch(self, call: grpc.Call) -> Iterator[pb.GenerationChunk]:
        """The call's chunks; its failure as an ApiError, and ClientGone as soon as the client
        has hung up."""
        try:
            for chunk in call:
                if _peer_closed(self.connection):
                    raise ClientGone
                yield chunk
        except grpc.RpcError as exc:
            raise ApiError.from_rpc(exc) from None

    def _write_chunk(self, text: str) -> None:
        """One chunk of the chunked transfer encoding (empty text = the terminating chunk)."""
        data = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _read_body(self) -> bytes:
        if "Transfer-Encoding" in self.headers:  # its body would be read as the next request
            self.close_connection = True
            raise ApiError(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length, not chunked")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE if length > 0 else HTTPStatus.BAD_REQUEST,
                           f"the body must come with a Content-Length of at most {MAX_BODY_BYTES} bytes")
        return self.rfile.read(length)

    def _not_found(self, path: str) -> None:
        self._send_error(ApiError(HTTPStatus.NOT_FOUND, f"no route {self.command} {path}; this server serves "
                                  "/v1/completions, /v1/chat/completions and /v1/models, their /render, "
                                  "/tokenize, /detokenize, /health and /metrics"))

    def _answer(self, reply: Callable[[], Reply]) -> None:
        try:
            answer = reply()
        except ApiError as exc:
            self._send_error(exc)
            return
        if isinstance(answer.body, bytes):
            self._send_bytes(answer.status, answer.body, answer.content_type)
        else:
            self._send_json(answer.status, answer.body)

    def _send_error(self, exc: ApiError) -> None:
        self._send_json(exc.status, exc.body())

    def _send_json(self, status: HTTPStatus, body: dict | list, headers: dict[str, str] | None = None) -> None:
        self._send_bytes(status, json.dumps(body).encode(), "application/json", headers)

    def _send_bytes(self, status: HTTPStatus, data: bytes, content_type: str,
                    headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)


def _parse_json(body: bytes):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        raise ApiError.invalid(f"the body is not valid JSON: {exc}") from None


def _cancel_when_client_leaves(sock: socket.socket, call: grpc.Call, answered: threading.Event) -> None:
    """Cancel `call` if the client hangs up before it was answered, even while the request
    produces nothing to write (e.g. while it waits for admission on the node)."""
    while not answered.wait(DISCONNECT_POLL_SECONDS):
        if _peer_closed(sock):
            call.cancel()
            return


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the client has closed its end (readable, and a peek reads end-of-file). The peek
    reads the raw socket, beneath TLS when there is TLS."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and socket.socket.recv(sock, 1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True
