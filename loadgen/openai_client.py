"""One streamed OpenAI completions / chat completions call over HTTP(S), timed event by event.

Any OpenAI-compatible server works (duet's `--openai-port`, vLLM, ...). The request asks for
`stream_options.include_usage`, so token counts come from the server's own usage; TTFT and ITL
come from the server-sent events that carry text.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx2

from loadgen.config import CHAT, BenchmarkConfig
from loadgen.datasets import SampleRequest
from loadgen.request_result import OK, ChunkClock, RequestResult

CONNECT_TIMEOUT_S = 10.0
MODELS_TIMEOUT_S = 30.0


class OpenAITarget:
    """An OpenAI-compatible server for one run (`async with OpenAITarget(config) as t: await t.send(...)`).

    The model is `config.model`, else the first id `/v1/models` lists. When that lookup fails
    (the server is down), every request fails with its reason instead of the run raising.
    """

    def __init__(self, config: BenchmarkConfig) -> None:
        self.config = config
        self.endpoint = config.openai_endpoint
        self.model: str | None = config.model
        self._setup_failure: tuple[str, str] | None = None
        self._client = httpx2.AsyncClient(base_url=config.target.rstrip("/"),
                                          timeout=httpx2.Timeout(None, connect=CONNECT_TIMEOUT_S),
                                          limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None))

    async def __aenter__(self) -> OpenAITarget:
        if self.model is None:
            try:
                self.model = await self._first_model()
            except Exception as exc:
                self._setup_failure = _failure(exc)
            except BaseException:
                await self._client.aclose()
                raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._client.aclose()

    async def _first_model(self) -> str:
        response = await self._client.get("/v1/models", timeout=MODELS_TIMEOUT_S)
        if response.status_code != 200:
            raise TargetFailure(f"HTTP_{response.status_code}", _error_message(response.text))
        models = response.json().get("data") or []
        if not models:
            raise TargetFailure("NO_MODEL", "/v1/models lists no model; pass --model")
        return models[0]["id"]

    async def send(self, index: int, request_id: str, sample: SampleRequest, *, origin: float,
                   arrival: float) -> RequestResult:
        """Stream one request to completion; every failure becomes the result's status, never an exception."""
        start = time.perf_counter()
        stream = _StreamState()
        if self._setup_failure is not None:
            stream.status, stream.error = self._setup_failure
        else:
            try:
                async with asyncio.timeout(self.config.timeout):
                    await self._stream(self.body(sample), stream)
            except Exception as exc:  # a transport failure or the deadline, at any point of the call
                stream.status, stream.error = _failure(exc, started=stream.responded)
        end = time.perf_counter()
        if stream.status == OK and not (stream.finish_reason and stream.done):
            stream.status, stream.error = "INCOMPLETE", "the stream ended without a finish_reason and [DONE]"
        usage = stream.usage
        clock = stream.clock
        return RequestResult(
            index=index, request_id=request_id, arrival=arrival, start=start - origin, end=end - origin,
            first_token=None if clock.first is None else clock.first - origin, itl=clock.itl,
            prompt_tokens=usage.get("prompt_tokens") or (sample.prompt_len or 0),
            completion_tokens=usage.get("completion_tokens") or stream.text_events,
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            finish_reason=stream.finish_reason, status=stream.status, error=stream.error, text="".join(stream.texts),
        )

    async def _stream(self, body: dict, stream: _StreamState) -> None:
        async with self._client.stream("POST", self.endpoint, json=body) as response:
            stream.responded = True
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                stream.status, stream.error = f"HTTP_{response.status_code}", _error_message(text)
                return
            async for line in response.aiter_lines():
                if line.startswith("data:") and stream.add(line[len("data:"):].strip(), time.perf_counter()):
                    return

    def body(self, sample: SampleRequest) -> dict[str, Any]:
        """The request body: greedy, `output_len` tokens, streamed with usage."""
        body: dict[str, Any] = {"model": self.model, "temperature": 0.0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.endpoint == CHAT:  # BenchmarkConfig.samples made every prompt a conversation
            body["messages"] = [{"role": role, "content": content} for role, content in sample.messages]
            body["max_completion_tokens"] = sample.output_len
        else:
            body["prompt"] = list(sample.token_ids) if sample.token_ids else sample.prompt or _joined(sample.messages)
            body["max_tokens"] = sample.output_len
        if self.config.effective_ignore_eos:
            body["ignore_eos"] = True  # an extension vLLM and duet honour; sent only when wanted
        return body


class TargetFailure(Exception):
    """The server cannot take requests (its /v1/models failed): `status` and the reason."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class _StreamState:
    """What the server-sent events of one request said so far."""

    def __init__(self) -> None:
        self.clock = ChunkClock()
        self.texts: list[str] = []
        self.text_events = 0
        self.finish_reason = ""
        self.usage: dict = {}
        self.done = False  # saw [DONE]
        self.responded = False  # the server answered with a status line
        self.status, self.error = OK, ""

    def add(self, data: str, now: float) -> bool:
        """Take one event's data; True when the stream is over ([DONE] or an in-band error)."""
        if data == "[DONE]":
            self.done = True
            return True
        event = json.loads(data)
        if event.get("error"):
            self.status, self.error = "STREAM_ERROR", _error_message(data)
            return True
        for choice in event.get("choices") or ():
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if text:
                self.clock.tick(now)
                self.texts.append(text)
                self.text_events += 1
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if event.get("usage"):
            self.usage = event["usage"]
        return False


def _failure(exc: Exception, started: bool = False) -> tuple[str, str]:
    """A status and reason for what ended a call: no connection, the deadline, the connection lost
    before the server answered (DISCONNECTED) or after (STREAM_CUT)."""
    if isinstance(exc, TargetFailure):
        return exc.status, str(exc)
    if isinstance(exc, httpx2.ConnectError):
        return "CONNECT_ERROR", str(exc) or "could not connect"
    if isinstance(exc, (TimeoutError, httpx2.TimeoutException)):
        return "TIMEOUT", str(exc) or "the request ran past --timeout"
    if isinstance(exc, httpx2.TransportError):  # the connection broke: mid-stream, or before any answer
        return "STREAM_CUT" if started else "DISCONNECTED", str(exc) or type(exc).__name__
    return type(exc).__name__, str(exc)


def _error_message(text: str) -> str:
    """An OpenAI-style error body's message (vLLM and duet answer `{"error": {"message": ...}}`)."""
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text.strip()[:500]
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(error or text)[:500]


def _joined(messages: tuple[tuple[str, str], ...]) -> str:
    return "\n".join(content for _, content in messages)
