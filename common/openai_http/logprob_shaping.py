"""duet.v1 PositionLogprobs -> the `logprobs` objects of OpenAI's two APIs.

A token's text is its bytes as UTF-8; a token holding only part of a character is written
`bytes:\\xe2\\x80` (as OpenAI does), its exact bytes are in chat's `bytes`.
"""
from __future__ import annotations

from collections.abc import Iterable

from protos.duet.v1 import duet_pb2 as pb


def token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _logprob(entry: pb.TokenLogprob) -> float | None:
    return entry.logprob if entry.HasField("logprob") else None


class CompletionLogprobs:
    """/v1/completions' `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset}) of one
    choice, built in pieces (a stream's events) whose `text_offset`s continue one another: each
    is the token's character offset in the choice's text, the echoed prompt included."""

    def __init__(self) -> None:
        self.offset = 0

    def shape(self, positions: Iterable[pb.PositionLogprobs]) -> dict:
        tokens, logprobs, tops, offsets = [], [], [], []
        for p in positions:
            text = token_text(p.token.token_bytes)
            logprob = _logprob(p.token)
            tokens.append(text)
            logprobs.append(logprob)
            if logprob is None:  # a prompt's first token: no context, no alternatives
                tops.append(None)
            else:  # the most likely tokens, and the chosen one among them (as vLLM does)
                top = {token_text(t.token_bytes): t.logprob for t in p.top}
                top.setdefault(text, logprob)
                tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(positions: Iterable[pb.PositionLogprobs]) -> dict:
    """Chat's `logprobs`: {content: [{token, logprob, bytes, top_logprobs}], refusal}."""
    return {"content": [{**_chat_entry(p.token), "top_logprobs": [_chat_entry(t) for t in p.top]}
                        for p in positions], "refusal": None}


def _chat_entry(entry: pb.TokenLogprob) -> dict:
    return {"token": token_text(entry.token_bytes), "logprob": entry.logprob, "bytes": list(entry.token_bytes)}
