"""Tiny random checkpoints of every supported family, built and saved by transformers (nothing
downloaded): the models tests/daemons/test_model_families.py and tests/unit/test_gguf_families.py
check against transformers."""
from __future__ import annotations

from pathlib import Path

import torch

from harness.engine_checks import full_logits
from harness.helpers import random_ids
from harness.reference import engine_greedy, hf_greedy

VOCAB, WINDOW, PROMPT = 320, 8, 40  # prompts several windows long
SLIDING, FULL = "sliding_attention", "full_attention"
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
_EXPERTS = dict(num_experts_per_tok=2)


def configs() -> dict:
    """Each family's `model_type` -> a function returning its tiny transformers config."""
    import transformers as t

    return {
        "qwen3": lambda: t.Qwen3Config(**COMMON, head_dim=16),
        "gemma2": lambda: t.Gemma2Config(**COMMON, head_dim=16, sliding_window=WINDOW),
        "gemma3_text": lambda: t.Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=WINDOW,
                                                  layer_types=[SLIDING, FULL, SLIDING]),
        "phi3": lambda: t.Phi3Config(**COMMON),
        "granite": lambda: t.GraniteConfig(**COMMON, embedding_multiplier=3.0, attention_multiplier=0.2,
                                           residual_multiplier=0.5, logits_scaling=2.0),
        "olmo2": lambda: t.Olmo2Config(**COMMON),
        "mixtral": lambda: t.MixtralConfig(**COMMON, **_EXPERTS, num_local_experts=4),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**COMMON, **_EXPERTS, num_experts=4, moe_intermediate_size=32,
                                              head_dim=16, norm_topk_prob=True, mlp_only_layers=[1]),
        "gpt_oss": lambda: t.GptOssConfig(**COMMON, **_EXPERTS, num_local_experts=4, head_dim=16,
                                          sliding_window=WINDOW),
    }


def save_tiny(name: str, path: Path, **overrides):
    """The family's tiny random model (config values `overrides` changed), saved as save_model saves it."""
    config = configs()[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return save_model(config, path)


def save_model(config, path: Path):
    """A random model of this transformers config, saved with a word-level tokenizer.json; returned
    in eval mode. Norm weights, biases and sinks are drawn too (random init leaves them at 0 or 1,
    where a misplaced `1 +` or a dropped bias would not show)."""
    import transformers
    from tokenizers import Tokenizer, models

    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            if "norm" in param_name or param_name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5)
    hf.save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return hf


def tiny_prompt(seed: int, n: int = PROMPT) -> list[int]:
    """`n` random token ids of the tiny vocabulary, clear of its pad, BOS and EOS."""
    return random_ids(n, seed, low=3, high=VOCAB)


def assert_as_transformers(model, hf) -> None:
    """Our `model` computes what transformers' `hf` does in float32: logits within 1e-4 on a
    60-token prompt, the same 12 greedy tokens after two prompts several windows long."""
    ids = tiny_prompt(1, 60)
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0]
    assert (full_logits(model, ids) - reference).abs().max().item() <= 1e-4
    for seed in (2, 3):
        prompt = tiny_prompt(seed)
        assert engine_greedy(model, prompt, 12, page_size=4) == hf_greedy(hf, prompt, 12)
