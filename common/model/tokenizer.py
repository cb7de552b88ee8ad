"""Text <-> token ids, and chat-template rendering, without transformers.

Two sources: the tokenizer metadata embedded in a GGUF file (rebuilt the way llama.cpp reads it),
or a Hugging Face model directory holding `tokenizer.json`.
"""
from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Iterable

import tokenizers
from tokenizers import decoders

from common.model.chat_template import ChatTemplate
from common.model.gguf_tokenizer import read_gguf_tokenizer


# What every tokenizer.json must encode and decode, checked at load.
PROBE_TEXT = "Hello, world! 1 + 1 = 2 \u00e9t\u00e9 \U0001f600 \U0010fffd"


class Tokenizer:
    """Encodes without adding BOS/EOS: prompts get their special tokens from the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token_id: int,
        bos_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer a GGUF file carries: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) with
        one of the pre-tokenizers in `gguf_tokenizer.PRE_TOKENIZERS`, or SentencePiece (`"llama"`);
        others are refused (common/model/gguf_tokenizer.py)."""
        found = read_gguf_tokenizer(path)
        return cls(found.backend, eos_token_id=found.eos_token_id, bos_token_id=found.bos_token_id,
                   chat_template=found.chat_template)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face model directory: `tokenizer.json` plus whichever configs are present.
        A file that cannot be read, or holds a value of the wrong kind, is a ValueError naming it."""
        path = Path(path)
        # tokenizers raises a bare Exception; some files load, then fail on any text (an unk token not in the vocabulary).
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
            backend.decode(backend.encode(PROBE_TEXT, add_special_tokens=False).ids)
        except Exception as exc:
            raise ValueError(f"{path / 'tokenizer.json'}: {exc}") from None
        tokenizer_config = _read_json(path / "tokenizer_config.json")
        configs = {name: _read_json(path / name) for name in ("generation_config.json", "config.json")}
        vocab_size = backend.get_vocab_size(with_added_tokens=True)

        def token_id(name: str) -> int | None:
            """The id of `<name>_token` from tokenizer_config, else `<name>_token_id` from the configs."""
            token = tokenizer_config.get(f"{name}_token")
            if isinstance(token, dict):  # serialized AddedToken
                token = token.get("content")
            if isinstance(token, str) and backend.token_to_id(token) is not None:
                return backend.token_to_id(token)
            for file, config in configs.items():
                found = config.get(f"{name}_token_id")
                if isinstance(found, list):  # several stop ids: the first is the primary one
                    found = found[0] if found else None
                if found is not None:
                    if type(found) is not int or not 0 <= found < vocab_size:
                        raise ValueError(f"{path / file}: {name}_token_id must be a token id below the vocabulary's "
                                         f"{vocab_size}, got {found!r}")
                    return found
            return None

        eos_token_id = token_id("eos")
        if eos_token_id is None:
            raise ValueError(f"{path}: no eos token in tokenizer_config.json, generation_config.json or config.json")
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text()
        else:
            chat_template = tokenizer_config.get("chat_template")
            if not isinstance(chat_template, str | None):
                raise ValueError(f"{path / 'tokenizer_config.json'}: chat_template must be a string, got "
                                 f"{type(chat_template).__name__}")
        return cls(backend, eos_token_id, token_id("bos"), chat_template)

    def save_hf(self, out_dir: str | Path, model_max_length: int) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (special tokens, chat template), as a
        Hugging Face model directory holds them; `from_hf_dir` and transformers read them back."""
        out_dir = Path(out_dir)
        self._backend.save(str(out_dir / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                  "eos_token": self._token_text(self.eos_token_id), "clean_up_tokenization_spaces": False}
        if self.bos_token_id is not None:
            config["bos_token"] = self._token_text(self.bos_token_id)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (part of a UTF-8 character, for some tokens)."""
        return self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""

    def to_json(self) -> str:
        """The Hugging Face `tokenizers` JSON of this tokenizer (what grammar engines build from)."""
        return self._backend.to_str()

    @cached_property
    def _token_bytes(self) -> list[bytes]:
        byte_level = isinstance(self._backend.decoder, decoders.ByteLevel)
        table = []
        for token_id in range(self.vocab_size):
            piece = self.id_to_token(token_id) or ""
            if byte_level and token_id not in self.special_token_ids and all(c in _BYTE_OF_CHAR for c in piece):
                table.append(bytes(_BYTE_OF_CHAR[c] for c in piece))
            elif (byte := _BYTE_FALLBACK.fullmatch(piece)) is not None:
                table.append(bytes([int(byte.group(1), 16)]))
            elif not byte_level and token_id not in self.special_token_ids and "\u2581" in piece:
                # SentencePiece: decoding a lone token would strip the space its `▁` stands for.
                table.append(piece.replace("\u2581", " ").encode())
            else:
                table.append(self.decode([token_id]).encode())
        return table

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render a conversation to prompt text, as transformers' `apply_chat_template(tokenize=False)`
        does; `tools` (OpenAI's function tools) reach templates that take them (`takes_tools`)."""
        extra = {} if tools is None else {"tools": tools}
        return self._chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
            **extra,
        )

    @cached_property
    def takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (renders function definitions itself)."""
        return bool(self.chat_template) and "tools" in self._chat_template.variables

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.id_to_token(token_id) or ""

    @cached_property
    def _chat_template(self) -> ChatTemplate:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; format the prompt yourself")
        return ChatTemplate(self.chat_template)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte -> the byte: printable Latin-1 bytes
    stand for themselves, the other bytes for the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + i)) for i, b in enumerate(others))
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a `.gguf` file or of a Hugging Face model directory; ValueError when it
    cannot be read (naming the file)."""
    path = Path(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    raise ValueError(f"{path}: expected a .gguf file or a directory with tokenizer.json")


def _read_json(path: Path) -> dict:
    """A JSON object file's content ({} when there is no such file); ValueError naming it else."""
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path}: must hold a JSON object, not {type(content).__name__}")
    return content
