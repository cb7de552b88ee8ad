"""The benchmark's settings, shared by the CLI and in-process callers."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.conversations import Conversation, sharegpt_conversations, synthetic_conversations
from loadgen.datasets import (
    SYNTHETIC_DATASETS,
    SampleRequest,
    as_chat,
    file_dataset,
    random_dataset,
    shared_prefix_dataset,
)

SLO_METRICS = ("ttft", "tpot", "e2el")
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OPENAI_ENDPOINTS = (COMPLETIONS, CHAT)
HTTP_SCHEMES = ("http://", "https://")


def is_http_target(target: str) -> bool:
    """http(s)://HOST:PORT is an OpenAI-compatible server; HOST:PORT is duet's gRPC."""
    return target.startswith(HTTP_SCHEMES)


@dataclass(frozen=True)
class BenchmarkConfig:
    target: str  # host:port serving duet.v1.DecodeNode/Generate, or http(s)://host:port (OpenAI API)
    # gRPC targets a request moves to, in order, when the one serving it becomes UNAVAILABLE
    # (`--targets A,B`): it goes on there with the tokens it has received (a Continuation).
    fallbacks: tuple[str, ...] = ()
    num_requests: int = 64
    request_rate: float = math.inf  # requests per second; inf = all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 = Poisson
    max_concurrency: int | None = None  # None = unlimited
    dataset: str = "random"  # "random", "shared-prefix" or a file path
    input_len: int = 128  # prompt length (random) or per-request suffix length (shared-prefix)
    output_len: int = 32
    range_ratio: float = 0.0
    num_prefix_groups: int = 4
    prefix_len: int = 256
    ignore_eos: bool | None = None  # None = True for synthetic datasets, False for files
    seed: int = 0
    timeout: float | None = 600.0  # seconds per request; None = no deadline
    goodput: dict[str, float] = field(default_factory=dict)  # SLO metric -> milliseconds
    label: str = ""  # the run's name in tables, JSON and plots; "" = the target
    endpoint: str | None = None  # /v1/completions (None) or /v1/chat/completions: chat sends every prompt as messages
    model: str | None = None  # OpenAI targets: None = the first id /v1/models lists
    tokenizer: str | None = None  # decodes token-id prompts for the chat endpoint; None = the embedded model
    num_users: int = 8  # conversations: users, each sending `turns` turns one after another
    turns: int = 3
    multi_turn: bool = False  # a ShareGPT file replayed as conversations instead of first turns
    think_time: float = 0.0  # conversations: mean seconds (exponential) from an answer to the user's next turn

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0 (or inf)")
        if not 0 < self.burstiness < math.inf:
            raise ValueError("--burstiness must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if self.input_len < 1 or self.output_len < 1 or self.prefix_len < 1 or self.num_prefix_groups < 1:
            raise ValueError("--input-len, --output-len, --prefix-len and --num-prefix-groups must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("--range-ratio must be in [0, 1)")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError("--timeout must be > 0")
        if self.fallbacks and any(is_http_target(t) for t in (self.target, *self.fallbacks)):
            raise ValueError("--targets are duet gRPC HOST:PORT (a request continues on the next with a Continuation)")
        unknown = set(self.goodput) - set(SLO_METRICS)
        if unknown:
            raise ValueError(f"--goodput: unknown metric(s) {sorted(unknown)}; use {', '.join(SLO_METRICS)}")
        if self.endpoint is not None and self.endpoint not in OPENAI_ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(OPENAI_ENDPOINTS)}, got {self.endpoint!r}")
        if self.dataset not in SYNTHETIC_DATASETS and not Path(self.dataset).is_file():
            raise ValueError(f"--dataset: {self.dataset!r} is neither {' nor '.join(SYNTHETIC_DATASETS)} nor a file")
        if self.num_users < 1 or self.turns < 1:
            raise ValueError("--num-users and --turns must be >= 1")
        if not 0 <= self.think_time < math.inf:
            raise ValueError("--think-time must be >= 0 seconds")
        if self.multi_turn and self.dataset in SYNTHETIC_DATASETS:
            raise ValueError("--multi-turn replays a ShareGPT file: give --dataset PATH")
        if self.is_conversational and self.endpoint == COMPLETIONS:
            raise ValueError(f"conversations are chats: use --endpoint {CHAT} (the default for them)")

    @property
    def name(self) -> str:
        return self.label or self.target

    @property
    def is_http(self) -> bool:
        return is_http_target(self.target)

    @property
    def is_conversational(self) -> bool:
        """Multi-turn: requests are built as answers come back (conversations())."""
        return self.dataset in ("conversations", "agentic") or self.multi_turn

    @property
    def openai_endpoint(self) -> str:
        return self.endpoint or (CHAT if self.is_conversational else COMPLETIONS)

    @property
    def tokenizer_path(self) -> Path:
        if self.tokenizer:
            return Path(self.tokenizer)
        from common.model.default_model import default_model_path

        return default_model_path()

    @property
    def effective_ignore_eos(self) -> bool:
        return self.dataset in SYNTHETIC_DATASETS if self.ignore_eos is None else self.ignore_eos

    def samples(self) -> list[SampleRequest]:
        """The workload, a pure function of the settings (so --compare replays the same one). For
        the chat endpoint every prompt is a conversation, whichever protocol carries it."""
        samples = self._dataset()
        return as_chat(samples, self.tokenizer_path) if self.endpoint == CHAT else samples

    def conversations(self) -> list[Conversation]:
        """The multi-turn workload: --prefix-len tokens of system prompt (shared, or each user's own
        for agentic) and --input-len tokens per question (synthetic), or a ShareGPT file's conversations."""
        if self.dataset in ("conversations", "agentic"):
            return synthetic_conversations(self.num_users, self.turns, self.prefix_len, self.input_len,
                                           self.output_len, self.range_ratio, self.seed, self.tokenizer_path,
                                           own_system=self.dataset == "agentic")
        return sharegpt_conversations(Path(self.dataset), self.num_users, self.turns, self.output_len, self.seed)

    def _dataset(self) -> list[SampleRequest]:
        if self.dataset == "random":
            return random_dataset(self.num_requests, self.input_len, self.output_len, self.range_ratio, self.seed)
        if self.dataset == "shared-prefix":
            return shared_prefix_dataset(self.num_requests, self.num_prefix_groups, self.prefix_len,
                                         self.input_len, self.output_len, self.range_ratio, self.seed)
        return file_dataset(Path(self.dataset), self.num_requests, self.output_len, self.seed)
