"""One streamed duet.v1.DecodeNode/Generate call, timestamped chunk by chunk."""
from __future__ import annotations

import asyncio
import time

import grpc

from loadgen.config import BenchmarkConfig
from loadgen.datasets import SampleRequest
from loadgen.request_result import OK, ChunkClock, RequestResult
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20
# With fallbacks, a request goes round its targets at most this many times, pausing ROUND_PAUSE_S x the
# round before each new one: a target that died and came back on its port (a restarted router) takes the
# request again once every other target has failed it too.
ROUNDS = 3
ROUND_PAUSE_S = 1.0


def generate_request(request_id: str, sample: SampleRequest, ignore_eos: bool) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=sample.output_len, ignore_eos=ignore_eos)  # temperature 0: greedy
    if sample.token_ids:
        return pb.GenerateRequest(request_id=request_id, token_ids=sample.token_ids, sampling=sampling)
    if sample.prompt:
        return pb.GenerateRequest(request_id=request_id, prompt=sample.prompt, sampling=sampling)
    messages = [pb.ChatMessage(role=role, content=content) for role, content in sample.messages]
    return pb.GenerateRequest(request_id=request_id, messages=messages, sampling=sampling)


def continued(request: pb.GenerateRequest, received: list[int]) -> pb.GenerateRequest:
    """`request` asked again for what follows the `received` tokens (its one sample's)."""
    again = pb.GenerateRequest()
    again.CopyFrom(request)
    again.continuation.CopyFrom(pb.Continuation(samples=[pb.SampleContinuation(index=0, generated_token_ids=received)]))
    return again


class GrpcTarget:
    """A decode node or router over gRPC, for one run (`async with GrpcTarget(config) as t: await t.send(...)`);
    with `config.fallbacks`, the next one takes a request over when its target becomes UNAVAILABLE, the
    first again after the last (at most ROUNDS times round)."""

    def __init__(self, config: BenchmarkConfig) -> None:
        self.config = config
        self.model: str | None = None  # gRPC does not name the model
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self._channels = [grpc.aio.insecure_channel(t, options=options) for t in (config.target, *config.fallbacks)]
        self._stubs = [duet_pb2_grpc.DecodeNodeStub(channel) for channel in self._channels]

    async def __aenter__(self) -> GrpcTarget:
        return self

    async def __aexit__(self, *exc_info) -> None:
        for channel in self._channels:
            await channel.close()

    async def send(self, index: int, request_id: str, sample: SampleRequest, *, origin: float,
                   arrival: float) -> RequestResult:
        """Stream one request to completion; every failure becomes the result's status, never an exception."""
        request = generate_request(request_id, sample, self.config.effective_ignore_eos)
        start = time.perf_counter()
        clock = ChunkClock()
        ids: list[int] = []
        texts: list[str] = []
        final: pb.GenerationChunk | None = None
        status, error = OK, ""
        attempts = ROUNDS * len(self._stubs) if len(self._stubs) > 1 else 1
        for attempt in range(attempts):
            stub = self._stubs[attempt % len(self._stubs)]
            if attempt and attempt % len(self._stubs) == 0:
                await asyncio.sleep(ROUND_PAUSE_S * (attempt // len(self._stubs)))
            try:
                async for chunk in stub.Generate(continued(request, ids) if ids else request,
                                                 timeout=self.config.timeout):
                    if chunk.token_ids:
                        clock.tick(time.perf_counter())
                        ids.extend(chunk.token_ids)
                    texts.append(chunk.text)
                    if chunk.finish_reason:
                        final = chunk
            except grpc.aio.AioRpcError as exc:
                status, error = exc.code().name, exc.details() or ""
                if exc.code() == grpc.StatusCode.UNAVAILABLE and final is None and attempt + 1 < attempts:
                    status, error = OK, ""  # the next target goes on from the tokens received
                    continue
            except Exception as exc:  # anything else that ends the call is reported, not raised
                status, error = type(exc).__name__, str(exc)
            break
        end = time.perf_counter()
        if status == OK and final is None:
            status, error = "INCOMPLETE", "the stream ended without a finish_reason"
        elif status == OK and final.finish_reason == "abort":
            status, error = "ABORTED", "the server aborted the request"
        usage = final.usage if final is not None else pb.Usage()
        return RequestResult(
            index=index, request_id=request_id, arrival=arrival, start=start - origin, end=end - origin,
            first_token=None if clock.first is None else clock.first - origin, itl=clock.itl,
            prompt_tokens=usage.prompt_tokens or (sample.prompt_len or 0),
            completion_tokens=usage.completion_tokens or len(ids), cached_tokens=usage.cached_tokens,
            finish_reason=final.finish_reason if final is not None else "", status=status, error=error,
            text="".join(texts), token_ids=ids, retries=attempt,
        )
