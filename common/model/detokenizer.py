"""Streaming detokenization: token ids in, finalized text deltas out, honouring stop strings."""
from __future__ import annotations

from typing import Sequence

from common.model.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Only a short window of ids is decoded per token: `ids[prefix_offset:read_offset]` is text
    already emitted (kept as context, since some decoders render a token differently at the start
    of a string), `ids[read_offset:]` is not yet emitted. Text is held back while it ends in an
    incomplete UTF-8 sequence (decoded as U+FFFD), and the last `len(longest stop) - 1` characters
    are held back so that a stop string split across tokens is caught before any of it is emitted.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._pending = ""  # decoded, not yet emitted
        self.finished_by_stop: str | None = None

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final with it."""
        if self.finished_by_stop is not None:
            return ""
        self._ids.append(token_id)
        new_text = self._decode_unread()
        if not new_text or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._emit(new_text, self._holdback)

    def flush(self) -> str:
        """At the end of generation: everything still held back, up to any stop string."""
        if self.finished_by_stop is not None:
            return ""
        tail = self._decode_unread()
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._emit(tail, 0)

    def _decode_unread(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._decode(self._ids[self._prefix_offset :])[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _emit(self, new_text: str, holdback: int) -> str:
        """Append to the pending text; return what is final, keeping `holdback` characters back."""
        text = self._pending + new_text
        # Everything emitted so far was checked, and a stop string is at most holdback + 1 long,
        # so any new match lies entirely within `text`; the earliest one wins.
        hits = [(at, s) for s in self._stop if (at := text.find(s)) >= 0]
        if hits:
            at, self.finished_by_stop = min(hits)
            self._pending = ""
            return text[:at]
        cut = max(len(text) - holdback, 0)
        self._pending = text[cut:]
        return text[:cut]
