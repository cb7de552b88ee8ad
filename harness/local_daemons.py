"""Start the real daemons as separate processes on loopback (for `make run`, benchmarks and
tests), and always clean them up."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.serving.tls import TlsFiles
from protos.duet.v1 import duet_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
# Both daemons on one host: UCX over shared memory (DESIGN.md §3).
UCX_ENV = {"UCX_TLS": "sm,self"}


def _ephemeral_range() -> range:
    """The ports the kernel hands to bind(0) and to outgoing connections."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port that is free now, and that no bind(0) or outgoing connection can take before a
    daemon binds it.

    Drawn outside the kernel's ephemeral range: a port that bind(0) picked is freed again at once,
    and the kernel may hand it to any socket before the daemon binds it: an outgoing connection or a
    listener of any process, the daemon's own included (seen in CI: a decode node's metrics server
    failed with "Address already in use" just after its NIXL receiver started). Where 200 draws find
    none (the ephemeral range covers nearly all), bind(0) it is after all."""
    ephemeral = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(20000, 65536)
        if port not in ephemeral and port not in _handed_out and _bind(port) is not None:
            break
    else:
        while (port := _bind(0)) in _handed_out:
            pass
    _handed_out.add(port)
    return port


def _bind(port: int) -> int | None:
    """The loopback port a socket bound to `port` got (0: the kernel picks), None if taken."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return None
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text page, by name."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Daemon:
    def __init__(self, module: str, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 cpus: set[int] | None = None, tls: TlsFiles = TlsFiles(), port: int | None = None) -> None:
        self.port, self.metrics_port = port or free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), *_tls_flags(tls), *args]
        self._log = open(log_path, "w")
        # Pinned by taskset, never by a Popen preexec_fn: one makes Python fork() rather than vfork(),
        # and grpcio >= 1.80 then runs its fork handlers in the child, which abort it when this
        # process's channels are busy ("epoll_wait error: Bad file descriptor", grpc/grpc#43055).
        if cpus:
            cmd = ["taskset", "--cpu-list", ",".join(map(str, sorted(cpus))), *cmd]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **UCX_ENV, **(env or {}), "PYTHONUNBUFFERED": "1"})
        self.channel = tls.channel(self.address)

    def wait_healthy(self, timeout: float = 300.0) -> None:
        """Wait until the daemon serves, failing at once if it exits. The timeout is generous:
        daemons started side by side on two busy cores of a slow machine take minutes to load."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"daemon not healthy after {timeout}s:\n{self.log_path.read_text()}")

    def metrics_text(self) -> str:
        """The Prometheus endpoint's page."""
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of the Prometheus endpoint, by name."""
        return parse_metrics(self.metrics_text())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _tls_flags(tls: TlsFiles) -> list[str]:
    pairs = (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-ca", tls.ca))
    return [part for flag, path in pairs if path is not None for part in (flag, str(path))]


@contextmanager
def _running(module: str, stub_class, tmp_dir: Path, args: tuple[str, ...], env: dict[str, str] | None,
             cpus: set[int] | None = None, tls: TlsFiles = TlsFiles(), port: int | None = None):
    d = Daemon(module, list(args), tmp_dir / f"{module}_{free_port()}.log", env, cpus, tls, port)
    try:
        d.wait_healthy()
        d.stub = stub_class(d.channel)
        yield d
    finally:
        d.stop()


def _sampled(module: str, env: dict[str, str] | None, profile: Path | None) -> tuple[str, dict[str, str] | None]:
    """`module` run under scripts/stack_sampler.py, which writes its thread profile to `profile`."""
    if profile is None:
        return module, env
    return "scripts.stack_sampler", {**(env or {}), "DUET_SAMPLE_MODULE": module, "DUET_SAMPLE_OUT": str(profile)}


def decode_node(tmp_dir: Path, *args: str, env: dict[str, str] | None = None, cpus: set[int] | None = None,
                tls: TlsFiles = TlsFiles(), profile: Path | None = None, port: int | None = None):
    """A healthy decode node daemon (`with decode_node(tmp) as d: d.stub.Generate(...)`), optionally
    pinned to `cpus`, optionally serving (m)TLS with `tls` (also used by the returned stub), optionally
    writing a profile of its threads to `profile` when it stops (scripts/stack_sampler.py), on
    `port` when given (a restart at the same address)."""
    module, env = _sampled("decode_node", env, profile)
    return _running(module, duet_pb2_grpc.DecodeNodeStub, tmp_dir, args, env, cpus, tls, port)


def prefill_node(tmp_dir: Path, *args: str, env: dict[str, str] | None = None, cpus: set[int] | None = None,
                 tls: TlsFiles = TlsFiles(), profile: Path | None = None):
    """A healthy prefill node daemon."""
    module, env = _sampled("prefill_node", env, profile)
    return _running(module, duet_pb2_grpc.PrefillNodeStub, tmp_dir, args, env, cpus, tls)


def router(tmp_dir: Path, *args: str):
    """A healthy router daemon (`python -m router`); its stub is a DecodeNodeStub."""
    return _running("router", duet_pb2_grpc.DecodeNodeStub, tmp_dir, args, None)
