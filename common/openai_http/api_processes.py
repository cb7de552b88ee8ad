"""The daemon's side of its HTTP front: the listening socket, and the API-server processes
that serve it (common/openai_http/api_server.py), started, restarted when one dies, and stopped.

The daemon binds the port itself (a taken port fails its start, as before) with a backlog sized
for bursts, and opens two doors for its API servers that no one else can reach: its gRPC server
on a Unix socket in a private directory, and its Prometheus registry on a loopback port. The API
servers inherit the listening socket and accept on it together.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from common.openai_http.api_server import LISTEN_BACKLOG, ApiServerSettings

log = logging.getLogger("openai_http")

SUPERVISE_SECONDS = 1.0  # how often a dead API server is noticed and started again
CPUS_PER_API_SERVER = 8  # --api-server-count's default: one per this many CPUs, at least one
MAX_DEFAULT_API_SERVERS = 4


def default_api_server_count() -> int:
    """One API server per CPUS_PER_API_SERVER CPUs this process may run on, 1 to MAX_DEFAULT_API_SERVERS."""
    return max(1, min(MAX_DEFAULT_API_SERVERS, len(os.sched_getaffinity(0)) // CPUS_PER_API_SERVER))


def listening_socket(host: str, port: int) -> socket.socket:
    """`host:port` bound and listening (port 0: any free one); an IPv6 host may come bracketed."""
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


class OpenAIFront:
    """The HTTP front of a daemon: `count` API-server processes serving `settings` (less the
    parts filled in here) on `host:port`, calling the daemon's gRPC server `grpc_server` over a
    Unix socket, with `registry` as their /metrics. The port is bound at construction; `start`
    starts the processes once gRPC serves."""

    def __init__(self, host: str, port: int, count: int, settings: ApiServerSettings, grpc_server: grpc.Server,
                 registry: CollectorRegistry | None) -> None:
        self._listener = listening_socket(host, port)
        self._dir = tempfile.mkdtemp(prefix="duet-api-")  # 0700: only this user reaches the socket in it
        grpc_target = f"unix:{self._dir}/grpc.sock"
        if grpc_server.add_insecure_port(grpc_target) == 0:
            raise OSError(f"cannot listen on {grpc_target}")
        metrics_url = None
        if registry is not None:
            self._metrics_server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
            metrics_url = f"http://127.0.0.1:{self._metrics_server.server_port}/metrics"
        self.settings = replace(settings, listen_fd=self._listener.fileno(), grpc_target=grpc_target,
                                metrics_url=metrics_url)
        self.count = count
        self.model_name = settings.model_names[0]
        self._processes: list[subprocess.Popen | None] = [None] * count
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="api-servers", daemon=True)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def start(self) -> None:
        for index in range(self.count):
            self._spawn(index)
        self._supervisor.start()
        log.info("openai http serving", extra={"fields": {
            "openai_port": self.port, "model": self.model_name, "api_servers": self.count,
            "https": self.settings.tls_cert is not None, "api_key_required": bool(self.settings.api_keys)}})

    def stop(self) -> None:
        """The daemon begins to drain: the API servers go on answering while it does, so a
        request that comes now gets 503 with Retry-After (the daemon refuses it, its health says
        NOT_SERVING) rather than a refused connection; `join` ends them."""
        self._stopping.set()

    def join(self, timeout: float = 10.0) -> None:
        """Once the daemon's gRPC server stopped: each API server stops listening, lets what is
        still in flight end and exits (killed past `timeout`); then close what the front holds."""
        self._stopping.set()
        for process in self._processes:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self._processes:
            if process is None:
                continue
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            process.stdin.close()
        self._listener.close()
        if self.settings.metrics_url is not None:
            self._metrics_server.shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _spawn(self, index: int) -> None:
        settings = replace(self.settings, index=index)
        process = subprocess.Popen([sys.executable, "-m", "common.openai_http"], stdin=subprocess.PIPE,
                                   pass_fds=(self._listener.fileno(),), text=True)
        process.stdin.write(settings.to_json() + "\n")  # the keys travel here, not on a command line
        process.stdin.flush()  # and the pipe stays open: its end tells the API server the daemon is gone
        self._processes[index] = process

    def _supervise(self) -> None:
        """Start an API server again when one dies while the daemon serves."""
        while not self._stopping.wait(SUPERVISE_SECONDS):
            for index, process in enumerate(self._processes):
                if process is not None and process.poll() is not None and not self._stopping.is_set():
                    log.error("api server exited: starting it again", extra={"fields": {
                        "api_server": index, "returncode": process.returncode}})
                    process.stdin.close()
                    self._spawn(index)
