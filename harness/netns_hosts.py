"""Several "hosts" on one Linux machine: network namespaces joined by veth pairs to a bridge.

Each host is a network namespace with loopback up and one veth interface (``duet0`` inside the
namespace) carrying its own address ``10.77.N.k/24``; the other ends of the veths join a bridge
in the root namespace that holds ``10.77.N.254``, so the process that built the network (a test,
a demo) reaches every daemon's gRPC, health and metrics ports directly, and the hosts reach each
other only through their veths (no loopback shortcut between them). Cutting a host off the
network is ``host.link_down()`` (its veth goes down; its loopback stays up).

    with Network() as net:
        dh, ph = net.add_host("decode"), net.add_host("prefill")
        with netns_daemon(dh, "decode_node", tmp, "--transport", "nixl") as dn, ...:
            ...

Everything is created under names unique to the run (``duet-<pid>-<rand>-<host>`` namespaces,
``db<pid>-<rand>`` bridge, ``dv<pid>-<rand><k>`` veth ends) and deleted by :meth:`Network.close`
(context exit, also on failure); :func:`cleanup_stale` removes what a killed run left behind
(names whose pid is no longer alive). Subnets: the third octet is chosen among those no
interface of the root namespace uses, under a lock file, so concurrent runs do not clash.
Creating namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2;
:func:`netns_unavailable_reason` tries it and says why not.

The daemons run under ``ip netns exec NS python -m MODULE --host ... --advertise-host ADDR``
with UCX over TCP pinned to the host's veth (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=duet0``,
``UCX_TCP_PORT_RANGE=51000-51999``).

Command line (root):

    python -m harness.netns_hosts up        # two hosts, a decode and a prefill node; Ctrl-C stops
    python -m harness.netns_hosts cleanup   # remove leftovers of killed runs
    python -m harness.netns_hosts probe     # can namespaces be created here?

The module also serves as the small gRPC/HTTP client run *inside* a namespace (for a host whose
link to the bridge is down): ``ip netns exec NS python -m harness.netns_hosts remote-send
ADDRESS < RemoteSendRequest.bin`` and ``... metrics URL`` print one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from harness.local_daemons import ROOT, Daemon, parse_metrics

SUBNET_PREFIX = "10.77"
ROOT_HOST_OCTET = 254  # the bridge's own address: where the test process sits
IFNAME = "duet0"  # every host's veth, as seen inside its namespace
UCX_TCP_PORT_RANGE = "51000-51999"
LOCK_FILE = Path("/run/duet-netns.lock")
NS_PATTERN = re.compile(r"^duet-(\d+)-[0-9a-f]{3}-")
LINK_PATTERN = re.compile(r"^d[bv](\d+)-[0-9a-f]{3}")
# gRPC and urllib must never send our private addresses to an HTTP proxy from the environment.
GRPC_OPTIONS = [("grpc.enable_http_proxy", 0)]
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# A child SIGKILLed when the process that started it dies (a killed test run leaves no daemon
# behind): util-linux's setpriv sets the signal on its way to exec the command, a few ms after
# Popen returns (not a preexec_fn: see Daemon in harness/local_daemons.py). Without
# setpriv, Network.close and cleanup_stale still remove what a run leaves.
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL"] if shutil.which("setpriv") else []


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, no permission)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise NetnsUnavailable("iproute2's `ip` command is not installed") from None
    if check and result.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip() or result.returncode}")
    return result


def netns_unavailable_reason() -> str | None:
    """None if this process can create a namespace, a veth pair and a bridge (it tries, then
    removes them); otherwise why not."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed"
    tag = f"{os.getpid()}-{random.randrange(4096):03x}"
    ns, bridge, veth = f"duet-{tag}-probe", f"db{tag}", f"dv{tag}0"
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "add", veth, "type", "veth", "peer", "name", "probe0", "netns", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        return None
    except NetnsUnavailable as exc:
        return f"cannot create network namespaces here (needs root/CAP_NET_ADMIN): {exc}"
    finally:
        _ip("link", "del", veth, check=False)
        _ip("link", "del", bridge, check=False)
        _ip("netns", "del", ns, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete namespaces and links left by runs whose process is gone; returns their names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = NS_PATTERN.match(name)
        if m and not _pid_alive(int(m.group(1))):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():  # orphaned daemons of that run
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = LINK_PATTERN.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass
class Host:
    """One network namespace with one address on the shared link."""

    name: str  # logical name, e.g. "decode"
    netns: str
    address: str
    root_ifname: str  # the veth end in the root namespace (on the bridge)
    ifname: str = IFNAME  # the veth end inside the namespace

    def exec_args(self, *cmd: str) -> list[str]:
        """`cmd` run inside this namespace, killed when the process that started it dies."""
        return ["ip", "netns", "exec", self.netns, *DIE_WITH_PARENT, *cmd]

    def run(self, *cmd: str, timeout: float = 60, input: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_args(*cmd), capture_output=True, timeout=timeout, input=input, cwd=ROOT)

    def ucx_env(self) -> dict[str, str]:
        """UCX over TCP, on this host's veth only (no shared memory: the peers are 'remote'),
        its listening ports from a fixed range as a firewall would need (deploy/kubernetes)."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.ifname, "UCX_TCP_PORT_RANGE": UCX_TCP_PORT_RANGE}

    def link_down(self) -> None:
        """Cut this host off the network (its veth goes down; loopback stays up)."""
        _ip("-n", self.netns, "link", "set", self.ifname, "down")

    def link_up(self) -> None:
        _ip("-n", self.netns, "link", "set", self.ifname, "up")

    def sent_bytes(self) -> int:
        """Bytes this host has sent onto the link (what its veth's root end received)."""
        return int(Path(f"/sys/class/net/{self.root_ifname}/statistics/rx_bytes").read_text())

    def python(self, *args: str, timeout: float = 60, input: bytes | None = None) -> dict:
        """Run `python -m harness.netns_hosts ARGS` inside this namespace; its JSON answer."""
        out = self.run(sys.executable, "-m", "harness.netns_hosts", *args, timeout=timeout, input=input)
        if out.returncode != 0:
            raise RuntimeError(f"in-namespace client failed ({out.returncode}): {out.stderr.decode()[-2000:]}")
        return json.loads(out.stdout.decode().strip().splitlines()[-1])


class Network:
    """A bridge in the root namespace plus hosts (namespaces) attached to it by veth pairs."""

    def __init__(self) -> None:
        self.tag = f"{os.getpid()}-{random.randrange(4096):03x}"
        self.bridge = f"db{self.tag}"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._links: list[str] = []
        self.subnet: str | None = None  # "10.77.N"
        self._closed = False

    @property
    def root_address(self) -> str:
        return f"{self.subnet}.{ROOT_HOST_OCTET}"

    def __enter__(self) -> Network:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` command is not installed")
        cleanup_stale()
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # choosing and taking a subnet is one step
            used = set(re.findall(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.", _ip("-4", "-o", "addr").stdout))
            free = [n for n in range(0, 255) if str(n) not in used]
            if not free:
                raise NetnsUnavailable(f"every {SUBNET_PREFIX}.N.0/24 subnet is taken")
            self.subnet = f"{SUBNET_PREFIX}.{random.choice(free)}"
            self._links.append(self.bridge)
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")

    def add_host(self, name: str) -> Host:
        """A new namespace with address `<subnet>.<k>` (k = 1, 2, ... in creation order)."""
        k = len(self.hosts) + 1
        netns = f"duet-{self.tag}-{name}"[:64]
        root_if = f"dv{self.tag}{k}"
        host = Host(name, netns, f"{self.subnet}.{k}", root_if)
        self._namespaces.append(netns)
        _ip("netns", "add", netns)
        self._links.append(root_if)
        _ip("link", "add", root_if, "type", "veth", "peer", "name", host.ifname, "netns", netns)
        _ip("link", "set", root_if, "master", self.bridge)
        _ip("link", "set", root_if, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("-n", netns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
        _ip("-n", netns, "link", "set", host.ifname, "up")
        self.hosts[name] = host
        self._wait_reachable(host)
        return host

    def _wait_reachable(self, host: Host, timeout: float = 10.0) -> None:
        """The bridge port starts forwarding at once (STP is off), but addresses may still be
        tentative (DAD); wait until a TCP connection attempt gets an answer (refused is fine)."""
        import socket

        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection((host.address, 9), timeout=0.5).close()
                return
            except ConnectionRefusedError:
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise NetnsUnavailable(f"host {host.name} at {host.address} unreachable: {exc}") from None
                time.sleep(0.05)

    def close(self) -> None:
        """Delete every namespace and link this network created. Idempotent; never raises.
        Stop the processes running inside the namespaces first (a namespace lives on, unnamed,
        while a process is in it)."""
        if self._closed:
            return
        self._closed = True
        for netns in reversed(self._namespaces):
            _ip("netns", "del", netns, check=False)
        for link in reversed(self._links):
            if _ip("link", "show", link, check=False).returncode == 0:
                _ip("link", "del", link, check=False)


class NetnsDaemon(Daemon):
    """A daemon module running inside `host`'s namespace, listening on `listen` (default: the
    host's address) and advertising the host's address to its peers."""

    def __init__(self, host: Host, module: str, args: list[str], log_path: Path, *, port: int = 50051,
                 metrics_port: int = 9400, listen: str | None = None, advertise: bool = True,
                 env: dict[str, str] | None = None) -> None:
        self.host = host
        self.port, self.metrics_port = port, metrics_port
        self.address = f"{host.address}:{port}"
        self.log_path = log_path
        advertise_args = ["--advertise-host", host.address] if advertise else []
        cmd = host.exec_args(sys.executable, "-m", module, "--host", listen or host.address, "--port", str(port),
                             "--metrics-port", str(metrics_port), *advertise_args, *args)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **host.ucx_env(), **(env or {}), "PYTHONUNBUFFERED": "1"})
        self.channel = grpc.insecure_channel(self.address, options=GRPC_OPTIONS)

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host.address}:{self.metrics_port}/metrics"

    def metrics(self) -> dict[str, float]:
        return parse_metrics(_NO_PROXY.open(self.metrics_url, timeout=5).read().decode())


def start_daemons(daemons: list[NetnsDaemon], stub_classes: list, timeout: float = 180.0) -> None:
    """Wait for daemons started together (they load their models in parallel); on failure stop
    them all and raise."""
    try:
        for d, stub_class in zip(daemons, stub_classes):
            d.wait_healthy(timeout)
            d.stub = stub_class(d.channel)
    except BaseException:
        for d in daemons:
            d.stop(signal.SIGKILL, timeout=10)
        raise


@contextlib.contextmanager
def netns_daemon(host: Host, module: str, tmp_dir: Path, *args: str, stub_class=None, **kw) -> Iterator[NetnsDaemon]:
    """One healthy daemon inside `host`; stopped (SIGTERM, then SIGKILL) on exit."""
    d = NetnsDaemon(host, module, list(args), tmp_dir / f"{module}_{host.name}_{kw.get('port', 50051)}.log", **kw)
    try:
        d.wait_healthy()
        if stub_class is not None:
            d.stub = stub_class(d.channel)
        yield d
    finally:
        d.stop()


# ---------------------------------------------------------------------------------------------
# In-namespace clients and the command line


def _remote_send(address: str, timeout: float) -> dict:
    from protos.duet.v1 import duet_pb2 as pb
    from protos.duet.v1 import duet_pb2_grpc

    request = pb.RemoteSendRequest.FromString(sys.stdin.buffer.read())
    started = time.monotonic()
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        try:
            r = duet_pb2_grpc.PrefillNodeStub(channel).RemoteSend(request, timeout=timeout)
            return {"code": "OK", "details": "", "seconds": time.monotonic() - started,
                    "tokens_sent": r.tokens_sent, "bytes_sent": r.bytes_sent}
        except grpc.RpcError as exc:
            return {"code": exc.code().name, "details": exc.details(), "seconds": time.monotonic() - started}


def _up(args: argparse.Namespace) -> int:
    import tempfile

    from protos.duet.v1 import duet_pb2_grpc

    with Network() as net, tempfile.TemporaryDirectory() as tmp:
        dh, ph = net.add_host("decode"), net.add_host("prefill")
        transport = ("--transport", args.transport)
        pn = NetnsDaemon(ph, "prefill_node", [*transport], Path(tmp) / "prefill.log")
        dn = NetnsDaemon(dh, "decode_node", [*transport, "--prefill", pn.address], Path(tmp) / "decode.log")
        try:
            start_daemons([pn, dn], [duet_pb2_grpc.PrefillNodeStub, duet_pb2_grpc.DecodeNodeStub])
            print(f"decode node  {dn.address} (namespace {dh.netns}, metrics {dn.metrics_url})")
            print(f"prefill node {pn.address} (namespace {ph.netns}, metrics {pn.metrics_url})")
            print(f"this shell reaches them through bridge {net.bridge} ({net.root_address}); Ctrl-C stops",
                  flush=True)
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            for d in (dn, pn):
                d.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.netns_hosts", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="two hosts with a decode and a prefill node, until Ctrl-C")
    up.add_argument("--transport", default="nixl", choices=["nixl", "tcp"])
    sub.add_parser("cleanup", help="remove namespaces and links left by killed runs")
    sub.add_parser("probe", help="say whether namespaces can be created here")
    rs = sub.add_parser("remote-send", help="(inside a namespace) RemoteSend a serialized request from stdin")
    rs.add_argument("address")
    rs.add_argument("--timeout", type=float, default=60.0)
    mt = sub.add_parser("metrics", help="(inside a namespace) fetch a /metrics page")
    mt.add_argument("url")
    args = p.parse_args(argv)
    if args.command == "up":
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it like Ctrl-C
        return _up(args)
    if args.command == "cleanup":
        print(json.dumps({"removed": cleanup_stale()}))
    elif args.command == "probe":
        reason = netns_unavailable_reason()
        print(json.dumps({"available": reason is None, "reason": reason}))
        return 0 if reason is None else 1
    elif args.command == "remote-send":
        print(json.dumps(_remote_send(args.address, args.timeout)))
    elif args.command == "metrics":
        print(json.dumps(parse_metrics(_NO_PROXY.open(args.url, timeout=5).read().decode())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
