"""Multi-turn conversation workloads: users who each send their next turn when the previous
answer ends, every prompt being the whole conversation so far.

- ``conversations`` (synthetic): `num_users` users share one system prompt of about `prefix_len`
  tokens; each of their `turns` questions is about `input_len` tokens of random text.
- ``agentic`` (synthetic): the same, except that every user has a system prompt of its own (an
  agent's tool definitions and documents), so the live histories together can outgrow a node's
  KV pool; with `--think-time` between an answer and the next turn, as an agent runs its tools.
- a ShareGPT-style JSON file with ``--multi-turn``: each entry's human turns, in order, after its
  system turn if it has one; the recorded answers are not used, the server's are.

Turn t of a user asks with the system prompt, every earlier question and the answer the server
gave to it, and the new question: the prompt a chat client sends, and one a prefix cache can
serve all but the new question of.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from loadgen.datasets import SampleRequest, random_token_ids, uniform_lengths

Message = tuple[str, str]  # (role, content)


@dataclass(frozen=True)
class Conversation:
    system: str  # "" = none
    questions: tuple[str, ...]
    output_len: int

    def turn(self, history: tuple[Message, ...], question: str) -> SampleRequest:
        """The request of the turn asking `question` after `history` (earlier questions and answers)."""
        head = (("system", self.system),) if self.system else ()
        return SampleRequest(output_len=self.output_len, messages=head + history + (("user", question),))


def synthetic_conversations(num_users: int, turns: int, system_len: int, question_len: int, output_len: int,
                            range_ratio: float, seed: int, tokenizer_path: Path,
                            own_system: bool = False) -> list[Conversation]:
    """Text decoded from random token ids (clear of special tokens), so every server tokenizes the
    same prompt the same way. `own_system`: a system prompt per user (agentic), else one for all."""
    from common.model.tokenizer import load_tokenizer

    decode = load_tokenizer(tokenizer_path).decode
    rng = random.Random(seed)
    systems = [decode(random_token_ids(rng, system_len)) for _ in range(num_users if own_system else 1)]
    lengths = uniform_lengths(rng, num_users * turns, question_len, range_ratio)
    return [Conversation(systems[u % len(systems)],
                         tuple(decode(random_token_ids(rng, lengths[u * turns + t])) for t in range(turns)),
                         output_len) for u in range(num_users)]


def sharegpt_conversations(path: Path, num_users: int, turns: int, output_len: int, seed: int) -> list[Conversation]:
    """The first `num_users` conversations (shuffled with the seed) of a ShareGPT JSON file that
    have a human turn, each cut to its first `turns` human turns."""
    entries = json.loads(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a ShareGPT JSON list of {{'conversations': [...]}}")
    conversations = []
    for entry in entries:
        turns_of = entry.get("conversations", ()) if isinstance(entry, dict) else ()
        system = next((t.get("value", "") for t in turns_of if t.get("from") == "system"), "")
        questions = [t["value"] for t in turns_of if t.get("from") in ("human", "user") and t.get("value")]
        if questions:
            conversations.append(Conversation(system, tuple(questions[:turns]), output_len))
    if not conversations:
        raise ValueError(f"{path}: no conversation with a human turn")
    random.Random(seed).shuffle(conversations)
    return conversations[:num_users]
