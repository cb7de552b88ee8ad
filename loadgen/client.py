"""One streamed Generate call, timestamped chunk by chunk."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from loadgen.datasets import SampleRequest
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

OK = "OK"


@dataclass
class RequestResult:
    """Times are seconds since the start of the run (time.perf_counter based)."""

    index: int
    request_id: str  # sent with the request, so its traces on every node can be fetched
    arrival: float  # when it was due to be sent
    start: float  # when it was sent (later than arrival while --max-concurrency holds it back)
    end: float
    first_token: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between successive token-carrying chunks
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    status: str = OK  # "OK", a gRPC status name, or what else ended the call
    error: str = ""

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


def generate_request(request_id: str, sample: SampleRequest, ignore_eos: bool) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=sample.output_len, ignore_eos=ignore_eos)
    if sample.token_ids:
        return pb.GenerateRequest(request_id=request_id, token_ids=sample.token_ids, sampling=sampling)
    if sample.prompt:
        return pb.GenerateRequest(request_id=request_id, prompt=sample.prompt, sampling=sampling)
    messages = [pb.ChatMessage(role=role, content=content) for role, content in sample.messages]
    return pb.GenerateRequest(request_id=request_id, messages=messages, sampling=sampling)


async def send_request(stub: duet_pb2_grpc.DecodeNodeStub, index: int, request_id: str, sample: SampleRequest, *,
                       origin: float, arrival: float, timeout: float | None, ignore_eos: bool) -> RequestResult:
    """Stream one request to completion; every failure becomes the result's status, never an exception."""
    request = generate_request(request_id, sample, ignore_eos)
    start = time.perf_counter()
    first = last = None
    itl: list[float] = []
    received = 0
    final: pb.GenerationChunk | None = None
    status, error = OK, ""
    try:
        async for chunk in stub.Generate(request, timeout=timeout):
            now = time.perf_counter()
            if chunk.token_ids:
                if first is None:
                    first = now
                else:
                    itl.append(now - last)
                last = now
                received += len(chunk.token_ids)
            if chunk.finish_reason:
                final = chunk
    except grpc.aio.AioRpcError as exc:
        status, error = exc.code().name, exc.details() or ""
    except Exception as exc:  # anything else that ends the call is reported, not raised
        status, error = type(exc).__name__, str(exc)
    end = time.perf_counter()
    if status == OK and final is None:
        status, error = "INCOMPLETE", "the stream ended without a finish_reason"
    elif status == OK and final.finish_reason == "abort":
        status, error = "ABORTED", "the server aborted the request"
    usage = final.usage if final is not None else pb.Usage()
    return RequestResult(
        index=index, request_id=request_id, arrival=arrival, start=start - origin, end=end - origin,
        first_token=None if first is None else first - origin, itl=itl,
        prompt_tokens=usage.prompt_tokens or (sample.prompt_len or 0),
        completion_tokens=usage.completion_tokens or received, cached_tokens=usage.cached_tokens,
        finish_reason=final.finish_reason if final is not None else "", status=status, error=error,
    )
