"""Prometheus metrics of the prefill node, in a registry of its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.engine.core import Engine
from common.serving.pool_metrics import register_pool_gauges
from common.transports.metrics import TransferMetrics
from prefill_node.scheduler import PrefillScheduler

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class PrefillMetrics:
    def __init__(self, engine: Engine, scheduler: PrefillScheduler) -> None:
        self.registry = r = CollectorRegistry()
        register_pool_gauges(r, engine, scheduler.compute_threads)
        Gauge("duet_prefill_pending_tokens", "Prompt tokens admitted or queued but not yet computed",
              registry=r).set_function(scheduler.pending_tokens)
        self.requests = Counter("duet_requests", "RemoteSend calls by outcome", ["rpc", "outcome"], registry=r)
        self.computed_tokens = Counter("duet_prefill_computed_tokens", "Prompt tokens computed", registry=r)
        self.prefill_seconds = Histogram("duet_prefill_seconds", "RemoteSend start to last layer computed",
                                         buckets=_BUCKETS, registry=r)
        self.remote_send_seconds = Histogram("duet_remote_send_seconds", "RemoteSend start to confirmed transfer",
                                             buckets=_BUCKETS, registry=r)
        self.transfers = TransferMetrics(r)

    def observe(self, computed_tokens: int, prefill_s: float, total_s: float) -> None:
        self.computed_tokens.inc(computed_tokens)
        self.prefill_seconds.observe(prefill_s)
        self.remote_send_seconds.observe(total_s)
