"""Decode node settings and their command-line flags."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.speculative import METHODS, SpeculativeConfig
from common.openai_http import add_openai_args
from common.openai_http.messages_api import BILLING_HEADER_CHOICES
from common.peers.routing import DEFAULT_LOAD_WEIGHT, RoutingPolicy, add_routing_args
from common.serving.daemon_config import DaemonConfig, daemon_parser, parse_config

ADMISSION_MODES = ("reject", "queue")
ON_OFF = ("on", "off")


@dataclass(frozen=True)
class DecodeNodeConfig(DaemonConfig):
    lease_seconds: float = 30.0
    # How long pages a one-sided (NIXL) writer was cleared to write stay out of circulation when
    # it never reports back; must exceed the prefill nodes' --transfer-timeout-seconds.
    quarantine_seconds: float = 60.0
    verify_kv: str = "on"  # check received KV against the writer's checksums (common/transports/checksum.py)
    # Requests held at once: admitted plus waiting for admission; more are refused with RESOURCE_EXHAUSTED.
    max_requests: int = 256
    # Fraction of the pool PrepareReceive leaves free for running decodes to grow into.
    admission_watermark: float = 0.05
    admission: str = "reject"  # what a request that does not fit gets: "reject" (RESOURCE_EXHAUSTED) or "queue"
    max_queued_requests: int = 32  # queue mode: waiters; each holds a gRPC worker thread (64 in all)
    max_running_requests: int | None = None  # admitted (generating or reserved) at once; None = max_requests
    max_total_tokens: int | None = None  # admitted requests' prompt + generated tokens; None = no cap
    prefill: tuple[str, ...] = ()  # prefill node addresses Generate hands prompts to
    drain_to: tuple[str, ...] = ()  # decode nodes SIGTERM and Drain migrate running requests to (decode_node/drain.py)
    min_remote_prefill_tokens: int = 32
    routing: str = "prefix"  # how Generate picks a prefill node (common/peers/routing.py)
    load_weight: float = DEFAULT_LOAD_WEIGHT
    pd_balance: float = 0.0  # fraction of each prompt's tail the decode node prefills itself
    prefix_fetch: str = "on"  # fetch a prefix from the decode node a GenerateRequest names as its holder
    # Latency target of one engine step that carries prompt chunks next to decodes; 0 = none
    # (chunks fill --max-batch-tokens). common/engine/step_budget.py
    max_step_ms: float = 100.0
    openai_port: int | None = None  # serve the OpenAI-compatible HTTP API here (0 = any free port)
    api_server_count: int | None = None  # processes serving it; None = by the CPUs (common/openai_http)
    served_model_name: tuple[str, ...] = ()  # names the HTTP API answers to, the first reported; () = from --model
    api_key: tuple[str, ...] = field(default=(), repr=False)  # Bearer keys the HTTP API requires; () = none
    tool_call_parser: str = "hermes"  # how the HTTP API reads tool calls out of tool_choice "auto" answers
    anthropic_billing_header: str = "strip"  # Claude Code's per-request system line, dropped before templating
    speculative: str | None = None  # "ngram": prompt-lookup speculative decoding (common/engine/speculative.py)
    num_speculative_tokens: int = SpeculativeConfig.num_speculative_tokens
    ngram_min: int = SpeculativeConfig.ngram_min
    ngram_max: int = SpeculativeConfig.ngram_max

    @property
    def speculative_config(self) -> SpeculativeConfig:
        """Validated in __post_init__ (a bad flag is a usage error)."""
        return SpeculativeConfig(self.speculative, self.num_speculative_tokens, self.ngram_min, self.ngram_max)

    @property
    def routing_policy(self) -> RoutingPolicy:
        """Validated in __post_init__."""
        return RoutingPolicy(self.routing, self.load_weight)

    @property
    def running_cap(self) -> int:
        """How many requests may be admitted at once."""
        return self.max_requests if self.max_running_requests is None else self.max_running_requests

    @property
    def grpc_workers(self) -> int:
        """Every request held here (--max-requests) holds a gRPC thread while it streams; 64 more
        serve the other calls and answer the requests past the cap with RESOURCE_EXHAUSTED at
        once, rather than leave them waiting for a thread."""
        return self.max_requests + 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lease_seconds <= 0:
            raise ValueError("--lease-seconds must be > 0")
        if self.quarantine_seconds <= 0:
            raise ValueError("--quarantine-seconds must be > 0")
        if self.verify_kv not in ON_OFF:
            raise ValueError("--verify-kv must be on or off")
        if self.prefix_fetch not in ON_OFF:
            raise ValueError("--prefix-fetch must be on or off")
        if self.max_requests < 1:
            raise ValueError("--max-requests must be >= 1")
        if not 0 <= self.admission_watermark < 1:
            raise ValueError("--admission-watermark must be in [0, 1)")
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"--admission must be one of {', '.join(ADMISSION_MODES)}")
        if self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be >= 1")
        if self.max_running_requests is not None and not 1 <= self.max_running_requests <= self.max_requests:
            raise ValueError(f"--max-running-requests must be in [1, --max-requests ({self.max_requests})]: "
                             "--max-requests caps admitted plus waiting requests")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError("--max-total-tokens must be >= 1")
        if not 0 <= self.pd_balance < 1:
            raise ValueError("--pd-balance must be in [0, 1)")
        if self.max_step_ms < 0:
            raise ValueError("--max-step-ms must be >= 0")
        if self.openai_port is not None and not 0 <= self.openai_port < 65536:
            raise ValueError("--openai-port must be in [0, 65535]")
        if self.api_key and self.openai_port is None:
            raise ValueError("--api-key guards the HTTP API: give --openai-port too")
        if self.api_server_count is not None and not (type(self.api_server_count) is int and self.api_server_count >= 1):
            raise ValueError(f"--api-server-count must be an integer >= 1, got {self.api_server_count!r}")
        if self.anthropic_billing_header not in BILLING_HEADER_CHOICES:
            raise ValueError(f"--anthropic-billing-header must be one of {', '.join(BILLING_HEADER_CHOICES)}, "
                             f"got {self.anthropic_billing_header!r}")
        bad = next((a for a in self.drain_to if a.rpartition(":")[0] == "" or not a.rpartition(":")[2].isdigit()), None)
        if bad is not None:
            raise ValueError(f"--drain-to {bad!r} must be HOST:PORT")
        _ = self.speculative_config  # raises ValueError on a bad --speculative flag
        _ = self.routing_policy


def parse_args(argv: list[str] | None = None) -> DecodeNodeConfig:
    d = DecodeNodeConfig()
    p = daemon_parser("python -m decode_node", "duet decode node: paged KV pool, prefix cache, continuous-batching "
                      "decode; serves duet.v1.DecodeNode over gRPC.", d)
    p.add_argument("--lease-seconds", type=float, default=d.lease_seconds,
                   help="how long a PrepareReceive reservation lives unclaimed (default %(default)s)")
    p.add_argument("--quarantine-seconds", type=float, default=d.quarantine_seconds,
                   help="how long pages a NIXL writer was cleared to write stay unused after their reservation "
                   "ended, when the writer never reports back; keep it above the prefill nodes' "
                   "--transfer-timeout-seconds (default %(default)s)")
    p.add_argument("--verify-kv", choices=ON_OFF, default=d.verify_kv,
                   help="check the KV a writer pushed against its checksums (xxh3-64 per layer, K and V) before "
                   "the request may generate; a mismatch discards it (DATA_LOSS to the writer, which retries or "
                   "falls back to local prefill); the check costs little beside a hand-off's TTFT "
                   "(docs/bench/README.md) (default %(default)s)")
    p.add_argument("--max-requests", type=int, default=d.max_requests,
                   help="requests held at once: admitted (generating, queued in the scheduler or holding a "
                   "reservation) plus, with --admission queue, waiting for admission; beyond it new ones get "
                   "RESOURCE_EXHAUSTED at once (default %(default)s)")
    p.add_argument("--admission-watermark", type=float, default=d.admission_watermark,
                   help="fraction of pages admission keeps free for running decodes (default %(default)s)")
    p.add_argument("--admission", default=d.admission, choices=ADMISSION_MODES,
                   help="a request that does not fit now (pages, --max-running-requests, --max-total-tokens): "
                   "'reject' answers RESOURCE_EXHAUSTED at once; 'queue' makes PrepareReceive and Generate wait, "
                   "first come first served, until it fits or the call's deadline passes (default %(default)s)")
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="--admission queue: requests that may wait; beyond it RESOURCE_EXHAUSTED at once. Each "
                   "waiter holds one of the 64 gRPC worker threads (default %(default)s)")
    p.add_argument("--max-running-requests", type=int, default=None, metavar="N",
                   help="requests admitted at once (generating, queued in the scheduler or holding a "
                   "reservation); more wait or are refused per --admission. At most --max-requests, which "
                   "also counts waiters (default: --max-requests)")
    p.add_argument("--max-total-tokens", type=int, default=None, metavar="N",
                   help="cap on the tokens of admitted requests, each counted as its prompt plus the tokens "
                   "generated so far; a prompt that would pass it waits or is refused per --admission. "
                   "Admission sizes a request by its prompt: the n parallel samples of one grow past that once "
                   "running (default: no cap but the KV pool)")
    p.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                   help="a prefill node for Generate to hand prompts to (repeatable); none = single-node mode")
    p.add_argument("--drain-to", action="append", default=[], metavar="HOST:PORT",
                   help="a decode node to migrate running requests to on SIGTERM or the Drain RPC, the least "
                   "loaded first, relaying their streams until they end (repeatable); none = SIGTERM lets them "
                   "finish here within --drain-seconds")
    p.add_argument("--min-remote-prefill-tokens", type=int, default=d.min_remote_prefill_tokens,
                   help="prefill locally when fewer uncached prompt tokens than this (default %(default)s)")
    add_routing_args(p, "the prefill node Generate hands a prompt to")
    p.add_argument("--pd-balance", type=float, default=d.pd_balance, metavar="F",
                   help="prefill the last fraction F of each prompt here instead of on the prefill node "
                   "(default %(default)s)")
    p.add_argument("--prefix-fetch", choices=ON_OFF, default=d.prefix_fetch,
                   help="when a GenerateRequest names another decode node holding more of its prompt (a router's "
                   "prefix_holder), have that node write it here (SendPrefix) instead of computing it; off = always "
                   "compute (default %(default)s)")
    p.add_argument("--max-step-ms", type=float, default=d.max_step_ms, metavar="MS",
                   help="while requests are decoding, prefill only as many prompt tokens per engine step as "
                   "fit in MS milliseconds by the measured step cost (at least 32), so running streams keep "
                   "their inter-token latency; 0 = fill --max-batch-tokens (default %(default)s)")
    p.add_argument("--speculative", choices=METHODS, default=None,
                   help="speculative decoding: 'ngram' drafts each decoding sequence's next tokens from the longest "
                   "earlier match of its own suffix (prompt lookup) and verifies them in the step's forward; "
                   "output is unchanged (default: off)")
    p.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens, metavar="K",
                   help="--speculative: draft tokens per step, and the most a request's num_speculative_tokens "
                   "may ask for (default %(default)s)")
    p.add_argument("--ngram-min", type=int, default=d.ngram_min, metavar="N",
                   help="--speculative ngram: shortest suffix looked up (default %(default)s)")
    p.add_argument("--ngram-max", type=int, default=d.ngram_max, metavar="N",
                   help="--speculative ngram: longest suffix looked up (default %(default)s)")
    add_openai_args(p)
    return parse_config(p, DecodeNodeConfig, argv)
