"""GenerationChunks -> OpenAI response objects: whole responses and server-sent-event chunks.

Chunks of the n parallel samples arrive interleaved; `GenerationChunk.index` says which sample
(choice) each belongs to. Each sample's last chunk has its finish_reason; only the request's very
last chunk carries usage, that of all samples together.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from http import HTTPStatus
from typing import Protocol

from common.openai_http.api_errors import ApiError
from common.openai_http.logprob_shaping import CompletionLogprobs, chat_logprobs
from common.openai_http.request_mapping import Endpoint, MappedRequest
from common.openai_http.tool_output import DEFAULT_TOOL_CALL_PARSER, ToolAnswer
from protos.duet.v1 import duet_pb2 as pb


class Choices:
    """Demultiplexes chunks into per-choice text, logprobs, finish reason and usage."""

    def __init__(self, n: int) -> None:
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.logprobs: list[list[pb.PositionLogprobs]] = [[] for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * n
        self.stop_strings: list[str | None] = [None] * n  # the stop string that ended each, if one did
        self.node_usage = pb.Usage()
        self.prompt_logprobs: list[pb.PositionLogprobs] = []  # every choice shares the prompt

    def add(self, chunk: pb.GenerationChunk) -> None:
        n = len(self.texts)
        if not 0 <= chunk.index < n:
            raise ApiError(HTTPStatus.INTERNAL_SERVER_ERROR,
                           f"the node sent a chunk for sample {chunk.index} of a request for {n}")
        self.texts[chunk.index].append(chunk.text)
        self.logprobs[chunk.index].extend(chunk.logprobs)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        if chunk.finish_reason:
            self.finish_reasons[chunk.index] = chunk.finish_reason
            self.stop_strings[chunk.index] = chunk.stop_string or None
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


class AnswerShaper(Protocol):
    """What the server asks of an API's answers: the whole response, or its server-sent events."""

    named_events: bool  # each event goes out with an `event:` line naming its `type`
    end_of_stream: bytes  # written after the last event

    def response(self, chunks: Iterable[pb.GenerationChunk]) -> dict: ...
    def opening(self) -> Iterator[dict]: ...
    def events(self, chunk: pb.GenerationChunk) -> Iterator[dict]: ...
    def closing(self) -> Iterator[dict]: ...
    def failure(self, error: ApiError) -> dict: ...


class ResponseShaper:
    """Builds the response objects of one completions or chat completions request."""

    named_events = False
    end_of_stream = b"data: [DONE]\n\n"

    def __init__(self, request: MappedRequest, model: str, tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER) -> None:
        self.request = request
        self.chat = request.endpoint is Endpoint.CHAT
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request.request_id
        self.model = model
        self.created = int(time.time())
        self.choices = Choices(request.n)
        self.tool_answers = [ToolAnswer(request.tools, tool_call_parser)
                                                 for _ in range(request.n)] if request.tools else None
        self._logprob_shapers = [CompletionLogprobs() for _ in range(request.n)]  # streamed completions' offsets
        self._echoed = False

    @property
    def echo_text(self) -> str:
        """The prompt as text: as sent, or (token ids) the text of its tokens, which the node
        returned as prompt logprobs."""
        if self.request.generate.prompt:
            return self.request.generate.prompt
        return b"".join(p.token.token_bytes for p in self.choices.prompt_logprobs).decode("utf-8", "replace")

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
        logprobs = None
        finish_reason = self.choices.finish_reasons[index]
        if self.tool_answers is not None:
            choice["message"], finish_reason = self.tool_answers[index].message(text, finish_reason)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        if self.chat:
            if self.request.logprobs:
                logprobs = chat_logprobs(self.choices.logprobs[index])
        else:
            choice["text"] = self.echo_text + text if self.request.echo else text
            if self.request.logprobs:
                echoed = self.choices.prompt_logprobs if self.request.echo else []
                logprobs = CompletionLogprobs().shape([*echoed, *self.choices.logprobs[index]])
        choice.update(logprobs=logprobs, finish_reason=finish_reason)
        return choice

    def opening(self) -> Iterator[dict]:
        """The server-sent events before any chunk: OpenAI opens each chat choice with the
        assistant role."""
        if self.chat:
            for i in range(self.request.n):
                yield self._stream_chunk(i, {"delta": {"role": "assistant", "content": ""}}, None)

    def events(self, chunk: pb.GenerationChunk) -> Iterator[dict]:
        """The server-sent events' payloads of one chunk, in order."""
        self.choices.add(chunk)
        if self.request.echo and not self._echoed:  # each choice opens with the prompt
            self._echoed = True
            for i in range(self.request.n):
                echoed = {"text": self.echo_text}
                if self.request.logprobs:
                    echoed["logprobs"] = self._logprob_shapers[i].shape(self.choices.prompt_logprobs)
                yield self._stream_chunk(i, echoed, None)
        if self.tool_answers is not None:
            yield from self._tool_events(chunk)
        elif chunk.text or chunk.finish_reason or chunk.logprobs:
            if self.chat:
                choice = {"delta": {"content": chunk.text} if chunk.text else {}}
                if self.request.logprobs:
                    choice["logprobs"] = chat_logprobs(chunk.logprobs)
            else:
                choice = {"text": chunk.text}
                if self.request.logprobs:
                    choice["logprobs"] = self._logprob_shapers[chunk.index].shape(chunk.logprobs)
            yield self._stream_chunk(chunk.index, choice, chunk.finish_reason or None)

    def closing(self) -> Iterator[dict]:
        """The last event, with usage when the request asked for it (the caller adds `[DONE]`)."""
        if self.request.include_usage:
            body = self._envelope(self._stream_object, [])
            body["usage"] = self.choices.usage()
            yield body

    def _tool_events(self, chunk: pb.GenerationChunk) -> Iterator[dict]:
        """A chunk of an answer with tools: its text through the choice's ToolAnswer, which sends
        content, or tool-call deltas, as soon as it can tell which they are."""
        answer = self.tool_answers[chunk.index]
        deltas = answer.feed(chunk.text)
        reason = None
        if chunk.finish_reason:
            last, reason = answer.finish(chunk.finish_reason)
            deltas += last
        logprobs = {"logprobs": chat_logprobs(chunk.logprobs)} if self.request.logprobs else {}
        if (logprobs or reason) and not deltas:
            deltas = [{}]
        for i, delta in enumerate(deltas):
            yield self._stream_chunk(chunk.index, {"delta": delta, **(logprobs if i == 0 else {})},
                                     reason if i == len(deltas) - 1 else None)

    def failure(self, error: ApiError) -> dict:
        """The in-band event of a stream that failed after it started."""
        return error.body()

    @property
    def _stream_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _stream_chunk(self, index: int, content: dict, finish_reason: str | None) -> dict:
        """One event: `content` is the choice's `delta` (chat) or `text` (completions) entry, and
        its `logprobs` if any."""
        choice = {"index": index, "logprobs": None, **content, "finish_reason": finish_reason}
        body = self._envelope(self._stream_object, [choice])
        if self.request.include_usage:
            body["usage"] = None  # as OpenAI does: only the last event carries usage
        return body
