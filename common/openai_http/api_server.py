"""One API-server process (`python -m common.openai_http`, started by its daemon:
common/openai_http/api_processes.py, never by hand).

It reads its `ApiServerSettings` as one JSON line on stdin, serves the listening socket it
inherited (every API server of a daemon accepts on the same one) until SIGTERM, then stops
accepting and lets its in-flight requests finish (the daemon's gRPC drain ends them). Its stdin
stays open while the daemon lives: end-of-file means the daemon is gone, and it exits too.
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import shutil
import signal
import socket
import ssl
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from aiohttp import web

from common.daemon_limits import CHANNEL_OPTIONS
from common.model.tokenizer import load_tokenizer
from common.openai_http.api_keys import ApiKeys
from common.openai_http.gateway_routes import GatewayRoutes
from common.openai_http.server import Front
from common.serving.tls import TlsFiles

log = logging.getLogger("openai_http")

IDLE_SECONDS = 120.0  # a keep-alive connection that sends nothing this long is closed
LISTEN_BACKLOG = 4096  # connections the kernel holds for accept (capped by net.core.somaxconn)
FD_RESERVE = 64  # descriptors kept for the process itself beyond its connections


@dataclass(frozen=True)
class ApiServerSettings:
    """What an API-server process serves, and where its daemon is."""

    listen_fd: int  # the daemon's bound socket, inherited
    grpc_target: str  # the daemon's gRPC server, "unix:PATH"
    model_names: tuple[str, ...]
    api_keys: tuple[str, ...]
    tool_call_parser: str
    tokenizer_path: str | None  # a .gguf or Hugging Face directory; None: no tokenize, render or prompt rendering
    max_model_len: int | None
    metrics_url: str | None  # the daemon's Prometheus registry over loopback HTTP; None: no /metrics here
    created: int  # /v1/models' `created`
    max_generations: int | None = None  # the daemon's --max-requests (None: no cap)
    tls_cert: str | None = None  # HTTPS with the daemon's certificate; with tls_ca, clients need one it signed
    tls_key: str | None = None
    tls_ca: str | None = None
    drain_seconds: float = 10.0  # how long in-flight requests may take to end after SIGTERM
    strip_billing_header: bool = True  # /v1/messages: Claude Code's billing line dropped from system prompts
    index: int = 0  # which of its daemon's API servers this is (logs)
    log_level: str = "info"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> ApiServerSettings:
        fields = json.loads(line)
        return cls(**{**fields, "model_names": tuple(fields["model_names"]), "api_keys": tuple(fields["api_keys"])})

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)


def https_context(tls: TlsFiles) -> ssl.SSLContext:
    """The HTTPS side of the daemon's TLS settings: its certificate, and mutual TLS with a CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # trusts no CA but --tls-ca for client certificates
    context.load_cert_chain(tls.cert, tls.key)
    if tls.ca is not None:
        context.load_verify_locations(tls.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def raise_fd_limit() -> int:
    """Lift this process's open-file limit to its hard limit; returns how many connections fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        soft = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return max(16, soft - FD_RESERVE)


async def serve(settings: ApiServerSettings, max_connections: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    parent = await _stop_when_parent_exits(stop)
    tokenizer = load_tokenizer(settings.tokenizer_path) if settings.tokenizer_path else None
    channel = grpc.aio.insecure_channel(settings.grpc_target, options=CHANNEL_OPTIONS)
    runner: web.AppRunner | None = None
    front = Front(settings.model_names, channel, GatewayRoutes(tokenizer, settings.max_model_len),
                  ApiKeys(settings.api_keys), settings.tool_call_parser, settings.metrics_url, settings.created,
                  max_connections, lambda: len(runner.server.connections) if runner and runner.server else 0,
                  settings.max_generations, settings.strip_billing_header)
    runner = web.AppRunner(front.app(), handler_cancellation=True, access_log=None, keepalive_timeout=IDLE_SECONDS,
                           shutdown_timeout=settings.drain_seconds + 5)
    await runner.setup()
    listener = socket.socket(fileno=settings.listen_fd)
    site = web.SockSite(runner, listener, backlog=LISTEN_BACKLOG,
                        ssl_context=https_context(settings.tls) if settings.tls.enabled else None)
    await site.start()
    log.info("api server serving", extra={"fields": {"api_server": settings.index, "model": settings.model_names[0],
                                                     "max_connections": max_connections}})
    await stop.wait()
    log.info("api server stopping: in-flight requests finish", extra={"fields": {"api_server": settings.index}})
    await runner.cleanup()
    await channel.close()
    if parent.done():  # the daemon is gone without cleaning up: its private directory goes too
        shutil.rmtree(Path(settings.grpc_target.removeprefix("unix:")).parent, ignore_errors=True)
    parent.cancel()


async def _stop_when_parent_exits(stop: asyncio.Event) -> asyncio.Task:
    """A task that sets `stop` when stdin (the daemon's end of the pipe) reaches end-of-file."""
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def watch() -> None:
        await reader.read()
        stop.set()

    return asyncio.get_running_loop().create_task(watch())
