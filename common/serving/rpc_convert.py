"""Conversions between duet.v1 protobuf messages and engine types."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from common.engine.guided import GrammarCompiler
from common.engine.sampling import PositionLogprobs, SamplingParams
from common.engine.scheduler import Chunk
from common.errors import InvalidArgument
from protos.duet.v1 import duet_pb2 as pb


def sampling_from_proto(msg: pb.SamplingParams, vocab_size: int,
                        grammars: GrammarCompiler | None = None) -> SamplingParams:
    """`grammars` compiles `msg.guided`; without one a guided request is refused."""
    try:
        guided = None
        if msg.HasField("guided") and msg.guided.WhichOneof("kind") is not None:
            if grammars is None:
                raise ValueError("guided decoding is not served by this endpoint")
            guided = grammars.compile(msg.guided)
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


def chunk_to_proto(request_id: str, chunk: Chunk, token_bytes: Callable[[int], bytes]) -> pb.GenerationChunk:
    """`token_bytes` gives a token's bytes for the logprob entries."""
    msg = pb.GenerationChunk(request_id=request_id, token_ids=chunk.token_ids, text=chunk.text,
                             finish_reason=chunk.finish_reason or "", index=chunk.index,
                             logprobs=_logprobs_to_proto(chunk.logprobs, token_bytes),
                             prompt_logprobs=_logprobs_to_proto(chunk.prompt_logprobs, token_bytes))
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
