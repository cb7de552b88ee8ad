"""`--dtype auto` picks what the hardware computes natively; the choice is visible to peers and
to Prometheus."""
from __future__ import annotations

import logging

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from common.engine.core import Engine
from common.serving import dtype_choice, model_loading
from common.serving.fingerprint import fingerprint_of, mismatch
from common.serving.pool_metrics import register_pool_gauges
from decode_node.config import DecodeNodeConfig


@pytest.mark.parametrize(("flags", "device", "want"), [
    ({"avx512f", "avx512_bf16"}, "cpu", "bfloat16"),
    ({"amx_bf16", "amx_tile"}, "cpu", "bfloat16"),
    ({"avx512f", "avx2"}, "cpu", "float32"),  # bf16 would be emulated: slower than fp32
    (set(), "cuda", "bfloat16"),
])
def test_auto_follows_the_hardware(monkeypatch, flags, device, want):
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: flags)
    assert dtype_choice.resolve_dtype(device, "auto") == want


def test_explicit_dtypes_and_refusals():
    assert dtype_choice.resolve_dtype("cpu", "float32") == "float32"
    assert dtype_choice.resolve_dtype("cpu", "bfloat16") == "bfloat16"
    assert dtype_choice.resolve_dtype("cuda", "float16") == "float16"
    with pytest.raises(ValueError, match="--dtype float16 needs --device cuda"):
        dtype_choice.resolve_dtype("cpu", "float16")
    with pytest.raises(ValueError, match="--dtype must be one of auto, float32, bfloat16, float16"):
        dtype_choice.resolve_dtype("cpu", "fp8")


@pytest.mark.parametrize(("flags", "device", "dtype", "emulated"), [
    ({"avx2"}, "cpu", "bfloat16", True),  # asked for on a CPU that only emulates it: warned at start
    ({"avx2"}, "cpu", "auto", False),  # auto picks float32 there
    ({"avx512_bf16"}, "cpu", "bfloat16", False),
    ({"amx_bf16"}, "cpu", "bfloat16", False),
    (set(), "cuda", "bfloat16", False),
])
def test_emulated_bf16_is_named(monkeypatch, flags, device, dtype, emulated):
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: flags)
    assert dtype_choice.emulated_bf16(device, dtype) is emulated


@pytest.mark.parametrize(("flags", "warned"), [({"avx2"}, True), ({"avx512_bf16"}, False)])
def test_loading_bf16_where_it_is_emulated_warns(monkeypatch, caplog, flags, warned):
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: flags)
    with caplog.at_level(logging.WARNING, logger=model_loading.__name__):
        model_loading.load_model_and_tokenizer(None, torch.bfloat16, dtype_flag="bfloat16")
    assert ("bfloat16 is emulated on this CPU" in caplog.messages) is warned


def test_config_resolves_auto(monkeypatch):
    monkeypatch.setattr(dtype_choice, "cpu_flags", lambda: {"avx512_bf16"})
    config = DecodeNodeConfig()
    assert config.dtype == "auto" and config.resolved_dtype == "bfloat16"
    assert str(config.torch_dtype) == "torch.bfloat16"
    assert DecodeNodeConfig(dtype="float32").resolved_dtype == "float32"


def test_dtype_in_fingerprint_and_info_gauge(model, model_bf16):
    # The session's models (tests/conftest.py): DecoderModel(load_checkpoint(path)) in float32 and bfloat16.
    engines = {d: Engine(m, num_pages=4, page_size=16) for d, m in (("float32", model), ("bfloat16", model_bf16))}
    assert {d: str(e.model.dtype) for d, e in engines.items()} == {"float32": "torch.float32",
                                                                   "bfloat16": "torch.bfloat16"}
    prints = {d: fingerprint_of(e.model, e.pool) for d, e in engines.items()}
    assert prints["bfloat16"].dtype == "bfloat16"
    why = mismatch(prints["float32"], prints["bfloat16"], "decode node", "prefill node")
    assert why == "incompatible KV layout (dtype: decode node has 'float32', prefill node has 'bfloat16')"
    registry = CollectorRegistry()
    register_pool_gauges(registry, engines["bfloat16"], lambda: 1)
    assert 'duet_info{device="cpu",dtype="bfloat16"} 1.0' in generate_latest(registry).decode()
