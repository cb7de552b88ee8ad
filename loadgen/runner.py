"""Run a workload against one target: schedule arrivals, cap concurrency, collect results.

A conversation workload schedules users instead of requests: each user starts at its arrival
time and sends its next turn when the answer to the previous one has ended (and, with
--think-time, an exponentially drawn pause after it, seeded per user)."""
from __future__ import annotations

import asyncio
import random
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TextIO

from loadgen.arrivals import arrival_offsets
from loadgen.cacheable import fill_cacheable_tokens
from loadgen.config import BenchmarkConfig
from loadgen.conversations import Conversation, Message
from loadgen.datasets import SampleRequest
from loadgen.grpc_client import GrpcTarget
from loadgen.metrics import Summary, summarize
from loadgen.openai_client import OpenAITarget
from loadgen.progress import Progress
from loadgen.request_result import RequestResult


@dataclass(frozen=True)
class BenchmarkResult:
    config: BenchmarkConfig
    started_unix: float  # wall-clock time of the run's start; request times are relative to it
    summary: Summary
    requests: list[RequestResult]  # in workload order
    model: str | None = None  # the model an OpenAI target served (gRPC names none)


def run_benchmark(config: BenchmarkConfig, progress: TextIO | None = sys.stderr) -> BenchmarkResult:
    """Send the configured workload to config.target and measure it (progress bar on `progress`).

    Failed requests are part of the result; nothing a target does makes this raise. Call it from
    code that is not already inside a running event loop.
    """
    if config.is_conversational:
        conversations = config.conversations()
        offsets = arrival_offsets(len(conversations), config.request_rate, config.burstiness, config.seed)
        started_unix = time.time()
        bar = Progress(sum(len(c.questions) for c in conversations), config.name, progress)
        samples, results, duration, model = asyncio.run(_run_conversations(config, conversations, offsets.tolist(), bar))
        fill_cacheable_tokens(samples, results, config.tokenizer_path)
    else:
        samples = config.samples()
        offsets = arrival_offsets(len(samples), config.request_rate, config.burstiness, config.seed)
        started_unix = time.time()
        bar = Progress(len(samples), config.name, progress)
        results, duration, model = asyncio.run(_run(config, samples, offsets.tolist(), bar))
    bar.close()
    return BenchmarkResult(config=config, started_unix=started_unix,
                           summary=summarize(results, duration, config.goodput), requests=results, model=model)


async def _run(config: BenchmarkConfig, samples: list[SampleRequest], offsets: list[float],
               bar: Progress) -> tuple[list[RequestResult], float, str | None]:
    async with (OpenAITarget(config) if config.is_http else GrpcTarget(config)) as target:
        slots = asyncio.Semaphore(config.max_concurrency or len(samples))
        origin = time.perf_counter()
        run_id = uuid.uuid4().hex[:12]  # request ids unique across runs, so a node never sees one twice

        async def one(index: int) -> RequestResult:
            await asyncio.sleep(max(0.0, origin + offsets[index] - time.perf_counter()))
            arrival = time.perf_counter() - origin
            async with slots:
                result = await target.send(index, f"loadgen-{run_id}-{index}", samples[index],
                                           origin=origin, arrival=arrival)
            bar.advance(result.ok)
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(samples))))
        return list(results), time.perf_counter() - origin, target.model


async def _run_conversations(config: BenchmarkConfig, conversations: list[Conversation], offsets: list[float],
                             bar: Progress) -> tuple[list[SampleRequest], list[RequestResult], float, str | None]:
    """Every user's turns in order, each with the answers so far; results (and the samples sent)
    numbered user by user, turn by turn."""
    async with (OpenAITarget(config) if config.is_http else GrpcTarget(config)) as target:
        slots = asyncio.Semaphore(config.max_concurrency or len(conversations))
        origin = time.perf_counter()
        run_id = uuid.uuid4().hex[:12]
        firsts = [sum(len(c.questions) for c in conversations[:u]) for u in range(len(conversations))]
        sent: dict[int, tuple[SampleRequest, RequestResult]] = {}

        async def user(u: int) -> None:
            await asyncio.sleep(max(0.0, origin + offsets[u] - time.perf_counter()))
            history: tuple[Message, ...] = ()
            thinking = random.Random(f"{config.seed}-{u}")
            for t, question in enumerate(conversations[u].questions):
                if t and config.think_time:
                    await asyncio.sleep(thinking.expovariate(1 / config.think_time))
                index = firsts[u] + t
                sample = conversations[u].turn(history, question)
                arrival = time.perf_counter() - origin
                async with slots:
                    result = await target.send(index, f"loadgen-{run_id}-{index}", sample, origin=origin,
                                               arrival=arrival)
                bar.advance(result.ok)
                sent[index] = (sample, result)
                history += (("user", question), ("assistant", result.text))

        await asyncio.gather(*(user(u) for u in range(len(conversations))))
        ordered = [sent[i] for i in range(len(sent))]
        return [s for s, _ in ordered], [r for _, r in ordered], time.perf_counter() - origin, target.model
