"""Fuzz targets: the parsers that take bytes from outside, each as a function of one input.

A target's contract: any input either works or raises its documented error (`Target.refusals`),
never anything else, and within `Target.seconds`. `scripts/fuzz.py` runs them under atheris
(coverage-guided, seeded from `tests/fuzz/corpus/TARGET/`); `tests/fuzz/test_fuzz_corpus.py`
replays every corpus file and every past finding through them in `make test`.
"""
from __future__ import annotations

import json
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from unittest import mock

import tokenizers
import torch
from google.protobuf.message import DecodeError
from tokenizers import models, pre_tokenizers

from common.engine.guided import GrammarCompiler
from common.errors import RequestError
from common.kv.block_hashes import ROOT_HASH, chain_hash
from common.kv.disk_tier import DiskTier
from common.kv.page_allocator import PageAllocator
from common.kv.pool import KVPool
from common.kv.segments import MetadataError, Placement, Segments
from common.model.default_model import default_model_path
from common.model.gguf_file import GgufFile
from common.model.hf_loader import config_from_json
from common.model.tokenizer import Tokenizer, load_tokenizer
from common.openai_http import messages_api, responses_api
from common.openai_http.api_errors import ApiError
from common.openai_http.request_mapping import Endpoint, map_request
from common.peers.kv_index import KvIndex
from common.serving.prompts import prompt_token_ids
from common.serving.rpc_convert import continuation_from_proto, sampling_from_proto
from common.transports.connector import WriteWindow
from common.transports.fences import WriteFences
from common.transports.tcp import wire
from common.transports.tcp.receiver import TcpReceiver
from protos.duet.v1 import duet_pb2 as pb

VOCAB = 49152  # the embedded model's
POOL_SLOTS = 4096


@dataclass(frozen=True)
class Target:
    name: str
    one_input: Callable[[bytes], None]
    refusals: tuple[type[BaseException], ...]  # what an input may raise: the parser's documented errors
    seconds: float = 1.0  # the longest one input may take

    def run(self, data: bytes) -> None:
        """`one_input(data)`, its documented refusals swallowed: anything else propagates."""
        try:
            self.one_input(data)
        except self.refusals:
            pass


# Each route that generates, as the HTTP front maps its body (served model "m").
GENERATING_ROUTES: dict[str, Callable[[object], object]] = {
    "chat": lambda b: map_request(Endpoint.CHAT, b, "m"),
    "completions": lambda b: map_request(Endpoint.COMPLETIONS, b, "m"),
    "responses": lambda b: map_request(Endpoint.CHAT, responses_api.chat_body(b), "m"),
    "messages": lambda b: map_request(Endpoint.CHAT, messages_api.chat_body(b), "m"),
}


def map_or_refuse(route: str, body: object) -> None:
    """`body` on `route`: a request, or a 4xx ApiError (swallowed); anything else raises."""
    try:
        GENERATING_ROUTES[route](body)
    except ApiError as exc:
        if not 400 <= exc.status < 500:
            raise AssertionError(f"a bad body answered {exc.status}: {exc}") from None


def _http_body(data: bytes) -> None:
    """A JSON body on each route that generates."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return
    for route in GENERATING_ROUTES:
        map_or_refuse(route, body)


def _kv_metadata(data: bytes) -> None:
    """PrepareReceive's page-segment metadata, both forms, against a pool and a window read from
    the input's first bytes."""
    if len(data) < 4:
        return
    tokens, sliding = struct.unpack_from("<HH", data)
    metadata = [v for (v,) in struct.iter_unpack("<q", data[4:len(data) - (len(data) - 4) % 8])]
    for read in (lambda: Segments.from_wire(metadata, tokens, POOL_SLOTS),
                 lambda: Placement.from_wire(metadata, tokens, POOL_SLOTS, sliding_tokens=sliding % 512,
                                             sliding_slots=POOL_SLOTS // 2)):
        try:
            read()
        except MetadataError:
            pass


@cache
def _grammars() -> GrammarCompiler:
    """The embedded model's grammar compiler, as its decode node's."""
    return GrammarCompiler(load_tokenizer(default_model_path()), VOCAB)


def _generate_request(data: bytes) -> None:
    """A GenerateRequest's bytes as a decode node reads them: sampling, its grammar compiled, a
    continuation."""
    request = pb.GenerateRequest.FromString(data)
    params = sampling_from_proto(request.sampling, VOCAB, _grammars())
    if request.HasField("continuation"):
        continuation_from_proto(request.continuation, params, VOCAB)


def _hf_config(data: bytes) -> None:
    """A Hugging Face model directory's config.json: a model config, or a ValueError."""
    config_from_json(data.decode("utf-8", "replace"))


def _gguf(data: bytes) -> None:
    """A GGUF file: read, or refused with a ValueError naming it."""
    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        if data:  # mmap refuses an empty file (a ValueError too)
            GgufFile(f.name)


TIER_FINGERPRINT = "fuzz-model"
TIER_TOKENS = tuple(range(100, 116))
TIER_BLOCK = chain_hash(ROOT_HASH, TIER_TOKENS)
TIER_PAYLOAD = 64


def _disk_tier_file(data: bytes) -> None:
    """A page file in the disk tier's directory (shared storage, a crash mid-write): the tier
    opens over it and reads it back; a bad file is counted and deleted, never an error."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = DiskTier(Path(tmp), 1 << 20, TIER_FINGERPRINT, TIER_PAYLOAD).directory
        (directory / f"{TIER_BLOCK:016x}.kv").write_bytes(data)
        tier = DiskTier(Path(tmp), 1 << 20, TIER_FINGERPRINT, TIER_PAYLOAD)
        tier.read(TIER_BLOCK, TIER_TOKENS)


def _kv_events(data: bytes) -> None:
    """A node's WatchKvEvents stream as the router's index applies it (each event its length,
    one byte, then its bytes), then the index asked where a prompt's blocks are."""
    index, at = KvIndex(), 0
    while at < len(data):
        length = data[at]
        index.apply("node", pb.KvEvent.FromString(data[at + 1:at + 1 + length]))
        at += 1 + length
    prompt = list(range(64))
    index.note_routed("node", prompt)
    index.cached_tokens(["node"], prompt)


# The window ("r", 7) admitted to the TCP receiver's pool, whose layer 1 is in a sliding group of its own.
TCP_PLACEMENT = Placement(Segments(((4, 3), (20, 5))), Segments(((2, 3),)))
TCP_CANARY = 0x5A5A5A5A  # every word of the pool before an input; outside the window, after it too
TCP_MAX_STREAM = 64 * 1024  # what a socketpair buffers without a reader


@cache
def _tcp_receiver() -> tuple[TcpReceiver, PageAllocator, torch.Tensor]:
    """A receiver on a small pool with TCP_PLACEMENT admitted, its allocator, and the pool's words
    outside the window (a mask of `pool.storage`)."""
    pool = KVPool(num_layers=3, num_kv_heads=1, head_dim=4, num_pages=8, page_size=4, sliding_layers=(1,),
                  sliding_pages=2)
    allocator = PageAllocator(pool.num_pages)
    window = WriteWindow("r", 7, TCP_PLACEMENT, tuple(allocator.allocate(pool.num_pages)), alive=lambda: True)
    receiver = TcpReceiver(pool, WriteFences(allocator, threading.RLock(), quarantine_seconds=60))
    receiver.admit(window)
    pool.storage.fill_(1)
    for layer in range(pool.num_layers):
        pool.layer_kv(layer)[:, window.granted(pool, layer).slots()] = 0
    return receiver, allocator, pool.storage != 0


def _tcp_frame(data: bytes) -> None:
    """A peer's TCP KV connection (BEGIN, LAYER frames, END) as the receiver reads it, each frame
    received in place and staged: it lands, or is refused with a ValueError (a ConnectionError
    when cut short); either way no byte lands outside the window and the fence comes down."""
    receiver, allocator, outside = _tcp_receiver()
    words = receiver.pool.storage.view(torch.int32)
    for stage_below in (0, wire.STAGE_BELOW):
        words.fill_(TCP_CANARY)
        ours, peer = socket.socketpair()
        with ours, peer, mock.patch.object(wire, "STAGE_BELOW", stage_below):
            peer.sendall(data[:TCP_MAX_STREAM])
            peer.shutdown(socket.SHUT_WR)
            try:
                receiver._transfer(ours)
            except (ValueError, ConnectionError):
                pass
        assert bool((words[outside] == TCP_CANARY).all()), "a write landed outside the window"
        assert {allocator.refcount(p) for p in range(allocator.num_pages)} == {1}, "a fence outlived its connection"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _tokenizer_json(data: bytes) -> None:
    """A Hugging Face model directory's tokenizer files, the input's NUL-separated parts in the
    order of TOKENIZER_FILES (an empty or missing part: no such file): a tokenizer that encodes
    and decodes, or a ValueError naming the file."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, part in zip(TOKENIZER_FILES, data.split(b"\0", len(TOKENIZER_FILES) - 1)):
            if part:
                (Path(tmp) / name).write_bytes(part)
        tokenizer = load_tokenizer(tmp)
    ids = tokenizer.encode("Hello, world! <s> 1 + 1 = 2 \u00e9t\u00e9 \U0001f600")
    tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True)
    assert tokenizer.chat_template is None or isinstance(tokenizer.chat_template, str), "a chat template not text"


@cache
def _word_level() -> tokenizers.Tokenizer:
    """A small word-level backend: <s> 0, </s> 1, <unk> 2, then some words."""
    words = ["<s>", "</s>", "<unk>", "user", "assistant", "system", "tool", "hello", "weather", "in", "paris"]
    backend = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    return backend


CHAT = pb.GenerateRequest(
    messages=[pb.ChatMessage(role="system", content="You are terse."),
              pb.ChatMessage(role="user", content="Hello! The weather in Paris?"),
              pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="weather",
                                                                       arguments='{"city": "Paris"}')]),
              pb.ChatMessage(role="tool", content='{"celsius": 21}', tool_call_id="c1"),
              pb.ChatMessage(role="assistant", content="21 degrees."),
              pb.ChatMessage(role="user", content="Thanks")],
    tools=[pb.FunctionTool(name="weather", description="The weather in a city",
                           parameters='{"type": "object", "properties": {"city": {"type": "string"}}}')])


def _chat_template(data: bytes) -> None:
    """A chat template (tokenizer_config.json's, chat_template.jinja, a GGUF's) rendering a
    conversation with a tool call, as a node turns chat messages into a prompt: token ids, or
    InvalidArgument."""
    tokenizer = Tokenizer(_word_level(), eos_token_id=1, bos_token_id=0, chat_template=data.decode("utf-8", "replace"))
    prompt_token_ids(CHAT, tokenizer)


TARGETS = {t.name: t for t in (
    Target("http_body", _http_body, ()),
    Target("kv_metadata", _kv_metadata, ()),
    Target("generate_request", _generate_request, (DecodeError, RequestError)),
    Target("gguf", _gguf, (ValueError,)),
    Target("hf_config", _hf_config, (ValueError,)),
    Target("disk_tier_file", _disk_tier_file, ()),
    Target("kv_events", _kv_events, (DecodeError,)),
    Target("tcp_frame", _tcp_frame, ()),
    Target("tokenizer_json", _tokenizer_json, (ValueError,)),
    Target("chat_template", _chat_template, (RequestError,)),
)}
