"""What one benchmark request measured, whichever protocol carried it."""
from __future__ import annotations

from dataclasses import dataclass, field

OK = "OK"


@dataclass
class RequestResult:
    """Times are seconds since the start of the run (time.perf_counter based)."""

    index: int
    request_id: str  # sent with the request (gRPC), so its traces on every node can be fetched
    arrival: float  # when it was due to be sent
    start: float  # when it was sent (later than arrival while --max-concurrency holds it back)
    end: float
    first_token: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between successive token-carrying chunks
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cacheable_tokens: int | None = None  # what a prefix cache could have served (loadgen/cacheable.py); conversations
    finish_reason: str = ""
    status: str = OK  # "OK", a gRPC status name, an HTTP failure (HTTP_503, CONNECT_ERROR, ...)
    error: str = ""
    text: str = ""  # the generated text, so answers of two servers can be compared
    token_ids: list[int] = field(default_factory=list)  # the generated ids, where the protocol carries them (gRPC)
    retries: int = 0  # targets (--targets A,B) that became UNAVAILABLE before the one that ended the request

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (completion_tokens - 1); undefined for fewer than two tokens."""
        if self.first_token is None or self.completion_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.completion_tokens - 1)


class ChunkClock:
    """Timestamps the token-carrying chunks of one stream: first token and inter-token gaps."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.itl: list[float] = []

    def tick(self, now: float) -> None:
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
