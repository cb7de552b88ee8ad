"""Per-token mask cost of the grammar engines on the default model's tokenizer (SmolLM2, 49152
tokens): walk a valid JSON document token by token, timing the mask computed before each token.

    flock /tmp/duet-bench.lock .venv/bin/python -m scripts.bench_grammar_mask [--xgrammar-path DIR]

`--xgrammar-path` adds a directory holding xgrammar (not a duet dependency) to sys.path.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from common.model.default_model import default_model_path
from common.model.tokenizer import load_tokenizer
from loadgen.percentiles import percentiles

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                      "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "12345"}}


def time_llguidance(tokenizer, tokens: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.torch as llt
    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer._backend.to_str(), n_vocab=tokenizer.vocab_size,
                                   eos_token=tokenizer.eos_token_id)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(lltok, grammar)
    setup = time.perf_counter() - start
    mask = llt.allocate_token_bitmask(1, tokenizer.vocab_size)
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        llt.fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - t0)
        assert matcher.consume_token(t), matcher.get_error()
    return setup, times


def time_xgrammar(tokenizer, tokens: list[int]) -> tuple[float, list[float]]:
    import transformers
    import xgrammar
    start = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer._backend)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size,
                                                   stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                  separators=(",", ":"))
    matcher = xgrammar.GrammarMatcher(compiled)
    setup = time.perf_counter() - start
    mask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t0)
        assert matcher.accept_token(t)
    return setup, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--xgrammar-path", default=None)
    args = parser.parse_args()
    if args.xgrammar_path:
        sys.path.append(args.xgrammar_path)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(default_model_path())
    tokens = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")))
    print(f"vocab {tokenizer.vocab_size}, document of {len(tokens)} tokens")
    for name, bench in (("llguidance", time_llguidance), ("xgrammar", time_xgrammar)):
        try:
            setup, times = bench(tokenizer, tokens)
        except ImportError as exc:
            print(f"{name}: not importable ({exc})")
            continue
        ms = [t * 1e3 for t in times]
        median, p90 = percentiles(ms, [50, 90])
        print(f"{name}: setup {setup * 1e3:.0f} ms, mask per token median {median:.3f} ms, "
              f"p90 {p90:.3f} ms, max {max(ms):.3f} ms, first {ms[0]:.3f} ms")


if __name__ == "__main__":
    main()
