"""How many prompt tokens of a run a prefix cache could have served: the yardstick for the
`cached_tokens` servers report.

A request's cacheable tokens are the longest prefix its prompt shares with the context of a
request that had ended before it was sent (that request's prompt followed by its answer's token
ids, or over HTTP its answer's text re-tokenized), at most all but the prompt's last token (whose
logits must be computed). Prompts are tokenized the way duet's nodes do (the chat template, then
the tokenizer), so with another server's tokenizer the figure is an estimate.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loadgen.datasets import SampleRequest
from loadgen.request_result import RequestResult


def prompt_ids(sample: SampleRequest, tokenizer) -> list[int]:
    if sample.token_ids:
        return list(sample.token_ids)
    if sample.prompt:
        return tokenizer.encode(sample.prompt)
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in sample.messages]))


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _answer_ids(result: RequestResult, tokenizer) -> list[int]:
    if result.token_ids:
        return result.token_ids
    return tokenizer.encode(result.text) if result.text else []


def fill_cacheable_tokens(samples: Sequence[SampleRequest], results: Sequence[RequestResult],
                          tokenizer_path: Path) -> None:
    """Set `cacheable_tokens` of every result (results[i] answered samples[i])."""
    from common.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    prompts = [np.asarray(prompt_ids(s, tokenizer), dtype=np.int64) for s in samples]
    contexts = [np.concatenate([p, np.asarray(_answer_ids(r, tokenizer), dtype=np.int64)])
                for p, r in zip(prompts, results)]
    for i, r in enumerate(results):
        before = [c for j, c in enumerate(contexts) if results[j].end <= r.start and j != i]
        best = max((_shared_prefix(prompts[i], c) for c in before), default=0)
        r.cacheable_tokens = min(best, max(0, len(prompts[i]) - 1))
