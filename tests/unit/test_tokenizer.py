"""Tokenizer, chat template and streaming detokenizer, checked against transformers.

transformers builds its own tokenizer from the same GGUF, independently of ours, with one known
difference: its GGUF loader does not know llama.cpp's `smollm` pre-tokenizer type and falls back to
the plain GPT-2 split, without llama.cpp's first step of cutting out every digit. The vocabulary has
no merges involving digits, so this only shows where a run of two or more whitespace characters
precedes a digit ("  1": llama.cpp and we give ["ĠĠ", "1"], transformers ["Ġ", "Ġ", "1"]).
Encodings are therefore compared both against transformers' tokenizer with its pre-tokenizer set to
the smollm split, on every sample, and against it unmodified, on the samples the difference cannot touch.
"""
from __future__ import annotations

import re

import gguf
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from common.model.default_model import default_model_path
from common.model.detokenizer import IncrementalDetokenizer
from common.model.tokenizer import Tokenizer, load_tokenizer

SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see.",
    "12345 and 3.14",
    "price: $1,000.50 (approx 2e10), on 2024-01-01",
    "  1",
    "x  42\n\n 7\t\t8",
    "def f(x):\n    return x**2  # 10\n\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "héllo wörld — naïve café",
    "🤖 robots 😀👍🏽 and 👨‍👩‍👧",
    "日本語のテキスト, 中文, 한국어",
    "a   b\t\tc\n\n\nd    \n  ",
    "\n\nleading newlines and trailing space ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|>",
]
WHITESPACE_RUN_BEFORE_DIGIT = re.compile(r"\s{2}\d")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def ref():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def ref_smollm_split(ref) -> tokenizers.Tokenizer:
    """transformers' tokenizer, with the smollm pre-tokenizer (see the module docstring)."""
    backend = tokenizers.Tokenizer.from_str(ref.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return backend


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_transformers(tok, ref_smollm_split, text):
    assert tok.encode(text) == ref_smollm_split.encode(text).ids


def test_encode_matches_unmodified_transformers_away_from_digits(tok, ref):
    untouched = [text for text in SAMPLES if not WHITESPACE_RUN_BEFORE_DIGIT.search(text)]
    assert len(untouched) >= 10
    for text in untouched:
        assert tok.encode(text) == ref.encode(text), text


def test_whitespace_run_before_digit_splits_like_llama_cpp(tok, ref):
    token = ref.convert_tokens_to_ids
    assert tok.encode("  1") == [token("ĠĠ"), token("1")]
    assert tok.encode("\n 12") == [token("ĊĠ"), token("1"), token("2")]


def test_vocabulary_and_special_tokens(tok, ref):
    assert tok.vocab_size == len(ref) == 49152
    assert tok.eos_token_id == ref.eos_token_id == tok.encode("<|im_end|>")[0]
    special = {i for i, added in ref.backend_tokenizer.get_added_tokens_decoder().items() if added.special}
    assert tok.special_token_ids == special and len(special) == 17
    assert tok.encode("<|im_start|>") == [1]
    assert tok.id_to_token(1) == "<|im_start|>"
    assert tok.encode("hi")[0] != tok.bos_token_id  # no BOS, as the GGUF's add_bos_token=False says


@pytest.mark.parametrize("text", SAMPLES)
def test_decode(tok, ref, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text == ref.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)



@pytest.mark.parametrize("text", SAMPLES)
def test_token_bytes_spell_the_text(tok, ref, text):
    """Each token's bytes (pieces of a character for some) concatenate to the text's UTF-8, and
    a token that decodes to whole characters is exactly those characters' bytes."""
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    for i in ids:
        single = ref.decode([i])
        if "\ufffd" not in single:
            assert tok.token_bytes(i) == single.encode()


CONVERSATIONS = {
    "no_system": [{"role": "user", "content": "Hi there"}],
    "system": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? 🤔"},
    ],
}


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, ref, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_no_chat_template_is_a_clear_error():
    bare = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), eos_token_id=0)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "model, pre, complaint",
    [("bert", "default", "tokenizer.ggml.model 'bert'"), ("gpt2", "deepseek-coder", "tokenizer.ggml.pre 'deepseek-coder'")],
)
def test_unsupported_gguf_tokenizer_is_rejected(tmp_path, model, pre, complaint):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["<s>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"unsupported {complaint}"):
        Tokenizer.from_gguf(path)


def test_load_tokenizer_rejects_other_paths(tmp_path):
    with pytest.raises(ValueError, match=".gguf"):
        load_tokenizer(tmp_path / "model.bin")


def test_from_hf_dir(tmp_path, ref):
    ref.save_pretrained(tmp_path)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    hf = load_tokenizer(tmp_path)
    assert (hf.vocab_size, hf.eos_token_id, hf.bos_token_id) == (49152, 2, 1)
    assert len(hf.special_token_ids) == 17
    for text in SAMPLES:
        assert hf.encode(text) == ref.encode(text)
    messages = CONVERSATIONS["system"]
    assert hf.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def stream(tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    """Every push's delta, then the flush's, and the detokenizer."""
    detok = IncrementalDetokenizer(tok, stop)
    deltas = [detok.push(i) for i in ids]
    return deltas + [detok.flush()], detok


def test_stream_reproduces_decode_of_multibyte_text(tok):
    text = "<|im_start|>assistant\nrobots 🤖 say 日本語 and 😀👍🏽 ok<|im_end|>"
    ids = tok.encode(text)
    deltas, detok = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some character spans several tokens
    assert not any("\ufffd" in delta for delta in deltas)
    assert detok.finished_by_stop is None


def test_stop_string_split_across_tokens(tok):
    ids = tok.encode("The answer is 4.\nUser: and now?")
    stop = "\nUser:"
    assert not any(stop in tok.decode([i]) for i in ids)  # no single token holds it
    detok = IncrementalDetokenizer(tok, [stop])
    deltas = []
    for i in ids:
        deltas.append(detok.push(i))
        assert "".join(deltas) == "The answer is 4."[: len("".join(deltas))]
    assert "".join(deltas) == "The answer is 4."
    assert detok.finished_by_stop == stop
    assert detok.push(tok.encode(" more")[0]) == "" and detok.flush() == ""


def test_stop_string_inside_one_token(tok):
    deltas, detok = stream(tok, tok.encode("Hello wonderful world"), ("world", "nderf"))  # the earliest wins
    assert "".join(deltas) == "Hello wo"
    assert detok.finished_by_stop == "nderf"


def test_flush_returns_what_is_held_back(tok):
    text = "Counting: one two three"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, ["STOP!"])
    emitted = "".join(detok.push(i) for i in ids)
    assert emitted == text[:-4]  # the last len(stop) - 1 characters wait for more
    assert detok.flush() == text[-4:]
    assert detok.flush() == ""
    assert detok.finished_by_stop is None


def test_flush_emits_an_incomplete_character(tok):
    ids = tok.encode("ok 🤖")
    detok = IncrementalDetokenizer(tok)
    emitted = "".join(detok.push(i) for i in ids[:-1])
    assert emitted == "ok"  # the next token is " " plus the robot's first bytes
    assert detok.flush() == tok.decode(ids[:-1])[len("ok") :] == " \ufffd"


def test_decodes_a_bounded_window(tok):
    lengths: list[int] = []

    class Recording:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode("word " * 300)
    deltas, _ = stream(Recording(), ids)
    assert "".join(deltas) == "word " * 300
    assert max(lengths) <= 3


# The vocabulary has no token for some bytes: those of a few control characters, and the lead
# bytes 0xF1 and 0xF2 (code points U+40000..U+BFFFF, all unassigned). Text with them cannot be encoded.
UNENCODABLE = "\x04\x06\x13\x14\x16\x1d"
ENCODABLE_TEXT = st.text(
    st.characters(codec="utf-8", max_codepoint=0x3FFFF, exclude_characters=UNENCODABLE), min_size=1, max_size=40
)


def test_unencodable_characters_are_dropped_like_transformers(tok, ref):
    text = "a\x04b\U00040000c"
    assert tok.encode(text) == ref.encode(text)
    assert tok.decode(tok.encode(text)) == "ab" + "\ufffd" * 3 + "c"  # 3 stray continuation bytes


@settings(max_examples=150, deadline=None)
@given(text=ENCODABLE_TEXT, data=st.data())
def test_stream_property(tok, text, data):
    """Any text streams back whole; with a stop string from it, exactly up to its first occurrence."""
    ids = tok.encode(text)
    deltas, detok = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : data.draw(st.integers(start + 1, len(text)))]
    deltas, detok = stream(tok, ids, (stop,))
    assert "".join(deltas) == text[: text.index(stop)]
    assert detok.finished_by_stop == stop
