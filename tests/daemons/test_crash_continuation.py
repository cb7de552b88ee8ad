"""A decode node SIGKILLed mid-stream: the router continues each of its requests on another decode
node from the tokens it already relayed (router/continuation.py), and the client's stream goes
on as an uninterrupted run's. Real daemons: two decode nodes and two routers (--migration-limit
1, the default, and 0) that first know only decode node A, so that every request lands there,
then both nodes, so that B can take A's requests over once A is killed."""
from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from router.__main__ import parse_args
from harness.local_daemons import Daemon
from harness.helpers import random_ids, wait_clean
from harness.reference import FP32

DECODE_FLAGS = (*FP32, "--transport", "tcp")
MAX_TOKENS = 48
MARGIN = 8  # tokens each sample still had to generate when A was killed, at least


def _sampling(**kwargs) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


# Through the router with --migration-limit 1: greedy, seeded, and seeded with two samples.
REQUESTS = [pb.GenerateRequest(token_ids=random_ids(20, 300 + i), sampling=_sampling(temperature=0.0))
            for i in range(3)]
REQUESTS += [pb.GenerateRequest(token_ids=random_ids(20, 310 + i), sampling=_sampling(temperature=0.8, seed=7 + i))
             for i in range(2)]
REQUESTS += [pb.GenerateRequest(token_ids=random_ids(20, 320), sampling=_sampling(temperature=0.8, seed=11, n=2))]
# Through the router with --migration-limit 0.
UNCONTINUED = pb.GenerateRequest(token_ids=random_ids(20, 330), sampling=_sampling(temperature=0.0))


@dataclass
class Stream:
    """A Generate call read on a thread, what it has received visible as it arrives."""

    request: pb.GenerateRequest
    tokens: dict[int, list[int]] = field(init=False)  # per sample index
    usage: pb.Usage | None = None
    error: grpc.RpcError | None = None

    def __post_init__(self) -> None:
        n = self.request.sampling.n or 1
        self.tokens = {i: [] for i in range(n)}

    def start(self, stub: duet_pb2_grpc.DecodeNodeStub) -> Stream:
        self._thread = threading.Thread(target=self._read, args=(stub,), daemon=True)
        self._thread.start()
        return self

    def _read(self, stub: duet_pb2_grpc.DecodeNodeStub) -> None:
        try:
            for chunk in stub.Generate(self.request, timeout=120):
                self.tokens[chunk.index] = self.tokens[chunk.index] + list(chunk.token_ids)
                if chunk.HasField("usage"):
                    self.usage = chunk.usage
        except grpc.RpcError as exc:
            self.error = exc

    def join(self) -> Stream:
        self._thread.join(150)
        assert not self._thread.is_alive(), "the stream did not end"
        return self


def run_all(stub: duet_pb2_grpc.DecodeNodeStub, requests: list[pb.GenerateRequest]) -> list[Stream]:
    streams = [Stream(r).start(stub) for r in requests]
    return [s.join() for s in streams]


def wait_for(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in {timeout}s: {what}"
        time.sleep(0.05)


def migrations(rt: Daemon, outcome: str) -> float:
    """The router's duet_migrations_total{reason="crash",outcome=...} (0 before the first)."""
    for name, labels, value in re.findall(r'^(\w+)\{(.*)\} (\S+)$', rt.metrics_text(), re.MULTILINE):
        if name == "duet_migrations_total" and dict(re.findall(r'(\w+)="([^"]*)"', labels)) == {
                "reason": "crash", "outcome": outcome}:
            return float(value)
    return 0.0


_log_names = itertools.count()


def _start(started: list[Daemon], tmp: Path, module: str, *args: str) -> Daemon:
    """A daemon process, started now and made healthy later (`_ready`), so that the decode nodes'
    model loads (most of a minute each on a busy machine) overlap."""
    d = Daemon(module, list(args), tmp / f"{module}_{next(_log_names)}.log")
    started.append(d)
    return d


def _stop_all(daemons: list[Daemon]) -> None:
    """Stop (and reap) them side by side: each takes seconds to exit."""
    with ThreadPoolExecutor(len(daemons) or 1) as pool:
        list(pool.map(Daemon.stop, daemons))


def _ready(*daemons: Daemon) -> None:
    for d in daemons:
        d.wait_healthy()
        d.stub = duet_pb2_grpc.DecodeNodeStub(d.channel)


@dataclass
class Cluster:
    a: Daemon  # the decode node that gets killed
    b: Daemon
    router: Daemon  # --migration-limit 1 (the default)
    router0: Daemon  # --migration-limit 0
    members: list[Path]  # the routers' members files


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("crash")
    started: list[Daemon] = []
    try:
        a = _start(started, tmp, "decode_node", *DECODE_FLAGS)
        b = _start(started, tmp, "decode_node", *DECODE_FLAGS)
        members = [tmp / "members.json", tmp / "members0.json"]
        for path in members:
            path.write_text(json.dumps({"decode": [a.address]}))
        routers = [_start(started, tmp, "router", "--members", str(path), "--poll-seconds", "0.1", *limit)
                   for path, limit in zip(members, ((), ("--migration-limit", "0")))]
        _ready(a, b, *routers)
        for rt in routers:
            wait_for(lambda rt=rt: rt.metrics().get("duet_router_healthy_decode_nodes") == 1, "A healthy")
        yield Cluster(a, b, *routers, members)
    finally:
        _stop_all(started)


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> list[Stream]:
    """The requests' output uninterrupted, through the router (on A)."""
    return run_all(cluster.router.stub, REQUESTS)


@dataclass
class Crash:
    continued: list[Stream]  # through the router
    uncontinued: Stream  # through the router with --migration-limit 0


@pytest.fixture(scope="module")
def crash(cluster: Cluster, reference: list[Stream]) -> Crash:
    """Every request streaming from A, B known to both routers, then A SIGKILLed."""
    c = cluster
    streams = [Stream(r).start(c.router.stub) for r in REQUESTS]
    uncontinued = Stream(UNCONTINUED).start(c.router0.stub)
    everything = [*streams, uncontinued]
    wait_for(lambda: all(len(t) > 0 for s in everything for t in s.tokens.values()), "every sample streamed a token")
    for path in c.members:
        path.write_text(json.dumps({"decode": [c.a.address, c.b.address]}))
    for rt in (c.router, c.router0):
        wait_for(lambda rt=rt: rt.metrics().get("duet_router_healthy_decode_nodes") == 2, "B healthy")
    assert c.b.stub.GetLoad(pb.GetLoadRequest(), timeout=5).running_requests == 0, "B must start with nothing"
    streamed = [len(t) for s in everything for t in s.tokens.values()]
    assert max(streamed) <= MAX_TOKENS - MARGIN, f"too fast for the test: {streamed} tokens before the kill"
    c.a.proc.kill()
    c.a.proc.wait()
    return Crash([s.join() for s in streams], uncontinued.join())


def test_uninterrupted_reference(reference: list[Stream]) -> None:
    for s in reference:
        assert s.error is None, s.error
        n = len(s.tokens)
        assert [len(t) for t in s.tokens.values()] == [MAX_TOKENS] * n
        assert (s.usage.prompt_tokens, s.usage.completion_tokens) == (len(s.request.token_ids), MAX_TOKENS * n)
    two = reference[-1].tokens
    assert two[0] != two[1], "the two seeded samples draw from streams of their own"


def test_killed_decode_node_every_request_completes_token_identical(cluster: Cluster, reference: list[Stream],
                                                                    crash: Crash) -> None:
    for got, want in zip(crash.continued, reference):
        assert got.error is None, f"{got.error.code()}: {got.error.details()}"
        assert got.tokens == want.tokens, f"sampling {want.request.sampling}"
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        assert got.usage.completion_tokens == want.usage.completion_tokens
    assert migrations(cluster.router, "continued") == len(REQUESTS)
    assert migrations(cluster.router, "failed") == 0
    wait_clean(cluster.b)


def test_migration_limit_0_surfaces_the_break(cluster: Cluster, crash: Crash) -> None:
    error = crash.uncontinued.error
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
    assert "--migration-limit is 0" in error.details(), error.details()
    assert cluster.a.address in error.details()
    assert (migrations(cluster.router0, "continued"), migrations(cluster.router0, "failed")) == (0, 1)


def test_migration_limit_flag(capsys) -> None:
    assert parse_args([]).migration_limit == 1
    assert parse_args(["--migration-limit", "3"]).migration_limit == 3
    with pytest.raises(SystemExit):
        parse_args(["--migration-limit", "-1"])
    assert "--migration-limit must be >= 0" in capsys.readouterr().err
