"""Write the embedded model (or another GGUF) as a Hugging Face directory: config.json,
generation_config.json, the tokenizer files and fp32 safetensors, so duet (`--model DIR`),
transformers and vLLM all load the very same weights.

    python -m scripts.export_hf_model OUT_DIR [--gguf FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from common.model.default_model import default_model_path
from common.model.gguf_loader import load_gguf
from common.model.config import ModelConfig
from common.model.tokenizer import load_tokenizer

_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM"}  # the families whose config.json hf_config writes


def hf_config(config: ModelConfig, bos_token_id: int | None, eos_token_id: int) -> dict:
    """config.json of a Hugging Face model with these hyper-parameters."""
    out = {
        "architectures": [_HF_ARCHITECTURES[config.architecture]], "model_type": config.architecture,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "torch_dtype": "float32",
    }
    if config.rope_scaling:
        out["rope_scaling"] = config.rope_scaling
    if config.sliding_window is not None:
        out.update(sliding_window=config.sliding_window, use_sliding_window=True)
    return out


def export_hf_model(out_dir: Path, gguf: Path | None = None) -> Path:
    """`out_dir` holding the model of `gguf` (default: the embedded one), dequantized to fp32."""
    gguf = gguf or default_model_path()
    checkpoint = load_gguf(gguf)
    if checkpoint.config.architecture not in _HF_ARCHITECTURES:
        raise ValueError(f"{gguf}: a GGUF of {checkpoint.config.architecture} is not exported; "
                         f"only of {', '.join(_HF_ARCHITECTURES)}")
    if (checkpoint.config.rope_scaling or {}).get("rope_type") == "frequency_factors":
        raise ValueError(f"{gguf}: its rope is per-frequency factors (rope_freqs), which no config.json holds: the "
                         "converter wrote no `llama3` scaling parameters to recover; use the model's Hugging Face "
                         "directory instead")
    tokenizer = load_tokenizer(gguf)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in checkpoint.tensors.items()
               if not (checkpoint.config.tie_word_embeddings and name == "lm_head.weight")}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(checkpoint.config, tokenizer.bos_token_id, tokenizer.eos_token_id)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save_hf(out_dir, checkpoint.config.max_position_embeddings)
    return out_dir


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--gguf", type=Path, default=None, help="(default: the embedded SmolLM2-135M-Instruct)")
    a = p.parse_args()
    print(export_hf_model(a.out_dir, a.gguf))
    return 0


if __name__ == "__main__":
    sys.exit(main())
