"""Run a workload against one target: schedule arrivals, cap concurrency, collect results."""
from __future__ import annotations

import asyncio
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TextIO

import grpc

from loadgen.arrivals import arrival_offsets
from loadgen.client import RequestResult, send_request
from loadgen.config import BenchmarkConfig
from loadgen.datasets import SampleRequest
from loadgen.metrics import Summary, summarize
from loadgen.progress import Progress
from protos.duet.v1 import duet_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class BenchmarkResult:
    config: BenchmarkConfig
    started_unix: float  # wall-clock time of the run's start; request times are relative to it
    summary: Summary
    requests: list[RequestResult]  # in workload order


def run_benchmark(config: BenchmarkConfig, progress: TextIO | None = sys.stderr) -> BenchmarkResult:
    """Send the configured workload to config.target and measure it (progress bar on `progress`).

    Failed requests are part of the result; nothing a target does makes this raise. Call it from
    code that is not already inside a running event loop.
    """
    samples = config.samples()
    offsets = arrival_offsets(len(samples), config.request_rate, config.burstiness, config.seed)
    started_unix = time.time()
    bar = Progress(len(samples), config.target, progress)
    results, duration = asyncio.run(_run(config, samples, offsets.tolist(), bar))
    bar.close()
    return BenchmarkResult(config=config, started_unix=started_unix,
                           summary=summarize(results, duration, config.goodput), requests=results)


async def _run(config: BenchmarkConfig, samples: list[SampleRequest], offsets: list[float],
               bar: Progress) -> tuple[list[RequestResult], float]:
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    async with grpc.aio.insecure_channel(config.target, options=options) as channel:
        stub = duet_pb2_grpc.DecodeNodeStub(channel)
        slots = asyncio.Semaphore(config.max_concurrency or len(samples))
        origin = time.perf_counter()
        run_id = uuid.uuid4().hex[:12]  # request ids unique across runs, so a node never sees one twice

        async def one(index: int) -> RequestResult:
            await asyncio.sleep(max(0.0, origin + offsets[index] - time.perf_counter()))
            arrival = time.perf_counter() - origin
            async with slots:
                result = await send_request(stub, index, f"loadgen-{run_id}-{index}", samples[index],
                                            origin=origin, arrival=arrival,
                                            timeout=config.timeout, ignore_eos=config.effective_ignore_eos)
            bar.advance(result.ok)
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(samples))))
        return list(results), time.perf_counter() - origin
