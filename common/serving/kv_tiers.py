"""A node's KV beyond its pool, as its request paths use it: the disk tier of `--kv-offload-dir`
(common/kv/disk_tier.py, kept by common/engine/kv_offload.py), read back before a prompt is
matched, traced, and counted by where each prompt token's KV came from.

Metrics (in the node's registry):
- `duet_prompt_tokens{source}`: prompt tokens by source: `pool` (the prefix cache held them),
  `disk` (read back from the tier for this request), `peer` (written by another decode node that
  held them, decode_node/prefix_fetch.py), `computed` (prefilled, here or, on a decode node, by
  the prefill node it handed the prompt to);
- `duet_prefix_cache_hit_tokens`: pool and disk together (what the prefix cache served);
- with a tier: `duet_kv_tier_blocks`, `duet_kv_tier_bytes` and `duet_kv_tier_capacity_bytes`
  (gauges), `duet_kv_tier_pages{direction}` and `duet_kv_tier_transferred_bytes{direction}`
  (written, read), `duet_kv_tier_read_seconds` (the time each read-back took, sum and count),
  `duet_kv_tier_write_skipped` (evicted while the writer was far behind), `duet_kv_tier_write_errors` (the disk
  refused), `duet_kv_tier_bad_files{reason}` (torn, checksum, fingerprint: found bad, deleted,
  recomputed). Every series is labelled `tier="disk"`.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from common.engine.core import Engine
from common.engine.kv_offload import KvOffload, ReadBack
from common.kv.disk_tier import CHECKSUM, FOREIGN, TORN, DiskTier
from common.serving.daemon_config import DaemonConfig
from common.serving.fingerprint import fingerprint_key
from common.tracing import Tracer

GIB = 1 << 30


class KvTiers:
    def __init__(self, config: DaemonConfig, engine: Engine, tracer: Tracer, registry: CollectorRegistry) -> None:
        self.engine = engine
        self.tracer = tracer
        self.offload: KvOffload | None = None
        if config.kv_offload_dir is not None:
            pool = engine.pool
            page_bytes = pool.num_layers * 2 * pool.page_size * pool.slot_bytes()
            tier = DiskTier(config.kv_offload_dir, int(config.kv_offload_gib * GIB),
                            fingerprint_key(engine.model, pool), page_bytes, engine.kv_events)
            self.offload = KvOffload(engine, tier)
            registry.register(_TierCollector(self.offload))
        self.prompt_tokens = Counter("duet_prompt_tokens", "Prompt tokens by where their KV came from: pool (the "
                                     "prefix cache), disk (read back from --kv-offload-dir), peer (another decode node "
                                     "that held them), computed (prefilled)",
                                     ["source"], registry=registry)
        self.prefix_hit_tokens = Counter("duet_prefix_cache_hit_tokens", "Prompt tokens served from the prefix "
                                         "cache (pool or disk)", registry=registry)

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()

    def read_back(self, request_id: str, token_ids: Sequence[int], deadline: float | None = None) -> ReadBack:
        """Bring what the tier holds of the prompt `token_ids` (the part whose KV may be reused)
        into the prefix cache, waiting for room until the request's `deadline` (monotonic) at
        most; call before matching, without the engine lock."""
        if self.offload is None:
            return ReadBack()
        got = self.offload.read_back(token_ids, deadline)
        if got.tokens:
            self.tracer.event(request_id, "kv_read_back", tier="disk", tokens=got.tokens, bytes=got.bytes,
                              seconds=round(got.seconds, 6))
        return got

    def served(self, prompt_tokens: int, matched: int, from_disk: int, rest: str = "computed") -> None:
        """A prompt of `prompt_tokens` whose first `matched` came from the prefix cache, `from_disk`
        of them read back for it; the rest came from `rest` (computed, or a peer)."""
        disk = min(from_disk, matched)
        self.prompt_tokens.labels("pool").inc(matched - disk)
        self.prompt_tokens.labels("disk").inc(disk)
        self.prompt_tokens.labels(rest).inc(prompt_tokens - matched)
        self.prefix_hit_tokens.inc(matched)


class _TierCollector:
    """The disk tier's running totals as Prometheus series, read at scrape time."""

    def __init__(self, offload: KvOffload) -> None:
        self._offload = offload

    def collect(self) -> Iterator[Metric]:
        tier: DiskTier = self._offload.tier
        stats = self._offload.stats
        gauges = (("duet_kv_tier_blocks", "Pages the tier holds", tier.num_blocks),
                  ("duet_kv_tier_bytes", "Bytes of the tier's files", tier.bytes_used),
                  ("duet_kv_tier_capacity_bytes", "--kv-offload-gib, in bytes", tier.capacity_bytes))
        for name, doc, value in gauges:
            yield _labelled(GaugeMetricFamily(name, doc, labels=["tier"]), value)
        pages = CounterMetricFamily("duet_kv_tier_pages", "Pages written to and read back from the tier",
                                    labels=["tier", "direction"])
        pages.add_metric(["disk", "written"], stats.pages_written)
        pages.add_metric(["disk", "read"], stats.pages_read)
        moved = CounterMetricFamily("duet_kv_tier_transferred_bytes", "Bytes written to and read back from the tier",
                                    labels=["tier", "direction"])
        moved.add_metric(["disk", "written"], stats.bytes_written)
        moved.add_metric(["disk", "read"], stats.bytes_read)
        bad = CounterMetricFamily("duet_kv_tier_bad_files", "Tier files found bad (torn, checksum, fingerprint), "
                                  "deleted and recomputed instead", labels=["tier", "reason"])
        for reason in (TORN, CHECKSUM, FOREIGN):
            bad.add_metric(["disk", reason], tier.errors[reason])
        reads = SummaryMetricFamily("duet_kv_tier_read_seconds", "Time to read a prompt's pages back from the "
                                    "tier into the pool", labels=["tier"])
        reads.add_metric(["disk"], count_value=stats.read_backs, sum_value=stats.read_seconds)
        yield from (pages, moved, bad, reads)
        yield _labelled(CounterMetricFamily("duet_kv_tier_write_skipped", "Pages not written: evicted while "
                                            "the writer was far behind", labels=["tier"]), stats.writes_skipped)
        yield _labelled(CounterMetricFamily("duet_kv_tier_write_errors", "Pages the disk refused to take",
                                            labels=["tier"]), stats.write_errors)


def _labelled(family: GaugeMetricFamily | CounterMetricFamily, value: float) -> Metric:
    family.add_metric(["disk"], value)
    return family
