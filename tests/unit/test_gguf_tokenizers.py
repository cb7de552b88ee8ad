"""The tokenizers GGUF files carry, against transformers' own GGUF tokenizer builder.

Small vocabularies are trained here with `tokenizers` and written into GGUF files as llama.cpp's
converter writes them (token types, merges or scores, `<0xNN>` byte tokens, pre-tokenizer name).
transformers builds a tokenizer from the same file independently of our code
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`); encodings, decodings, special
tokens and the BOS/EOS ids must agree. Byte-level vocabularies are trained on whole lines, so
their merges cross every boundary a pre-tokenizer draws: a wrong split regex changes encodings.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from common.model.gguf_tokenizer import PRE_TOKENIZERS
from common.model.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

CORPUS = """\
The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see, they've said, I'm sure you'd agree.
IT'S LOUD, WE'LL SHOUT -- THEY'RE HERE!!! Don't, won't, can't.
Prices: $1,234.56 (approx 2e10) on 2024-01-01 at 12:30, 3.14159 and 1000000 and 42nd.
def f(x):\n    return x ** 2  # squares\n\tpass\n
    indented   spaces    and\ttabs\t\there, trailing spaces   \n\n\nthree newlines.
héllo wörld — naïve café, Ünïcödé ñandú, Straße, ΕΛΛΗΝΙΚΆ and ελληνικά, кириллица Кириллица.
日本語のテキスト、中文文本，한국어 텍스트. 🤖 robots 😀👍🏽 and 👨‍👩‍👧 family.
CamelCaseWords, snake_case_words, HTTPServerError, iPhone, McDonald's, O'Neill's, WE'LLSEE IT'SOK THEY'REHERE.
Windows line\r\nendings\r\n and a URL: https://example.com/path?q=1&r=2#frag, email a.b@c.de.
"""
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see.",
    "IT'S LOUD and We'Ll SEE, they'RE here, she'd've, WE'LLSEE IT'SOK THEY'REHERE",
    "12345 and 3.14 and 1,000,000.50 and 2024-01-01",
    "  1", "x  42\n\n 7\t\t8", "a   b\t\tc\n\n\nd    \n  ", "\n\nleading newlines and trailing space ",
    "def f(x):\n    return x**2  # 10\n\tpass\n",
    "héllo wörld — naïve café ΕΛΛΗΝΙΚΆ ελληνικά",
    "🤖 robots 😀👍🏽 and 👨‍👩‍👧", "日本語のテキスト, 中文, 한국어",
    "CamelCaseWords HTTPServerError iPhone McDonald's",
    "line\r\nendings\r\n", " leading space", "   ", "",
    "ZZZ qqq unseen ж ❄ words",
]
SPECIAL_TEXTS = ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
                 "text<|im_end|>more<|endoftext|> <think>x</think>"]
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>", "</think>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _write(path: Path, arch: str, fields: dict) -> Path:
    """A GGUF holding only tokenizer metadata (the tokenizer reads nothing else)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tokenizer_model(fields["model"])
    if "pre" in fields:
        writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    if "scores" in fields:
        writer.add_token_scores(fields["scores"])
    if "merges" in fields:
        writer.add_token_merges(fields["merges"])
    writer.add_bos_token_id(fields["bos"])
    writer.add_eos_token_id(fields["eos"])
    if "add_space_prefix" in fields:
        writer.add_add_space_prefix(fields["add_space_prefix"])
    writer.add_add_bos_token(fields.get("add_bos", False))
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _reference(path: Path) -> tokenizers.Tokenizer:
    """transformers' tokenizer for the file, as `from_pretrained(..., gguf_file=...)` builds it."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return backend


@pytest.fixture(scope="module")
def byte_level_fields() -> dict:
    """Byte-level BPE trained on whole lines, so merges span spaces, digits and punctuation."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="merged_with_previous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=1200, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([CORPUS] * 3, trainer)
    model = json.loads(backend.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = CONTROL + [t for t, _ in vocab] + USER_DEFINED
    types = [3] * len(CONTROL) + [1] * len(vocab) + [4] * len(USER_DEFINED)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return dict(model="gpt2", tokens=tokens, types=types, merges=merges, bos=1, eos=2)


@pytest.mark.parametrize("pre", ["llama-bpe", "dbrx", "qwen2", "smollm", "refact", "gpt-2", "olmo", "gpt-4o"])
def test_byte_level_bpe_matches_transformers(tmp_path, byte_level_fields, pre):
    path = _write(tmp_path / f"{pre}.gguf", "llama", dict(byte_level_fields, pre=pre))
    ours, ref = Tokenizer.from_gguf(path), _reference(path)
    if pre in ("smollm", "refact", "gpt-2", "olmo"):
        # transformers' table has no entry for these names and keeps GPT-2's split (see
        # tests/unit/test_tokenizer.py); give it llama.cpp's, so the rest of its build is compared.
        ref.pre_tokenizer = pre_tokenizers.Sequence(
            ([pre_tokenizers.Digits(individual_digits=True)] if pre in ("smollm", "refact") else [])
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    _check_against(ours, ref, byte_level_fields)
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text


@pytest.fixture(scope="module")
def sentencepiece_pieces() -> list[str]:
    """SentencePiece-style BPE pieces (`▁` for a space), in the order training made them."""
    backend = tokenizers.Tokenizer(models.BPE(byte_fallback=True))
    backend.normalizer = tokenizers.normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split("\n", behavior="merged_with_previous")
    trainer = trainers.BpeTrainer(vocab_size=900, min_frequency=1, show_progress=False, limit_alphabet=200)
    backend.train_from_iterator([CORPUS.replace("\n", " \n ")] * 3, trainer)
    vocab = backend.get_vocab()
    return [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if "\n" not in t or t == "\n"]


def _sentencepiece_fields(pieces: list[str], in_file_order: bool) -> dict:
    """As llama.cpp's converter writes a SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256
    byte tokens, the pieces (score -i for the i-th merge), then chat control tokens and unused ones."""
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tail = ["<|im_start|>", "<|im_end|>", "<unused0>", "<unused1>"]
    pieces = [p for p in pieces if p not in head]
    if in_file_order:  # Gemma: the file is in merge order, its scores do not follow it (here: the reverse)
        piece_scores = [float(i) for i in range(len(pieces))]
    else:  # the i-th merge scores -i; the file lists them backwards, so only the scores give the order
        pieces, piece_scores = pieces[::-1], [-float(i) for i in reversed(range(len(pieces)))]
    scores = [0.0] * len(head) + piece_scores + [0.0] * len(tail)
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3, 3, 5, 5]
    return dict(model="llama", tokens=head + pieces + tail, types=types, scores=scores, bos=1, eos=2, add_bos=True)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_sentencepiece_matches_transformers(tmp_path, sentencepiece_pieces, arch):
    fields = _sentencepiece_fields(sentencepiece_pieces, in_file_order=False)
    path = _write(tmp_path / f"{arch}.gguf", arch, dict(fields, add_space_prefix=True))
    ours, ref = Tokenizer.from_gguf(path), _reference(path)
    _check_against(ours, ref, fields)
    for text in TEXTS:
        if text:
            assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text, add_special_tokens=False).ids)
    assert ours.token_bytes(ours._backend.token_to_id("<0x41>")) == b"A"
    spaced = next(t for t in sentencepiece_pieces if t.startswith("▁") and len(t) > 2)
    assert ours.token_bytes(ours._backend.token_to_id(spaced)) == spaced.replace("▁", " ").encode()


def test_gemma_sentencepiece_matches_transformers(tmp_path, sentencepiece_pieces):
    """Gemma: no prefix space, merges in file order, runs of spaces spelled as spaces in the file."""
    fields = _sentencepiece_fields(sentencepiece_pieces, in_file_order=True)
    fields["tokens"] = [" " * len(t) if len(t) > 1 and set(t) == {"▁"} else t for t in fields["tokens"]]
    assert "  " in fields["tokens"]
    path = _write(tmp_path / "gemma.gguf", "gemma2", dict(fields, add_space_prefix=False))
    ours, ref = Tokenizer.from_gguf(path), _reference(path)
    _check_against(ours, ref, fields)
    assert ours.encode("a  b")[1] == fields["tokens"].index("  ")
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text


def _check_against(ours: Tokenizer, ref: tokenizers.Tokenizer, fields: dict) -> None:
    for text in TEXTS + SPECIAL_TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    tokens, types = fields["tokens"], fields["types"]
    control = {i for i, kind in enumerate(types) if kind == 3}
    assert control <= ours.special_token_ids
    for i in control:
        assert ours.encode(tokens[i]) == [i]
        assert ours.decode([i], skip_special_tokens=True) == ""
    for i, kind in enumerate(types):
        if kind == 4:
            assert ours.encode(tokens[i]) == [i] and i not in ours.special_token_ids
    assert (ours.bos_token_id, ours.eos_token_id) == (fields["bos"], fields["eos"])
    assert ours.vocab_size == len(tokens)
    assert ours.chat_template == CHAT_TEMPLATE


def test_add_space_prefix_false_is_honoured(tmp_path, sentencepiece_pieces):
    """llama.cpp reads `tokenizer.ggml.add_space_prefix`; transformers ignores it, so no reference."""
    fields = _sentencepiece_fields(sentencepiece_pieces, in_file_order=False)
    with_prefix = Tokenizer.from_gguf(_write(tmp_path / "a.gguf", "llama", dict(fields, add_space_prefix=True)))
    without = Tokenizer.from_gguf(_write(tmp_path / "b.gguf", "llama", dict(fields, add_space_prefix=False)))
    first = lambda tok: tok.id_to_token(tok.encode("the fox")[0])  # noqa: E731
    assert first(with_prefix).startswith("▁") and not first(without).startswith("▁")
    assert without.decode(without.encode(" the fox")) == " the fox"


@pytest.mark.parametrize("model, pre, complaint", [
    ("bert", None, "unsupported tokenizer.ggml.model 'bert'; supported: 'gpt2' (byte-level BPE), 'llama'"),
    ("gpt2", "deepseek-coder", "unsupported tokenizer.ggml.pre 'deepseek-coder'"),
    ("gpt2", None, "unsupported tokenizer.ggml.pre None"),
])
def test_unsupported_tokenizers_are_refused(tmp_path, model, pre, complaint):
    fields = dict(model=model, tokens=["<s>", "a", "b", "ab"], types=[3, 1, 1, 1], merges=["a b"], bos=0, eos=0)
    if pre is not None:
        fields["pre"] = pre
    with pytest.raises(ValueError, match="supported") as refused:
        Tokenizer.from_gguf(_write(tmp_path / "x.gguf", "llama", fields))
    assert complaint in str(refused.value)
    if model == "gpt2":
        assert all(name in str(refused.value) for name in PRE_TOKENIZERS)


@pytest.mark.parametrize("pre, whole", [("llama-bpe", True), ("qwen2", False)])
def test_llama3_takes_whole_word_tokens_without_merging(tmp_path, pre, whole):
    """Llama 3's tokenizer.json sets `ignore_merges` (llama.cpp too, for these names): a piece that
    is a token is that token even if the merges would not build it. transformers' GGUF builder does
    not, so this is checked on its own: "abc" is a token, but the only merge is "b c"."""
    fields = dict(model="gpt2", pre=pre, tokens=["<s>", "a", "b", "c", "bc", "abc"], types=[3, 1, 1, 1, 1, 1],
                  merges=["b c"], bos=0, eos=0)
    tok = Tokenizer.from_gguf(_write(tmp_path / "x.gguf", "llama", fields))
    assert tok.encode("abc") == ([5] if whole else [1, 4])
