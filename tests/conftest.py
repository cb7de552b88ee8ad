"""Shared fixtures, made once per test session: the embedded default model (ours, transformers'),
a tiny sliding-window Mistral, TLS certificates. The helpers tests share are in `harness/`."""
from __future__ import annotations

import copy

import pytest
import torch

from common.model.checkpoint import load_checkpoint
from common.model.default_model import default_model_path
from common.model.decoder import DecoderModel
from common.model.tokenizer import load_tokenizer
from common.openai_http import served_model_name
from harness.certificates import issue_certificates
from harness.tiny_mistral import save_tiny_mistral

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
def hf_model_bf16(hf_model):
    """transformers on the same GGUF in bfloat16: the reference of the bf16 engine. Its float32
    model with the parameters cast to bfloat16, which is what `from_pretrained(..., dtype=torch.bfloat16)`
    makes of the GGUF (the same weights and buffers, tied the same, the same logits: compared
    once), without reading the GGUF a second time (about 20 s)."""
    bf16 = copy.deepcopy(hf_model)
    for param in bf16.parameters():
        param.data = param.data.to(torch.bfloat16)
    bf16.config.dtype = torch.bfloat16
    return bf16.eval()


@pytest.fixture(scope="session")
def model_name(model_path) -> str:
    """The name the OpenAI front serves the default model under."""
    return served_model_name(model_path)


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory):
    """harness/tiny_mistral.py's model, saved."""
    pytest.importorskip("transformers")
    return save_tiny_mistral(tmp_path_factory.mktemp("tiny_mistral"))


@pytest.fixture(scope="session")
def hf_mistral(mistral_dir):
    """transformers' own sliding-window Mistral (eager attention) on the same weights."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(mistral_dir, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    """A CA, node and client certificates it signed, a rogue CA's certificate (harness/certificates.py)."""
    return issue_certificates(tmp_path_factory.mktemp("certs"))
