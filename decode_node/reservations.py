"""Leased KV reservations made by PrepareReceive, waiting for their transfer and StartGeneration.

A reservation owns the page references of its sequence (matched prefix plus slots for the
window being received). If StartGeneration does not claim it before its deadline, a sweeper
returns every page to the pool, except pages a one-sided writer may still write: those wait
in quarantine (`write_fences.py`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.engine.engine import Engine, Sequence
from decode_node.write_fences import WriteFences

log = logging.getLogger(__name__)


@dataclass
class Reservation:
    request_id: str
    seq: Sequence
    prefix_matched: int
    end: int  # positions [kv_window_begin, end) arrive from the writer (begin >= prefix_matched)
    segments: list[tuple[int, int]]  # their destination slots, as (start, length) runs
    nonce: int
    deadline: float  # time.time() seconds
    complete: bool  # the writer reported the transfer finished (or nothing had to be sent)
    transfer_started: float | None = None  # time.perf_counter() of the writer's BeginTransfer

    @property
    def transfer_under_way(self) -> bool:
        return self.transfer_started is not None and not self.complete


class ReservationTable:
    """All methods must be called with `engine.lock` held, except start/stop."""

    def __init__(self, engine: Engine, on_expire: Callable[[Reservation], None], quarantine_seconds: float,
                 on_quarantine_expiry: Callable[[int], None], sweep_seconds: float = 0.1) -> None:
        self.engine = engine
        self._by_id: dict[str, Reservation] = {}
        self.fences = WriteFences(engine.allocator, quarantine_seconds)
        self._on_expire = on_expire
        self._on_quarantine_expiry = on_quarantine_expiry
        self._sweep_seconds = sweep_seconds
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sweep_loop, name="lease-sweeper", daemon=True)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def get(self, request_id: str) -> Reservation | None:
        return self._by_id.get(request_id)

    def add(self, r: Reservation) -> None:
        self._by_id[r.request_id] = r

    def claim(self, request_id: str) -> Reservation:
        """Take the reservation out of the table; its pages now belong to the caller."""
        return self._by_id.pop(request_id)

    def release(self, request_id: str) -> bool:
        r = self._by_id.pop(request_id, None)
        if r is None:
            return False
        self.engine.release(r.seq, cache=False)
        return True

    def awaiting_transfer(self) -> bool:
        """Whether any reservation still waits for its KV. Read without the lock, as a polling
        hint: a concurrent change may make it wrong for one poll."""
        try:
            return any(not r.complete for r in list(self._by_id.values()))
        except RuntimeError:  # the dict changed size while being copied
            return True

    def reserved_pages(self) -> int:
        return sum(len(r.seq.held_pages) for r in self._by_id.values())

    def reserved_tokens(self) -> int:
        """Prompt tokens of the reserved requests."""
        return sum(len(r.seq.token_ids) for r in self._by_id.values())

    def quarantined_pages(self) -> int:
        """Pages kept from reuse only because a writer of a gone reservation may still write them."""
        def is_live(request_id: str, nonce: int) -> bool:
            r = self._by_id.get(request_id)
            return r is not None and r.nonce == nonce

        return self.fences.quarantined_pages(is_live)

    def expire_due(self, now: float) -> list[Reservation]:
        expired = [r for r in self._by_id.values() if r.deadline <= now]
        for r in expired:
            self.release(r.request_id)
        return expired

    def release_all(self) -> None:
        for request_id in list(self._by_id):
            self.release(request_id)
        self.fences.release_all()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _sweep_loop(self) -> None:
        while not self._stopped.wait(self._sweep_seconds):
            with self.engine.lock:
                expired = self.expire_due(time.time())
                unfenced = self.fences.expire_due(time.monotonic())
            if unfenced:
                log.warning("writers never reported back; their pages leave quarantine",
                            extra={"fields": {"fences": unfenced}})
                self._on_quarantine_expiry(unfenced)
            for r in expired:
                log.info("lease expired", extra={"fields": {"request_id": r.request_id}})
                self._on_expire(r)
