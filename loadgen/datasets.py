"""Workloads: what each benchmark request asks for.

- ``random``: random token ids (exact prompt lengths), lengths uniform in [len·(1-r), len·(1+r)].
- ``shared-prefix``: groups of requests whose prompts start with the same long prefix (a shared
  system prompt), followed by a random per-request suffix.
- a file: JSONL of ``{"prompt": ...}`` lines, or ShareGPT JSON (a list of
  ``{"conversations": [{"from": "human", "value": ...}, ...]}``), whose first human turn is sent as a
  chat message.
- ``conversations``, ``agentic``, and a ShareGPT file with ``--multi-turn``: multi-turn chats,
  built turn by turn as answers come back (loadgen/conversations.py).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Token ids drawn for synthetic prompts: clear of special tokens, inside any common vocabulary.
TOKEN_ID_RANGE = (100, 40000)
SYNTHETIC_DATASETS = ("random", "shared-prefix", "conversations", "agentic")  # the last two: loadgen/conversations.py


@dataclass(frozen=True)
class SampleRequest:
    """One request's input (exactly one of token_ids, prompt, messages) and its output length."""

    output_len: int
    token_ids: tuple[int, ...] = ()
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()  # (role, content)

    @property
    def prompt_len(self) -> int | None:
        """Known without a tokenizer only for token-id prompts."""
        return len(self.token_ids) if self.token_ids else None


def as_chat(samples: list[SampleRequest], tokenizer_path: Path) -> list[SampleRequest]:
    """The same requests as one-message conversations: a text prompt becomes the user's message,
    a token-id prompt is decoded to text first (as `vllm bench serve` does for chat)."""
    decode = None
    out = []
    for s in samples:
        if s.messages:
            out.append(s)
            continue
        if s.token_ids and decode is None:
            from common.model.tokenizer import load_tokenizer

            decode = load_tokenizer(tokenizer_path).decode
        text = s.prompt or decode(s.token_ids)
        out.append(SampleRequest(output_len=s.output_len, messages=(("user", text),)))
    return out


def uniform_lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """n integers uniform in [length·(1-r), length·(1+r)], at least 1."""
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def random_token_ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_ID_RANGE) for _ in range(n))


def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[SampleRequest]:
    rng = random.Random(seed)
    inputs = uniform_lengths(rng, n, input_len, range_ratio)
    outputs = uniform_lengths(rng, n, output_len, range_ratio)
    return [SampleRequest(output_len=o, token_ids=random_token_ids(rng, i)) for i, o in zip(inputs, outputs)]


def shared_prefix_dataset(n: int, num_groups: int, prefix_len: int, input_len: int, output_len: int,
                          range_ratio: float, seed: int) -> list[SampleRequest]:
    """Request i belongs to group i mod num_groups, in shuffled order; suffixes are input_len long."""
    rng = random.Random(seed)
    prefixes = [random_token_ids(rng, prefix_len) for _ in range(num_groups)]
    suffixes = uniform_lengths(rng, n, input_len, range_ratio)
    outputs = uniform_lengths(rng, n, output_len, range_ratio)
    groups = [i % num_groups for i in range(n)]
    rng.shuffle(groups)
    return [SampleRequest(output_len=o, token_ids=prefixes[g] + random_token_ids(rng, s))
            for g, s, o in zip(groups, suffixes, outputs)]


def file_dataset(path: Path, n: int, output_len: int, seed: int) -> list[SampleRequest]:
    """n requests from a JSONL or ShareGPT file, shuffled with the seed, cycled when it holds fewer."""
    text = path.read_text()
    if text.lstrip().startswith("["):
        samples = [SampleRequest(output_len=output_len, messages=(("user", turn),))
                   for turn in _sharegpt_first_turns(json.loads(text))]
    else:
        samples = [SampleRequest(output_len=output_len, prompt=prompt) for prompt in _jsonl_prompts(text, path)]
    if not samples:
        raise ValueError(f"{path}: no prompts found")
    random.Random(seed).shuffle(samples)
    return [samples[i % len(samples)] for i in range(n)]


def _jsonl_prompts(text: str, path: Path) -> list[str]:
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f"{path}:{number}: expected an object with a string 'prompt'")
        prompts.append(record["prompt"])
    return prompts


def _sharegpt_first_turns(entries: list) -> list[str]:
    turns = []
    for entry in entries:
        for turn in entry.get("conversations", ()) if isinstance(entry, dict) else ():
            if turn.get("from") in ("human", "user") and turn.get("value"):
                turns.append(turn["value"])
                break
    return turns
