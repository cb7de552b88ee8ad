"""The receiving half of the NIXL transport: the whole pool registered once with NIXL's UCX
backend, and fences that only the writer's report or the quarantine lift.

Writes are one-sided, so nothing here touches the bytes or can stop one already posted: an
admitted writer's window is fenced at once and stays fenced until the writer reports it is done
(`complete`) or the quarantine ends (fences.py). UCX transports that emulate RMA (tcp) only move
data while the target makes progress, and NIXL's progress thread is off on small machines, so a
thread polls: briskly while transfers are due, lazily otherwise. Where every transport UCX_TLS
allows puts bytes without the target (shared memory through CMA/knem/xpmem, RDMA, CUDA IPC),
polling briskly only takes CPU from the computing processes on the host (the prefill node's
forward, on the same cores: docs/bench/README.md, "Figures behind the code"). There the poller
stays lazy (it still answers connection set-up).
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch

from common.kv.pool import KVPool
from common.transports.connector import WriteWindow
from common.transports.fences import WriteFences
from common.transports.nixl.target import NixlTarget
from protos.duet.v1 import duet_pb2 as pb

BUSY_POLL_S = 0.0005
IDLE_POLL_S = 0.02
# UCX transports whose puts land with no help from the target's worker (a kernel copy, RDMA, CUDA
# IPC). Any other (tcp, ud), a negated list or an unset UCX_TLS ("all") may emulate RMA in messages.
ONE_SIDED_UCX_TLS = frozenset({"self", "sm", "shm", "cma", "knem", "xpmem", "rc", "rc_v", "rc_x", "rc_verbs",
                               "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ib", "cuda_ipc", "cuda_copy", "gdr_copy"})

log = logging.getLogger(__name__)


def target_must_progress(ucx_tls: str | None) -> bool:
    """Whether writes under this UCX_TLS setting may need the target to make UCX progress."""
    names = {name.strip() for name in (ucx_tls or "").split(",")}
    return not ucx_tls or ucx_tls.startswith("^") or not names <= ONE_SIDED_UCX_TLS


class NixlReceiver:
    transport = "nixl"

    def __init__(self, pool: KVPool, fences: WriteFences, name: str, transfers_pending: Callable[[], bool]) -> None:
        self.fences = fences
        self._target = NixlTarget(name, pool.storage)  # a CUDA pool is registered as VRAM
        self._name = name
        self._cuda_device = pool.device if pool.storage.is_cuda else None
        self._pending = transfers_pending
        ucx_tls = os.environ.get("UCX_TLS")
        self._busy_poll_s = BUSY_POLL_S if target_must_progress(ucx_tls) else IDLE_POLL_S
        log.info("nixl receiver", extra={"fields": {"ucx_tls": ucx_tls or "<unset>",
                                                    "poll_ms_while_receiving": 1e3 * self._busy_poll_s}})
        self._stopped = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="nixl-progress", daemon=True)
        self._poller.start()

    def info(self) -> pb.TransportInfo:
        t = self._target
        return pb.TransportInfo(transport=self.transport, nixl_agent_name=self._name,
                                nixl_agent_metadata=t.metadata(), pool_base_address=t.base_address,
                                pool_size_bytes=t.size_bytes)

    def admit(self, window: WriteWindow) -> None:
        self.fences.raise_fence(window, quarantine=True)

    def complete(self, request_id: str, nonce: int) -> bool:
        return self.fences.lift_writer(request_id, nonce)

    def close(self) -> None:
        self._stopped.set()
        self._poller.join()
        self._target.close()

    def _poll_loop(self) -> None:
        if self._cuda_device is not None:  # UCX's CUDA transports use the calling thread's device
            torch.cuda.set_device(self._cuda_device)
        while not self._stopped.wait(self._busy_poll_s if self._pending() else IDLE_POLL_S):
            self._target.poll_notifications()
