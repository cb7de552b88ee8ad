"""The HTTP server of one API-server process: routes, JSON bodies, server-sent events,
cancellation on disconnect, and backpressure that speaks HTTP.

aiohttp, one event loop per process (common/openai_http/api_server.py runs it). Prompts are
rendered to token ids here (chat template, tools, tokenizer), off the engine's interpreter;
every generation becomes one gRPC `Generate` on the daemon over a Unix socket (`stub`, an
asyncio channel). A client that goes away cancels its handler and with it the call, so the node
aborts the request and frees its pages.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from http import HTTPStatus

import grpc
from aiohttp import ClientError, ClientSession, web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.errors import RequestError
from common.openai_http.api_errors import BUSY_RETRY_SECONDS, NOT_READY_RETRY_SECONDS, ApiError
from common.openai_http import messages_api, responses_api
from common.openai_http.api_keys import ApiKeys
from common.openai_http.endpoint_metrics import endpoint_metadata
from common.openai_http.gateway_routes import POST_PATHS, PREFILLER_HEADER, GatewayRoutes, prefiller_metadata
from common.openai_http.request_mapping import Endpoint, MappedRequest, map_request
from common.openai_http.response_shaping import AnswerShaper, ResponseShaper
from common.serving.prompts import prompt_token_ids
from common.serving.retry_hint import RetryHint
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

log = logging.getLogger("openai_http")

MAX_BODY_BYTES = 16 * 1024 * 1024
HEALTH_TIMEOUT_SECONDS = 2.0
_ROUTES = {"/v1/completions": Endpoint.COMPLETIONS, "/v1/chat/completions": Endpoint.CHAT}
ANTHROPIC_PREFIX = "/v1/messages"  # the routes under it answer errors in Anthropic's shape


class Front:
    """What one API-server process serves: the model named `model_names` (a name and its
    aliases, the first reported), to requests that present one of `api_keys`, by calling
    `stub.Generate`; `health` and `metrics_url` reach the daemon's readiness and Prometheus
    registry; `gateway` renders prompts (tokenize, render, and every generation's prompt);
    `open_connections()` counts this process's connections, capped at `max_connections`;
    `max_generations` is the daemon's cap on the requests it holds (None: no cap): this process
    alone holding that many, the daemon would refuse the next, so it is refused here at once.
    `strip_billing_header`: drop Claude Code's per-request billing line from Messages' system
    prompts (common/openai_http/messages_api.py)."""

    def __init__(self, model_names: tuple[str, ...], channel: grpc.aio.Channel, gateway: GatewayRoutes,
                 api_keys: ApiKeys = ApiKeys(), tool_call_parser: str = "hermes", metrics_url: str | None = None,
                 created: int = 0, max_connections: int = 4096,
                 open_connections: Callable[[], int] = lambda: 0, max_generations: int | None = None,
                 strip_billing_header: bool = True) -> None:
        self.model_names = model_names
        self.model_name = model_names[0]
        self.stub = duet_pb2_grpc.DecodeNodeStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        self.gateway = gateway
        self.api_keys = api_keys
        self.tool_call_parser = tool_call_parser
        self.metrics_url = metrics_url
        self.created = created
        self.max_connections = max_connections
        self.open_connections = open_connections
        self.max_generations = max_generations
        self.strip_billing_header = strip_billing_header
        self._generating = 0  # this process's calls to Generate in flight
        self._stays = RetryHint()  # how long they last: the retry hint of the refusals made here
        self._session: ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[self._errors, self._capacity, self._authorized])
        routes = [("GET", "/health", self.health_route), ("GET", "/metrics", self.metrics_route),
                  ("GET", "/v1/models", self.models_route), ("GET", "/v1/models/{name:.+}", self.model_route),
                  *(("POST", path, self.gateway_route) for path in POST_PATHS),
                  *(("POST", path, self.generate_route) for path in _ROUTES),
                  ("POST", "/v1/responses", self.responses_route),
                  ("POST", "/v1/responses/input_tokens", self.input_tokens_route),
                  ("POST", "/v1/messages", self.messages_route),
                  ("POST", "/v1/messages/count_tokens", self.count_tokens_route)]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
            if not path.endswith("}"):
                app.router.add_route(method, path + "/", handler)  # a trailing slash names the same route
        app.on_cleanup.append(self._close_session)
        return app

    # ---- middlewares ----

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        """Every failure as an OpenAI (or, under /v1/messages, Anthropic) error body; a route that
        does not exist is a 404 naming the routes; a path with a trailing slash is its route."""
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc, request)
        except web.HTTPRequestEntityTooLarge:
            return error_response(ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                           f"the body must be at most {MAX_BODY_BYTES} bytes"), request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
            return error_response(ApiError(HTTPStatus.NOT_FOUND, f"no route {request.method} {request.path}; this "
                                           "server serves /v1/completions, /v1/chat/completions, /v1/responses, "
                                           "/v1/messages and /v1/models, their /render, /input_tokens, "
                                           "/count_tokens, /tokenize, /detokenize, /health and /metrics"), request)
        except web.HTTPException:
            raise
        except Exception:
            log.exception("http request failed", extra={"fields": {"path": request.path}})
            return error_response(ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "the server failed to answer this "
                                           "request (its log has the cause)"), request)

    @web.middleware
    async def _capacity(self, request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Past `max_connections` open connections a request is answered 503 with Retry-After
        at once (and its connection closed), rather than left unaccepted or reset."""
        if self.open_connections() > self.max_connections:
            log.warning("too many http connections: refusing a request", extra={"fields": {
                "client": request.remote, "max_connections": self.max_connections}})
            return error_response(ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"this server holds its limit of "
                                           f"{self.max_connections} connections; retry later",
                                           retry_after=BUSY_RETRY_SECONDS), request, {"Connection": "close"})
        return await handler(request)

    @web.middleware
    async def _authorized(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """/v1/* wants one of the API keys, as a Bearer token or (Anthropic's clients) in
        `x-api-key`; a refusal is answered 401 (the key presented, if any, is neither logged nor
        echoed)."""
        path = request.path.rstrip("/")
        if (path == "/v1" or path.startswith("/v1/")) and not self.api_keys.admits(
                request.headers.get("Authorization"), request.headers.get("x-api-key")):
            log.info("http request without a valid api key", extra={"fields": {"client": request.remote,
                                                                                "path": path}})
            return error_response(ApiError(
                HTTPStatus.UNAUTHORIZED, "a valid API key is required: send the header 'Authorization: Bearer KEY' "
                "(or 'x-api-key: KEY') with a key this server was started with (--api-key)", code="invalid_api_key"),
                request, {"WWW-Authenticate": "Bearer"})
        return await handler(request)

    # ---- routes ----

    async def health_route(self, request: web.Request) -> web.Response:
        """200 while the daemon's gRPC health says SERVING, else 503 with Retry-After."""
        if await self.ready():
            return web.json_response({"status": "serving"})
        return web.json_response({"status": "not serving"}, status=HTTPStatus.SERVICE_UNAVAILABLE,
                                 headers={"Retry-After": str(NOT_READY_RETRY_SECONDS)})

    async def ready(self) -> bool:
        try:
            answer = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_SECONDS)
        except grpc.RpcError:
            return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    async def metrics_route(self, request: web.Request) -> web.Response:
        """The daemon's Prometheus registry, read from its loopback metrics endpoint."""
        if self.metrics_url is None:
            raise ApiError(HTTPStatus.NOT_FOUND, "this daemon serves its metrics on --metrics-port")
        if self._session is None:
            self._session = ClientSession()
        try:
            async with self._session.get(self.metrics_url) as answer:
                body, content_type = await answer.read(), answer.headers.get("Content-Type", "text/plain")
        except ClientError as exc:
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, f"the daemon's metrics cannot be read now: {exc}",
                           retry_after=NOT_READY_RETRY_SECONDS) from None
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _close_session(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def models_route(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_entry(name) for name in self.model_names]})

    async def model_route(self, request: web.Request) -> web.Response:
        name = request.match_info["name"].rstrip("/")  # a served name may hold slashes: "org/model"
        if name not in self.model_names:
            raise ApiError(HTTPStatus.NOT_FOUND, f"the model '{name}' does not exist", param="model",
                           code="model_not_found")
        return web.json_response(self._model_entry(name))

    def _model_entry(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "duet"}

    async def gateway_route(self, request: web.Request) -> web.Response:
        answer = self.gateway.post(request.path.rstrip("/"), await _json_body(request), self.model_names)
        return web.json_response(answer.body, status=answer.status)

    async def generate_route(self, request: web.Request) -> web.StreamResponse:
        """/v1/completions and /v1/chat/completions."""
        self._admit()
        mapped = map_request(_ROUTES[request.path.rstrip("/")], await _json_body(request), self.model_names)
        return await self._generate(request, mapped, ResponseShaper(mapped, self.model_name, self.tool_call_parser))

    async def responses_route(self, request: web.Request) -> web.StreamResponse:
        """/v1/responses: the chat request it means, answered as a Response."""
        self._admit()
        body = await _json_body(request)
        mapped = map_request(Endpoint.CHAT, responses_api.chat_body(body), self.model_names)
        return await self._generate(request, mapped,
                                    responses_api.ResponsesShaper(mapped, self.model_name, body, self.tool_call_parser))

    async def messages_route(self, request: web.Request) -> web.StreamResponse:
        """/v1/messages: the chat request it means, answered as an Anthropic Message."""
        self._admit()
        chat = messages_api.chat_body(await _json_body(request), self.strip_billing_header)
        mapped = map_request(Endpoint.CHAT, chat, self.model_names)
        return await self._generate(request, mapped,
                                    messages_api.MessagesShaper(mapped, self.model_name, self.tool_call_parser))

    async def input_tokens_route(self, request: web.Request) -> web.Response:
        """/v1/responses/input_tokens: the prompt's length, as /v1/responses would render it."""
        chat = responses_api.chat_body(await _json_body(request), responses_api.INPUT_TOKENS_FIELDS)
        return web.json_response({"object": "response.input_tokens", "input_tokens": self._prompt_length(chat)})

    async def count_tokens_route(self, request: web.Request) -> web.Response:
        """/v1/messages/count_tokens: the prompt's length, as /v1/messages would render it."""
        chat = messages_api.chat_body(await _json_body(request), self.strip_billing_header,
                                      messages_api.COUNT_TOKENS_FIELDS)
        return web.json_response({"input_tokens": self._prompt_length(chat)})

    def _prompt_length(self, chat: dict) -> int:
        return len(self.gateway.render(Endpoint.CHAT, chat, self.model_names))

    def _admit(self) -> None:
        """This process holding `max_generations` calls, the daemon would refuse the next: a 429
        now, before the body is read."""
        if self.max_generations is not None and (held := self._generating) >= self.max_generations:
            raise ApiError(HTTPStatus.TOO_MANY_REQUESTS, f"{held} requests are already running or waiting here "
                           f"(--max-requests {self.max_generations}); retry later", code="resource_exhausted",
                           retry_after=self._stays.seconds(held - self.max_generations + 1, held))

    async def _generate(self, request: web.Request, mapped: MappedRequest, shaper: AnswerShaper) -> web.StreamResponse:
        endpoint = request.path.rstrip("/")
        call = self.stub.Generate(self._rendered(mapped), metadata=endpoint_metadata(endpoint) + prefiller_metadata(
            request.headers.get(PREFILLER_HEADER)))
        self._generating += 1
        started = time.monotonic()
        try:
            if mapped.stream:
                return await self._stream(request, shaper, call)
            return web.json_response(shaper.response([chunk async for chunk in _chunks(call)]))
        finally:
            self._generating -= 1
            if call.done() and await call.code() == grpc.StatusCode.OK:
                self._stays.record(time.monotonic() - started)
            call.cancel()  # a no-op once answered; a client gone mid-way cancels the handler here

    def _rendered(self, mapped: MappedRequest) -> pb.GenerateRequest:
        """The request with its prompt as token ids, rendered here (the chat template, tools)
        rather than in the engine's process."""
        generate = mapped.generate
        if generate.token_ids or self.gateway.tokenizer is None:
            return generate
        try:
            tokens = prompt_token_ids(generate, self.gateway.tokenizer)
        except RequestError as exc:
            raise ApiError.invalid(str(exc)) from None
        rendered = pb.GenerateRequest()
        rendered.CopyFrom(generate)
        for field in ("prompt", "messages", "tools"):
            rendered.ClearField(field)
        rendered.token_ids.extend(tokens)
        return rendered

    async def _stream(self, request: web.Request, shaper: AnswerShaper, call) -> web.StreamResponse:
        chunks = _chunks(call)
        first = await anext(chunks, None)  # the node's refusal comes before any chunk: an HTTP error
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        named = shaper.named_events
        try:
            await _send(response, shaper.opening(), named)
            if first is not None:
                await _send(response, shaper.events(first), named)
                async for chunk in chunks:
                    await _send(response, shaper.events(chunk), named)
            await _send(response, shaper.closing(), named)
        except ApiError as exc:  # failed mid-stream: the status line is sent, so report it in-band
            await _send(response, [shaper.failure(exc)], named)
        await response.write(shaper.end_of_stream)
        await response.write_eof()
        return response


async def _chunks(call) -> AsyncIterator[pb.GenerationChunk]:
    """The call's chunks; its failure as an ApiError (the daemon's socket gone: a 503 saying so)."""
    try:
        async for chunk in call:
            yield chunk
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE and (exc.details() or "").startswith("failed to connect"):
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "the daemon is not serving requests now (it is shutting "
                           "down or restarting); retry later or at another node", code="unavailable") from None
        raise ApiError.from_rpc(exc) from None


async def _send(response: web.StreamResponse, events: Iterable[dict], named: bool) -> None:
    """Each event serialized as it is made (a shaper may change its objects after yielding them)."""
    data = b"".join([_event(e, named) for e in events])
    if data:
        await response.write(data)


def _event(payload: dict, named: bool) -> bytes:
    """One server-sent event; `named`: with an `event:` line naming its `type`, as the Responses
    and Messages APIs send them."""
    data = b"data: %s\n\n" % json.dumps(payload).encode()
    return b"event: %s\n%s" % (payload["type"].encode(), data) if named else data


async def _json_body(request: web.Request):
    body = await request.read()
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        raise ApiError.invalid(f"the body is not valid JSON: {exc}") from None


def error_response(exc: ApiError, request: web.Request, headers: dict[str, str] | None = None) -> web.Response:
    """`exc` in the shape of the API `request` called."""
    body = exc.anthropic_body() if request.path.startswith(ANTHROPIC_PREFIX) else exc.body()
    return web.json_response(body, status=exc.status, headers={**exc.headers(), **(headers or {})})
