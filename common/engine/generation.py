"""One request's generation as the scheduler runs it: its samples (`Sample`, one generating
sequence each), what they share (`Group`), and the stream of chunks it produces (`Chunk`,
`RequestHandle`); and a generation in progress as another node continues it (`Continuation`).
"""
from __future__ import annotations

import enum
import queue
import time
from dataclasses import dataclass, field

import torch

from common.engine.core import Sequence
from common.engine.sampling import PositionLogprobs, PromptLogprobs, Sampler, SamplingParams
from common.engine.speculative import DraftState
from common.errors import ErrorCode
from common.model.detokenizer import IncrementalDetokenizer


class FinishReason(enum.StrEnum):
    """Why a sample's stream ended; the strings are the wire's (`GenerationChunk.finish_reason`)."""

    STOP = "stop"  # end of sequence, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the model's context
    ABORT = "abort"  # Abort, a cancelled client, a superseded or drained instance
    ERROR = "error"  # failed: `Chunk.error_code` says how


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of parallel sample `index` (0 unless n > 1). The last chunk of each
    sample has `finish_reason` set (a `FinishReason`); the request's final
    chunk, sent when its last sample finishes, also carries `usage` for all of them."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # With finish_reason ERROR: the status (RESOURCE_EXHAUSTED, INTERNAL, ...) and why.
    error_code: ErrorCode | None = None
    error: str | None = None
    index: int = 0
    logprobs: tuple[PositionLogprobs, ...] = ()  # one per token, when the request asked for them
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()  # in the request's first chunk, when asked
    stop_string: str | None = None  # with finish_reason STOP: the stop string that ended the sample, if one did

    @property
    def final(self) -> bool:
        """Whether this is the stream's last chunk."""
        return self.usage is not None

    def followed_by(self, later: Chunk) -> Chunk:
        """This unfinished chunk and the same sample's next chunk as one."""
        return Chunk(self.token_ids + later.token_ids, self.text + later.text, later.finish_reason, later.usage,
                     later.error_code, later.error, self.index, self.logprobs + later.logprobs,
                     self.prompt_logprobs + later.prompt_logprobs, later.stop_string)


@dataclass(eq=False)
class Group:
    """What the n samples of one request share."""

    request_id: str
    params: SamplingParams
    prompt_len: int
    cached_tokens: int
    outputs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    unforked: bool = False  # samples 1..n-1 are still to fork from sample 0
    running: int = 1  # samples not finished
    completion_tokens: int = 0  # of the finished samples
    prompt_logprobs: PromptLogprobs | None = None  # gathered while the prompt is computed, then sent once
    last_sent: float | None = None  # time.perf_counter() of the last chunk sent

    def send(self, chunk: Chunk) -> None:
        self.last_sent = time.perf_counter()
        self.outputs.put(chunk)

    @property
    def scoring_prompt(self) -> bool:
        """Whether the prompt is still being computed with logits at every position."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs.done

    def take_prompt_logprobs(self) -> tuple[PositionLogprobs, ...]:
        """The prompt's logprobs for the first chunk sent (nothing for later ones)."""
        scored, self.prompt_logprobs = self.prompt_logprobs, None
        return tuple(scored.entries) if scored is not None and scored.done else ()


@dataclass(eq=False)  # compared by identity: two samples may hold equal fields
class Sample:
    """One generating sequence: a request, or one of its parallel samples."""

    group: Group
    index: int
    seq: Sequence
    params: SamplingParams
    sampler: Sampler
    detok: IncrementalDetokenizer
    num_generated: int = 0
    spec: DraftState = field(default_factory=DraftState)

    @property
    def request_id(self) -> str:
        return self.group.request_id

    @property
    def decoding(self) -> bool:
        """Whether it draws its next token in the next step: its prompt is computed and sampled
        (its siblings forked, its prompt scored), and it was not preempted."""
        group = self.group
        return self.seq.num_pending == 1 and bool(self.seq.pages) and not group.unforked and not group.scoring_prompt

    def catch_up(self, tokens: list[int], vocab_size: int, device: torch.device,
                 random_state: torch.Tensor | None = None) -> None:
        """Stand as if this sample had drawn `tokens` itself (they were drawn on another node; its
        sequence holds them already): they pass the detokenizer and stop strings (their text was
        sent there), the grammar, and the random stream (set to `random_state` when given)."""
        for token in tokens:
            self.detok.push(token)
        self.sampler.replay(tokens, vocab_size, device, random_state)
        self.num_generated += len(tokens)

    def state(self) -> SampleState:
        """Where this sample stands, for a node that continues it."""
        generated = tuple(self.seq.token_ids[len(self.seq.token_ids) - self.num_generated:])
        return SampleState(self.index, generated, self.sampler.seed, self.sampler.random_state())


class RequestHandle:
    """One instance of a request, as its caller holds it: its stream of chunks, and what the
    scheduler's `abort` and `detach` name. A request id may be taken again once its instance
    ended (a continuation supersedes a lost one); a handle names only its own."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._held: Chunk | None = None  # taken from the queue but not mergeable into the last one

    def next_chunk(self, timeout: float | None = None) -> Chunk | None:
        """The next chunk, or None if none arrived within `timeout` seconds. The same sample's
        chunks already waiting come merged into one: a speculative step emits several tokens at
        once, and a reader that fell behind catches up in one message instead of one per token.
        An error chunk is never merged, so the tokens before it are delivered first."""
        chunk, self._held = self._held, None
        if chunk is None:
            try:
                chunk = self.group.outputs.get(timeout=timeout)
            except queue.Empty:
                return None
        while chunk.finish_reason is None:
            try:
                later = self.group.outputs.get_nowait()
            except queue.Empty:
                break
            if later.index != chunk.index or later.finish_reason is FinishReason.ERROR:
                self._held = later
                break
            chunk = chunk.followed_by(later)
        return chunk

    @property
    def request_id(self) -> str:
        return self.group.request_id


@dataclass(frozen=True)
class SampleState:
    """Where one sample of a generation in progress stands."""

    index: int
    generated: tuple[int, ...]  # its output so far
    seed: int | None = None  # of its random stream; None: the request's seed + index, if it has one
    random_state: torch.Tensor | None = None  # the stream's state; None: replayed from the seed


@dataclass(frozen=True)
class Continuation:
    """A generation in progress, for the node that continues it (duet.v1 `Continuation`)."""

    samples: tuple[SampleState, ...]  # the unfinished ones
    cached_tokens: int = 0  # usage: prompt tokens the first node had cached
    finished_completion_tokens: int = 0  # usage: tokens of the samples that finished before
