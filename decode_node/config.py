"""Decode node settings and their command-line flags."""
from __future__ import annotations

from dataclasses import dataclass

from common.daemon_config import DaemonConfig, daemon_parser, parse_config


@dataclass(frozen=True)
class DecodeNodeConfig(DaemonConfig):
    lease_seconds: float = 30.0
    max_requests: int = 256  # generating or waiting to; more are refused with RESOURCE_EXHAUSTED
    # Fraction of the pool PrepareReceive leaves free for running decodes to grow into.
    admission_watermark: float = 0.05
    prefill: tuple[str, ...] = ()  # prefill node addresses Generate hands prompts to
    min_remote_prefill_tokens: int = 32
    pd_balance: float = 0.0  # fraction of each prompt's tail the decode node prefills itself

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lease_seconds <= 0:
            raise ValueError("--lease-seconds must be > 0")
        if self.max_requests < 1:
            raise ValueError("--max-requests must be >= 1")
        if not 0 <= self.admission_watermark < 1:
            raise ValueError("--admission-watermark must be in [0, 1)")
        if not 0 <= self.pd_balance < 1:
            raise ValueError("--pd-balance must be in [0, 1)")


def parse_args(argv: list[str] | None = None) -> DecodeNodeConfig:
    d = DecodeNodeConfig()
    p = daemon_parser("python -m decode_node", "duet decode node: paged KV pool, prefix cache, continuous-batching "
                      "decode; serves duet.v1.DecodeNode over gRPC.", d)
    p.add_argument("--lease-seconds", type=float, default=d.lease_seconds,
                   help="how long a PrepareReceive reservation lives unclaimed (default %(default)s)")
    p.add_argument("--max-requests", type=int, default=d.max_requests,
                   help="requests generating or queued to; beyond it new ones get RESOURCE_EXHAUSTED at once "
                   "(default %(default)s)")
    p.add_argument("--admission-watermark", type=float, default=d.admission_watermark,
                   help="fraction of pages PrepareReceive keeps free for running decodes (default %(default)s)")
    p.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                   help="a prefill node for Generate to hand prompts to (repeatable); none = single-node mode")
    p.add_argument("--min-remote-prefill-tokens", type=int, default=d.min_remote_prefill_tokens,
                   help="prefill locally when fewer uncached prompt tokens than this (default %(default)s)")
    p.add_argument("--pd-balance", type=float, default=d.pd_balance, metavar="F",
                   help="prefill the last fraction F of each prompt here instead of on the prefill node "
                   "(default %(default)s)")
    return parse_config(p, DecodeNodeConfig, argv)
