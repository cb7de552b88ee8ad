"""Prometheus metrics of the decode node, in a registry of its own."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.engine.core import Engine
from common.serving.pool_metrics import register_gateway_gauges, register_pool_gauges
from common.transports.metrics import TransferMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class DecodeMetrics:
    def __init__(self, engine: Engine, reserved_pages: Callable[[], int], quarantined_pages: Callable[[], int],
                 compute_threads: Callable[[], int], running: Callable[[], int], waiting: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        register_pool_gauges(r, engine, compute_threads)
        register_gateway_gauges(r, engine, running, waiting)
        Gauge("duet_kv_pages_reserved", "Pages held by reservations not yet claimed by StartGeneration",
              registry=r).set_function(reserved_pages)
        self.requests = Counter("duet_requests", "Finished requests by outcome", ["rpc", "outcome"], registry=r)
        self.prefiller_header = Counter(
            "duet_prefiller_header_requests", "Requests whose HTTP call named a prefill node (x-prefiller-host-port), "
            "by outcome (used: one of --prefill, tried first for the hand-off; ignored: not one of them)",
            ["outcome"], registry=r)
        self.ttft = Histogram("duet_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("duet_tpot_seconds", "Mean time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        Gauge("duet_kv_pages_quarantined", "Pages of expired or aborted reservations kept from reuse while "
              "their one-sided writer may still write them", registry=r).set_function(
            quarantined_pages)
        self.quarantine_expiries = Counter(
            "duet_quarantine_expiries", "Write fences dropped after --quarantine-seconds because the writer never "
            "reported back (a prefill node died or was cut off mid-transfer)", registry=r)
        self.lease_expiries = Counter("duet_lease_expiries", "Reservations freed because their lease ran out",
                                      registry=r)
        self.admission_queue_depth = Gauge("duet_admission_queue_depth",
                                           "Requests waiting for admission (--admission queue)", registry=r)
        self.admission_wait = Histogram("duet_admission_wait_seconds", "Time requests spent waiting for admission, "
                                        "until admitted or given up", buckets=_WAIT_BUCKETS, registry=r)
        self.admission_refusals = Counter(
            "duet_admission_refusals", "Requests refused at admission with RESOURCE_EXHAUSTED, by reason: "
            "max_requests, queue_full, too_large (never fits), or (--admission reject) pages, running, tokens",
            ["reason"], registry=r)
        self.transfers = TransferMetrics(r)
        self.spec_draft_tokens = Counter("duet_spec_draft_tokens", "Speculative draft tokens verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter("duet_spec_accepted_tokens", "Speculative draft tokens accepted",
                                            registry=r)
        self.spec_acceptance_length = Histogram(
            "duet_spec_acceptance_length", "Draft tokens accepted per verified draft (each step also emits one "
            "token of its own)", buckets=_ACCEPTED_BUCKETS, registry=r)

        self.migrations = Counter(
            "duet_migrations", "Requests this node moved to another decode node, by why (rpc: Migrate, drain: "
            "Drain or SIGTERM with --drain-to) and outcome (migrated; failed: it decoded on here; resumed: the target "
            "died after taking it, it continued here; aborted)", ["reason", "outcome"], registry=r)
        self.migration_pause = Histogram("duet_migration_pause", "The gap a migrated request's stream saw: from the "
                                         "last token this node sent to the target's first", unit="seconds",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.migration_tokens = Counter("duet_migration_tokens", "Positions whose KV migrations moved (the rest "
                                        "was in the targets' prefix caches)", registry=r)

    def observe_speculation(self, drafted: int, accepted: int) -> None:
        """One verified draft (common/engine/speculative.py)."""
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted_tokens.inc(accepted)
        self.spec_acceptance_length.observe(accepted)

