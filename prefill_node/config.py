"""Prefill node settings and their command-line flags."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common.cli_config import parse_with_config_file
from common.transports import TRANSPORTS


@dataclass(frozen=True)
class PrefillNodeConfig:
    host: str = "127.0.0.1"
    port: int = 50061
    metrics_port: int | None = None
    model: Path | None = None
    transport: str = "nixl"
    page_size: int = 16  # must match the decode nodes' (checked in the handshake)
    kv_pages: int = 1024
    max_batch_tokens: int = 2048
    transfer_timeout_seconds: float = 30.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.kv_pages < 1 or self.max_batch_tokens < 1:
            raise ValueError("--page-size, --kv-pages and --max-batch-tokens must be >= 1")
        if self.transfer_timeout_seconds <= 0:
            raise ValueError("--transfer-timeout-seconds must be > 0")


def parse_args(argv: list[str] | None = None) -> PrefillNodeConfig:
    d = PrefillNodeConfig()
    p = argparse.ArgumentParser(
        prog="python -m prefill_node",
        description="duet prefill node: computes prompts' KV and writes it into decode nodes' reserved "
        "pages; serves duet.v1.PrefillNode over gRPC.",
    )
    p.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="gRPC port, 0 = any free port (default %(default)s)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--model", type=Path, default=None, help="a .gguf file or Hugging Face directory "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--transport", default=d.transport, choices=TRANSPORTS,
                   help="how KV is pushed to decode nodes (default %(default)s)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page (default %(default)s)")
    p.add_argument("--kv-pages", type=int, default=d.kv_pages,
                   help="pages of this node's own KV pool and prefix cache (default %(default)s)")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help="token budget of one prefill step; prompts are chunked and batched (default %(default)s)")
    p.add_argument("--transfer-timeout-seconds", type=float, default=d.transfer_timeout_seconds,
                   help="give up on a KV transfer after this long (default %(default)s)")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    a = parse_with_config_file(p, argv)
    try:
        return PrefillNodeConfig(
            host=a.host, port=a.port, metrics_port=a.metrics_port, model=a.model, transport=a.transport,
            page_size=a.page_size, kv_pages=a.kv_pages, max_batch_tokens=a.max_batch_tokens,
            transfer_timeout_seconds=a.transfer_timeout_seconds, log_level=a.log_level,
        )
    except ValueError as exc:
        p.error(str(exc))
