"""The HTTP API's requests by endpoint, counted in the daemon's own Prometheus registry.

API servers are processes of their own and /metrics is the daemon's registry, so an API server
names the endpoint a generation came in on as gRPC metadata of its `Generate` call
(`endpoint_metadata`), and the daemon's servicer counts it (`EndpointCounter.count`):
`duet_http_requests_total{endpoint="/v1/messages"}`.
"""
from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter

ENDPOINT_KEY = "x-duet-http-endpoint"
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


def endpoint_metadata(endpoint: str) -> tuple[tuple[str, str], ...]:
    return ((ENDPOINT_KEY, endpoint),)


class EndpointCounter:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("duet_http_requests", "Generations asked for over the HTTP API, by endpoint",
                                ["endpoint"], registry=registry)
        for endpoint in GENERATION_ENDPOINTS:
            self.requests.labels(endpoint)  # every series exists from the start, at 0

    def count(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        """One request, when its call's metadata names an endpoint (a gRPC client's names none)."""
        endpoint = dict(metadata).get(ENDPOINT_KEY)
        if endpoint in GENERATION_ENDPOINTS:
            self.requests.labels(endpoint).inc()
