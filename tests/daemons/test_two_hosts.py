"""Beyond one machine: the decode node, the prefill node and the router on three "hosts" (Linux
network namespaces joined by veth pairs to a bridge, `harness/netns_hosts.py`), NIXL over UCX
TCP (`UCX_TLS=tcp`, `UCX_NET_DEVICES=duet0`) and the TCP fallback.

    decode  10.77.N.1  ns duet-...-decode   --host 10.77.N.1  (--advertise-host 10.77.N.1)
    prefill 10.77.N.2  ns duet-...-prefill  --host 0.0.0.0    --advertise-host 10.77.N.2
    router  10.77.N.3  ns duet-...-router   --members FILE
    this test process: 10.77.N.254 on the bridge (gRPC, health and /metrics of every daemon)

The hosts reach each other only over their veths, so every byte of KV crosses a link (checked
with the veth counters). The network-cut test takes the prefill host's veth down in the middle of
a transfer; its RemoteSend client runs inside the prefill namespace (over loopback), the only
place that can still hear the answer while the link is down.

Skipped, with the reason, where network namespaces cannot be created (needs root and iproute2).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from common.transports.nixl.agent import nixl_unavailable_reason
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from harness.netns_hosts import (ROOT, UCX_TCP_PORT_RANGE, Host, NetnsDaemon, Network,
                                 netns_unavailable_reason, start_daemons)
from harness.helpers import drain, greedy, random_ids
from harness.reference import FP32, engine_greedy

LEASE_S = 5.0  # short, but long enough for a 400-token hand-off on a busy 2-core machine
TRANSFER_TIMEOUT_S = 8.0
# How long the decode node keeps a silent NIXL writer's pages out of use (above the writer's timeout).
QUARANTINE_S = TRANSFER_TIMEOUT_S + 2
MAX_BATCH_TOKENS = 128  # small prefill chunks: a long prompt's transfer stays in flight for seconds
CUT_PROMPT_TOKENS = 1024
PORTS = {"nixl": (50051, 9400), "tcp": (50052, 9401)}  # the same in every namespace
ROUTER_PORTS = {"nixl": (50071, 9410), "tcp": (50072, 9411)}
RPC_TIMEOUT_S = 60.0


_references: dict[tuple[tuple[int, ...], int], list[int]] = {}


def reference(model, prompt: list[int], n: int) -> list[int]:
    """engine_greedy, computed once per prompt for both transports (2 cores are precious)."""
    key = (tuple(prompt), n)
    if key not in _references:
        _references[key] = engine_greedy(model, prompt, n)
    return _references[key]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not reached within {timeout}s: {what}"
        time.sleep(0.1)


def clean(m: dict[str, float]) -> bool:
    """Every page is free or cached, none reserved (the prefill node has no reserved gauge)."""
    return m["duet_kv_pages_free"] + m.get("duet_kv_pages_cached", 0) == m["duet_kv_pages_total"] and \
        m.get("duet_kv_pages_reserved", 0) == 0


@dataclass
class Pair:
    transport: str
    decode_host: Host
    prefill_host: Host
    dn: NetnsDaemon
    pn: NetnsDaemon
    extra: dict = field(default_factory=dict)

    def prepare(self, request_id: str, prompt: list[int]) -> tuple[pb.PrepareReceiveResponse, pb.RemoteSendRequest]:
        r = self.dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=request_id, token_ids=prompt),
                                        timeout=RPC_TIMEOUT_S)
        return r, pb.RemoteSendRequest(
            request_id=request_id, token_ids=prompt, kv_window_begin=r.prefix_matched_length,
            kv_window_end=r.kv_window_end, kv_append_metadata=r.kv_append_metadata,
            decode_address=self.dn.address, transfer_nonce=r.transfer_nonce)

    def three_calls(self, request_id: str, prompt: list[int], max_tokens: int = 8):
        """PrepareReceive on the decode host, RemoteSend on the prefill host (which pushes the KV
        to the decode host's advertised address), StartGeneration on the decode host."""
        r, send = self.prepare(request_id, prompt)
        sent = None
        if r.kv_window_end > r.prefix_matched_length:
            sent = self.pn.stub.RemoteSend(send, timeout=RPC_TIMEOUT_S)
        start = pb.StartGenerationRequest(request_id=request_id, kv_window_begin=r.kv_window_end,
                                          sampling=greedy(max_tokens))
        tokens, last = drain(self.dn.stub.StartGeneration(start, timeout=RPC_TIMEOUT_S))
        return tokens, r, sent, last


@pytest.fixture(scope="module")
def net():
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"two-host tests need network namespaces: {reason}")
    with Network() as network:
        for name in ("decode", "prefill", "router"):
            network.add_host(name)
        yield network


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def pair(request, net, tmp_path_factory):
    transport = request.param
    if transport == "nixl" and (why := nixl_unavailable_reason()) is not None:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp(f"two_hosts_{transport}")
    dh, ph = net.hosts["decode"], net.hosts["prefill"]
    members = tmp / "members.json"
    pn, dn, rt = _start_three(net, transport, tmp, members)
    try:
        yield Pair(transport, dh, ph, dn, pn, extra={"router": rt, "members": members})
    finally:
        for d in (rt, dn, pn):
            d.stop()


def _start_three(net, transport: str, tmp: Path, members: Path):
    dh, ph = net.hosts["decode"], net.hosts["prefill"]
    port, metrics_port = PORTS[transport]
    # The prefill node listens on every interface of its host (so the cut test's in-namespace
    # client reaches it over loopback) and advertises its link address.
    pn = NetnsDaemon(ph, "prefill_node", [*FP32, "--transport", transport, "--max-batch-tokens", str(MAX_BATCH_TOKENS),
                                          "--transfer-timeout-seconds", str(TRANSFER_TIMEOUT_S)],
                     tmp / "prefill.log", port=port, metrics_port=metrics_port, listen="0.0.0.0")
    dn = NetnsDaemon(dh, "decode_node", [*FP32, "--transport", transport, "--prefill", pn.address,
                                         "--min-remote-prefill-tokens", "1", "--lease-seconds", str(LEASE_S),
                                         "--quarantine-seconds", str(QUARANTINE_S)],
                     tmp / "decode.log", port=port, metrics_port=metrics_port)
    # The router on the third host finds both nodes through a members file (started now so its
    # start-up overlaps the nodes' model loading).
    members.write_text(json.dumps({"decode": [dn.address], "prefill": [pn.address]}))
    router_port, router_metrics_port = ROUTER_PORTS[transport]
    rt = NetnsDaemon(net.hosts["router"], "router", ["--members", str(members), "--poll-seconds", "0.2",
                                                            "--min-remote-prefill-tokens", "8"],
                     tmp / "router.log", port=router_port, metrics_port=router_metrics_port, advertise=False)
    start_daemons([pn, dn, rt], [duet_pb2_grpc.PrefillNodeStub, duet_pb2_grpc.DecodeNodeStub,
                                 duet_pb2_grpc.DecodeNodeStub])  # stops all three if one fails
    return pn, dn, rt


def _listeners(host: Host) -> set[tuple[str, int]]:
    """(address, port) of every TCP listener in the host's namespace; IPv4-mapped addresses as
    plain IPv4, every wildcard as "*"."""
    out = host.run("ss", "-Hltn")
    assert out.returncode == 0, out.stderr
    found = set()
    for line in out.stdout.decode().splitlines():
        local = line.split()[3]
        address, port = local.rsplit(":", 1)
        address = address.strip("[]").removeprefix("::ffff:")
        found.add(("*" if address in ("0.0.0.0", "*", "::") else address, int(port)))
    return found


def _dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (an orphan in a container whose init does not reap)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split() == ["State:", "Z", "(zombie)"] for line in f)
    except FileNotFoundError:
        return True


def test_a_process_started_in_a_namespace_dies_with_its_starter(net):
    """A killed test run leaves no daemon behind in a namespace: the launcher asks for SIGKILL on
    the starter's death (without a Popen preexec_fn, which would fork and let grpcio abort the child)."""
    with subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                           "print(subprocess.Popen(sys.argv[1:]).pid, flush=True); time.sleep(60)",
                           *net.hosts["decode"].exec_args("sleep", "60")], stdout=subprocess.PIPE) as starter:
        child = int(starter.stdout.readline())
        try:
            # setpriv sets the signal on its way to `sleep`: wait for that exec before killing
            wait_for(lambda: open(f"/proc/{child}/comm").read().strip() == "sleep", 10, "sleep runs")
            starter.kill()
            starter.wait()
            wait_for(lambda: _dead(child), 10, "the namespace's process dies with its starter")
        finally:
            starter.kill()
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_nodes_listen_and_advertise_their_own_addresses(pair):
    """Nothing is on loopback: the decode node listens on its link address (gRPC; the KV receiver
    for tcp; UCX's TCP listener for nixl), the prefill node on every interface with
    --advertise-host; both answer health and /metrics from another host (this process)."""
    dn, pn, address = pair.dn, pair.pn, pair.decode_host.address
    decode = _listeners(pair.decode_host)
    assert (address, dn.port) in decode, decode
    assert not any(a.startswith("127.") for a, _ in decode), decode
    assert len([a for a, _ in decode if a == address]) >= 2, decode  # + the KV receiver / UCX listener
    if pair.transport == "nixl":  # UCX's TCP listener honours UCX_TCP_PORT_RANGE (firewalls, k8s)
        low, high = map(int, UCX_TCP_PORT_RANGE.split("-"))
        assert any(a == address and low <= p <= high for a, p in decode), decode
    assert ("*", pn.port) in _listeners(pair.prefill_host)
    assert dn.metrics()["duet_kv_pages_total"] > 0 and pn.metrics()["duet_kv_pages_total"] > 0
    assert pn.stub.GetLoad(pb.GetLoadRequest(), timeout=5).kv_pages_total > 0


@pytest.mark.parametrize("length", [1, 17, 100])
def test_three_call_flow_across_hosts_equals_single_node(pair, model, length):
    prompt = random_ids(length, 1000 + length)
    tokens, r, sent, last = pair.three_calls(f"len{length}", prompt)
    assert tokens == reference(model, prompt, 8)
    if length > 1:
        assert sent.tokens_sent == length - 1 and r.prefix_matched_length == 0
    assert last.usage.prompt_tokens == length


def test_kv_crosses_the_link(pair, model):
    """The prefill host's veth carried at least the KV bytes RemoteSend reports."""
    prompt = random_ids(400, 77)
    before = pair.prefill_host.sent_bytes()
    tokens, _, sent, _ = pair.three_calls("link", prompt, max_tokens=6)
    assert sent.tokens_sent == 399 and sent.bytes_sent > 0
    assert pair.prefill_host.sent_bytes() - before >= sent.bytes_sent
    assert tokens == reference(model, prompt, 6)
    # The prefill node handshook with the decode node at the address it was given (not loopback).
    assert f'"handshake done", "decode_address": "{pair.dn.address}"' in pair.pn.log_path.read_text()


def test_one_call_generate_hands_off_to_the_prefill_host(pair, model):
    """The decode node's Generate dials the prefill node at its advertised address and gives it
    the decode node's own advertised address for the push."""
    prompt = random_ids(150, 5)
    before = pair.pn.metrics()["duet_prefill_computed_tokens_total"]
    tokens, last = drain(pair.dn.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=greedy(8)),
                                                   timeout=RPC_TIMEOUT_S))
    assert tokens == reference(model, prompt, 8)
    assert pair.pn.metrics()["duet_prefill_computed_tokens_total"] > before


def test_router_on_a_third_host_discovers_nodes_from_a_members_file(pair, model):
    rt = pair.extra["router"]
    wait_for(lambda: rt.metrics().get("duet_router_healthy_prefill_nodes") == 1, 20, "router sees the prefill node")
    before = pair.pn.metrics()["duet_prefill_computed_tokens_total"]
    prompt = random_ids(120, 6)
    tokens, _ = drain(rt.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=greedy(6)),
                                           timeout=RPC_TIMEOUT_S))
    assert tokens == reference(model, prompt, 6)
    assert pair.pn.metrics()["duet_prefill_computed_tokens_total"] - before == 119


# ---------------------------------------------------------------------------------------------
# A network cut in the middle of a transfer


@pytest.fixture(scope="module")
def cut(pair, model):
    """Run the cut once per transport and record what each side did; the tests below judge it.

    PrepareReceive for a long prompt; RemoteSend from inside the prefill namespace; once a few
    chunks of KV have crossed the link, the prefill host's veth goes down. While it is down:
    RemoteSend's status and duration, the prefill node's pages (read inside its namespace), the
    decode node's reservation and pages. Then the link comes back and a new request runs."""
    dn, pn, ph = pair.dn, pair.pn, pair.prefill_host
    obs: dict = {}
    wait_for(lambda: clean(dn.metrics()) and clean(pn.metrics()), 20, "both nodes clean before the cut")
    expiries = dn.metrics().get("duet_lease_expiries_total", 0)
    cfg = model.config
    token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V of one position
    prompt = random_ids(CUT_PROMPT_TOKENS, 4242)
    r, send = pair.prepare("cut", prompt)
    obs["kv_bytes"] = (r.kv_window_end - r.prefix_matched_length) * token_bytes
    in_ns_metrics = f"http://127.0.0.1:{pn.metrics_port}/metrics"
    sent0 = ph.sent_bytes()
    started = time.monotonic()
    request_file = tempfile.TemporaryFile()
    request_file.write(send.SerializeToString())
    request_file.seek(0)
    client = subprocess.Popen(ph.exec_args(sys.executable, "-m", "harness.netns_hosts", "remote-send",
                                           f"127.0.0.1:{pn.port}", "--timeout", "120"),
                              stdin=request_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        wait_for(lambda: ph.sent_bytes() - sent0 >= 2 * MAX_BATCH_TOKENS * token_bytes or client.poll() is not None,
                 60, "KV starts crossing the link")
        obs["crossed_before_cut"] = ph.sent_bytes() - sent0
        ph.link_down()
        cut_at = time.monotonic()
        obs["cut_after_s"] = cut_at - started
        try:
            out, err = client.communicate(timeout=4 * TRANSFER_TIMEOUT_S + 30)
            obs["remote_send"] = json.loads(out.decode().strip().splitlines()[-1]) if out.strip() else \
                {"code": "CLIENT_FAILED", "details": err.decode()[-2000:], "seconds": -1}
            obs["remote_send_after_cut_s"] = time.monotonic() - cut_at
            obs["prefill_clean_while_down"] = _wait_quietly(lambda: clean(ph.python("metrics", in_ns_metrics)), 10)
            lease_left = max(0.0, r.lease_deadline_unix - time.time()) if r.lease_deadline_unix else LEASE_S
            obs["reservation_expired_while_down"] = _wait_quietly(
                lambda: (m := dn.metrics()).get("duet_kv_pages_reserved", 0) == 0
                and m.get("duet_lease_expiries_total", 0) > expiries, lease_left + 5)
            # With NIXL the cut-off writer cannot report back: its pages wait out the quarantine.
            obs["decode_clean_while_down"] = _wait_quietly(lambda: clean(dn.metrics()), QUARANTINE_S + 5)
            obs["prefill_reachable_while_down"] = _reachable(pn)
        finally:
            ph.link_up()
        up_at = time.monotonic()
        obs["decode_clean_after_up"] = _wait_quietly(lambda: clean(dn.metrics()), 30)
        obs["decode_clean_after_up_s"] = time.monotonic() - up_at
        obs["prefill_clean_after_up"] = _wait_quietly(lambda: clean(pn.metrics()), 10)
        after = random_ids(200, 4343)
        obs["after"] = _first_success_after_link_up(pair, after, up_at, timeout=45)
        obs["after_expected"] = reference(model, after, 8)
        obs["both_clean_at_end"] = _wait_quietly(lambda: clean(dn.metrics()) and clean(pn.metrics()), 20)
    finally:
        ph.link_up()
        if client.poll() is None:
            client.kill()
            client.wait()
        request_file.close()
    print(f"\n[{pair.transport}] network cut: " + json.dumps({k: v for k, v in obs.items() if k != "after_expected"}))
    return obs


def _first_success_after_link_up(pair: Pair, prompt: list[int], up_at: float, timeout: float) -> dict:
    """Run the three calls until they succeed; what the first attempt said, how many failed."""
    failures = []
    while True:
        try:
            tokens, _, sent, _ = pair.three_calls(f"after-cut-{len(failures)}", prompt)
            return {"ok": True, "tokens": tokens, "tokens_sent": sent.tokens_sent, "failed_attempts": failures,
                    "seconds_after_up": time.monotonic() - up_at}
        except grpc.RpcError as exc:
            failures.append(f"{exc.code().name}: {exc.details()}")
            if time.monotonic() - up_at > timeout:
                return {"ok": False, "failed_attempts": failures}
            time.sleep(0.5)


def _wait_quietly(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return True
        except Exception:  # noqa: BLE001 - a metrics read can fail while links flap
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _reachable(d: NetnsDaemon) -> bool:
    try:
        d.stub.GetLoad(pb.GetLoadRequest(), timeout=1)
        return True
    except grpc.RpcError:
        return False


def test_cut_happens_mid_transfer(cut):
    assert 0 < cut["crossed_before_cut"] < cut["kv_bytes"] / 2, cut
    assert cut["prefill_reachable_while_down"] is False  # the cut is real


def test_cut_remote_send_fails_with_a_clear_status_in_bounded_time(cut):
    rs = cut["remote_send"]
    assert rs["code"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED"), rs
    assert "prefill of" not in rs["details"], rs  # the transfer stalled, not the compute
    assert cut["remote_send_after_cut_s"] <= 2 * TRANSFER_TIMEOUT_S + 5, cut


def test_cut_remote_send_respects_transfer_timeout(cut):
    assert cut["remote_send"]["seconds"] <= TRANSFER_TIMEOUT_S + 3, cut["remote_send"]


def test_cut_prefill_node_frees_its_pages_while_link_is_down(cut):
    assert cut["prefill_clean_while_down"], cut


def test_cut_decode_reservation_expires_while_link_is_down(cut):
    assert cut["reservation_expired_while_down"], cut


def test_cut_decode_pages_return_while_link_is_down(cut):
    assert cut["decode_clean_while_down"], cut


def test_cut_both_nodes_clean_after_link_up(cut):
    assert cut["decode_clean_after_up"] and cut["prefill_clean_after_up"] and cut["both_clean_at_end"], cut


def test_cut_new_request_after_link_up_gives_correct_tokens(cut):
    """A request after the link returns succeeds with the right tokens. With NIXL the first one
    may still fail (NOT_FOUND: its lease ran out while UCX's TCP connection waited for the
    kernel's next retransmission, seconds after the link came back); a retry succeeds."""
    after = cut["after"]
    assert after["ok"], after
    failed = after["failed_attempts"]
    assert len(failed) <= 2 and all(f.startswith(("NOT_FOUND", "DEADLINE_EXCEEDED")) for f in failed), after
    assert after["tokens_sent"] == 199
    assert after["tokens"] == cut["after_expected"]
