"""KV pool and prefix cache metrics every node exports, and the load it reports (GetLoad)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from common.engine.core import Engine
from common.node_messages import NodeLoad


def read_locked(engine: Engine, read: Callable[[], float]) -> float:
    with engine.lock:
        return read()


def register_pool_gauges(registry: CollectorRegistry, engine: Engine, compute_threads: Callable[[], int]) -> None:
    """The pool's gauges, and `duet_compute_threads` from `compute_threads()`."""
    pool = engine.pool
    Gauge("duet_info", "What this node computes in: 1, labelled with the dtype and device of its weights and KV",
          ["dtype", "device"], registry=registry).labels(
        dtype=str(pool.dtype).removeprefix("torch."), device=pool.device.type).set(1)
    Gauge("duet_kv_pages_total", "Pages in the KV pool", registry=registry).set(engine.allocator.num_pages)
    Gauge("duet_kv_pages_free", "Pages on the free list", registry=registry).set_function(
        lambda: engine.allocator.num_free)
    sliding = engine.sliding
    Gauge("duet_kv_sliding_pages_total", "Pages of the pool's sliding group (a hybrid model's sliding layers, "
          "--kv-sliding-pages; 0 without one)", registry=registry).set(0 if sliding is None else sliding.num_pages)
    Gauge("duet_kv_sliding_pages_free", "Free pages of the sliding group", registry=registry).set_function(
        lambda: 0 if sliding is None else sliding.allocator.num_free)
    Gauge("duet_kv_sliding_pages_parked", "Sliding pages kept only for K/V a window moved past, taken back "
          "first when the group runs short", registry=registry).set_function(
        lambda: 0 if sliding is None else read_locked(engine, lambda: sliding.num_parked))
    Gauge("duet_kv_pages_cached", "Pages held by the prefix cache", registry=registry).set_function(
        lambda: read_locked(engine, lambda: engine.prefix_cache.num_cached_pages))
    Gauge("duet_prefix_cache_blocks", "Full pages the prefix cache holds (what WatchKvEvents reports)",
          registry=registry).set_function(lambda: engine.kv_events.num_blocks)
    Gauge("duet_compute_threads", "Threads the engine computes with now: its CPUs and CPU quota at most, fewer "
          "while neighbours hold some of those cores (common/engine/compute_threads.py)",
          registry=registry).set_function(compute_threads)


USAGE_REFRESH_S = 0.2  # the KV usage gauge is recounted (under the engine lock) at most this often


def register_gateway_gauges(registry: CollectorRegistry, engine: Engine, running: Callable[[], int],
                            waiting: Callable[[], int]) -> None:
    """What the Kubernetes inference gateway's endpoint picker scrapes from a pod, under the names it
    reads by default (vLLM's): requests `running()` and `waiting()` (for admission or for their KV),
    the share of the pool requests hold (0..1; pages only the prefix cache holds count as free, as
    vLLM counts its cached blocks), and the pool's shape."""
    pool, num_pages = engine.pool, engine.allocator.num_pages
    Gauge("vllm:num_requests_running", "Requests decoding (or prefilling) on this node",
          registry=registry).set_function(running)
    Gauge("vllm:num_requests_waiting", "Requests waiting for admission or for their KV",
          registry=registry).set_function(waiting)
    Gauge("vllm:kv_cache_usage_perc", "Share of the KV pool's pages held by requests, 0 to 1",
          registry=registry).set_function(_Throttled(lambda: read_locked(engine, lambda: 1 - (
              engine.allocator.num_free + engine.prefix_cache.pages_held_only_here()) / num_pages)))
    Gauge("vllm:cache_config_info", "The KV pool: 1, labelled with tokens per page and pages",
          ["block_size", "num_gpu_blocks"], registry=registry).labels(
        block_size=str(pool.page_size), num_gpu_blocks=str(num_pages)).set(1)


class _Throttled:
    """`read()`, computed again only when the last value is USAGE_REFRESH_S old (the picker
    scrapes every 50 ms; the count takes the engine lock)."""

    def __init__(self, read: Callable[[], float]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._value, self._at = 0.0, float("-inf")

    def __call__(self) -> float:
        with self._lock:
            if time.monotonic() - self._at >= USAGE_REFRESH_S:
                self._value, self._at = self._read(), time.monotonic()
            return self._value


def node_load(engine: Engine, **requests: int) -> NodeLoad:
    """GetLoad's answer: the pool's pages read under the engine lock, plus the node's own
    request counts (`running_requests`, `queued_requests`, ... as NodeLoad names them)."""
    with engine.lock:
        return NodeLoad(kv_pages_total=engine.allocator.num_pages, kv_pages_free=engine.allocator.num_free,
                        kv_pages_cached=engine.prefix_cache.num_cached_pages, **requests)
