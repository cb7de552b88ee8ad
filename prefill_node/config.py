"""Prefill node settings and their command-line flags."""
from __future__ import annotations

from dataclasses import dataclass

from common.serving.daemon_config import DaemonConfig, daemon_parser, parse_config


@dataclass(frozen=True)
class PrefillNodeConfig(DaemonConfig):
    port: int = 50061
    max_batch_tokens: int = 2048
    nice: int = 10  # yield the cores to a decode node on the same host (common/serving/placement.py)
    transfer_timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transfer_timeout_seconds <= 0:
            raise ValueError("--transfer-timeout-seconds must be > 0")


def parse_args(argv: list[str] | None = None) -> PrefillNodeConfig:
    d = PrefillNodeConfig()
    p = daemon_parser("python -m prefill_node", "duet prefill node: computes prompts' KV and writes it into "
                      "decode nodes' reserved pages; serves duet.v1.PrefillNode over gRPC.", d)
    p.add_argument("--transfer-timeout-seconds", type=float, default=d.transfer_timeout_seconds,
                   help="the longest one RemoteSend (prefill plus transfer) may take; keep it at most the "
                   "decode nodes' --lease-seconds (default %(default)s)")
    return parse_config(p, PrefillNodeConfig, argv)
