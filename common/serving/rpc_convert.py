"""Conversions between duet.v1 protobuf messages and engine types (and `common.node_messages`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from common.engine.generation import Chunk, Continuation, FinishReason, SampleState, Usage
from common.engine.guided import GrammarCompiler, GuidedSpec
from common.engine.sampling import PositionLogprobs, SamplingParams, TokenLogprob
from common.errors import InvalidArgument
from protos.duet.v1 import duet_pb2 as pb

M = TypeVar("M")
D = TypeVar("D")


def to_proto(message: Any, proto_class: type[M]) -> M:
    """A `common.node_messages` dataclass as the protobuf message with the same fields."""
    return proto_class(**dataclasses.asdict(message))


def from_proto(msg: Any, dataclass: type[D]) -> D:
    """A protobuf message as the `common.node_messages` dataclass with the same fields (repeated
    fields as lists)."""
    def plain(value: Any) -> Any:
        return value if isinstance(value, (str, bytes, int, float)) else list(value)

    return dataclass(**{f.name: plain(getattr(msg, f.name)) for f in dataclasses.fields(dataclass)})


def sampling_from_proto(msg: pb.SamplingParams, vocab_size: int,
                        grammars: GrammarCompiler | None = None) -> SamplingParams:
    """`grammars` compiles `msg.guided`; without one a guided request is refused."""
    try:
        guided = None
        if msg.HasField("guided") and (spec := guided_from_proto(msg.guided)) is not None:
            if grammars is None:
                raise ValueError("guided decoding is not served by this endpoint")
            guided = grammars.compile(spec)
        params = SamplingParams(
            max_tokens=msg.max_tokens if msg.HasField("max_tokens") else SamplingParams.max_tokens,
            temperature=msg.temperature,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            top_k=msg.top_k,
            seed=msg.seed if msg.HasField("seed") else None,
            ignore_eos=msg.ignore_eos,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            n=msg.n if msg.HasField("n") else 1,
            logprobs=msg.logprobs,
            top_logprobs=msg.top_logprobs,
            prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
            guided=guided,
            num_speculative_tokens=msg.num_speculative_tokens if msg.HasField("num_speculative_tokens") else None,
        )
        params.validate(vocab_size)
    except ValueError as exc:
        raise InvalidArgument(f"sampling: {exc}") from None
    return params


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """The parameters as a client sends them (sampling_from_proto's inverse): a migration hands
    a running request's on to its target."""
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        seed=params.seed, ignore_eos=params.ignore_eos, stop=params.stop, stop_token_ids=params.stop_token_ids,
        n=params.n, logprobs=params.logprobs, top_logprobs=params.top_logprobs,
        prompt_logprobs=params.prompt_logprobs, num_speculative_tokens=params.num_speculative_tokens)
    if params.guided is not None:
        spec = params.guided.spec
        value = pb.GuidedDecoding.Choices(choices=spec.value) if spec.kind == "choice" else spec.value
        msg.guided.CopyFrom(pb.GuidedDecoding(**{spec.kind: value}))
    return msg


def guided_from_proto(msg: pb.GuidedDecoding) -> GuidedSpec | None:
    """None: the message asks for nothing."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    value = getattr(msg, kind)
    return GuidedSpec(kind, tuple(value.choices) if kind == "choice" else value)


def chunk_to_proto(request_id: str, chunk: Chunk, token_bytes: Callable[[int], bytes]) -> pb.GenerationChunk:
    """`token_bytes` gives a token's bytes for the logprob entries."""
    msg = pb.GenerationChunk(request_id=request_id, token_ids=chunk.token_ids, text=chunk.text,
                             finish_reason=chunk.finish_reason or "", index=chunk.index,
                             logprobs=_logprobs_to_proto(chunk.logprobs, token_bytes),
                             prompt_logprobs=_logprobs_to_proto(chunk.prompt_logprobs, token_bytes),
                             stop_string=chunk.stop_string or "")
    if chunk.usage is not None:
        u = chunk.usage
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                    cached_tokens=u.cached_tokens))
    return msg


def _logprobs_to_proto(positions: Iterable[PositionLogprobs],
                       token_bytes: Callable[[int], bytes]) -> list[pb.PositionLogprobs]:
    def entry(token_id: int, logprob: float | None) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=token_id, logprob=logprob, token_bytes=token_bytes(token_id))

    return [pb.PositionLogprobs(token=entry(p.token.token_id, p.token.logprob),
                                top=[entry(t.token_id, t.logprob) for t in p.top]) for p in positions]


def chunk_from_proto(msg: pb.GenerationChunk) -> Chunk:
    """A chunk another node streamed (a migrated request's, relayed to its client)."""
    usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens) \
        if msg.HasField("usage") else None
    reason = FinishReason(msg.finish_reason) if msg.finish_reason else None
    return Chunk(list(msg.token_ids), msg.text, reason, usage, index=msg.index,
                 logprobs=_logprobs_from_proto(msg.logprobs), prompt_logprobs=_logprobs_from_proto(msg.prompt_logprobs),
                 stop_string=msg.stop_string or None)


def _logprobs_from_proto(positions: Iterable[pb.PositionLogprobs]) -> tuple[PositionLogprobs, ...]:
    def entry(t: pb.TokenLogprob) -> TokenLogprob:
        return TokenLogprob(t.token_id, t.logprob if t.HasField("logprob") else None)

    return tuple(PositionLogprobs(entry(p.token), tuple(entry(t) for t in p.top)) for p in positions)


def continuation_to_proto(continuation: Continuation) -> pb.Continuation:
    return pb.Continuation(
        samples=[pb.SampleContinuation(
            index=s.index, generated_token_ids=s.generated, seed=s.seed,
            random_state=b"" if s.random_state is None else s.random_state.numpy().tobytes())
            for s in continuation.samples],
        cached_tokens=continuation.cached_tokens, finished_completion_tokens=continuation.finished_completion_tokens)


def continuation_from_proto(msg: pb.Continuation, params: SamplingParams, vocab_size: int) -> Continuation:
    """Validated against the request's sampling parameters: INVALID_ARGUMENT says what is wrong."""
    indices = [s.index for s in msg.samples]
    if not indices:
        raise InvalidArgument("continuation.samples is empty: send the samples still generating")
    if len(set(indices)) != len(indices) or not all(0 <= i < params.n for i in indices):
        raise InvalidArgument(f"continuation.samples: indices {indices} must be distinct, in [0, n={params.n})")
    if params.prompt_logprobs is not None:
        raise InvalidArgument("a continuation cannot score its prompt: leave sampling.prompt_logprobs unset "
                              "(the first node sent them)")
    for s in msg.samples:
        if len(s.generated_token_ids) >= max(params.max_tokens, 1):
            raise InvalidArgument(f"continuation sample {s.index} has {len(s.generated_token_ids)} tokens: "
                                  f"nothing is left of max_tokens {params.max_tokens}")
        bad = next((t for t in s.generated_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"continuation sample {s.index}: token id {bad} is outside the vocabulary")
    if msg.cached_tokens < 0 or msg.finished_completion_tokens < 0:
        raise InvalidArgument("continuation: cached_tokens and finished_completion_tokens must be >= 0")
    return Continuation(
        tuple(SampleState(s.index, tuple(s.generated_token_ids), s.seed if s.HasField("seed") else None,
                          _random_state(s.random_state)) for s in msg.samples),
        msg.cached_tokens, msg.finished_completion_tokens)


def _random_state(data: bytes) -> torch.Tensor | None:
    if not data:
        return None
    expected = torch.Generator().get_state().numel()
    if len(data) != expected:
        raise InvalidArgument(f"continuation: random_state has {len(data)} bytes where {expected} are expected")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
