"""The tokenizer a GGUF file carries, rebuilt with Hugging Face `tokenizers`.

A GGUF holds no `tokenizer.json`, only llama.cpp's description of one: `tokenizer.ggml.model`
(the algorithm), `tokenizer.ggml.pre` (for byte-level BPE, a name for the pre-tokenizer split),
tokens, merges or scores, and each token's type. This module turns that back into the tokenizer
the model's Hugging Face repository ships, for the two algorithms the supported families use:

- `gpt2`: byte-level BPE (Llama 3, Qwen2/3, SmolLM, Granite, OLMo 2, gpt-oss). The merges are in
  the file; the split regexes are named by `tokenizer.ggml.pre` (PRE_TOKENIZERS below).
- `llama`: SentencePiece BPE with byte fallback (Llama 2, Mistral, Mixtral, Gemma 2/3, Phi-3).
  The file has scores instead of merges; a merge's priority is its result's score.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from common.model.gguf_file import GgufFile

# llama.cpp's LLAMA_TOKEN_TYPE_*, as tokenizer.ggml.token_type stores them.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before byte-level BPE for one `tokenizer.ggml.pre` value.

    `splits` are applied in order, each one cutting every piece the previous ones left (matches and
    the text between them both become pieces), as llama.cpp's `unicode_regex_split` does. These are
    the regexes of the models' own `tokenizer.json` (llama.cpp's `src/llama-vocab.cpp` rewrites some
    for its regex engine, e.g. `(?i:'s|...)` as `'[sS]|...`; the Oniguruma engine of `tokenizers`
    takes the originals). `ignore_merges`: a piece that is a whole token is that token, without
    merging (Llama 3's `tokenizer.json` says so, and llama.cpp sets it for these names).
    """

    splits: tuple[str, ...]
    ignore_merges: bool = False


_LLAMA3_SPLIT = PreTokenizer((_LLAMA3,), ignore_merges=True)
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    # Llama 3; OLMo 2's cl100k-style vocabulary is labelled dbrx (same regex as Llama 3).
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "dbrx": PreTokenizer((_LLAMA3,)), "smaug-bpe": PreTokenizer((_LLAMA3,)),
    "qwen2": PreTokenizer((_QWEN2,)), "deepseek-r1-qwen": PreTokenizer((_QWEN2,)),
    # Every digit on its own, then GPT-2's split: SmolLM, and Granite 3's StarCoder vocabulary (refact).
    "smollm": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2,
    "gpt-2": PreTokenizer((_GPT2,)), "olmo": PreTokenizer((_GPT2,)),
    "gpt-4o": PreTokenizer((_GPT4O,)),  # gpt-oss (o200k_harmony)
}
_SUPPORTED_MODELS = "'gpt2' (byte-level BPE), 'llama' (SentencePiece)"
# SentencePiece vocabularies whose merge order is the order of the tokens in the file, not their scores.
_MERGES_IN_FILE_ORDER = {"gemma", "gemma2", "gemma3"}
# SentencePiece vocabularies whose prefix space comes before every stretch of text between special
# tokens (a normalizer, as Phi-3's tokenizer.json has), not only at the start of the text.
_PREFIX_EVERY_SEGMENT = {"phi3"}


@dataclass(frozen=True)
class GgufTokenizer:
    backend: tokenizers.Tokenizer
    eos_token_id: int
    bos_token_id: int | None
    chat_template: str | None


def read_gguf_tokenizer(path: str | Path) -> GgufTokenizer:
    """The tokenizer of the GGUF file at `path`; ValueError for one this module cannot build.

    `tokenizer.ggml.add_bos_token` is not applied: our encoding never adds BOS/EOS (prompts get them
    from the chat template), only the ids are kept.
    """
    fields = GgufFile(path).fields
    kind = fields.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _byte_level_bpe(path, fields)
        default_bos = default_eos = None
    elif kind == "llama":
        backend = _sentencepiece(fields)
        default_bos, default_eos = 1, 2  # llama.cpp's defaults for a file that names none
    else:
        raise ValueError(f"{path}: unsupported tokenizer.ggml.model {kind!r}; supported: {_SUPPORTED_MODELS}")
    eos = fields.get("tokenizer.ggml.eos_token_id", default_eos)
    if eos is None:
        raise ValueError(f"{path}: no tokenizer.ggml.eos_token_id")
    return GgufTokenizer(backend, eos, fields.get("tokenizer.ggml.bos_token_id", default_bos),
                         fields.get("tokenizer.chat_template"))


def _byte_level_bpe(path: str | Path, fields: dict[str, Any]) -> tokenizers.Tokenizer:
    pre = fields.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: unsupported tokenizer.ggml.pre {pre!r} for byte-level BPE; "
                         f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    split = PRE_TOKENIZERS[pre]
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]
    backend = tokenizers.Tokenizer(models.BPE(vocab=_vocab(tokens), merges=merges,
                                              ignore_merges=split.ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in split.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, fields.get("tokenizer.ggml.token_type"))
    return backend


def _sentencepiece(fields: dict[str, Any]) -> tokenizers.Tokenizer:
    """SentencePiece BPE as its Hugging Face `tokenizer.json` has it: whitespace as `▁`, an
    optional `▁` before the text (`tokenizer.ggml.add_space_prefix`, llama.cpp's default true),
    BPE with byte fallback to the `<0xNN>` tokens, and a decoder undoing all of it."""
    architecture = fields.get("general.architecture")
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    token_types: list[int] = fields.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    scores: list[float] = fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    add_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    if architecture in _MERGES_IN_FILE_ORDER:
        # Gemma's files spell tokens made of several spaces with real spaces; the text they match
        # has been through the `▁` normalizer, so they are respelled (unless that spelling exists).
        vocab = set(tokens)
        tokens = [t if t.strip(" ") or "▁" * len(t) in vocab else "▁" * len(t) for t in tokens]
        rank = list(range(len(tokens)))
    else:
        rank = [-score for score in scores]
    unknown = next((t for t, kind in zip(tokens, token_types) if kind == UNKNOWN), None)
    backend = tokenizers.Tokenizer(models.BPE(vocab=_vocab(tokens), merges=_spm_merges(tokens, rank),
                                              unk_token=unknown, fuse_unk=True, byte_fallback=True))
    if add_prefix and architecture not in _PREFIX_EVERY_SEGMENT:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        prefix = [normalizers.Prepend("▁")] if add_prefix else []
        backend.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    _add_special_tokens(backend, tokens, token_types)
    return backend


def _spm_merges(tokens: list[str], rank: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: each way of cutting a token in two
    pieces that are tokens too, ordered by the token's rank (lower first; ties in file order).

    SentencePiece (and llama.cpp) merge the adjacent pair whose joined text has the best score;
    BPE merges the pair with the lowest merge rank, so ranking each merge by its result agrees."""
    ids = _vocab(tokens)
    merges = []
    for token, token_id in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                merges.append((rank[token_id], token_id, left, right))
    merges.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in merges]


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    return vocab


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int] | None) -> None:
    """Control and unknown tokens become special tokens; user-defined ones (like `<think>`) added
    tokens that are not special. Both are matched whole in the text before anything else, as
    llama.cpp does; unused and byte tokens stay ordinary vocabulary."""
    if not token_types:
        return
    kinds = dict(zip(tokens, token_types))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in kinds.items() if kind in (CONTROL, UNKNOWN)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in kinds.items() if kind == USER_DEFINED])
