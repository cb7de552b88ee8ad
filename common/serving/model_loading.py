"""Load a model and its tokenizer for a daemon: the given path or the embedded default."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from common.engine.attention_window import with_attention_sinks
from common.model.checkpoint import load_checkpoint
from common.model.default_model import default_model_path
from common.model.decoder import DecoderModel
from common.model.tokenizer import Tokenizer, load_tokenizer
from common.serving.dtype_choice import CPU_BF16_FLAGS, emulated_bf16

log = logging.getLogger(__name__)


def load_model_and_tokenizer(path: Path | None, dtype: torch.dtype = torch.float32,
                             device: str = "cpu", attention_sinks: int = 0,
                             dtype_flag: str | None = None, quantization: str = "none") -> tuple[DecoderModel, Tokenizer]:
    """`dtype_flag`, when given, is the `--dtype` that chose `dtype` (logged beside it);
    `quantization` is `--quantization`."""
    path = path or default_model_path()
    started = time.monotonic()
    model = DecoderModel(with_attention_sinks(load_checkpoint(path, quantization), attention_sinks), dtype=dtype,
                         device=device)
    tokenizer = load_tokenizer(path)
    dtype_name = str(dtype).removeprefix("torch.")
    log.info("model loaded", extra={"fields": {
        "model": str(path), "layers": model.config.num_layers, "dtype": dtype_name,
        "dtype_flag": dtype_flag or dtype_name,
        "device": str(model.device), "linear": model.lm_head.instructions, "quantization": quantization,
        "seconds": round(time.monotonic() - started, 2)}})
    if emulated_bf16(model.device.type, dtype_name):
        log.warning("bfloat16 is emulated on this CPU", extra={"fields": {
            "missing_cpu_flags": " or ".join(CPU_BF16_FLAGS),
            "hint": "--dtype float32 (what --dtype auto picks here) prefills about 6x faster"}})
    return model, tokenizer
