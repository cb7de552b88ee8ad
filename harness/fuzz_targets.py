"""Fuzz targets: the parsers that take bytes from outside, each as a function of one input.

A target's contract: any input either works or raises its documented error (`Target.refusals`),
never anything else, and within `Target.seconds`. `scripts/fuzz.py` runs them under atheris
(coverage-guided, seeded from `tests/fuzz/corpus/TARGET/`); `tests/fuzz/test_fuzz_corpus.py`
replays every corpus file and every past finding through them in `make test`.
"""
from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from google.protobuf.message import DecodeError

from common.engine.guided import GrammarCompiler
from common.errors import RequestError
from common.kv.block_hashes import ROOT_HASH, chain_hash
from common.kv.disk_tier import DiskTier
from common.kv.segments import MetadataError, Placement, Segments
from common.model.default_model import default_model_path
from common.model.gguf_file import GgufFile
from common.model.hf_loader import config_from_json
from common.model.tokenizer import load_tokenizer
from common.openai_http import messages_api, responses_api
from common.openai_http.api_errors import ApiError
from common.openai_http.request_mapping import Endpoint, map_request
from common.peers.kv_index import KvIndex
from common.serving.rpc_convert import continuation_from_proto, sampling_from_proto
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


TARGETS = {t.name: t for t in (
    Target("http_body", _http_body, ()),
    Target("kv_metadata", _kv_metadata, ()),
    Target("generate_request", _generate_request, (DecodeError, RequestError)),
    Target("gguf", _gguf, (ValueError,)),
    Target("hf_config", _hf_config, (ValueError,)),
    Target("disk_tier_file", _disk_tier_file, ()),
    Target("kv_events", _kv_events, (DecodeError,)),
)}
