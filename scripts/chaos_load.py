"""Chaos under load (`make chaos ARGS="--load"`): random kills, hangs, network cuts, migrations and
drains while a disaggregated pool serves a Poisson stream of requests; published as goodput.

Topology (one run per transport, fp32, every daemon with one compute thread): `--prefill-nodes`
prefill nodes and `--decode-nodes` decode nodes (default 2 x 2) and two routers, each on a host of
its own (network namespaces joined by a bridge, harness/netns_hosts.py; needs root). Each decode
node hands prompts to every prefill node itself (`--prefill`), drains to the others
(`--drain-to`) and queues what does not fit (`--admission queue`); the routers route by prefix
over all of them.

Load: sessions of one turn or of `--turns` turns (every turn's prompt is the whole conversation
so far: the prefix cache and the routers' prefix routing are in play), prompts as token ids,
`--output-len` greedy tokens each (EOS ignored). A session enters through a router, or through a
decode node's own Generate (`--direct-share`); its client is loadgen's (loadgen/grpc_client.py)
with the other router (resp. decode node) as its fallback (`--targets A,B`): a stream that ends
UNAVAILABLE goes on there with the tokens it has. First the capacity: sessions at
`--capacity-concurrency` at once, fault-free; the two passes then send `--requests` requests each
with the same Poisson arrivals at `--load-fraction` of that capacity, and different prompts (neither
rides on the other's prefix cache): one fault-free, one with a fault every `--fault-every`
seconds (exponential gaps), drawn with `--seed`:

- `kill-prefill`, `kill-decode`, `kill-router`: SIGKILL, restarted on its port after 2 s;
- `stop-prefill`, `stop-decode`: SIGSTOP for longer than a lease (a hang, not a death), SIGCONT;
- `cut`: a prefill and a decode node lose their route to each other (a blackhole route on both
  hosts; both still reach everyone else) for `CUT_S` seconds;
- `migrate`: a streaming request is moved to the other decode node (Migrate on every decode node;
  the one that does not hold it answers NOT_FOUND);
- `drain`: a decode node's Drain: it migrates its requests to the others and exits; restarted.

At most one daemon of each role is under a fault at a time (a router's clients need the other).
Every answer, and the tokens of a broken stream, are checked against the in-process engine: each
token must be its greedy choice given the prompt the client sent and the tokens before it (one
teacher-forced forward, harness/reference.py `greedy_gaps`), within a logit gap of `TIE` (a near-tie
flipped by float32 sums in another order is counted apart). Printed per transport: completed,
failed by status, wrong tokens, hung requests (no end `HUNG_AFTER_S` after being
sent), pages reserved or quarantined on each decode node once idle, each fault with its time and
the seconds until the pool was whole again (every daemon serving, no page quarantined), requests
that a router's death moved to the other router, and goodput (exact completions per second from
the first arrival to the last end), faulted / fault-free.

Usage: python -m scripts.chaos --load [--transports nixl,tcp] [--requests 200] [--seed 1] [--json FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import torch

from common.model.checkpoint import load_checkpoint
from common.model.default_model import default_model_path
from common.model.decoder import DecoderModel
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loadgen.arrivals import arrival_offsets
from loadgen.config import BenchmarkConfig
from loadgen.datasets import SampleRequest
from loadgen.grpc_client import GrpcTarget
from loadgen.request_result import RequestResult
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from scripts.chaos import settle
from harness.netns_hosts import Host, Network, NetnsDaemon, netns_unavailable_reason
from harness.reference import FP32, greedy_gaps

TRANSPORTS = ("nixl", "tcp")
LEASE_S, QUARANTINE_S, TRANSFER_TIMEOUT_S = 8, 30, 10
STOP_S = LEASE_S + 4  # a hang outlasting a lease
CUT_S = 8
RESTART_PAUSE_S = 2
DEADLINE_S = 120.0  # each request's gRPC deadline, per target
HUNG_AFTER_S = 2 * DEADLINE_S + 15  # no end by then, with both targets' deadlines past: hung
RECOVERY_LIMIT_S = QUARANTINE_S + 60
TIE = 1e-3  # a logit this close to the best is as greedy a choice as the best (check())
# Each fault and the roles it takes (no two faults at once on one role).
FAULTS = {"kill-prefill": {"prefill"}, "kill-decode": {"decode"}, "kill-router": {"router"},
          "stop-prefill": {"prefill"}, "stop-decode": {"decode"}, "cut": {"prefill", "decode"},
          "migrate": {"decode"}, "drain": {"decode"}}
MODULES = {"prefill": "prefill_node", "decode": "decode_node", "router": "router"}
STUBS = {"prefill": duet_pb2_grpc.PrefillNodeStub, "decode": duet_pb2_grpc.DecodeNodeStub,
         "router": duet_pb2_grpc.DecodeNodeStub}


# ---------------------------------------------------------------------------------------------
# The cluster


@dataclass
class Node:
    """One daemon on a host of its own; `daemon` is its current incarnation."""
    name: str  # "p0", "d1", "r0"
    role: str  # "prefill", "decode", "router"
    args: list[str]
    host: Host
    daemon: NetnsDaemon | None = None
    incarnation: int = 0

    @property
    def address(self) -> str:
        return f"{self.host.address}:50051"


class Cluster:
    """Prefill and decode nodes and two routers of one transport, each in its own namespace."""

    def __init__(self, net: Network, transport: str, log_dir: Path, prefill: int, decode: int) -> None:
        self.net, self.log_dir = net, log_dir
        hosts = {name: net.add_host(f"{transport[0]}{name}")
                 for name in [*(f"p{i}" for i in range(prefill)), *(f"d{i}" for i in range(decode)), "r0", "r1"]}
        pn = [f"{hosts[f'p{i}'].address}:50051" for i in range(prefill)]
        dn = [f"{hosts[f'd{i}'].address}:50051" for i in range(decode)]
        common = [*FP32, "--transport", transport, "--threads", "1"]
        self.nodes: dict[str, Node] = {}
        for i in range(prefill):
            self._add(f"p{i}", "prefill", hosts, [*common, "--transfer-timeout-seconds", str(TRANSFER_TIMEOUT_S)])
        for i in range(decode):
            drain_to = [a for a in dn if a != dn[i]]
            self._add(f"d{i}", "decode", hosts, [
                *common, "--lease-seconds", str(LEASE_S), "--quarantine-seconds", str(QUARANTINE_S),
                "--admission", "queue", "--min-remote-prefill-tokens", "64",
                *(f for a in pn for f in ("--prefill", a)), *(f for a in drain_to for f in ("--drain-to", a))])
        for name in ("r0", "r1"):
            self._add(name, "router", hosts, [*(f for a in dn for f in ("--decode", a)),
                                              *(f for a in pn for f in ("--prefill", a)),
                                              "--poll-seconds", "0.5", "--min-remote-prefill-tokens", "64"])
        # The client reaches every daemon directly, never through a proxy from the environment.
        os.environ["no_grpc_proxy"] = ",".join(h.address for h in hosts.values())
        # Every daemon is started from this one thread, which lives as long as the cluster: a
        # daemon dies with the thread that started it (harness/netns_hosts.py DIE_WITH_PARENT:
        # the parent-death signal follows the thread, not the process), and faults run in
        # threads of their own that end.
        self._spawner = ThreadPoolExecutor(1)

    def _add(self, name: str, role: str, hosts: dict, args: list[str]) -> None:
        self.nodes[name] = Node(name, role, args, hosts[name])

    def of(self, role: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.role == role]

    def start(self, node: Node | None = None) -> None:
        """Start `node` (default: every node, in parallel) and wait until it serves."""
        nodes = [node] if node else list(self.nodes.values())
        for n in nodes:
            n.incarnation += 1
            n.daemon = self._spawner.submit(NetnsDaemon, n.host, MODULES[n.role], n.args,
                                            self.log_dir / f"{n.name}_{n.incarnation}.log",
                                            advertise=n.role != "router").result()
            n.daemon.stub = STUBS[n.role](n.daemon.channel)
        for n in nodes:
            n.daemon.wait_healthy(600)

    def signal(self, node: Node, sig: int) -> None:
        node.daemon.proc.send_signal(sig)

    def kill(self, node: Node) -> None:
        self.signal(node, signal.SIGKILL)
        node.daemon.proc.wait(10)
        node.daemon.stop()

    def route(self, a: Node, b: Node, action: str) -> None:
        """Add (`action` "add") or remove ("del") blackhole routes between the hosts of a and b."""
        for here, there in ((a, b), (b, a)):
            subprocess.run(["ip", "-n", here.host.netns, "route", action, "blackhole", f"{there.host.address}/32"],
                           check=True, capture_output=True)

    def serving(self, node: Node) -> bool:
        try:
            return health_pb2_grpc.HealthStub(node.daemon.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING
        except (grpc.RpcError, ValueError):  # ValueError: a killed incarnation's closed channel
            return False

    def quarantined(self) -> int:
        """Pages quarantined on the decode nodes that answer now."""
        total = 0
        for n in self.of("decode"):
            try:
                total += n.daemon.stub.GetLoad(pb.GetLoadRequest(), timeout=1).kv_pages_quarantined
            except (grpc.RpcError, ValueError):  # ValueError: a killed incarnation's closed channel
                pass
        return total

    def close(self) -> None:
        for n in self.nodes.values():
            if n.daemon is not None:
                if n.daemon.proc.poll() is None:
                    self.signal(n, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
                n.daemon.stop(timeout=15)
        self._spawner.shutdown()


# ---------------------------------------------------------------------------------------------
# The load


@dataclass
class Session:
    """A conversation: the first prompt, then each later turn's new question."""
    index: int
    entry: tuple[str, str]  # the target, then its fallback (node names)
    prompt: list[int]
    questions: list[list[int]]
    arrival: float = 0.0


@dataclass
class Record:
    """One request as its client saw it."""
    session: int
    turn: int
    request_id: str
    entry: str  # the node the client tried first
    prompt: list[int]
    status: str  # "OK", a gRPC status name, "HUNG", "NOT_SENT" (an earlier turn failed)
    error: str = ""
    tokens: list[int] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    retries: int = 0  # the target became UNAVAILABLE and the fallback went on
    exact: bool | None = None  # every token is the reference's greedy choice (None: no token)
    near_tie: bool = False  # a token is the other side of a near-tie with the reference's choice


def sessions(n_requests: int, seed: int, prompt_seed: int, turns: int, direct_share: float, routers: list[str],
             decodes: list[str]) -> list[Session]:
    """Sessions whose turns add up to `n_requests`: half of them of one turn, half of `turns`;
    `direct_share` of them enter at a decode node, the others at a router. Their shape (turns,
    entries, lengths) follows `seed`, their tokens `prompt_seed`: plans of one seed and two
    prompt seeds send the same shapes with prompts neither shares."""
    shape, text = random.Random(seed), random.Random(prompt_seed)
    out, planned = [], 0
    while planned < n_requests:
        n_turns = min(1 if shape.random() < 0.5 else turns, n_requests - planned)
        pool = decodes if shape.random() < direct_share else routers
        first = shape.choice(pool)
        fallback = shape.choice([p for p in pool if p != first])
        lengths = [shape.randint(128, 384), *(shape.randint(16, 64) for _ in range(n_turns - 1))]
        prompts = [text.choices(range(100, 40000), k=k) for k in lengths]
        out.append(Session(len(out), (first, fallback), prompts[0], prompts[1:]))
        planned += n_turns
    return out


class Load:
    """Runs sessions against the cluster; remembers what is streaming (for Migrate)."""

    def __init__(self, cluster: Cluster, output_len: int, tag: str) -> None:
        self.cluster, self.output_len, self.tag = cluster, output_len, tag
        self.streaming: set[str] = set()
        self.records: list[Record] = []
        self._targets: dict[tuple[str, str], GrpcTarget] = {}

    def _target(self, entry: tuple[str, str]) -> GrpcTarget:
        if entry not in self._targets:
            a, b = (self.cluster.nodes[n].address for n in entry)
            self._targets[entry] = GrpcTarget(BenchmarkConfig(target=a, fallbacks=(b,), timeout=DEADLINE_S))
        return self._targets[entry]

    async def run(self, plan: list[Session], concurrency: int | None = None) -> float:
        """Send every session (at its arrival, or `concurrency` at a time); the seconds it took."""
        gate = asyncio.Semaphore(concurrency or len(plan) or 1)
        t0 = time.monotonic()

        async def one(s: Session) -> None:
            await asyncio.sleep(max(0.0, t0 + s.arrival - time.monotonic()))
            async with gate:
                await self._session(s, t0)

        try:
            await asyncio.gather(*(one(s) for s in plan))
        finally:
            for t in self._targets.values():
                await t.__aexit__(None, None, None)
            self._targets.clear()
        return time.monotonic() - t0

    async def _session(self, s: Session, t0: float) -> None:
        prompt, failed = s.prompt, False
        for turn in range(len(s.questions) + 1):
            rid = f"{self.tag}-s{s.index}-t{turn}"
            record = Record(s.index, turn, rid, s.entry[0], prompt, "NOT_SENT")
            self.records.append(record)
            if failed:
                continue
            record.start = time.monotonic() - t0
            sent = self._target(s.entry).send(0, rid, SampleRequest(self.output_len, token_ids=tuple(prompt)),
                                              origin=0.0, arrival=0.0)
            self.streaming.add(rid)
            try:
                r: RequestResult = await asyncio.wait_for(sent, HUNG_AFTER_S)
                record.status, record.error, record.tokens, record.retries = r.status, r.error, r.token_ids, r.retries
            except asyncio.TimeoutError:
                record.status = "HUNG"
            finally:
                self.streaming.discard(rid)
            record.end = time.monotonic() - t0
            failed = record.status != "OK"
            if turn < len(s.questions):
                prompt = prompt + record.tokens + s.questions[turn]


# ---------------------------------------------------------------------------------------------
# The faults


@dataclass
class Fault:
    kind: str
    targets: list[str]
    at: float  # seconds since the pass began
    outcome: str = ""
    whole_after: float | None = None  # seconds from the fault to the pool whole again (None: not within the limit)


class Chaos:
    """Draws a fault every `every` seconds (exponential gaps) until stopped; each runs in a
    thread of its own, so a hang and a kill may overlap, never two faults on one role."""

    def __init__(self, cluster: Cluster, load: Load, every: float, seed: int) -> None:
        self.cluster, self.load, self.every = cluster, load, every
        self.rng = random.Random(seed)
        self.faults: list[Fault] = []
        self._busy: set[str] = set()  # roles under a fault
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._t0 = time.monotonic()
        self._drawer = threading.Thread(target=self._draw, daemon=True)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._drawer.start()

    def stop(self) -> None:
        """No new fault; wait until every fault in progress ended and its pool recovered."""
        self._stop.set()
        self._drawer.join()
        for t in self._threads:
            t.join()

    def _draw(self) -> None:
        while not self._stop.wait(self.rng.expovariate(1.0 / self.every)):
            kind = self.rng.choice(sorted(FAULTS))
            roles = FAULTS[kind]
            with self._lock:
                if roles & self._busy:
                    continue  # that role is under a fault already
                self._busy |= roles
            t = threading.Thread(target=self._run, args=(kind, roles, random.Random(self.rng.random())), daemon=True)
            self._threads.append(t)
            t.start()

    def _run(self, kind: str, roles: set[str], rng: random.Random) -> None:
        c, pick = self.cluster, rng.choice
        fault = Fault(kind, [], time.monotonic() - self._t0)
        started = time.monotonic()
        try:
            if kind.startswith(("kill-", "stop-")):
                node = pick(c.of(kind.split("-")[1]))
                fault.targets = [node.name]
                if kind.startswith("kill-"):
                    c.kill(node)
                    time.sleep(RESTART_PAUSE_S)
                    c.start(node)
                    fault.outcome = f"restarted in {time.monotonic() - started:.1f} s"
                else:
                    c.signal(node, signal.SIGSTOP)
                    time.sleep(STOP_S)
                    c.signal(node, signal.SIGCONT)
                    fault.outcome = f"stopped {STOP_S} s"
            elif kind == "cut":
                a, b = pick(c.of("prefill")), pick(c.of("decode"))
                fault.targets = [a.name, b.name]
                c.route(a, b, "add")
                time.sleep(CUT_S)
                c.route(a, b, "del")
                fault.outcome = f"cut {CUT_S} s"
            elif kind == "migrate":
                fault.targets, fault.outcome = self._migrate(rng)
            else:  # drain
                node = pick(c.of("decode"))
                fault.targets = [node.name]
                r = node.daemon.stub.Drain(pb.DrainRequest(), timeout=DEADLINE_S)
                node.daemon.proc.wait(DEADLINE_S)
                node.daemon.stop()
                time.sleep(RESTART_PAUSE_S)
                c.start(node)
                fault.outcome = f"{r.requests_migrated} migrated, exited, restarted"
        except grpc.RpcError as exc:  # the fault's own failure is reported, the run goes on
            fault.outcome = f"fault failed: {exc.code().name}: {exc.details()}"
        except Exception as exc:
            fault.outcome = f"fault failed: {type(exc).__name__}: {' '.join(str(exc).split())}"
        try:
            fault.whole_after = self._whole_after(started)
        finally:
            self.faults.append(fault)
            with self._lock:
                self._busy -= roles

    def _migrate(self, rng: random.Random) -> tuple[list[str], str]:
        """Migrate a request that is streaming now to another decode node."""
        if not self.load.streaming:
            return [], "nothing streaming"
        rid = rng.choice(sorted(self.load.streaming))
        outcomes = []
        for node in self.cluster.of("decode"):
            other = rng.choice([n for n in self.cluster.of("decode") if n is not node])
            try:
                r = node.daemon.stub.Migrate(pb.MigrateRequest(request_id=rid, target_address=other.address),
                                             timeout=30)
            except grpc.RpcError as exc:
                outcomes.append(f"{node.name} {exc.code().name}")
                continue
            outcomes.append(f"{node.name}->{other.name} OK ({r.tokens_moved} positions)")
            break
        return [rid], ", ".join(outcomes)

    def _whole_after(self, started: float) -> float | None:
        """Seconds from `started` until every daemon serves and no page is quarantined."""
        deadline = time.monotonic() + RECOVERY_LIMIT_S
        while time.monotonic() < deadline:
            if all(self.cluster.serving(n) for n in self.cluster.nodes.values()) and not self.cluster.quarantined():
                return time.monotonic() - started
            time.sleep(0.1)
        return None


# ---------------------------------------------------------------------------------------------
# One transport's run


@dataclass
class Pass:
    name: str
    requests: int
    completed: int
    failed: dict[str, int]  # status -> requests
    wrong: int  # requests with a token different from the reference
    hung: int
    seconds: float  # first arrival to last end
    goodput: float  # exact completions per second
    router_retries: int  # requests a router's death moved to the other router
    router_retries_exact: int
    near_ties: int = 0  # requests with a near-tie token (exact all the same)
    failures: list[str] = field(default_factory=list)  # each failed or wrong request, and why


@dataclass
class Run:
    transport: str
    seed: int
    capacity: float  # requests/s, fault-free, at --capacity-concurrency
    rate: float  # requests/s sent in both passes
    passes: list[Pass]
    faults: list[Fault]
    stranded: dict[str, str | None]  # decode node -> what was still out of service once idle (None: whole)
    records: list[Record] = field(default_factory=list)  # both passes' requests (--json), to check again

    @property
    def goodput_ratio(self) -> float:
        return self.passes[1].goodput / self.passes[0].goodput if self.passes[0].goodput else 0.0


def check(records: list[Record], model: DecoderModel) -> None:
    """Every token a request streamed must be the in-process engine's greedy choice given its
    prompt and the tokens before it, within `TIE`: float32 sums in another order (chunked
    prefill, batches, a hand-off) can pick the other side of a near-tie (seen: a gap of 2e-5),
    which is counted apart, not as wrong."""
    for r in records:
        if r.tokens:
            gaps = greedy_gaps(model, r.prompt, r.tokens)
            r.exact, r.near_tie = max(gaps) <= TIE, any(0.0 < g <= TIE for g in gaps)


def summarize(name: str, records: list[Record], routers: set[str]) -> Pass:
    ok = [r for r in records if r.status == "OK"]
    exact = [r for r in ok if r.exact]
    retried = [r for r in records if r.retries and r.entry in routers]
    seconds = max((r.end for r in records), default=0.0)
    failures = [f"{r.request_id} (at {r.entry}, {r.start:.0f}-{r.end:.0f} s, {r.retries} retries, "
                f"{len(r.tokens)} tokens{', WRONG' if r.exact is False else ''}): {r.status} {r.error}".rstrip()
                for r in records if r.status not in ("OK", "NOT_SENT") or r.exact is False]
    return Pass(name, len(records), len(ok), dict(Counter(r.status for r in records if r.status != "OK")),
                sum(r.exact is False for r in records), sum(r.status == "HUNG" for r in records), seconds,
                len(exact) / seconds if seconds else 0.0, len(retried),
                sum(r.status == "OK" and bool(r.exact) for r in retried), sum(r.near_tie for r in records), failures)


def statuses(records: list[Record]) -> str:
    return ", ".join(f"{k} {v}" for k, v in Counter(r.status for r in records).most_common())


def run_transport(transport: str, args: argparse.Namespace, model_ready: threading.Event,
                  model_box: list[DecoderModel], log_dir: Path) -> Run:
    with Network() as net:
        cluster = Cluster(net, transport, log_dir / transport, args.prefill_nodes, args.decode_nodes)
        (log_dir / transport).mkdir(parents=True, exist_ok=True)
        try:
            cluster.start()
            time.sleep(2)  # the routers' and decode nodes' pollers see every peer
            say = lambda text: print(f"[{transport}] {text}", flush=True)  # noqa: E731
            entries = [n.name for n in cluster.of("router")], [n.name for n in cluster.of("decode")]
            plan_cap = sessions(args.capacity_requests, args.seed + 1000, args.seed + 1000, args.turns,
                                args.direct_share, *entries)
            cap_load = Load(cluster, args.output_len, "capacity")
            seconds = asyncio.run(cap_load.run(plan_cap, args.capacity_concurrency))
            capacity = sum(r.status == "OK" for r in cap_load.records) / seconds
            rate = args.load_fraction * capacity
            say(f"capacity {capacity:.2f} requests/s at {args.capacity_concurrency} sessions at once "
                f"({statuses(cap_load.records)} in {seconds:.0f} s); sending {rate:.2f} requests/s")
            results, faults = [], []
            for name, seed in (("fault-free", args.seed + 2000), ("faulted", args.seed + 3000)):
                plan = sessions(args.requests, args.seed, seed, args.turns, args.direct_share, *entries)
                per_session = args.requests / len(plan)
                for s, at in zip(plan, arrival_offsets(len(plan), rate / per_session, seed=args.seed)):
                    s.arrival = float(at)
                load = Load(cluster, args.output_len, f"{transport}-{name}")
                chaos = Chaos(cluster, load, args.fault_every, args.seed) if name == "faulted" else None
                if chaos:
                    chaos.start()
                try:
                    asyncio.run(load.run(plan))
                finally:
                    if chaos:
                        chaos.stop()
                        faults = sorted(chaos.faults, key=lambda f: f.at)
                results.append(load.records)
                say(f"{name}: {statuses(load.records)}" + (f", {len(faults)} faults" if chaos else ""))
            stranded = {n.name: settle(n.daemon, timeout=QUARANTINE_S + 30) for n in cluster.of("decode")}
        finally:
            cluster.close()
    model_ready.wait()
    torch.set_num_threads(os.cpu_count() or 1)  # the daemons are gone: the reference may take every core
    for records in results:
        check(records, model_box[0])
    passes = [summarize(name, records, set(entries[0])) for name, records in zip(("fault-free", "faulted"), results)]
    return Run(transport, args.seed, capacity, rate, passes, faults, stranded, [r for rs in results for r in rs])


# ---------------------------------------------------------------------------------------------
# Report


def report(run: Run) -> str:
    lines = [f"### {run.transport}", "",
             f"Capacity {run.capacity:.2f} requests/s (fault-free, closed loop); both passes sent "
             f"{run.rate:.2f} requests/s (Poisson), seed {run.seed}.", "",
             "| pass | requests | completed | failed (by status) | wrong tokens (near-tie flips) | hung | seconds "
             "| goodput (exact/s) | moved to the other router (exact) |", "|---|---|---|---|---|---|---|---|---|"]
    for p in run.passes:
        failed = ", ".join(f"{k} {v}" for k, v in sorted(p.failed.items())) or "none"
        lines.append(f"| {p.name} | {p.requests} | {p.completed} ({100 * p.completed / max(p.requests, 1):.1f}%) "
                     f"| {failed} | {p.wrong} ({p.near_ties}) | {p.hung} | {p.seconds:.0f} | {p.goodput:.3f} "
                     f"| {p.router_retries} ({p.router_retries_exact}) |")
    for p in run.passes:
        lines += [f"- {p.name}: {f}" for f in p.failures]
    stranded = "; ".join(f"{k}: {v}" for k, v in run.stranded.items() if v) or "none"
    lines += ["", f"Goodput faulted / fault-free: **{run.goodput_ratio:.2f}x**. Pages stranded once idle: {stranded}.",
              "", "| s | fault | target | outcome | pool whole after (s) |", "|---|---|---|---|---|"]
    for f in run.faults:
        whole = "not within the limit" if f.whole_after is None else f"{f.whole_after:.1f}"
        lines.append(f"| {f.at:.1f} | {f.kind} | {', '.join(f.targets)} | {f.outcome} | {whole} |")
    return "\n".join(lines)


def verdict(run: Run) -> list[str]:
    """What misses the goals under load: no wrong token, no hung request, no page stranded once idle,
    >= 99% of the faulted pass completed, every request moved to the other router exact, goodput
    faulted / fault-free >= 0.9x."""
    faulted = run.passes[1]
    misses = [f"{what}: {n}" for what, n in (("wrong tokens", sum(p.wrong for p in run.passes)),
                                              ("hung requests", sum(p.hung for p in run.passes))) if n]
    misses += [f"pages stranded on {k}: {v}" for k, v in run.stranded.items() if v]
    if faulted.completed < 0.99 * faulted.requests:
        misses.append(f"completed {faulted.completed}/{faulted.requests} < 99%")
    if faulted.router_retries_exact < faulted.router_retries:
        misses.append(f"moved to the other router: {faulted.router_retries_exact}/{faulted.router_retries} exact")
    if run.goodput_ratio < 0.9:
        misses.append(f"goodput {run.goodput_ratio:.2f}x < 0.9x")
    return [f"{run.transport}: {m}" for m in misses]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.chaos --load", description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--prefill-nodes", type=int, default=2)
    p.add_argument("--decode-nodes", type=int, default=2)
    p.add_argument("--requests", type=int, default=200, help="requests of each pass (default %(default)s)")
    p.add_argument("--load-fraction", type=float, default=0.8,
                   help="the share of the measured capacity both passes send (default %(default)s)")
    p.add_argument("--capacity-requests", type=int, default=40)
    p.add_argument("--capacity-concurrency", type=int, default=8)
    p.add_argument("--turns", type=int, default=3, help="turns of a multi-turn session (default %(default)s)")
    p.add_argument("--direct-share", type=float, default=0.3,
                   help="share of sessions sent to a decode node's own Generate, not a router (default %(default)s)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--fault-every", type=float, default=5.0, help="mean seconds between faults (default %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write every run's summary here")
    p.add_argument("--log-dir", type=Path, help="the daemons' logs (default: a new temporary directory)")
    args = p.parse_args(argv)
    if (reason := netns_unavailable_reason()) is not None:
        print(f"chaos --load needs network namespaces (one host per daemon, cuts between two of them): {reason}")
        return 2
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="duet-chaos-load-"))
    torch.set_num_threads(1)  # the daemons need the cores more
    model_box: list[DecoderModel] = []
    model_ready = threading.Event()
    threading.Thread(target=lambda: (model_box.append(DecoderModel(load_checkpoint(default_model_path()))),
                                     model_ready.set()), daemon=True).start()
    started, runs = time.monotonic(), []
    for transport in args.transports.split(","):
        runs.append(run_transport(transport, args, model_ready, model_box, log_dir))
        print("\n" + report(runs[-1]) + "\n", flush=True)
    misses = [m for r in runs for m in verdict(r)]
    print(f"{len(runs)} runs in {time.monotonic() - started:.0f} s; daemon logs in {log_dir}")
    print("goals met" if not misses else "goals missed:\n  " + "\n  ".join(misses))
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "goodput_ratio": r.goodput_ratio} for r in runs], indent=2)
                             + "\n")
    return 1 if misses else 0


if __name__ == "__main__":
    raise SystemExit(main())
