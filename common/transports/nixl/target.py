"""The receiving half of NIXL: an agent exposing one registered pool tensor to remote writers."""
from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from common.transports.nixl.agent import agent_name, check_tensor, make_agent, register

log = logging.getLogger(__name__)


class NixlTarget:
    """The decode side: an agent that exposes one registered pool tensor to remote writers."""

    def __init__(self, name: str, pool_tensor: torch.Tensor) -> None:
        check_tensor(pool_tensor, "pool_tensor")
        self.name = name
        self._tensor = pool_tensor  # keep the memory alive while it is registered
        self._lock = threading.Lock()
        self._agent = make_agent(name)
        self._reg = register(self._agent, pool_tensor)

    @property
    def base_address(self) -> int:
        """Address of the pool's first byte, as remote ranges must be expressed."""
        return self._tensor.data_ptr()

    @property
    def size_bytes(self) -> int:
        return self._tensor.numel() * self._tensor.element_size()

    def metadata(self) -> bytes:
        """NIXL agent metadata (connection info and the pool registration) for initiators."""
        with self._lock:
            return self._live().get_agent_metadata()

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """Notifications that arrived since the last call, as (initiator agent name, payload),
        in arrival order per initiator. Also drives UCX progress (needed for ``tcp``)."""
        with self._lock:
            notifs = self._live().get_new_notifs()
        return [(agent_name(peer), bytes(msg)) for peer, msgs in notifs.items() for msg in msgs]

    def close(self) -> None:
        """Deregister the pool and destroy the agent. Idempotent."""
        with self._lock:
            agent, self._agent = self._agent, None
            if agent is None:
                return
            try:
                agent.deregister_memory(self._reg)
            except Exception as exc:  # closing must not raise; the agent dies anyway
                log.warning("NIXL deregister failed on close: %s", exc)
            del agent

    def _live(self) -> Any:
        if self._agent is None:
            raise RuntimeError(f"NixlTarget {self.name!r} is closed")
        return self._agent

    def __enter__(self) -> NixlTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
