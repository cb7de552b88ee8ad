"""The KV transfer metrics both nodes export, each from its own side of the hand-off.

- ``duet_kv_transfer_bytes_total``: K and V bytes of completed transfers.
- ``duet_kv_transfer_seconds``: the transfer alone, apart from prefill: on the prefill node from
  its first layer handed to the transport to the decode node's confirmation of CompleteTransfer;
  on the decode node from BeginTransfer (the writer's last check before its first byte) to
  CompleteTransfer.
- ``duet_kv_transfer_segments``: destination segments (``kv_append_metadata[0]``) per transfer.
- ``duet_kv_transfer_failures_total{reason}``: transfers that began and did not complete. The
  writing node's reason is the status its transfer ended with, lower case (``unavailable``,
  ``deadline_exceeded``, ...: `failed_with`); the decode node's is a `TransferFailure`.
"""
from __future__ import annotations

import enum

from prometheus_client import CollectorRegistry, Counter, Histogram

from common.errors import ErrorCode

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_SEGMENT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class TransferFailure(enum.StrEnum):
    """Why a decode node saw a transfer into one of its reservations fail."""

    ABANDONED = "abandoned"  # the writer reported it will write nothing more
    ABORTED = "aborted"  # the request was aborted with its transfer under way
    LEASE_EXPIRED = "lease_expired"  # the reservation's lease ran out with its transfer under way
    CHECKSUM = "checksum"  # the KV that landed is not the KV the writer sent


class TransferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._bytes = Counter("duet_kv_transfer_bytes", "K and V bytes moved by completed KV transfers",
                              registry=registry)
        self._seconds = Histogram("duet_kv_transfer_seconds", "KV transfer time, first write posted to "
                                  "confirmation (prefill not included)", buckets=_SECONDS_BUCKETS, registry=registry)
        self._segments = Histogram("duet_kv_transfer_segments", "Destination slot segments per KV transfer",
                                   buckets=_SEGMENT_BUCKETS, registry=registry)
        self._failures = Counter("duet_kv_transfer_failures", "KV transfers that began and did not complete, "
                                 "by reason", ["reason"], registry=registry)

    def completed(self, nbytes: int, seconds: float, segments: int) -> None:
        self._bytes.inc(nbytes)
        self._seconds.observe(seconds)
        self._segments.observe(segments)

    def failed(self, reason: TransferFailure) -> None:
        """On the decode node."""
        self._failures.labels(reason).inc()

    def failed_with(self, code: ErrorCode | None) -> None:
        """On the writing node: the status its transfer ended with (None: an unexpected error)."""
        self._failures.labels((code or ErrorCode.INTERNAL).name.lower()).inc()
