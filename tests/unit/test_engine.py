"""Paged KV, chunked prefill and batched decode all compute the same thing."""
from __future__ import annotations

import pytest
import torch

from common.engine.core import Engine
from common.kv.page_allocator import OutOfPages
from common.kv.segments import slot_range
from harness.helpers import random_ids
from harness.reference import engine_greedy, engine_greedy_many, greedy_gaps
from harness.engine_checks import full_logits


def test_scattered_pages_equal_contiguous(model):
    ids = random_ids(70, 0)
    assert torch.allclose(full_logits(model, ids, scatter=True), full_logits(model, ids, scatter=False), atol=1e-5)


def test_chunked_prefill_equals_one_shot(model):
    ids = random_ids(100, 1)
    engine = Engine(model, num_pages=64, page_size=16)
    one = engine.new_sequence("one", ids, use_prefix_cache=False)
    engine.reserve(one, len(ids))
    expected = engine.forward([(one, len(ids))])[0]
    chunked = engine.new_sequence("chunked", ids, use_prefix_cache=False)
    for n in (7, 16, 33, 44):
        engine.reserve(chunked, chunked.num_computed + n)
        got = engine.forward([(chunked, n)])[0]
    assert torch.allclose(got, expected, atol=1e-4)
    # Both sequences hold the same K/V for the same positions.
    a = slot_range(one.pages, engine.pool.page_size, 0, len(ids))
    b = slot_range(chunked.pages, engine.pool.page_size, 0, len(ids))
    assert torch.allclose(engine.pool.data[:, :, a], engine.pool.data[:, :, b], atol=1e-4)


def test_batched_decode_of_mixed_lengths_equals_each_alone(model):
    prompts = [random_ids(n, 10 + n) for n in (5, 17, 40, 64)]
    # One batched prefill of all prompts, then batched single-token decode steps.
    assert engine_greedy_many(model, prompts, 6) == [engine_greedy(model, p, 6) for p in prompts]


def test_greedy_gaps_are_zero_along_the_greedy_output_and_large_off_it(model):
    prompt = random_ids(50, 12)
    tokens = engine_greedy(model, prompt, 8)
    assert max(greedy_gaps(model, prompt, tokens)) < 1e-4
    wrong = tokens[:5] + [(tokens[5] + 1) % 1000 + 100] + tokens[6:]
    gaps = greedy_gaps(model, prompt, wrong)
    assert max(gaps[:5]) < 1e-4 and gaps[5] > 0.1


def test_reserve_is_all_or_nothing(model):
    engine = Engine(model, num_pages=4, page_size=16)
    seq = engine.new_sequence("big", random_ids(100, 2), use_prefix_cache=False)
    with pytest.raises(OutOfPages):
        engine.reserve(seq, 100)
    assert seq.pages == [] and engine.allocator.num_free == 4


def test_release_caches_full_pages_for_the_next_request(model):
    engine = Engine(model, num_pages=16, page_size=16)
    ids = random_ids(40, 3)
    first = engine.new_sequence("a", ids)
    engine.reserve(first, 40)
    expected = engine.forward([(first, 40)])[0]
    engine.release(first)
    assert engine.prefix_cache.num_cached_pages == 3  # two full pages and the partial third
    second = engine.new_sequence("b", ids)
    # The partial page is handed over: only the last token is left to compute.
    assert second.num_cached == second.num_computed == 39
    engine.reserve(second, 40)
    assert torch.allclose(engine.forward([(second, 1)])[0], expected, atol=1e-4)
    engine.release(second)
    with engine.lock:  # the allocator's free list wakes admission: only under the engine lock
        engine.prefix_cache.clear()
    assert engine.allocator.num_free == 16


def test_the_prefix_cache_checks_the_engine_lock(model):
    """The engine hands the cache its lock: changing the cache without holding it is refused (every
    other engine test changes it through the engine's `locked` methods, checked too)."""
    engine = Engine(model, num_pages=4, page_size=16)
    with pytest.raises(RuntimeError, match="engine lock"):
        engine.prefix_cache.clear()
    with engine.lock:
        engine.prefix_cache.clear()


def test_fork_shares_full_pages_and_copies_the_partial_one(model):
    engine = Engine(model, num_pages=16, page_size=16)
    prompt = random_ids(40, 5)
    parent = engine.new_sequence("parent", prompt, use_prefix_cache=False)
    engine.reserve(parent, 40)
    engine.forward([(parent, 40)])
    child = engine.fork(parent, "child")
    assert child.token_ids == prompt and child.num_computed == 40
    assert child.pages[:2] == parent.pages[:2] and child.pages[2] != parent.pages[2]
    assert [engine.allocator.refcount(p) for p in parent.pages + child.pages[2:]] == [2, 2, 1, 1]
    pool = engine.pool
    assert torch.equal(pool.data[:, :, slot_range(child.pages, pool.page_size, 0, 40)],
                       pool.data[:, :, slot_range(parent.pages, pool.page_size, 0, 40)])

    # Each continues with a token of its own; the child's writes leave the parent's page alone.
    parent_page = pool.data[:, :, slot_range(parent.pages, pool.page_size, 32, 48)].clone()
    child.token_ids.append(222)
    engine.reserve(child, 41)
    child_logits = engine.forward([(child, 1)])[0]
    assert torch.equal(pool.data[:, :, slot_range(parent.pages, pool.page_size, 32, 48)], parent_page)
    parent.token_ids.append(111)
    engine.reserve(parent, 41)
    parent_logits = engine.forward([(parent, 1)])[0]
    for tokens, logits in ((prompt + [222], child_logits), (prompt + [111], parent_logits)):
        alone = engine.new_sequence("alone", tokens, use_prefix_cache=False)
        engine.reserve(alone, 41)
        assert torch.allclose(engine.forward([(alone, 41)])[0], logits, atol=1e-4)
        engine.release(alone, cache=False)

    engine.release(parent, cache=False)
    engine.release(child, cache=False)
    assert engine.allocator.num_free == 16


def test_fork_at_a_page_boundary_copies_nothing_and_a_full_pool_changes_nothing(model):
    engine = Engine(model, num_pages=3, page_size=16)
    parent = engine.new_sequence("parent", random_ids(33, 6), use_prefix_cache=False)
    engine.reserve(parent, 33)
    parent.num_computed = 32  # as if computed: forking only moves page references
    child = engine.fork(parent, "child")
    assert child.pages == parent.pages[:2] and engine.allocator.num_free == 0
    parent.num_computed = 33
    with pytest.raises(OutOfPages):
        engine.fork(parent, "no-room")
    assert [engine.allocator.refcount(p) for p in parent.pages] == [2, 2, 1]
    engine.release(child, cache=False)
    engine.release(parent, cache=False)
    assert engine.allocator.num_free == 3
