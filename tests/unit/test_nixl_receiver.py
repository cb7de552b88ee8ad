"""The NIXL receiver's progress poller (common/transports/nixl/receiver.py): brisk while
transfers are due only where UCX may need the target's progress to move the bytes."""
from __future__ import annotations

import threading
import time

import pytest

from common.kv.page_allocator import PageAllocator
from common.kv.pool import KVPool
from common.transports.fences import WriteFences
from common.transports.nixl import receiver
from common.transports.nixl.receiver import NixlReceiver, target_must_progress


@pytest.mark.parametrize("ucx_tls, must", [
    ("sm,self", False), ("cuda_ipc,cuda_copy,sm,self", False), ("rc_x,cuda_copy", False), ("cma", False),
    ("tcp", True), ("sm,self,tcp", True), ("rc,ud,cuda_copy,cuda_ipc", True), ("^tcp", True), ("all", True),
    ("", True), (None, True),
])
def test_which_ucx_transports_need_the_target_to_progress(ucx_tls, must):
    assert target_must_progress(ucx_tls) is must


class _CountingTarget:
    """Stands in for NixlTarget (no UCX): counts the polls."""

    def __init__(self, name, tensor) -> None:
        self.polls = 0

    def poll_notifications(self) -> list:
        self.polls += 1
        return []

    def close(self) -> None:
        pass


def _polls_while_receiving(monkeypatch, ucx_tls: str, seconds: float = 0.3) -> int:
    monkeypatch.setenv("UCX_TLS", ucx_tls)
    monkeypatch.setattr(receiver, "NixlTarget", _CountingTarget)
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=4, page_size=4)
    fences = WriteFences(PageAllocator(pool.num_pages), threading.RLock(), quarantine_seconds=1.0)
    r = NixlReceiver(pool, fences, "test", transfers_pending=lambda: True)
    try:
        start = r._target.polls
        time.sleep(seconds)
        return r._target.polls - start
    finally:
        r.close()


def test_one_sided_transports_poll_lazily_tcp_briskly(monkeypatch):
    lazy = _polls_while_receiving(monkeypatch, "sm,self")
    brisk = _polls_while_receiving(monkeypatch, "tcp")
    assert lazy <= 0.3 / receiver.IDLE_POLL_S + 5, lazy
    assert brisk > 3 * max(lazy, 1), (brisk, lazy)
