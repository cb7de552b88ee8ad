"""The continuous-batching loop: same tokens as running each request alone, no page leaks."""
from __future__ import annotations

import time

import pytest
import torch

from common.engine.core import Engine
from common.engine.sampling import SamplingParams
from common.engine.generation import Chunk, FinishReason, Group, RequestHandle, Usage
from common.engine.scheduler import Scheduler
from common.errors import ErrorCode
from harness.helpers import random_ids
from harness.reference import engine_greedy
from harness.engine_checks import assert_pool_whole, collect, collect_samples


@pytest.fixture
def make_scheduler(model, tokenizer):
    started = []

    def make(num_pages: int = 64, page_size: int = 16, max_batch_tokens: int = 512) -> Scheduler:
        s = Scheduler(Engine(model, num_pages, page_size), tokenizer, max_batch_tokens)
        s.start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def test_staggered_requests_with_chunked_prefill_match_solo_runs(model, make_scheduler):
    prompts = [random_ids(n, n) for n in (50, 9, 33, 70)]
    expected = [engine_greedy(model, p, 8) for p in prompts]
    s = make_scheduler(max_batch_tokens=24)  # forces prefill chunks mixed with decodes
    handles = []
    for i, p in enumerate(prompts):
        handles.append(s.submit(str(i), s.engine.new_sequence(str(i), p), GREEDY))
        time.sleep(0.05)
    for h, want in zip(handles, expected):
        tokens, _, last = collect(h)
        assert tokens == want
        assert last.finish_reason == "length" and last.usage.completion_tokens == 8
    assert_pool_whole(s)


def test_preemption_under_a_small_pool_keeps_outputs_exact(model, make_scheduler):
    prompts = [random_ids(30, 100 + i) for i in range(4)]
    expected = [engine_greedy(model, p, 20, page_size=4) for p in prompts]
    s = make_scheduler(num_pages=30, page_size=4)  # 4 x 50 tokens need 52 pages
    handles = [s.submit(str(i), s.engine.new_sequence(str(i), p), SamplingParams(max_tokens=20, ignore_eos=True))
               for i, p in enumerate(prompts)]
    assert [collect(h)[0] for h in handles] == expected
    assert_pool_whole(s)


def test_request_larger_than_the_pool_fails_fast(make_scheduler):
    s = make_scheduler(num_pages=4, page_size=16)
    _, _, last = collect(s.submit("big", s.engine.new_sequence("big", random_ids(100, 5)), GREEDY))
    assert last.finish_reason == "error" and last.error_code is ErrorCode.RESOURCE_EXHAUSTED and "KV pool" in last.error
    assert_pool_whole(s)


def test_the_oldest_request_takes_pages_from_newer_ones_that_arrived_holding_a_prefix(model, make_scheduler):
    """Requests that arrive holding cached pages (a read-back from the disk tier, a returning
    conversation) can hold the whole pool: the oldest then preempts them rather than fail."""
    s = make_scheduler(num_pages=20, page_size=16)
    histories = [random_ids(150, 60 + i) for i in range(2)]
    for i, h in enumerate(histories):  # cached: 10 pages each, the whole pool
        collect(s.submit(f"h{i}", s.engine.new_sequence(f"h{i}", h), GREEDY))
    oldest = random_ids(100, 70)
    returning = [h + random_ids(60, 80 + i) for i, h in enumerate(histories)]
    expected = [engine_greedy(model, p, 8) for p in (oldest, *returning)]
    with s.engine.lock:  # all three submitted before the scheduler's next step
        seqs = [s.engine.new_sequence(f"r{i}", p) for i, p in enumerate(returning)]
        assert s.engine.allocator.num_free == 0 and all(q.num_computed == 150 for q in seqs)
        handles = [s.submit("oldest", s.engine.new_sequence("oldest", oldest), GREEDY)]
        handles += [s.submit(f"r{i}", q, GREEDY) for i, q in enumerate(seqs)]
    outcomes = [collect(h) for h in handles]
    assert [o[2].finish_reason for o in outcomes] == ["length"] * 3
    assert [o[0] for o in outcomes] == expected
    assert_pool_whole(s)


def test_abort_frees_pages(make_scheduler):
    s = make_scheduler()
    h = s.submit("a", s.engine.new_sequence("a", random_ids(20, 6)), SamplingParams(max_tokens=10_000, ignore_eos=True))
    assert h.next_chunk(timeout=60).finish_reason is None
    assert s.abort(h)
    assert collect(h)[2].finish_reason == "abort"
    assert not s.abort(h)
    assert_pool_whole(s)


def test_an_abort_ends_its_own_instance_not_a_newer_one_under_the_same_id(make_scheduler):
    """A stream's late cancellation (gRPC runs its callback when the call ends) may come after a
    continuation took the request id over: it must not end the new instance."""
    s = make_scheduler()
    old = s.submit("a", s.engine.new_sequence("a", random_ids(20, 6)), SamplingParams(max_tokens=10_000, ignore_eos=True))
    assert s.abort(old)
    assert collect(old)[2].finish_reason == "abort"
    new = s.submit("a", s.engine.new_sequence("a", random_ids(20, 7)), SamplingParams(max_tokens=40, ignore_eos=True))
    assert not s.abort(old)
    tokens, _, last = collect(new)
    assert last.finish_reason == "length" and len(tokens) == 40
    assert_pool_whole(s)


def test_prefix_cache_hit_reported_in_usage(make_scheduler, model):
    s = make_scheduler()
    prompt = random_ids(40, 7)
    first, _, _ = collect(s.submit("1", s.engine.new_sequence("1", prompt), GREEDY))
    seq = s.engine.new_sequence("2", prompt)
    second, _, last = collect(s.submit("2", seq, GREEDY))
    # Two full pages and, from the first request's tail page, all but the last prompt token.
    assert first == second and last.usage.cached_tokens == 39 and last.usage.prompt_tokens == 40


def test_stop_strings_and_stop_tokens(make_scheduler, tokenizer):
    s = make_scheduler()
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to 20."}]))
    full_tokens, full_text, _ = collect(s.submit("full", s.engine.new_sequence("full", prompt),
                                                 SamplingParams(max_tokens=40, ignore_eos=True)))
    stop = full_text[10:14]
    _, text, last = collect(s.submit("s", s.engine.new_sequence("s", prompt),
                                     SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,))))
    assert last.finish_reason == "stop" and text == full_text[: full_text.index(stop)]
    tokens, _, last = collect(s.submit("t", s.engine.new_sequence("t", prompt),
                                       SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(full_tokens[5],))))
    assert last.finish_reason == "stop" and tokens == full_tokens[: full_tokens.index(full_tokens[5]) + 1]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(make_scheduler, model):
    s = make_scheduler()
    prompt = random_ids(12, 8)
    hot = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.95, seed=1234, ignore_eos=True)
    a = collect(s.submit("a", s.engine.new_sequence("a", prompt), hot))[0]
    b = collect(s.submit("b", s.engine.new_sequence("b", prompt), hot))[0]
    assert a == b
    k1 = SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True)
    assert collect(s.submit("k", s.engine.new_sequence("k", prompt), k1))[0] == engine_greedy(model, prompt, 8)


@pytest.mark.parametrize("bad, message", [
    (SamplingParams(max_tokens=-1), "max_tokens"),
    (SamplingParams(logprobs=True, top_logprobs=21), "top_logprobs"),
    (SamplingParams(top_logprobs=2), "top_logprobs needs logprobs"),
    (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"),
    (SamplingParams(top_k=-2), "top_k"),
    (SamplingParams(stop_token_ids=(10**9,)), "stop_token_ids"),
    (SamplingParams(n=0), "n must be between 1 and 16"),
    (SamplingParams(n=17), "n must be between 1 and 16"),
])
def test_sampling_validation(bad, message):
    with pytest.raises(ValueError, match=message):
        bad.validate(vocab_size=49152)


def test_parallel_samples_prefill_once_and_each_equals_a_solo_run(model, make_scheduler):
    prompt = random_ids(40, 11)  # 2.5 pages: the samples share two and each copies the third
    want = engine_greedy(model, prompt, 8)
    s = make_scheduler()
    computed = []
    forward = s.engine.forward
    s.engine.forward = lambda work, *a, **k: computed.append(sum(n for _, n in work)) or forward(work, *a, **k)
    h = s.submit("n3", s.engine.new_sequence("n3", prompt), SamplingParams(max_tokens=8, ignore_eos=True, n=3))
    tokens, reasons, last = collect_samples(h)
    assert tokens == {0: want, 1: want, 2: want} and reasons == {0: "length", 1: "length", 2: "length"}
    assert last.usage == Usage(prompt_tokens=40, completion_tokens=24, cached_tokens=0)
    assert sum(computed) == 40 + 3 * 7  # one prefill, then each sample's own decode steps
    assert_pool_whole(s)


@pytest.mark.parametrize("num_pages, max_tokens", [
    (9, 12),  # the copies fit, but the samples' growth (14 pages) preempts the newest ones
    (3, 2),  # no page for any copy: the samples start without KV and are recomputed in turn
])
def test_parallel_samples_survive_a_pool_too_small_for_them(model, make_scheduler, num_pages, max_tokens):
    prompt = random_ids(10, 12)  # pages of 4: two full pages and a partial one
    want = engine_greedy(model, prompt, max_tokens, page_size=4)
    s = make_scheduler(num_pages=num_pages, page_size=4)
    h = s.submit("tight", s.engine.new_sequence("tight", prompt),
                 SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=3))
    tokens, _, last = collect_samples(h)
    assert tokens == {0: want, 1: want, 2: want} and last.usage.completion_tokens == 3 * max_tokens
    assert_pool_whole(s)


def test_abort_ends_every_sample_and_frees_their_pages(make_scheduler):
    s = make_scheduler()
    h = s.submit("a3", s.engine.new_sequence("a3", random_ids(20, 13)),
                 SamplingParams(max_tokens=10_000, ignore_eos=True, n=3, temperature=1.0))
    seen: set[int] = set()
    while seen != {0, 1, 2}:
        chunk = h.next_chunk(timeout=60)
        assert chunk is not None and chunk.finish_reason is None
        seen.add(chunk.index)
    assert s.abort(h)
    _, reasons, last = collect_samples(h)
    assert reasons == {0: "abort", 1: "abort", 2: "abort"} and last.usage.completion_tokens >= 3
    assert_pool_whole(s)


def test_prompt_logprobs_over_chunks_and_a_cached_prefix_equal_transformers(make_scheduler, hf_model):
    """Prompt logprobs computed in 8-token chunks, although a cached prefix of the prompt exists,
    equal transformers' log-softmax at every position; max_tokens 0 then draws nothing."""
    prompt = random_ids(30, 7)
    s = make_scheduler(page_size=4, max_batch_tokens=8)
    collect(s.submit("warm", s.engine.new_sequence("warm", prompt), SamplingParams(max_tokens=1)))
    seq = s.engine.new_sequence("p", prompt, use_prefix_cache=False)
    tokens, _, last = collect(s.submit("p", seq, SamplingParams(max_tokens=0, prompt_logprobs=3)))
    assert tokens == [] and last.finish_reason == "length" and last.usage.completion_tokens == 0
    with torch.inference_mode():
        want = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    got = last.prompt_logprobs
    assert [p.token.token_id for p in got] == prompt and got[0].token.logprob is None and got[0].top == ()
    for position, entry in enumerate(got[1:], start=1):
        row = want[position - 1]
        assert abs(entry.token.logprob - float(row[prompt[position]])) < 1e-4
        assert [t.token_id for t in entry.top] == row.topk(3).indices.tolist()
    assert_pool_whole(s)


def test_drawn_token_logprobs_follow_the_tempered_distribution(make_scheduler, model):
    """Greedy logprobs are the raw log-softmax's; sampled ones (top_k cuts nothing from them) use
    the temperature; top_logprobs are the most likely tokens, most likely first."""
    prompt = random_ids(12, 3)
    s = make_scheduler()
    for temperature in (0.0, 0.7):
        params = SamplingParams(max_tokens=4, temperature=temperature, top_k=5, seed=3, logprobs=True,
                                top_logprobs=2, ignore_eos=True)
        handle = s.submit(f"t{temperature}", s.engine.new_sequence(f"t{temperature}", prompt, False), params)
        chunks = []
        while not chunks or not chunks[-1].final:
            chunks.append(handle.next_chunk(timeout=120))
        tokens = [t for c in chunks for t in c.token_ids]
        entries = [e for c in chunks for e in c.logprobs]
        engine = Engine(model, 8, 16)
        ref = engine.new_sequence("ref", prompt + tokens, use_prefix_cache=False)
        engine.reserve(ref, len(ref.token_ids))
        logits = engine.forward([(ref, len(ref.token_ids))], every_position={0})[len(prompt) - 1 : -1]
        want = (logits / (temperature or 1.0)).log_softmax(-1)
        assert [e.token.token_id for e in entries] == tokens
        for e, row, token in zip(entries, want, tokens):
            assert abs(e.token.logprob - float(row[token])) < 1e-4
            assert [t.token_id for t in e.top] == row.topk(2).indices.tolist()
    assert_pool_whole(s)


def test_handle_merges_a_samples_waiting_chunks_in_order_and_never_into_an_error():
    handle = RequestHandle(Group("r", SamplingParams(), 1, 0))
    outputs = handle.group.outputs
    assert handle.next_chunk(timeout=0) is None
    waiting = [Chunk([1], "a", prompt_logprobs=("p",)), Chunk([2], "b", logprobs=("x",)), Chunk([3], "c", index=1),
               Chunk([4], "d"), Chunk([5], "e", FinishReason.STOP, logprobs=("y",)), Chunk([6], "f", index=1),
               Chunk([], "", FinishReason.ERROR, Usage(1, 6, 0), ErrorCode.INTERNAL, "boom", index=1)]
    for chunk in waiting:
        outputs.put(chunk)
    got = []
    while (chunk := handle.next_chunk(timeout=0)) is not None:
        got.append(chunk)
    assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in got] == [
        (0, [1, 2], "ab", None), (1, [3], "c", None), (0, [4, 5], "de", "stop"), (1, [6], "f", None),
        (1, [], "", "error")]
    assert (got[0].prompt_logprobs, got[0].logprobs, got[2].logprobs) == (("p",), ("x",), ("y",))
    assert got[-1].final and got[-1].error == "boom"
