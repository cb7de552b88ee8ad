"""GenerationChunks -> OpenAI response objects: whole responses and server-sent-event chunks.

Chunks of the n parallel samples arrive interleaved; `GenerationChunk.index` says which sample
(choice) each belongs to. Each sample's last chunk has its finish_reason; only the request's very
last chunk carries usage, that of all samples together.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from http import HTTPStatus

from common.openai_http.api_errors import ApiError
from common.openai_http.request_mapping import Endpoint, MappedRequest
from protos.duet.v1 import duet_pb2 as pb


class Choices:
    """Demultiplexes chunks into per-choice text, finish reason and usage."""

    def __init__(self, n: int) -> None:
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * n
        self.node_usage = pb.Usage()

    def add(self, chunk: pb.GenerationChunk) -> None:
        n = len(self.texts)
        if not 0 <= chunk.index < n:
            raise ApiError(HTTPStatus.INTERNAL_SERVER_ERROR,
                           f"the node sent a chunk for sample {chunk.index} of a request for {n}")
        self.texts[chunk.index].append(chunk.text)
        if chunk.finish_reason:
            self.finish_reasons[chunk.index] = chunk.finish_reason
        if chunk.HasField("usage"):
            self.node_usage = chunk.usage

    def text(self, index: int) -> str:
        return "".join(self.texts[index])

    def usage(self) -> dict:
        """OpenAI's usage object: the prompt counted once, the completion tokens of every choice."""
        u = self.node_usage
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class ResponseShaper:
    """Builds the response objects of one request."""

    def __init__(self, request: MappedRequest, model: str) -> None:
        self.request = request
        self.chat = request.endpoint is Endpoint.CHAT
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request.request_id
        self.model = model
        self.created = int(time.time())
        self.choices = Choices(request.n)

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def response(self, chunks: Iterable[pb.GenerationChunk]) -> dict:
        """The whole (non-streaming) response once every chunk arrived."""
        for chunk in chunks:
            self.choices.add(chunk)
        body = self._envelope(self.request.endpoint.value, [self._final_choice(i) for i in range(self.request.n)])
        body["usage"] = self.choices.usage()
        return body

    def _final_choice(self, index: int) -> dict:
        text = self.choices.text(index)
        choice: dict = {"index": index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=self.choices.finish_reasons[index])
        return choice

    def stream(self, chunks: Iterable[pb.GenerationChunk]) -> Iterator[dict]:
        """The server-sent events' payloads (the caller adds the `[DONE]` terminator)."""
        if self.chat:  # OpenAI opens each choice with the assistant role
            for i in range(self.request.n):
                yield self._stream_chunk(i, {"delta": {"role": "assistant", "content": ""}}, None)
        for chunk in chunks:
            self.choices.add(chunk)
            if chunk.text or chunk.finish_reason:
                if self.chat:
                    choice = {"delta": {"content": chunk.text} if chunk.text else {}}
                else:
                    choice = {"text": chunk.text}
                yield self._stream_chunk(chunk.index, choice, chunk.finish_reason or None)
        if self.request.include_usage:
            body = self._envelope(self._stream_object, [])
            body["usage"] = self.choices.usage()
            yield body

    @property
    def _stream_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _stream_chunk(self, index: int, content: dict, finish_reason: str | None) -> dict:
        """One event: `content` is the choice's `delta` (chat) or `text` (completions) entry."""
        choice = {"index": index, **content, "logprobs": None, "finish_reason": finish_reason}
        body = self._envelope(self._stream_object, [choice])
        if self.request.include_usage:
            body["usage"] = None  # as OpenAI does: only the last event carries usage
        return body
