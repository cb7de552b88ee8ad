"""Failing closed without losing capacity, with real daemons: KV corrupted on its way is caught by
its checksums and the answer stays exact; a write fence comes down as soon as its writer's run is
proven over (it restarted, or its process is gone from this host), not a quarantine later."""
from __future__ import annotations

import re
import subprocess
import time

import grpc
import pytest

from common.serving.fingerprint import fingerprint_of
from common.serving.incarnation import process_start_ticks, writer_identity
from protos.duet.v1 import duet_pb2 as pb
from harness.helpers import drain, greedy, random_ids, started_pair
from harness.reference import FP32, engine_greedy

TRANSPORTS = ["nixl", "tcp"]
QUARANTINE_S = "120"  # far longer than any test waits: pages that come back early came back on proof


def _failures(d, reason: str) -> float:
    m = re.search(rf'^duet_kv_transfer_failures_total{{reason="{reason}"}} (\S+)$', d.metrics_text(), re.M)
    return float(m.group(1)) if m else 0.0


def _wait_for(predicate, timeout: float) -> float:
    """Seconds until `predicate()` held; fails after `timeout`."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.05)
    return time.monotonic() - started


def _whole(dn) -> bool:
    load = dn.stub.GetLoad(pb.GetLoadRequest())
    return load.kv_pages_free + load.kv_pages_cached == load.kv_pages_total and not load.kv_pages_reserved


@pytest.fixture(scope="module", params=TRANSPORTS)
def nodes(request, tmp_path_factory):
    """A decode node that verifies KV (the default) and hands prompts to a prefill node whose every
    transfer sends one position from the wrong slot."""
    tmp = tmp_path_factory.mktemp(f"fail_closed_{request.param}")
    transport = (*FP32, "--transport", request.param)
    with started_pair(tmp, transport, (*transport, "--min-remote-prefill-tokens", "1", "--quarantine-seconds",
                                       QUARANTINE_S), prefill_env={"DUET_TEST_FAULTS": "corrupt-kv"}) as (dn, pn):
        yield request.param, dn, pn


def test_corrupted_kv_is_refused_and_the_answer_stays_exact(nodes, model):
    _, dn, pn = nodes
    prompt = random_ids(150, 1)
    before = _failures(dn, "checksum")
    tokens, _ = drain(dn.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=greedy(8)), timeout=120))
    assert tokens == engine_greedy(model, prompt, 8)
    assert _failures(dn, "checksum") == before + 1, "the corrupt transfer was not counted"
    assert _failures(pn, "data_loss") >= 1
    _wait_for(lambda: _whole(dn), 10)


def test_remote_send_of_corrupt_kv_is_data_loss_and_the_reservation_waits_again(nodes):
    _, dn, pn = nodes
    prompt = random_ids(90, 2)
    r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="corrupt", token_ids=prompt))
    with pytest.raises(grpc.RpcError) as info:
        pn.stub.RemoteSend(pb.RemoteSendRequest(
            request_id="corrupt", token_ids=prompt, kv_window_begin=r.kv_window_begin, kv_window_end=r.kv_window_end,
            kv_append_metadata=r.kv_append_metadata, decode_address=dn.address, transfer_nonce=r.transfer_nonce),
            timeout=60)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:  # the KV was discarded: nothing to generate from
        next(iter(dn.stub.StartGeneration(pb.StartGenerationRequest(
            request_id="corrupt", kv_window_begin=r.kv_window_end, sampling=pb.SamplingParams(max_tokens=1)))))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    dn.stub.Abort(pb.AbortRequest(request_id="corrupt"))
    _wait_for(lambda: _whole(dn), 10)


def test_a_completion_without_checksums_is_refused(nodes):
    _, dn, _ = nodes
    r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="unchecked", token_ids=random_ids(40, 4)))
    dn.stub.BeginTransfer(pb.BeginTransferRequest(request_id="unchecked", transfer_nonce=r.transfer_nonce,
                                                  kv_append_metadata=r.kv_append_metadata))
    with pytest.raises(grpc.RpcError) as info:
        dn.stub.CompleteTransfer(pb.CompleteTransferRequest(request_id="unchecked", transfer_nonce=r.transfer_nonce))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_checksums" in info.value.details()
    dn.stub.Abort(pb.AbortRequest(request_id="unchecked"))
    _wait_for(lambda: _whole(dn), 10)


@pytest.fixture
def handshake(nodes, model):
    """Announce a writer run to the decode node as a prefill node's handshake does."""
    transport, dn, _ = nodes
    fingerprint = fingerprint_of(model, model.new_pool(1, 16))

    def announce(writer: pb.WriterIdentity) -> None:
        dn.stub.GetTransportInfo(pb.GetTransportInfoRequest(fingerprint=fingerprint, transport=transport,
                                                            writer=writer))

    return announce


def _begin_then_abort(dn, request_id: str, writer: pb.WriterIdentity) -> None:
    """A reservation whose writer began (BeginTransfer) and was never heard of again, aborted."""
    r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=request_id, token_ids=random_ids(100, 3)))
    dn.stub.BeginTransfer(pb.BeginTransferRequest(request_id=request_id, transfer_nonce=r.transfer_nonce,
                                                  kv_append_metadata=r.kv_append_metadata,
                                                  writer_incarnation=writer.incarnation))
    dn.stub.Abort(pb.AbortRequest(request_id=request_id))


def _quarantined(dn) -> int:
    return dn.stub.GetLoad(pb.GetLoadRequest()).kv_pages_quarantined


def _remote_writer(incarnation: int) -> pb.WriterIdentity:
    return pb.WriterIdentity(incarnation=incarnation, address="10.0.0.7:50061", boot_id="another-host", pid=1)


def test_a_restarted_writer_lifts_its_earlier_runs_fences(nodes, handshake):
    transport, dn, _ = nodes
    handshake(_remote_writer(11))
    _begin_then_abort(dn, "fenced-by-11", _remote_writer(11))
    if transport == "tcp":  # the receiver owns the socket: no connection, nothing fenced
        assert _quarantined(dn) == 0 and _whole(dn)
        return
    time.sleep(0.5)
    assert _quarantined(dn) == 7, "without proof the fence waits for its quarantine"
    handshake(_remote_writer(12))  # the same address, a new run: the old one writes no more
    assert _quarantined(dn) == 0 and _whole(dn)


def test_a_writer_whose_process_is_gone_lifts_its_fences(nodes, handshake):
    transport, dn, _ = nodes
    with subprocess.Popen(["sleep", "60"]) as writer_process:
        writer = writer_identity("127.0.0.1:1")
        writer.incarnation, writer.pid = 21, writer_process.pid
        writer.process_start_ticks = process_start_ticks(writer.pid)
        handshake(writer)
        _begin_then_abort(dn, "fenced-by-21", writer)
        if transport == "nixl":
            time.sleep(0.5)
            assert _quarantined(dn) == 7, "the writer's process still runs"
        writer_process.kill()
    took = _wait_for(lambda: _quarantined(dn) == 0 and _whole(dn), 5)
    assert took < 5
