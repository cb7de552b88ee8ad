"""The decode node's NIXL endpoint: the whole pool registered once with NIXL's UCX backend.

Writes are one-sided, so nothing here touches the bytes; but UCX transports that emulate RMA
(tcp) only move data while the target makes progress, and NIXL's progress thread is off on
small machines, so a thread polls: briskly while reservations wait for KV, lazily otherwise.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from common.kv.kv_pool import KVPool
from common.transports.nixl_transport import NixlTarget
from protos.duet.v1 import duet_pb2 as pb

BUSY_POLL_S = 0.0005
IDLE_POLL_S = 0.02


class NixlEndpoint:
    transport = "nixl"
    one_sided = True  # writers write without us: see decode_node/write_fences.py

    def __init__(self, pool: KVPool, name: str, transfers_pending: Callable[[], bool]) -> None:
        self._target = NixlTarget(name, pool.data)  # a CUDA pool is registered as VRAM
        self._name = name
        self._cuda_device = pool.data.device if pool.data.is_cuda else None
        self._pending = transfers_pending
        self._stopped = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="nixl-progress", daemon=True)
        self._poller.start()

    def info(self) -> pb.TransportInfo:
        t = self._target
        return pb.TransportInfo(transport=self.transport, nixl_agent_name=self._name,
                                nixl_agent_metadata=t.metadata(), pool_base_address=t.base_address,
                                pool_size_bytes=t.size_bytes)

    def close(self) -> None:
        self._stopped.set()
        self._poller.join()
        self._target.close()

    def _poll_loop(self) -> None:
        if self._cuda_device is not None:  # UCX's CUDA transports use the calling thread's device
            torch.cuda.set_device(self._cuda_device)
        while not self._stopped.wait(BUSY_POLL_S if self._pending() else IDLE_POLL_S):
            self._target.poll_notifications()
