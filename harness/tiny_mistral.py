"""A 2-layer random Mistral with a sliding window, saved by transformers (safetensors and a
word-level tokenizer.json): the sliding-window tests' model and their reference's."""
from __future__ import annotations

import math
from pathlib import Path

import torch

WINDOW, PAGE, VOCAB = 32, 16, 512
WINDOW_PAGES = 1 + math.ceil(WINDOW / PAGE)  # the reference's cap on a windowed sequence's pages


def save_tiny_mistral(path: Path) -> Path:
    import transformers
    from tokenizers import Tokenizer, models

    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.3,  # wide logit margins: greedy is not a coin toss
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path
