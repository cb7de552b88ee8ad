"""Decode node settings and their command-line flags."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common.cli_config import parse_with_config_file
from common.transports import TRANSPORTS


@dataclass(frozen=True)
class DecodeNodeConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int | None = None
    model: Path | None = None  # None = the embedded SmolLM2-135M-Instruct
    page_size: int = 16
    kv_pages: int = 1024  # 16k tokens at the default page size
    lease_seconds: float = 30.0
    max_batch_tokens: int = 512
    # Fraction of the pool PrepareReceive leaves free for running decodes to grow into.
    admission_watermark: float = 0.05
    log_level: str = "info"
    transport: str = "nixl"
    prefill: tuple[str, ...] = ()  # prefill node addresses Generate hands prompts to
    min_remote_prefill_tokens: int = 32
    pd_balance: float = 0.0  # fraction of each prompt's tail the decode node prefills itself
    advertise_address: str = ""  # how prefill nodes reach this node; default host:port

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.kv_pages < 1:
            raise ValueError("--page-size and --kv-pages must be >= 1")
        if self.lease_seconds <= 0:
            raise ValueError("--lease-seconds must be > 0")
        if not 0 <= self.admission_watermark < 1:
            raise ValueError("--admission-watermark must be in [0, 1)")
        if not 0 <= self.pd_balance < 1:
            raise ValueError("--pd-balance must be in [0, 1)")


def parse_args(argv: list[str] | None = None) -> DecodeNodeConfig:
    d = DecodeNodeConfig()
    p = argparse.ArgumentParser(
        prog="python -m decode_node",
        description="duet decode node: paged KV pool, prefix cache, continuous-batching decode; "
        "serves duet.v1.DecodeNode over gRPC.",
    )
    p.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="gRPC port, 0 = any free port (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--model", type=Path, default=None, help="a .gguf file or Hugging Face directory "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page (default %(default)s)")
    p.add_argument("--kv-pages", type=int, default=d.kv_pages, help="pages in the KV pool (default %(default)s)")
    p.add_argument("--lease-seconds", type=float, default=d.lease_seconds,
                   help="how long a PrepareReceive reservation lives unclaimed (default %(default)s)")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help="token budget of one engine step; longer prefills are chunked (default %(default)s)")
    p.add_argument("--admission-watermark", type=float, default=d.admission_watermark,
                   help="fraction of pages PrepareReceive keeps free for running decodes (default %(default)s)")
    p.add_argument("--transport", default=d.transport, choices=TRANSPORTS,
                   help="how KV arrives from prefill nodes: NIXL's UCX backend or plain TCP (default %(default)s)")
    p.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                   help="a prefill node for Generate to hand prompts to (repeatable); none = single-node mode")
    p.add_argument("--min-remote-prefill-tokens", type=int, default=d.min_remote_prefill_tokens,
                   help="prefill locally when fewer uncached prompt tokens than this (default %(default)s)")
    p.add_argument("--pd-balance", type=float, default=d.pd_balance, metavar="F",
                   help="prefill the last fraction F of each prompt here instead of on the prefill node "
                   "(default %(default)s)")
    p.add_argument("--advertise-address", default="", metavar="HOST:PORT",
                   help="address prefill nodes use to reach this node (default: --host:--port)")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    a = parse_with_config_file(p, argv)
    try:
        return DecodeNodeConfig(
            host=a.host, port=a.port, metrics_port=a.metrics_port, model=a.model, page_size=a.page_size,
            kv_pages=a.kv_pages, lease_seconds=a.lease_seconds, max_batch_tokens=a.max_batch_tokens,
            admission_watermark=a.admission_watermark, log_level=a.log_level, transport=a.transport,
            prefill=tuple(a.prefill), min_remote_prefill_tokens=a.min_remote_prefill_tokens, pd_balance=a.pd_balance,
            advertise_address=a.advertise_address,
        )
    except ValueError as exc:
        p.error(str(exc))
