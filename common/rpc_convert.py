"""Conversions between duet.v1 protobuf messages and engine types."""
from __future__ import annotations

from common.errors import InvalidArgument
from common.sampling import SamplingParams
from common.scheduler import Chunk
from protos.duet.v1 import duet_pb2 as pb


def sampling_from_proto(msg: pb.SamplingParams, vocab_size: int) -> SamplingParams:
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
    )
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        raise InvalidArgument(f"sampling: {exc}") from None
    return params


def chunk_to_proto(request_id: str, chunk: Chunk) -> pb.GenerationChunk:
    msg = pb.GenerationChunk(request_id=request_id, token_ids=chunk.token_ids, text=chunk.text,
                             finish_reason=chunk.finish_reason or "", index=chunk.index)
    if chunk.usage is not None:
        u = chunk.usage
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                    cached_tokens=u.cached_tokens))
    return msg
