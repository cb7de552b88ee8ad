"""Helpers that run our engine and the transformers reference the same way."""
from __future__ import annotations

import torch

from common.engine.core import Engine
from common.model.decoder import DecoderModel

# Daemon flags of tests that compare tokens with the float32 references below (the daemons'
# default, --dtype auto, is bfloat16 on CPUs with AVX512-BF16 or AMX).
FP32 = ("--dtype", "float32")

# Prompts the engine is checked on against transformers (tests/unit/test_model_vs_transformers.py),
# also asked for JSON and tool calls (tests/http/test_openai_tools.py, scripts/json_object_share.py).
REFERENCE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a dragon who loved 42 kinds of tea.",
]
# Requests that ask for JSON in words, as users do.
JSON_PROMPTS = [
    "Give a person as JSON.",
    "Describe a book as a JSON object.",
    "List three fruits and their colours as JSON.",
    "Give the weather in Paris today as JSON.",
]


@torch.inference_mode()
def hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation with transformers' own KV cache; EOS does not stop it."""
    out = hf_model(torch.tensor([prompt], device=hf_model.device), use_cache=True)
    tokens = []
    for _ in range(num_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf_model(torch.tensor([[tokens[-1]]], device=hf_model.device), past_key_values=out.past_key_values,
                       use_cache=True)
    return tokens


def engine_greedy(model: DecoderModel, prompt: list[int], num_tokens: int, page_size: int = 16) -> list[int]:
    """Greedy continuation with our engine: one prefill, then single-token decode steps."""
    return engine_greedy_many(model, [prompt], num_tokens, page_size)[0]


@torch.inference_mode()
def greedy_gaps(model: DecoderModel, prompt: list[int], tokens: list[int], page_size: int = 16) -> list[float]:
    """How far below our engine's best logit each of `tokens` is, given the prompt and the tokens
    before it (teacher forcing: one forward): 0.0 where it is the greedy choice. Output computed
    in another order (chunked, batched, handed off) may pick the other side of a near-tie, a gap of
    about 1e-5 in float32; a wrong token is far below."""
    ids = prompt + tokens
    engine = Engine(model, num_pages=-(-len(ids) // page_size) + 1, page_size=page_size)
    seq = engine.new_sequence("gaps", ids, use_prefix_cache=False)
    engine.reserve(seq, len(ids))
    logits = engine.forward([(seq, len(ids))], every_position={0})[len(prompt) - 1 : len(ids) - 1]
    chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    return (logits.max(dim=1).values - chosen).tolist()


def engine_greedy_many(model: DecoderModel, prompts: list[list[int]], num_tokens: int,
                       page_size: int = 16) -> list[list[int]]:
    """engine_greedy of several prompts, run as one batch per step (a row's tokens do not depend
    on the batch around it, which tests/unit/test_engine.py checks)."""
    engine = Engine(model, num_pages=sum(-(-(len(p) + num_tokens) // page_size) + 1 for p in prompts),
                    page_size=page_size)
    seqs = [engine.new_sequence(f"ref{i}", p, use_prefix_cache=False) for i, p in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(num_tokens):
        for seq in seqs:
            engine.reserve(seq, len(seq.token_ids))
        logits = engine.forward([(seq, seq.num_pending) for seq in seqs])
        for seq, row, out in zip(seqs, logits, tokens):
            out.append(int(row.argmax()))
            seq.token_ids.append(out[-1])
            engine.outgrow_short_rope(seq)  # longrope: computed again with the long factors
    return tokens
