"""What both daemons share: structured logging, the gRPC server with health checking and
reflection, the Prometheus endpoint, and graceful shutdown on SIGTERM/SIGINT."""
from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from common.daemon_limits import CHANNEL_OPTIONS
from common.serving import heap, placement
from common.serving.tls import TlsFiles
from common.tracing import TraceFileWriter


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class Front(Protocol):
    """Another server a daemon runs beside gRPC (the OpenAI HTTP front)."""

    def start(self) -> None: ...

    def stop(self) -> None:
        """Shutdown began (without waiting)."""

    def join(self, timeout: float) -> None:
        """The gRPC server stopped: end, within `timeout`."""


class GrpcDaemon:
    """A gRPC server plus health/reflection/metrics, run until a termination signal."""

    def __init__(self, host: str, port: int, tls: TlsFiles = TlsFiles(), max_workers: int = 64) -> None:
        """`max_workers`: the threads that serve calls; a streamed call holds one to its end, and
        calls beyond them wait unanswered, so a node sizes them past the requests it admits."""
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
        self.address = f"{host}:{port}"
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if tls.enabled:
            self.port = self.server.add_secure_port(self.address, tls.server_credentials())
        else:
            self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.address}")
        self._stop = threading.Event()
        self.draining = threading.Event()  # set when shutdown begins: long-lived streams end
        self._ready = True  # the daemon's own word (a router: it has a healthy decode node)
        self._fronts: list[Front] = []
        self._service_names: list[str] = []
        self._health_lock = threading.Lock()
        self._started = False
        self._before_stop: list[Callable[[], None]] = []

    def request_stop(self) -> None:
        """Shut down as on SIGTERM."""
        self._stop.set()

    def before_stop(self, callback: Callable[[], None]) -> None:
        """Run `callback` when shutdown begins, while the server still serves (a decode node moving
        its running requests elsewhere), before in-flight calls get --drain-seconds to end."""
        self._before_stop.append(callback)

    @property
    def serving(self) -> bool:
        """Whether health checks say SERVING now: serving started, shutdown not begun, and the
        daemon ready (`set_ready`)."""
        return self._ready and self._started and not self.draining.is_set()

    def set_ready(self, ready: bool) -> None:
        """Whether the daemon can serve requests; health says SERVING only while it can."""
        self._ready = ready
        self._publish_health()

    def _publish_health(self) -> None:
        with self._health_lock:
            if self.draining.is_set():
                return  # the health servicer says NOT_SERVING for good
            status = health_pb2.HealthCheckResponse.SERVING if self.serving else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ["", *self._service_names]:
                self.health.set(name, status)

    def add_front(self, front: Front) -> None:
        """Start `front` once gRPC serves; stop it (no new requests) when shutdown begins."""
        self._fronts.append(front)

    def serve(
        self,
        service_names: list[str],
        metrics_registry: CollectorRegistry | None = None,
        metrics_port: int | None = None,
        on_shutdown: Callable[[], None] | None = None,
        grace_seconds: float = 10.0,
    ) -> None:
        """Start serving (health SERVING), block until SIGTERM/SIGINT, then drain and stop."""
        reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        if metrics_port is not None:
            start_http_server(metrics_port, registry=metrics_registry)
        self.server.start()
        for front in self._fronts:
            front.start()
        self._service_names, self._started = service_names, True
        self._publish_health()
        log = logging.getLogger("daemon")
        log.info("serving", extra={"fields": {"address": f"{self.address.rsplit(':', 1)[0]}:{self.port}",
                                              "metrics_port": metrics_port}})
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        self._stop.wait()
        log.info("shutting down: draining in-flight requests")
        with self._health_lock:
            self.draining.set()
            self.health.enter_graceful_shutdown()
        for front in self._fronts:
            front.stop()
        started = time.monotonic()
        for callback in self._before_stop:
            callback()
        self.server.stop(grace_seconds).wait()
        for front in self._fronts:
            front.join(grace_seconds)
        if on_shutdown is not None:
            on_shutdown()
        log.info("stopped", extra={"fields": {"drain_seconds": round(time.monotonic() - started, 3)}})


def run_node(config, service_name: str, start: Callable[[GrpcDaemon, object], object]) -> int:
    """The shared `main` of both daemons: logging and placement from `config`, bind the port
    first (a taken port fails fast), then `start(daemon, config)` loads the model, builds the
    node and registers its servicer (in a passing thread, after which only the engine loop's
    thread computes in parallel: common/serving/placement.py); serve until SIGTERM and shut the
    node down."""
    import torch

    setup_logging(config.log_level)
    torch.set_grad_enabled(False)
    placement.apply(config.cpus, config.threads, config.nice)
    heap.keep_freed_buffers()
    daemon = GrpcDaemon(config.host, config.port, config.tls, config.grpc_workers)
    try:
        node = placement.in_passing_thread(start, daemon, config)
    except ValueError as exc:  # a setting the node cannot start with (a taken or malformed endpoint, ...)
        logging.getLogger("daemon").error("cannot start: %s", exc)
        return 2
    placement.serialize_other_threads()
    trace_file = TraceFileWriter(node.tracer, config.trace) if config.trace is not None else None

    def shutdown() -> None:
        try:
            node.shutdown()
        finally:
            if trace_file is not None:
                trace_file.close()  # after the drain, so the file holds every request's last events

    daemon.serve([service_name], metrics_registry=node.metrics.registry, metrics_port=config.metrics_port,
                 on_shutdown=shutdown, grace_seconds=config.drain_seconds)
    return 0
