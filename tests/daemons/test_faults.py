"""Fault injection against the real daemons (DESIGN.md §4): processes killed mid-transfer, aborts
at every step of the hand-off, late writes into expired reservations, peer restarts.

Per transport one prefill node and one decode node are shared by every test; a test that kills
or restarts a daemon leaves a live replacement in the shared `Cluster`. Every test checks that
no KV page leaked on either node and that every completed output equals the single-node
greedy reference (`engine_greedy`).

Tests run in file order per transport (both transports' daemons start together, up front); the
ones that restart or kill a daemon come last. Shared configuration, chosen so that the faults land
where they should:
  * every daemon `--threads 1`: two torch threads per process thrash on this shared 2-core box;
  * prefill node `--max-batch-tokens 32`: a 300-600-token prompt takes seconds to prefill,
    so a kill or an abort 0.5 s in is mid-prefill and mid-transfer;
  * decode node `--lease-seconds 2 --kv-pages 40 --max-batch-tokens 1024`: a reservation of a
    ~560-token window outlives its lease while the prefill node still writes into it, and a
    second request of ~620 tokens (prefilled locally in one step) needs nearly the whole pool,
    so it is handed the expired reservation's pages unless the writer still pins them;
  * decode node `--prefill <the prefill node> --min-remote-prefill-tokens 64`: Generate hands
    prompts of 64+ tokens to the prefill node and falls back to local prefill when it fails;
  * prefill node `--transfer-timeout-seconds 10`, decode node `--quarantine-seconds 12`: a NIXL
    writer that dies mid-transfer leaves its pages fenced for 12 s, within `wait_clean`'s wait.
"""
from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import grpc
import pytest
import torch

from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from harness.local_daemons import Daemon, free_port
from harness.helpers import Background, drain, greedy, random_ids, status_of, wait_clean
from harness.reference import FP32, engine_greedy

TRANSPORTS = ["nixl", "tcp"]
LEASE_S = 2.0
TRANSFER_TIMEOUT_S = 10.0
QUARANTINE_S = 12.0
DECODE_PAGES = 40
RPC_TIMEOUT_S = 60.0
CLEAR = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
         grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT}

pytestmark = pytest.mark.timeout(300)


_REFERENCE: dict[tuple, list[int]] = {}


def reference(model, prompt: list[int], n: int) -> list[int]:
    """engine_greedy, memoised across the transports. One torch thread: on this shared 2-core
    machine two OpenMP threads contend with the daemons and run several times slower."""
    key = (tuple(prompt), n)
    if key not in _REFERENCE:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _REFERENCE[key] = engine_greedy(model, prompt, n)
        finally:
            torch.set_num_threads(threads)
    return _REFERENCE[key]


# ---------------------------------------------------------------------------------------------
# Daemons


def _spawn(module: str, args: list[str], tmp: Path, port: int | None = None) -> Daemon:
    if port is not None:
        args = [*args, "--port", str(port)]  # argparse: the last --port wins
    d = Daemon(module, [*FP32, *args], tmp / f"{module}_{free_port()}.log")
    if port is not None:
        d.port, d.address = port, f"127.0.0.1:{port}"
        d.channel.close()
        d.channel = grpc.insecure_channel(d.address)
    return d


def _ready(d: Daemon, stub_class) -> Daemon:
    d.wait_healthy()
    d.stub = stub_class(d.channel)
    d.ready_at = time.monotonic()
    return d


class Cluster:
    """The shared prefill node `pn` and decode node `dn` of one transport."""

    def __init__(self, tmp: Path, transport: str) -> None:
        self.tmp, self.transport = tmp, transport
        self.pn: Daemon | None = None
        self.dn: Daemon | None = None

    def _p_args(self) -> list[str]:
        return ["--transport", self.transport, "--max-batch-tokens", "32", "--threads", "1",
                "--transfer-timeout-seconds", str(TRANSFER_TIMEOUT_S)]

    def _d_args(self) -> list[str]:
        return ["--transport", self.transport, "--threads", "1", "--lease-seconds", str(LEASE_S),
                "--quarantine-seconds", str(QUARANTINE_S),
                "--kv-pages", str(DECODE_PAGES), "--max-batch-tokens", "1024", "--prefill", self.pn.address,
                "--min-remote-prefill-tokens", "64"]

    @staticmethod
    def _alive(d: Daemon | None) -> bool:
        return d is not None and d.proc.poll() is None

    def spawn(self) -> None:
        """Start whatever is dead (without waiting); a new prefill node gets a new decode node too
        (whose --prefill names it)."""
        new_p = not self._alive(self.pn)
        if new_p:
            if self.pn is not None:
                self.pn.stop()
            self.pn = _spawn("prefill_node", self._p_args(), self.tmp)
        if new_p or not self._alive(self.dn):
            if self.dn is not None:
                self.dn.stop()
            self.dn = _spawn("decode_node", self._d_args(), self.tmp)

    def ensure(self) -> None:
        """Both daemons up and healthy."""
        self.spawn()
        for d, stub_class in ((self.pn, duet_pb2_grpc.PrefillNodeStub), (self.dn, duet_pb2_grpc.DecodeNodeStub)):
            if getattr(d, "stub", None) is None:
                _ready(d, stub_class)

    def wait_prefill_pool(self) -> None:
        """Let the decode node's prefill pool see the prefill node (it polls every second), so that
        Generate hands long prompts over instead of prefilling them locally."""
        time.sleep(max(0.0, self.dn.ready_at + 1.5 - time.monotonic()))

    def spawn_decode(self) -> Daemon:
        """A second decode node, starting in the background (to replace `dn` later)."""
        return _spawn("decode_node", self._d_args(), self.tmp)

    def replace_decode(self, spare: Daemon) -> None:
        self.dn.stop(signal.SIGKILL)
        self.dn = _ready(spare, duet_pb2_grpc.DecodeNodeStub)

    def restart_decode_same_port(self) -> None:
        """Stop the decode node (SIGTERM) and serve a new one on the same gRPC port. To save a
        model load, the new process starts loading just before the old one is stopped (gRPC
        binds with SO_REUSEPORT); it only starts serving once the old one is gone."""
        port = self.dn.port
        new = _spawn("decode_node", self._d_args(), self.tmp, port)
        self.dn.stop()
        try:
            self.dn = _ready(new, duet_pb2_grpc.DecodeNodeStub)
        except RuntimeError:  # the port could not be shared: start it again now that it is free
            new.stop()
            self.dn = _ready(_spawn("decode_node", self._d_args(), self.tmp, port), duet_pb2_grpc.DecodeNodeStub)

    def close(self) -> None:
        for d in (self.dn, self.pn):
            if d is not None:
                d.stop()
        self.dn = self.pn = None


@pytest.fixture(scope="module")
def clusters(request, tmp_path_factory):
    """The clusters of every transport selected in this module, all started at once (their model
    loads overlap each other and the reference model's)."""
    wanted = {item.callspec.params.get("cluster") for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    out = {t: Cluster(tmp_path_factory.mktemp(f"faults_{t}"), t) for t in TRANSPORTS if t in wanted}
    try:
        for cl in out.values():
            cl.spawn()
        request.getfixturevalue("model")
        yield out
    finally:
        for cl in out.values():
            cl.close()


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(request, clusters):
    yield clusters[request.param]
    clusters[request.param].close()  # its CPU and memory go to the next transport's tests


@pytest.fixture
def c(cluster):
    """The shared cluster, healthy and clean at the start of the test."""
    cluster.ensure()
    wait_clean(cluster.dn, cluster.pn)
    return cluster


# ---------------------------------------------------------------------------------------------
# Checks


def remote_send(c: Cluster, rid: str, prompt: list[int], r: pb.PrepareReceiveResponse, timeout=RPC_TIMEOUT_S):
    return c.pn.stub.RemoteSend(pb.RemoteSendRequest(
        request_id=rid, token_ids=prompt, kv_window_begin=r.prefix_matched_length, kv_window_end=r.kv_window_end,
        kv_append_metadata=r.kv_append_metadata, decode_address=c.dn.address, transfer_nonce=r.transfer_nonce),
        timeout=timeout)


def three_calls(c: Cluster, rid: str, prompt: list[int], n: int = 8) -> list[int]:
    r = c.dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=rid, token_ids=prompt), timeout=RPC_TIMEOUT_S)
    if r.kv_window_end > r.prefix_matched_length:
        remote_send(c, rid, prompt, r)
    tokens, last = drain(c.dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id=rid, kv_window_begin=r.kv_window_end, sampling=greedy(n)), timeout=RPC_TIMEOUT_S))
    assert last.finish_reason == "length"
    return tokens


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not reached within {timeout}s"
        time.sleep(0.05)


def prepare_receive(c: Cluster, rid: str, prompt: list[int]) -> pb.PrepareReceiveResponse:
    """A reservation for `prompt` under `rid`, its window the default (all but the last token)."""
    return c.dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=rid, token_ids=prompt), timeout=10)


def sending(c: Cluster, rid: str, prompt: list[int]) -> tuple[pb.PrepareReceiveResponse, Background]:
    """A reservation for `prompt` and the RemoteSend filling it, in the background; returned once
    the prefill node computes it."""
    r = prepare_receive(c, rid, prompt)
    send = Background(lambda: remote_send(c, rid, prompt, r))
    wait_until(lambda: prefill_running(c), 10, "RemoteSend started")
    return r, send


def start_code(c: Cluster, rid: str, r: pb.PrepareReceiveResponse) -> grpc.StatusCode:
    """The status of a StartGeneration for the reservation `r` made under `rid`."""
    return status_of(lambda: c.dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id=rid, kv_window_begin=r.kv_window_end, sampling=greedy(2)), timeout=10))


def prefill_running(c: Cluster) -> bool:
    return c.pn.stub.GetLoad(pb.GetLoadRequest(), timeout=5).running_requests > 0


def handing_off(c: Cluster) -> bool:
    """A Generate is between its PrepareReceive and its StartGeneration."""
    return c.dn.stub.GetLoad(pb.GetLoadRequest(), timeout=5).kv_pages_reserved > 0


def assert_aborted_and_still_serving(c: Cluster, model, rid: str, r: pb.PrepareReceiveResponse, seed: int) -> None:
    """The aborted reservation `r` cannot start, both nodes are clean, and a fresh request is served."""
    assert start_code(c, rid, r) == grpc.StatusCode.NOT_FOUND
    wait_clean(c.dn, c.pn)
    still_serves(c, model, seed)


def still_serves(c: Cluster, model, seed: int) -> None:
    """A fresh three-call flow gives the single-node tokens, then both nodes are clean."""
    prompt = random_ids(40, seed)
    assert three_calls(c, f"sanity-{seed}-{time.monotonic_ns()}", prompt) == reference(model, prompt, 8)
    wait_clean(c.dn, c.pn)


# ---------------------------------------------------------------------------------------------
# 3. Abort at each step of the hand-off


def test_abort_after_prepare_receive(c, model):
    prompt = random_ids(64, 31)
    r = prepare_receive(c, "ab-prep", prompt)
    c.dn.stub.Abort(pb.AbortRequest(request_id="ab-prep"), timeout=10)
    wait_clean(c.dn, timeout=1)  # pages back at once
    code = status_of(lambda: remote_send(c, "ab-prep", prompt, r))
    assert code in {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED}, code
    assert_aborted_and_still_serving(c, model, "ab-prep", r, 32)


def test_abort_during_remote_send(c, model):
    prompt = random_ids(300, 33)
    r, send = sending(c, "ab-send", prompt)
    time.sleep(0.3)
    c.dn.stub.Abort(pb.AbortRequest(request_id="ab-send"), timeout=10)
    code, _, _ = send.result()
    assert code in {grpc.StatusCode.OK} | CLEAR, code
    assert_aborted_and_still_serving(c, model, "ab-send", r, 34)


def test_abort_during_start_generation_stream(c, model):
    prompt = random_ids(40, 35)
    r = prepare_receive(c, "ab-gen", prompt)
    remote_send(c, "ab-gen", prompt, r)
    stream = c.dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="ab-gen", kv_window_begin=r.kv_window_end, sampling=greedy(100_000)), timeout=RPC_TIMEOUT_S)
    first = next(stream)
    c.dn.stub.Abort(pb.AbortRequest(request_id="ab-gen"), timeout=10)
    tokens, last = drain(stream)
    tokens = list(first.token_ids) + tokens
    assert last is not None and last.finish_reason == "abort"
    assert tokens == reference(model, prompt, len(tokens))
    wait_clean(c.dn, c.pn)


def test_abort_during_generate_hand_off(c, model):
    """Abort while Generate waits for the prefill node: the stream must end as aborted."""
    prompt = random_ids(150, 38)  # 64+ tokens: handed to the prefill node (5 steps of 32 there)
    c.wait_prefill_pool()
    stream = c.dn.stub.Generate(pb.GenerateRequest(request_id="abort-hand-off", token_ids=prompt,
                                                   sampling=greedy(8)), timeout=RPC_TIMEOUT_S)
    try:
        wait_until(lambda: handing_off(c), 10, "Generate reserved pages for the hand-off")
        c.dn.stub.Abort(pb.AbortRequest(request_id="abort-hand-off"), timeout=10)
        try:
            tokens, last = drain(stream)
            outcome = last.finish_reason if last is not None else "no chunk"
        except grpc.RpcError as exc:
            outcome = exc.code()
        assert outcome in ("abort", grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND), \
            f"the aborted request finished with {outcome!r}"
        wait_clean(c.dn, c.pn)
    finally:
        stream.cancel()


def test_client_cancels_generate_while_streaming(c, model):
    prompt = random_ids(30, 36)  # shorter than --min-remote-prefill-tokens: prefilled locally
    stream = c.dn.stub.Generate(pb.GenerateRequest(request_id="cancel-stream", token_ids=prompt,
                                                   sampling=greedy(100_000)), timeout=RPC_TIMEOUT_S)
    first = next(stream)
    assert list(first.token_ids) == reference(model, prompt, len(first.token_ids))
    stream.cancel()
    wait_clean(c.dn, c.pn)


def test_client_cancels_generate_during_remote_prefill(c, model):
    prompt = random_ids(80, 37)  # handed to the prefill node (3 steps of 32 tokens there)
    c.wait_prefill_pool()
    stream = c.dn.stub.Generate(pb.GenerateRequest(request_id="cancel-prefill", token_ids=prompt,
                                                   sampling=greedy(100_000)), timeout=RPC_TIMEOUT_S)
    try:
        wait_until(lambda: handing_off(c), 10, "Generate reserved pages for the hand-off")
        stream.cancel()
        wait_until(lambda: not prefill_running(c), 10, "the prefill node finished")
        wait_clean(c.dn, c.pn, timeout=5)
    finally:  # if the generation survived the cancel, stop it so later tests get the CPU back
        status_of(lambda: c.dn.stub.Abort(pb.AbortRequest(request_id="cancel-prefill"), timeout=10))


def test_refused_remote_send_writes_nothing(c, model):
    """A RemoteSend the decode node refuses (unknown request id, made-up nonce) aimed at the slots
    of finished request A, whose full pages sit in the prefix cache: A's KV must stay intact."""
    prompt = random_ids(40, 39)
    r = prepare_receive(c, "victim", prompt)
    remote_send(c, "victim", prompt, r)
    tokens, _ = drain(c.dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="victim", kv_window_begin=r.kv_window_end, sampling=greedy(8)), timeout=RPC_TIMEOUT_S))
    assert tokens == reference(model, prompt, 8)  # its two full pages and its tail page are now cached
    rogue = random_ids(40, 40)
    code = status_of(lambda: c.pn.stub.RemoteSend(pb.RemoteSendRequest(
        request_id="no-such-request", token_ids=rogue, kv_window_begin=0, kv_window_end=r.kv_window_end,
        kv_append_metadata=r.kv_append_metadata, decode_address=c.dn.address, transfer_nonce=12345),
        timeout=RPC_TIMEOUT_S))
    assert code == grpc.StatusCode.NOT_FOUND, code
    again = c.dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="victim-again", token_ids=prompt,
                                                              kv_window_end=0), timeout=10)
    assert again.prefix_matched_length == 39  # two full pages and the victim's tail page
    tokens, _ = drain(c.dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="victim-again", kv_window_begin=0, sampling=greedy(8)), timeout=RPC_TIMEOUT_S))
    assert tokens == reference(model, prompt, 8), "a refused RemoteSend overwrote cached KV"
    wait_clean(c.dn, c.pn)


# ---------------------------------------------------------------------------------------------
# 4. A late write from an expired reservation


def test_late_write_after_lease_expiry(c, model):
    """The writer's pages stay out of use after the lease ran out: pinned by the TCP receiver while
    the connection lasts, fenced from BeginTransfer to the writer's CompleteTransfer with NIXL."""
    prompt = random_ids(600, 42)
    want = reference(model, prompt, 24)  # before the clock starts
    # R1: a 559-token window (35 of the 40 pages), pushed by the prefill node in 18 steps; the push
    # starts (and passes its BeginTransfer check) 0.8 s before the lease ends, so most of it lands
    # after the pages were reclaimed.
    late_prompt = random_ids(560, 41)
    r = prepare_receive(c, "late", late_prompt)
    time.sleep(max(0.0, r.lease_deadline_unix - 0.8 - time.time()))
    send = Background(lambda: remote_send(c, "late", late_prompt, r))
    wait_until(lambda: c.dn.metrics()["duet_kv_pages_reserved"] == 0, LEASE_S + 5, "the lease expired")
    load = c.dn.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    assert prefill_running(c), "the transfer should outlive its lease (make the prompt longer)"
    if c.transport == "nixl":  # the transfer was still running when the load was read
        assert load.kv_pages_quarantined >= 35, load
    # R2, right away: 600 prompt tokens + 24 generated = 39 pages, prefilled by the decode node in one
    # step, so it needs the expired reservation's pages; retried while a writer still pins them.
    attempt, deadline = 0, time.monotonic() + RPC_TIMEOUT_S
    while True:
        rid = f"after-late-{attempt}"
        c.dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=rid, token_ids=prompt, kv_window_end=0),
                                 timeout=10)
        try:
            tokens, last = drain(c.dn.stub.StartGeneration(pb.StartGenerationRequest(
                request_id=rid, kv_window_begin=0, sampling=greedy(24)), timeout=RPC_TIMEOUT_S))
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (exc.code(), exc.details())
            assert time.monotonic() < deadline, "the pool never became free again"
            attempt += 1
            time.sleep(0.2)
    code, _, _ = send.result()
    assert code in CLEAR, code  # the reservation was gone before the transfer completed
    assert tokens == want, f"served wrong tokens after a late write (attempt {attempt})"
    # R3: the same prompt again reuses R2's pages from the prefix cache, now that every late write
    # has landed: they must still hold R2's KV.
    c.dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="after-late-again", token_ids=prompt,
                                                      kv_window_end=0), timeout=10)
    tokens, last = drain(c.dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="after-late-again", kv_window_begin=0, sampling=greedy(24)), timeout=RPC_TIMEOUT_S))
    assert last.usage.cached_tokens > 0
    assert tokens == want, "the prefix cache holds KV overwritten by a late write"
    wait_clean(c.dn, c.pn)


def test_abandoned_transfer_lifts_its_fence_at_once(c):
    """A writer that gave up (CompleteTransfer{abandoned}) frees the pages of its aborted
    reservation right away; a wrong nonce cannot. With TCP there is no fence to lift."""
    prompt = random_ids(100, 61)
    r = prepare_receive(c, "abandoned", prompt)
    c.dn.stub.BeginTransfer(pb.BeginTransferRequest(request_id="abandoned", transfer_nonce=r.transfer_nonce,
                                                    kv_append_metadata=r.kv_append_metadata), timeout=10)
    c.dn.stub.Abort(pb.AbortRequest(request_id="abandoned"), timeout=10)
    quarantined = c.dn.stub.GetLoad(pb.GetLoadRequest(), timeout=5).kv_pages_quarantined
    assert quarantined == (7 if c.transport == "nixl" else 0)  # the 99-position window's pages

    def abandon(nonce: int) -> grpc.StatusCode:
        return status_of(lambda: c.dn.stub.CompleteTransfer(pb.CompleteTransferRequest(
            request_id="abandoned", transfer_nonce=nonce, abandoned=True), timeout=10))

    assert abandon(r.transfer_nonce ^ 1) == grpc.StatusCode.NOT_FOUND
    assert c.dn.stub.GetLoad(pb.GetLoadRequest(), timeout=5).kv_pages_quarantined == quarantined
    assert abandon(r.transfer_nonce) == (grpc.StatusCode.OK if c.transport == "nixl" else grpc.StatusCode.NOT_FOUND)
    assert abandon(r.transfer_nonce) == grpc.StatusCode.NOT_FOUND  # the fence came down once
    wait_clean(c.dn, timeout=3)  # long before --quarantine-seconds


# ---------------------------------------------------------------------------------------------
# 5. Decode node restarted on the same port: the prefill node's handshake is stale


def test_decode_restart_on_same_port(c, model):
    prompt = random_ids(40, 51)
    assert three_calls(c, "before-restart", prompt) == reference(model, prompt, 8)  # handshake cached
    pn_pid, old_port = c.pn.proc.pid, c.dn.port
    c.restart_decode_same_port()
    assert c.dn.port == old_port
    outcomes = []
    for attempt in range(2):
        rid = f"after-restart-{attempt}"
        r = prepare_receive(c, rid, prompt)
        started = time.monotonic()
        code = status_of(lambda: remote_send(c, rid, prompt, r, timeout=30))
        outcomes.append((code, round(time.monotonic() - started, 2)))
        assert code == grpc.StatusCode.OK or code in CLEAR - {grpc.StatusCode.DEADLINE_EXCEEDED}, outcomes
        if code == grpc.StatusCode.OK:
            tokens, _ = drain(c.dn.stub.StartGeneration(pb.StartGenerationRequest(
                request_id=rid, kv_window_begin=r.kv_window_end, sampling=greedy(8)), timeout=RPC_TIMEOUT_S))
            assert tokens == reference(model, prompt, 8)
            break
        status_of(lambda: c.dn.stub.Abort(pb.AbortRequest(request_id=rid), timeout=10))
    else:
        pytest.fail(f"RemoteSend to the restarted decode node failed twice: {outcomes}")
    assert c.pn.proc.poll() is None and c.pn.proc.pid == pn_pid
    # The failed attempt's fence came down with its abandoned report, not after the quarantine.
    wait_clean(c.dn, c.pn, timeout=LEASE_S + 3)


def test_hung_decode_node_does_not_stall_other_transfers(c, model):
    """A decode node that accepts connections but never answers (hung, SIGSTOPped, half-open)
    must not hold up RemoteSends to healthy decode nodes."""
    if c.transport != "tcp":
        pytest.skip("the handshake cache (common/peers/decode_peers.py) is transport-independent: checked once")
    prompt = random_ids(40, 61)
    with socket.create_server(("127.0.0.1", 0)) as hung:  # the kernel accepts, nobody ever answers
        stuck = Background(lambda: c.pn.stub.RemoteSend(pb.RemoteSendRequest(
            request_id="to-hung", token_ids=prompt, kv_window_begin=0, kv_window_end=39, kv_append_metadata=[1, 0, 39],
            decode_address=f"127.0.0.1:{hung.getsockname()[1]}", transfer_nonce=1), timeout=30))
        time.sleep(0.3)
        r = prepare_receive(c, "beside-hung", prompt)
        started = time.monotonic()
        code = status_of(lambda: remote_send(c, "beside-hung", prompt, r))
        took = time.monotonic() - started
        stuck_code, _, _ = stuck.result()
    status_of(lambda: c.dn.stub.Abort(pb.AbortRequest(request_id="beside-hung"), timeout=10))
    assert stuck_code in CLEAR, stuck_code
    assert code == grpc.StatusCode.OK and took < 3, f"RemoteSend to a healthy decode node: {code} after {took:.1f}s"
    still_serves(c, model, 62)


# ---------------------------------------------------------------------------------------------
# 2. Decode node killed during RemoteSend


def test_decode_node_dies_during_remote_send(c, model):
    prompt = random_ids(400, 21)
    spare = c.spawn_decode()  # the replacement (new port) starts while this one is killed
    try:
        _, send = sending(c, "dn-dies", prompt)
        time.sleep(0.5)
        c.dn.proc.send_signal(signal.SIGKILL)
        c.dn.proc.wait(10)
        killed = time.monotonic()
        code, exc, _ = send.result()
        took = time.monotonic() - killed
        assert code == grpc.StatusCode.UNAVAILABLE, (code, exc)
        # The failed transfer also stops the prompt's prefill (measured 0.0-0.3 s on 2 busy cores).
        assert took < 5, f"RemoteSend took {took:.1f}s to notice the dead decode node"
        assert c.pn.proc.poll() is None
        wait_clean(c.pn)  # the prefill side is released
        pn_pid = c.pn.proc.pid
        c.replace_decode(spare)
        prompt = random_ids(40, 22)
        assert three_calls(c, "after-dn-dies", prompt) == reference(model, prompt, 8)
        assert c.pn.proc.pid == pn_pid
        wait_clean(c.dn, c.pn)
    finally:
        if c.dn is not spare:
            spare.stop()


# ---------------------------------------------------------------------------------------------
# 1. Prefill node killed during RemoteSend


def test_prefill_node_dies_during_remote_send(c, model):
    prompt = random_ids(560, 11)
    r, send = sending(c, "pn-dies", prompt)
    time.sleep(0.5)
    c.pn.proc.send_signal(signal.SIGKILL)
    c.pn.proc.wait(10)
    code, exc, took = send.result(timeout=10)
    assert code == grpc.StatusCode.UNAVAILABLE, (code, exc)
    start = pb.StartGenerationRequest(request_id="pn-dies", kv_window_begin=r.kv_window_end, sampling=greedy(2))
    assert status_of(lambda: c.dn.stub.StartGeneration(start, timeout=10)) in {
        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}
    wait_clean(c.dn)  # the reservation expires and returns its pages
    assert status_of(lambda: c.dn.stub.StartGeneration(start, timeout=10)) == grpc.StatusCode.NOT_FOUND
    # Generate would hand this prompt to the (dead) prefill node; it falls back to local prefill.
    prompt = random_ids(100, 12)
    tokens, last = drain(c.dn.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=greedy(8)),
                                            timeout=RPC_TIMEOUT_S))
    assert tokens == reference(model, prompt, 8) and last.finish_reason == "length"
    wait_clean(c.dn)
