"""NIXL/UCX transport: two real processes on loopback (spawn), one target and one initiator.

Per UCX transport (``sm,self`` and ``tcp`` on ``lo``) one scenario runs and the tests below check
its results: scattered ranges land byte-exact with their notification, a remote range outside the
target's pool is a clean TransferError, and a killed and restarted target (same agent name) gives
PeerDisconnectedError and then works again after connect() with its new metadata.
"""
from __future__ import annotations

import multiprocessing as mp
import time

import grpc
import pytest
import torch

from common.transports.nixl.agent import nixl_available, nixl_unavailable_reason

if not nixl_available():
    pytest.skip(nixl_unavailable_reason() or "NIXL cannot be imported", allow_module_level=True)

pytestmark = pytest.mark.timeout(60)

POOL_BYTES = 1 << 20
SRC_BYTES = 1 << 20
SEED = 1234
TARGET = "decode-0"
INITIATOR = "prefill-0"
STEP_TIMEOUT_S = 15.0


def _source() -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 256, (SRC_BYTES,), dtype=torch.uint8, generator=g)


def _plan() -> list[tuple[int, int, int]]:
    """(src_offset, dst_offset, nbytes) triples: disjoint, odd sizes, unaligned, out of order."""
    g = torch.Generator().manual_seed(SEED + 1)
    n = 48
    sizes = torch.randint(1, 9000, (n,), generator=g).tolist()
    src_order = torch.randperm(n, generator=g).tolist()
    dst_order = torch.randperm(n, generator=g).tolist()
    gap = 37
    src_off, off = [0] * n, 5
    for i in src_order:
        src_off[i], off = off, off + sizes[i] + gap
    dst_off, off = [0] * n, 3
    for i in dst_order:
        dst_off[i], off = off, off + sizes[i] + gap
    assert off < POOL_BYTES
    return [(src_off[i], dst_off[i], sizes[i]) for i in range(n)]


def _expected_pool(plan) -> torch.Tensor:
    src, pool = _source(), torch.zeros(POOL_BYTES, dtype=torch.uint8)
    for s, d, n in plan:
        pool[d : d + n] = src[s : s + n]
    return pool


# --- child processes (module-level so that spawn can import them) -------------------------------


def _target_main(conn) -> None:
    """Register a zeroed pool, publish it, forward notifications with a byte-exact check."""
    from common.transports.nixl.target import NixlTarget

    pool = torch.zeros(POOL_BYTES, dtype=torch.uint8)
    target = NixlTarget(TARGET, pool)
    conn.send((target.metadata(), target.base_address, target.size_bytes))
    expected = _expected_pool(_plan())
    try:
        while True:
            if conn.poll(0.0005):
                if conn.recv() == ("quit",):
                    return
            for peer, payload in target.poll_notifications():
                mismatched = int((pool != expected).sum()) if payload == b"kv-done" else None
                conn.send(("notif", peer, payload, mismatched))
    except (EOFError, BrokenPipeError):
        return
    finally:
        target.close()


def _initiator_main(conn) -> None:
    """Run commands from the parent; every reply is ("ok", value) or ("err", type, code, msg)."""
    from common.transports.nixl.initiator import NixlInitiator, TransferError

    src = _source()
    ini = NixlInitiator(INITIATOR, src)
    remote_base = None
    try:
        while True:
            cmd, *args = conn.recv()
            try:
                if cmd == "quit":
                    return
                if cmd == "connect":
                    metadata, remote_base, _size = args
                    ini.connect(TARGET, metadata)
                    conn.send(("ok", None))
                elif cmd == "validate":
                    conn.send(("ok", _validation_errors(ini, src)))
                elif cmd == "write":
                    (plan, notif) = args
                    local = [(src.data_ptr() + s, n) for s, _d, n in plan]
                    remote = [(remote_base + d, n) for _s, d, n in plan]
                    ini.wait(ini.write(TARGET, local, remote, notif), timeout_s=STEP_TIMEOUT_S)
                    conn.send(("ok", None))
            except TransferError as exc:
                conn.send(("err", type(exc).__name__, exc.code.name, str(exc)))
    except EOFError:
        return
    finally:
        ini.close()


def _validation_errors(ini, src) -> list[str]:
    """Malformed writes, each of which must be refused before NIXL sees it."""
    p, far = src.data_ptr(), 1 << 40
    cases = [
        ("nobody", [(p, 10)], [(far, 20)]),         # sizes differ
        ("nobody", [(p + SRC_BYTES - 8, 16)], [(far, 16)]),  # local range past the tensor
        ("nobody", [], []),                          # nothing to write
        ("nobody", [(p, 10)], [(far, 10)]),          # peer never connected
    ]
    out = []
    for peer, local, remote in cases:
        try:
            ini.write(peer, local, remote, b"x")
            out.append("accepted")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


# --- orchestration -------------------------------------------------------------------------------


class _Child:
    def __init__(self, ctx, fn) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=fn, args=(child_conn,), daemon=True)
        self.proc.start()
        child_conn.close()

    def recv(self, what: str):
        if not self.conn.poll(STEP_TIMEOUT_S):
            raise AssertionError(f"no {what} from pid {self.proc.pid} within {STEP_TIMEOUT_S} s "
                                 f"(alive={self.proc.is_alive()}, exitcode={self.proc.exitcode})")
        return self.conn.recv()

    def ask(self, *cmd):
        self.conn.send(cmd)
        return self.recv(f"reply to {cmd[0]}")

    def stop(self) -> None:
        try:
            self.conn.send(("quit",))
        except (OSError, ValueError):
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def _run_scenario(tls: str) -> dict:
    env = {"UCX_TLS": tls}
    if "tcp" in tls:
        env["UCX_NET_DEVICES"] = "lo"
    ctx = mp.get_context("spawn")
    children: list[_Child] = []
    out: dict = {}
    with pytest.MonkeyPatch.context() as mpatch:  # children inherit the environment at start
        for k, v in env.items():
            mpatch.setenv(k, v)
        try:
            target = _Child(ctx, _target_main)
            children.append(target)
            initiator = _Child(ctx, _initiator_main)
            children.append(initiator)
            md, base, size = target.recv("target metadata")
            out["size"] = size
            out["connect"] = initiator.ask("connect", md, base, size)
            out["validate"] = initiator.ask("validate")
            plan = _plan()
            t0 = time.monotonic()
            out["write"] = initiator.ask("write", plan, b"kv-done")
            out["notif"] = target.recv("notification")
            out["write_s"] = time.monotonic() - t0
            # A range that runs past the end of the target's pool, then a valid write again.
            out["oversized"] = initiator.ask("write", [(0, size - 100, 4096)], b"never")
            out["after_oversized"] = initiator.ask("write", plan[:3], b"again")
            out["notif_again"] = target.recv("second notification")
            # Kill the target: writes must fail cleanly, then a restart under the same name works.
            target.proc.kill()
            target.proc.join(5)
            out["to_dead"] = initiator.ask("write", plan, b"dead")
            target2 = _Child(ctx, _target_main)
            children.append(target2)
            md2, base2, size2 = target2.recv("restarted target metadata")
            out["reconnect"] = initiator.ask("connect", md2, base2, size2)
            out["after_restart"] = initiator.ask("write", plan, b"kv-done")
            out["notif_restart"] = target2.recv("notification after restart")
        finally:
            for child in reversed(children):
                child.stop()
    return out


@pytest.fixture(scope="module", params=["sm,self", "tcp"], ids=["sm", "tcp"])
def scenario(request) -> dict:
    return _run_scenario(request.param)


def test_scattered_write_lands_exactly_with_notification(scenario):
    assert scenario["connect"] == ("ok", None)
    assert scenario["write"] == ("ok", None)
    kind, peer, payload, mismatched = scenario["notif"]
    assert (kind, peer, payload) == ("notif", INITIATOR, b"kv-done")
    assert mismatched == 0, f"{mismatched} bytes of the target pool differ from the expected image"


def test_oversized_remote_range_is_an_error_not_a_crash(scenario):
    status, err_type, code, message = scenario["oversized"]
    assert (status, err_type, code) == ("err", "TransferError", grpc.StatusCode.INVALID_ARGUMENT.name)
    assert TARGET in message
    # The initiator and the connection survive it.
    assert scenario["after_oversized"] == ("ok", None)
    assert scenario["notif_again"][:3] == ("notif", INITIATOR, b"again")


def test_dead_target_then_restart_under_same_name(scenario):
    status, err_type, code, _message = scenario["to_dead"]
    assert (status, err_type, code) == ("err", "PeerDisconnectedError", grpc.StatusCode.UNAVAILABLE.name)
    assert scenario["reconnect"] == ("ok", None)
    assert scenario["after_restart"] == ("ok", None)
    kind, peer, payload, mismatched = scenario["notif_restart"]
    assert (kind, peer, payload, mismatched) == ("notif", INITIATOR, b"kv-done", 0)


def test_malformed_ranges_are_refused_before_nixl(scenario):
    status, errors = scenario["validate"]
    assert status == "ok"
    sizes, local_oob, empty, unknown_peer = errors
    assert sizes.startswith("ValueError") and "local has 10 bytes, remote 20" in sizes
    assert local_oob.startswith("ValueError") and "outside the registered local tensor" in local_oob
    assert empty.startswith("ValueError") and "no ranges" in empty
    assert unknown_peer.startswith("TransferError") and "not connected" in unknown_peer
