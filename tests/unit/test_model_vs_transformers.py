"""Our engine against the transformers implementation of the same weights."""
from __future__ import annotations

import pytest
import torch

from common.model.checkpoint import load_checkpoint
from common.model.decoder import DecoderModel, grouped_query_attention
from harness.reference import REFERENCE_PROMPTS as PROMPTS
from harness.reference import engine_greedy, hf_greedy
from harness.engine_checks import full_logits


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(model, tokenizer, hf_model, prompt):
    ids = tokenizer.encode(prompt)
    ours = full_logits(model, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_32_tokens_match_transformers(model, tokenizer, hf_model, prompt):
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    assert engine_greedy(model, ids, 32) == hf_greedy(hf_model, ids, 32)


def _tiny_config(kind: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6)
    if kind == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "llama3-rope":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, head_dim=24)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["llama", "llama3-rope", "qwen2", "mistral"])
def test_tiny_random_hf_models(kind, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(_tiny_config(kind)).eval()
    if kind == "qwen2":  # random init leaves biases at zero; make the qkv bias path matter
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    hf.save_pretrained(tmp_path)
    model = DecoderModel(load_checkpoint(tmp_path))
    assert model.config.architecture == {"llama3-rope": "llama"}.get(kind, kind)
    ids = torch.randint(0, 320, (150,)).tolist()  # longer than original_max_position_embeddings
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = full_logits(model, ids)
    assert (ours - ref).abs().max().item() <= 1e-4
    assert engine_greedy(model, ids[:20], 12, page_size=4) == hf_greedy(hf, ids[:20], 12)


@pytest.mark.parametrize("config, message", [
    ('{"model_type": "gpt2"}', "unsupported model_type 'gpt2'"),
    ('{"model_type": "llama", "num_hidden_layers": 100000000}', "num_hidden_layers must be an integer from 1 to"),
    ('{"model_type": "llama", "vocab_size": 8}', "the config lacks 'num_attention_heads'"),
    ('["llama"]', "a JSON object with a model_type string"),
])
def test_a_bad_config_json_is_refused_naming_the_file_before_any_weight(tmp_path, config, message):
    (tmp_path / "config.json").write_text(config)  # and no weights at all: refused before looking for them
    with pytest.raises(ValueError, match=message) as refused:
        load_checkpoint(tmp_path)
    assert str(refused.value).startswith(str(tmp_path / "config.json"))


@pytest.mark.parametrize("window", [None, 40], ids=["after-cached-prefix", "sliding-window"])
def test_grouped_query_attention_equals_enable_gqa(window):
    """The CUDA path for masked GQA chunks (common.model.decoder.grouped_query_attention) computes what
    `enable_gqa=True` does; checked on the CPU, where both run."""
    g = torch.Generator().manual_seed(3)
    n, context, nh, kvh, hd = 37, 100, 9, 3, 64
    q = torch.randn(1, nh, n, hd, generator=g).transpose(1, 2).contiguous().transpose(1, 2)  # strided, as in the model
    k, v = torch.randn(2, 1, kvh, context, hd, generator=g)
    q_pos = torch.arange(context - n, context)[:, None]
    mask = torch.arange(context)[None, :] <= q_pos
    if window is not None:
        mask &= torch.arange(context)[None, :] > q_pos - window
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(grouped_query_attention(q, k, v, mask), expected, rtol=1e-5, atol=1e-6)
