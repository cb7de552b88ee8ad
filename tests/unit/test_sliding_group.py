"""A hybrid model's sliding layers on pages of their own (common/kv/sliding_pages.py, the engine's
sliding group): partners reference counted, a sequence holding only its window's, the prefix
cache its whole pages', and the engine's tokens those of transformers with a sliding group far
smaller than the sequences it serves."""
from __future__ import annotations

import pytest
import torch

from common.engine.core import Engine
from common.kv.page_allocator import OutOfPages
from common.kv.segments import MetadataError, MultiGroupUnreadable, Placement, Segments
from common.kv.sliding_pages import SlidingPages
from common.model.checkpoint import load_checkpoint
from common.model.decoder import DecoderModel
from harness.reference import hf_greedy
from harness.tiny_families import WINDOW, save_tiny, tiny_prompt

PAGE = 4


def test_partners_are_made_shared_and_given_back_with_their_last_holder():
    sliding = SlidingPages(num_full_pages=10, num_pages=3, page_size=PAGE)
    sliding.hold([7, 2])  # made: the first free sliding pages
    assert sliding.has(7) and sliding.has(2) and not sliding.has(3) and sliding.allocator.num_free == 1
    slots = sliding.slots(torch.tensor([7 * PAGE + 1, 2 * PAGE + 3]))
    assert [int(s) % PAGE for s in slots] == [1, 3] and len({int(s) // PAGE for s in slots}) == 2
    sliding.hold([7], make=False)  # a second holder
    sliding.drop([7])
    assert sliding.has(7) and sliding.holders(7) == 1
    with pytest.raises(OutOfPages):  # all or nothing: two missing, one free
        sliding.hold([3, 4])
    assert not sliding.has(3) and sliding.allocator.num_free == 1
    with pytest.raises(RuntimeError, match="no sliding K/V"):
        sliding.hold([5], make=False)
    sliding.drop([7, 2])
    assert not sliding.has(7) and sliding.allocator.num_free == 3
    with pytest.raises(ValueError, match="no sliding partner"):
        sliding.drop([7])
    with pytest.raises(RuntimeError, match="window bookkeeping"):
        sliding.slots(torch.tensor([7 * PAGE]))


def test_the_two_group_form_round_trips_and_a_single_group_reader_refuses_it():
    placement = Placement(Segments(((40, 6), (8, 2))), Segments(((0, 3),)))
    wire = placement.to_wire()
    assert wire == [-2, 2, 40, 6, 8, 2, 1, 0, 3]
    assert Placement.from_wire(wire, 8, 64, 3, 16) == placement
    assert Placement.from_wire([1, 40, 8], 8, 64, 3, 16) == Placement(Segments(((40, 8),)))  # one group
    with pytest.raises(MultiGroupUnreadable, match="two-group form"):
        Placement.from_wire(wire, 8, 64)
    with pytest.raises(MetadataError, match="the sliding group .* 3 tokens but 4"):
        Placement.from_wire(wire, 8, 64, 4, 16)
    with pytest.raises(MetadataError, match="the sliding group .* pool has 2 slots"):
        Placement.from_wire(wire, 8, 64, 3, 2)
    with pytest.raises(MetadataError, match="names no groups"):
        Placement.from_wire([-2], 8, 64, 3, 16)


@pytest.fixture(scope="module", params=["gemma3_text", "gpt_oss"])
def hybrid(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path)
    return DecoderModel(load_checkpoint(path)), hf


def _generate(engine: Engine, prompt: list[int], n: int, chunk: int = 8) -> list[int]:
    """Chunked prefill, then greedy decode steps, the window trimmed after each forward (as the
    schedulers do); the sequence is released into the prefix cache."""
    seq = engine.new_sequence("s", prompt)
    while seq.num_pending > 1:
        step = min(chunk, seq.num_pending - 1)
        engine.reserve(seq, seq.num_computed + step)
        engine.forward([(seq, step)], logits=False)
        engine.trim_to_window(seq)
    out = []
    for _ in range(n):
        engine.reserve(seq, len(seq.token_ids))
        out.append(int(engine.forward([(seq, seq.num_pending)])[0].argmax()))
        engine.trim_to_window(seq)
        seq.token_ids.append(out[-1])
        held = seq.sliding_to - seq.sliding_from
        assert held <= -(-WINDOW // PAGE) + 1, f"{held} sliding pages held for a {WINDOW}-position window"
    engine.release(seq)
    return out


def test_a_sliding_group_smaller_than_one_sequence_serves_it_as_transformers(hybrid):
    """40-token prompts and 24 tokens each on 16 pages per layer need 16 pages in the full group;
    the sliding group has 6 (the window's 3 and a chunk's 2, one spare): the sliding layers keep
    their window only, and the tokens are transformers' own."""
    model, hf = hybrid
    engine = Engine(model, num_pages=40, page_size=PAGE, sliding_pages=6)
    first, second = tiny_prompt(40), tiny_prompt(41)
    for prompt in (first, second):
        assert _generate(engine, prompt, 24) == hf_greedy(hf, prompt, 24)
    # The next turn of the last conversation reuses its pages: its window's are whole.
    turn = second + hf_greedy(hf, second, 24) + tiny_prompt(42, 6)
    seq = engine.new_sequence("turn", turn)
    assert seq.num_computed == len(second) + 24 - 1  # all it computed: the last token was not fed back
    engine.release(seq, cache=False)
    assert _generate(engine, turn, 8) == hf_greedy(hf, turn, 8)
    with engine.lock:
        engine.prefix_cache.clear()
    assert engine.allocator.num_free == 40 and engine.sliding.allocator.num_free == 6


def test_a_sliding_group_smaller_than_a_window_is_refused(hybrid):
    model, _ = hybrid
    with pytest.raises(ValueError, match="--kv-sliding-pages 2 cannot hold one request's sliding window of 8"):
        Engine(model, num_pages=40, page_size=PAGE, sliding_pages=2)


def test_a_prompt_sharing_a_finished_ones_head_reuses_it(hybrid):
    """The sliding K/V a window moved past stays (parked) while the group has room, so a prompt
    that shares a finished one's first 30 tokens (a system prompt) matches their whole pages."""
    model, hf = hybrid
    engine = Engine(model, num_pages=64, page_size=PAGE, sliding_pages=32)
    head = tiny_prompt(45, 30)
    _generate(engine, head + tiny_prompt(46, 10), 16)
    assert engine.sliding.num_parked > 0
    second = head + tiny_prompt(47, 10)
    seq = engine.new_sequence("second", second)
    assert seq.num_computed == 28  # the shared head's whole pages
    engine.release(seq, cache=False)
    assert _generate(engine, second, 8) == hf_greedy(hf, second, 8)


def test_forked_samples_and_cold_cached_windows_share_the_sliding_group(hybrid):
    """Parallel samples fork a sequence (full pages shared, the last one copied with its sliding
    partner); when the sliding group runs short, parked K/V goes, then cached pages give up their
    sliding K/V (turning partial, so no match reads it) before a request is refused."""
    model, hf = hybrid
    engine = Engine(model, num_pages=64, page_size=PAGE, sliding_pages=6)
    prompt = tiny_prompt(43, 22)
    want = hf_greedy(hf, prompt, 6)
    seq = engine.new_sequence("parent", prompt)
    engine.reserve(seq, len(prompt))
    engine.forward([(seq, len(prompt) - 1)], logits=False)
    engine.trim_to_window(seq)
    child = engine.fork(seq, "child")
    child.token_ids.append(prompt[-1])  # a sample goes on from the computed positions with its own tokens
    for s in (seq, child):
        out = []
        for _ in range(6):
            engine.reserve(s, len(s.token_ids))
            out.append(int(engine.forward([(s, s.num_pending)])[0].argmax()))
            engine.trim_to_window(s)
            s.token_ids.append(out[-1])
        assert out == want
    engine.release(child)
    engine.release(seq)
    assert engine.sliding.allocator.num_free < 8  # the cache keeps its whole pages' sliding K/V
    # A long prompt's 16-token chunks need the cached windows' sliding pages: taken, not refused.
    long = tiny_prompt(44, 40)
    assert _generate(engine, long, 4, chunk=16) == hf_greedy(hf, long, 4)
    again = engine.new_sequence("again", prompt + want)  # its window's pages gave their sliding K/V up
    assert again.num_computed < len(prompt)
    engine.release(again, cache=False)
