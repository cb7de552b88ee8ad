"""Shared fixtures: the embedded default model, loaded once per test session."""
from __future__ import annotations

import pytest
import torch

from common.model.checkpoint import load_checkpoint
from common.model.default_model import default_model_path
from common.model.decoder import DecoderModel
from common.model.tokenizer import load_tokenizer

torch.manual_seed(0)


@pytest.fixture(scope="session")
def model_path():
    return default_model_path()


@pytest.fixture(scope="session")
def model(model_path) -> DecoderModel:
    return DecoderModel(load_checkpoint(model_path))


@pytest.fixture(scope="session")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """The independent reference: transformers reading the same GGUF."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    return hf.eval()


@pytest.fixture(scope="session")
def model_bf16(model_path) -> DecoderModel:
    return DecoderModel(load_checkpoint(model_path), dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def hf_model_bf16(model_path):
    """transformers on the same GGUF in bfloat16: the reference of the bf16 engine."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.bfloat16
    ).eval()
