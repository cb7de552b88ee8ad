"""Sliding-window attention and attention sinks, on a tiny random Mistral saved by transformers.

The reference is transformers itself: its Mistral sliding-window attention (eager), and for
sinks the same model under an explicit dense 4D mask written here from the definition. Pages
outside the window must go back to the pool while a sequence runs, in the engine, in the
decode node's reservation and through the real daemons.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from common.engine.attention_window import with_attention_sinks
from common.engine.core import Engine
from common.engine.sampling import SamplingParams
from common.engine.scheduler import Scheduler
from common.model.checkpoint import Checkpoint, load_checkpoint
from common.model.hf_loader import model_config as _config
from common.model.decoder import DecoderModel
from common.model.tokenizer import load_tokenizer
from protos.duet.v1 import duet_pb2 as pb
from harness.helpers import greedy, random_ids, started_pair
from harness.reference import FP32, hf_greedy
from harness.tiny_mistral import PAGE, VOCAB, WINDOW, WINDOW_PAGES

transformers = pytest.importorskip("transformers")

SINKS = 4
PROMPT = 100  # longer than the window: pages wholly before it must not be held


def _teacher_forced(engine: Engine, ids: list[int], prompt: int, chunk: int) -> tuple[dict[int, torch.Tensor], int]:
    """Logits at every position from `prompt - 1` on (prefill in chunks, then one token a step,
    releasing out-of-window pages after each forward as the schedulers do), and the most pages
    the sequence held in a decode step."""
    seq = engine.new_sequence("tf", ids, use_prefix_cache=False)
    logits, most = {}, 0
    while seq.num_computed < len(ids):
        n = min(chunk, prompt - seq.num_computed) if seq.num_computed < prompt else 1
        engine.reserve(seq, seq.num_computed + n)
        if n == 1:
            most = max(most, len(seq.held_pages))
        last = seq.num_computed + n - 1
        logits[last] = engine.forward([(seq, n)])[0]
        engine.trim_to_window(seq)
    engine.release(seq, cache=False)
    return logits, most


def _max_error(ours: dict[int, torch.Tensor], reference: torch.Tensor) -> float:
    return max(float((row - reference[pos]).abs().max()) for pos, row in ours.items())


def test_window_read_from_config(mistral_dir):
    raw = json.loads((mistral_dir / "config.json").read_text())
    assert load_checkpoint(mistral_dir).config.sliding_window == WINDOW
    assert _config({**raw, "sliding_window": None}).sliding_window is None
    assert _config({**raw, "sliding_window": 4096}).sliding_window is None  # covers the whole context
    qwen = {**raw, "model_type": "qwen2", "use_sliding_window": True}
    assert _config({**qwen, "max_window_layers": 0}).sliding_window == WINDOW
    assert _config({**qwen, "use_sliding_window": False}).sliding_window is None
    hybrid = _config({**qwen, "max_window_layers": 1})  # layer 0 full, layer 1 sliding: the pages stay
    assert (hybrid.sliding_window, hybrid.layer_windows) == (None, (None, WINDOW))
    windowless = Checkpoint(_config({**raw, "sliding_window": None}), {}, "hash", mistral_dir)
    with pytest.raises(ValueError, match="--attention-sinks 2: attention sinks need a sliding-window model"):
        with_attention_sinks(windowless, 2)


def test_chunked_prefill_and_decode_match_transformers(mistral_dir, hf_mistral):
    ids = random_ids(PROMPT + 40, 1, low=3, high=VOCAB)
    with torch.no_grad():
        reference = hf_mistral(torch.tensor([ids])).logits[0]
        full = transformers.AutoModelForCausalLM.from_pretrained(
            mistral_dir, attn_implementation="eager", sliding_window=None).eval()(torch.tensor([ids])).logits[0]
    assert float((reference - full).abs().max()) > 1.0  # the window changes this model's output
    ours, most = _teacher_forced(Engine(DecoderModel(load_checkpoint(mistral_dir)), 16, PAGE), ids, PROMPT, chunk=24)
    assert _max_error(ours, reference) < 1e-3
    assert most <= WINDOW_PAGES


def test_attention_sinks_match_a_dense_masked_reference(mistral_dir, hf_mistral):
    ids = random_ids(PROMPT + 40, 2, low=3, high=VOCAB)
    q, k = torch.arange(len(ids))[:, None], torch.arange(len(ids))[None, :]
    attended = (k <= q) & ((q - k < WINDOW) | (k < SINKS))
    mask = torch.zeros(attended.shape).masked_fill(~attended, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        reference = hf_mistral(torch.tensor([ids]), attention_mask=mask).logits[0]
        no_sinks = hf_mistral(torch.tensor([ids])).logits[0]
    assert float((reference - no_sinks).abs().max()) > 1.0  # the sinks change this model's output
    model = DecoderModel(with_attention_sinks(load_checkpoint(mistral_dir), SINKS))
    ours, most = _teacher_forced(Engine(model, 16, PAGE), ids, PROMPT, chunk=24)
    assert _max_error(ours, reference) < 1e-3
    assert most <= WINDOW_PAGES + math.ceil(SINKS / PAGE)


def test_decode_releases_pages_outside_the_window(mistral_dir, hf_mistral):
    """Through the scheduler, in a pool too small for the whole sequence: the freed pages are
    reused, each returned once, and none is held when the request ends."""
    model = DecoderModel(load_checkpoint(mistral_dir))
    num_pages = WINDOW_PAGES + 2  # room for a prefill chunk, far from the 10 pages of 160 positions
    engine = Engine(model, num_pages, PAGE)
    held: list[int] = []
    forward = engine.forward

    def recording_forward(work, on_layer_done=None, **options):
        held.extend(len(seq.held_pages) for seq, n in work if n == 1)
        return forward(work, on_layer_done, **options)

    engine.forward = recording_forward
    scheduler = Scheduler(engine, load_tokenizer(mistral_dir), max_batch_tokens=24)
    scheduler.start()
    try:
        prompt = random_ids(PROMPT, 3, low=3, high=VOCAB)
        handle = scheduler.submit("long", engine.new_sequence("long", prompt),
                                  SamplingParams(max_tokens=60, ignore_eos=True))
        tokens, chunk = [], None
        while chunk is None or chunk.finish_reason is None:
            chunk = handle.next_chunk(timeout=30)
            tokens += chunk.token_ids
    finally:
        scheduler.stop()
    assert chunk.finish_reason == "length"
    assert tokens == hf_greedy(hf_mistral, prompt, 60)
    assert len(held) == 59 and max(held) <= WINDOW_PAGES
    with engine.lock:  # the finished sequence holds nothing; the cache holds only what it recorded
        refs = [engine.allocator.refcount(p) for p in range(num_pages)]
        assert sum(refs) == engine.prefix_cache.num_cached_pages and max(refs) <= 1
        assert engine.allocator.num_free + engine.prefix_cache.num_cached_pages == num_pages


def test_receive_begin_skips_to_the_window(mistral_dir):
    """A receiver of a long prompt reserves only the window's pages; uncached sinks make it
    receive everything from its cached prefix on, cached sinks let it skip again."""
    model = DecoderModel(with_attention_sinks(load_checkpoint(mistral_dir), SINKS))
    engine = Engine(model, 32, PAGE)
    prompt = random_ids(PROMPT, 4, low=3, high=VOCAB)
    cold = engine.new_sequence("cold", prompt)
    assert engine.receive_begin(cold, PROMPT - 1) == 0
    engine.release(cold, cache=False)
    first = engine.new_sequence("first", prompt, use_prefix_cache=False)  # computes page 0, caches it
    engine.reserve(first, PAGE)
    engine.forward([(first, PAGE)])
    engine.release(first)
    warm = engine.new_sequence("warm", prompt)
    assert warm.num_computed == PAGE
    begin = engine.receive_begin(warm, PROMPT - 1)
    assert begin == PROMPT - WINDOW  # the query at PROMPT - 1 attends (PROMPT - 1 - WINDOW, PROMPT - 1]
    engine.reserve(warm, PROMPT - 1)
    assert len(warm.held_pages) == 1 + (PROMPT - 2) // PAGE - begin // PAGE + 1  # the sink page, then the window
    engine.release(warm, cache=False)
    assert engine.allocator.num_free + engine.prefix_cache.num_cached_pages == 32


@pytest.fixture(scope="module")
def pair(mistral_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("window_pair")
    common = (*FP32, "--model", str(mistral_dir), "--transport", "tcp", "--threads", "1", "--page-size", str(PAGE))
    # 8 pages: a 100-token prompt plus 40 tokens needs 9 without the window.
    with started_pair(tmp, (*common, "--kv-pages", "8", "--max-batch-tokens", "24"),
                      (*common, "--kv-pages", "8", "--min-remote-prefill-tokens", "1")) as (dn, pn):
        yield dn, pn


def _tokens(stream) -> list[int]:
    return [t for chunk in stream for t in chunk.token_ids]


def _no_leak(node) -> None:
    load = node.stub.GetLoad(pb.GetLoadRequest())
    assert load.kv_pages_free + load.kv_pages_cached == load.kv_pages_total and load.kv_pages_reserved == 0


def test_daemons_receive_only_the_window(pair, hf_mistral):
    dn, pn = pair
    prompt = random_ids(PROMPT, 5, low=3, high=VOCAB)
    r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="win", token_ids=prompt))
    assert (r.prefix_matched_length, r.kv_window_end) == (0, PROMPT - 1)
    assert r.kv_window_begin == PROMPT - WINDOW  # the first position the query at PROMPT - 1 attends
    assert dn.stub.GetLoad(pb.GetLoadRequest()).kv_pages_reserved <= WINDOW_PAGES
    sent = pn.stub.RemoteSend(pb.RemoteSendRequest(
        request_id="win", token_ids=prompt, kv_window_begin=r.kv_window_begin, kv_window_end=r.kv_window_end,
        kv_append_metadata=r.kv_append_metadata, decode_address=dn.address, transfer_nonce=r.transfer_nonce))
    assert sent.tokens_sent == WINDOW - 1 and sent.tokens_computed == PROMPT - 1
    tokens = _tokens(dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="win", kv_window_begin=r.kv_window_end, sampling=greedy(40))))
    assert tokens == hf_greedy(hf_mistral, prompt, 40)
    _no_leak(dn)
    _no_leak(pn)


def test_daemons_one_call_generate_with_window(pair, hf_mistral):
    dn, pn = pair
    prompt = random_ids(PROMPT + 20, 6, low=3, high=VOCAB)
    computed = pn.metrics()["duet_prefill_computed_tokens_total"]
    tokens = _tokens(dn.stub.Generate(pb.GenerateRequest(request_id="gen", token_ids=prompt, sampling=greedy(30))))
    assert tokens == hf_greedy(hf_mistral, prompt, 30)
    assert pn.metrics()["duet_prefill_computed_tokens_total"] - computed == len(prompt) - 1  # prefilled remotely
    _no_leak(dn)
    _no_leak(pn)
