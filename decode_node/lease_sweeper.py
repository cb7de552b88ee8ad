"""A thread that ends reservations whose lease ran out before StartGeneration, and lifts write
fences whose writer is gone from this host or whose quarantine is over (the writer never
reported back)."""
from __future__ import annotations

import logging
import threading
import time

from common.tracing import Tracer
from common.transports.metrics import TransferFailure
from decode_node.metrics import DecodeMetrics
from decode_node.request_table import RequestTable, Status
from decode_node.writer_gate import WriterGate

log = logging.getLogger(__name__)


class LeaseSweeper:
    def __init__(self, requests: RequestTable, writer_gate: WriterGate, metrics: DecodeMetrics, tracer: Tracer,
                 sweep_seconds: float = 0.1) -> None:
        self._requests = requests
        self._writer_gate = writer_gate
        self._metrics = metrics
        self._tracer = tracer
        self._sweep_seconds = sweep_seconds
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lease-sweeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stopped.wait(self._sweep_seconds):
            expired = self._requests.expire_due(time.time())
            self._writer_gate.lift_gone_runs()
            if unfenced := self._writer_gate.fences.expire_due(time.monotonic()):
                log.warning("writers never reported back; their pages leave quarantine",
                            extra={"fields": {"fences": unfenced}})
                self._metrics.quarantine_expiries.inc(unfenced)
            for entry in expired:
                log.info("lease expired", extra={"fields": {"request_id": entry.request_id}})
                self._metrics.lease_expiries.inc()
                if entry.status is Status.RECEIVING:
                    self._metrics.transfers.failed(TransferFailure.LEASE_EXPIRED)
                self._tracer.event(entry.request_id, "lease_expired")
