"""Draining a decode node into others: SIGTERM (or the Drain RPC) on a node started with
--drain-to moves every running request to the least loaded of those nodes (decode_node/migration.py)
instead of waiting for it to finish here, and relays their streams until they end; then the node
exits. New requests are refused meanwhile (UNAVAILABLE: a router sends them elsewhere).

A request still being handed off or prefilled moves once it decodes. One that no target takes
(each unreachable, full or incompatible, MAX_ATTEMPTS times over) finishes here, within
--drain-seconds, as without --drain-to.
"""
from __future__ import annotations

import logging
import time
from collections import Counter

from common.errors import NotFound, RequestError
from decode_node.migration import Migrations
from decode_node.request_table import RequestTable, Status

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 50  # per request; a request not yet decoding fails an attempt per pass
_PASS_SECONDS = 0.02
_BECOMING_RUNNING = (Status.QUEUED, Status.RESERVED, Status.RECEIVING, Status.RECEIVED)


class Drain:
    def __init__(self, targets: tuple[str, ...], migrations: Migrations, requests: RequestTable) -> None:
        self.targets = targets
        self.migrations = migrations
        self.requests = requests

    def run(self) -> int:
        """Migrate until nothing runs here that a target would take; returns how many moved."""
        moved = 0
        attempts: Counter[str] = Counter()
        while True:
            counts = self.requests.counts()
            running = [e.request_id for e in self.requests.with_status(Status.RUNNING)
                       if attempts[e.request_id] < MAX_ATTEMPTS]
            if not running and not any(counts[s] for s in _BECOMING_RUNNING):
                return moved
            for request_id in running:
                if self._move(request_id):
                    moved += 1
                else:
                    attempts[request_id] += 1
            time.sleep(_PASS_SECONDS)

    def _move(self, request_id: str) -> bool:
        """Migrate one request to the least loaded target that takes it; False if none did."""
        for target in self._ranked_targets():
            try:
                self.migrations.migrate(request_id, target, reason="drain")
                return True
            except NotFound:
                return True  # it finished meanwhile: nothing left to move
            except RequestError as exc:
                log.info("drain: a migration failed", extra={"fields": {
                    "request_id": request_id, "target": target, "code": exc.code.name, "error": str(exc)}})
        return False

    def _ranked_targets(self) -> list[str]:
        """The reachable targets, least loaded first (running and queued requests, then free pages)."""
        loads = {}
        for target in self.targets:
            try:
                loads[target] = self.migrations.target_load(target)
            except RequestError:
                continue
        return sorted(loads, key=lambda t: (loads[t].running_requests + loads[t].queued_requests,
                                            -loads[t].kv_pages_free))
