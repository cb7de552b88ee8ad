"""Speculative decoding (prompt-lookup drafts): the output is the non-speculative output."""
from __future__ import annotations

import random

import pytest
import torch

from common.engine.core import Engine, Sequence
from common.engine.guided import GrammarCompiler, GuidedSpec
from common.engine.ngram_proposer import propose_ngram
from common.engine.sampling import Draw, SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.speculative import DraftState, SpeculativeConfig, Speculator
from common.errors import ErrorCode
from common.model.checkpoint import load_checkpoint
from common.model.decoder import DecoderModel
from common.model.tokenizer import load_tokenizer
from harness.helpers import random_ids
from harness.reference import engine_greedy, hf_greedy
from harness.engine_checks import assert_pool_whole, collect, collect_samples
from harness.tiny_mistral import PAGE, WINDOW_PAGES
from harness.tiny_mistral import VOCAB as WINDOW_VOCAB

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=5, ngram_min=1, ngram_max=3)


def test_proposer_takes_the_most_recent_longest_suffix_match():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 7, 2, 3, 5, 6, 1, 2, 3]
    # Suffix [1, 2, 3] recurs at 0..2 (followed by 9, 7); [2, 3] alone also at 5..6 (then 5, 6).
    assert propose_ngram(tokens, 2, 1, 3) == [9, 7]
    assert propose_ngram(tokens, 2, 1, 2) == [5, 6]  # only 2-grams: the most recent match wins
    assert propose_ngram(tokens, 10, 1, 3) == tokens[3:]  # a draft may run up to the end
    assert propose_ngram([4, 5, 6, 7], 3, 1, 3) == []  # the last token never occurred before
    assert propose_ngram([1, 2, 8, 2], 3, 2, 3) == []  # only a 1-gram recurs, 2 are needed
    assert propose_ngram([5, 5, 5], 4, 1, 4) == [5]


_NAMES = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]


def _copy(tokenizer, seed: int) -> list[int]:
    """A chat prompt asking to repeat a small piece of code: the model copies it, and the
    proposer drafts the copy from the prompt, so most drafts are accepted."""
    names = random.Random(seed).sample(_NAMES, 3)
    code = "".join(f"def {n}(x, y):\n    return x * {i} + y\n\n" for i, n in enumerate(names))
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Repeat this exactly:\n" + code}]))


class _Counts:
    def __init__(self, speculator: Speculator) -> None:
        self.drafted = self.accepted = self.steps = 0
        speculator.observers.append(self)

    def __call__(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1


@pytest.fixture
def make_pair(model, tokenizer):
    """A scheduler with speculation and one without, on engines alike."""
    started = []

    def make(num_pages: int = 64, page_size: int = 16, max_batch_tokens: int = 512,
             config: SpeculativeConfig = NGRAM) -> tuple[Scheduler, Scheduler, _Counts]:
        spec = Scheduler(Engine(model, num_pages, page_size), tokenizer, max_batch_tokens, speculative=config)
        plain = Scheduler(Engine(model, num_pages, page_size), tokenizer, max_batch_tokens)
        for s in (spec, plain):
            s.start()
            started.append(s)
        return spec, plain, _Counts(spec.speculator)

    yield make
    for s in started:
        s.stop()


def _run_all(s: Scheduler, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    handles = [s.submit(str(i), s.engine.new_sequence(str(i), p), params) for i, p in enumerate(prompts)]
    return [collect(h) for h in handles]


def test_greedy_batch_equals_engine_reference_and_drafts_are_accepted(model, make_pair, tokenizer):
    prompts = [_copy(tokenizer, 1), random_ids(30, 2), _copy(tokenizer, 3)]
    spec, _, counts = make_pair(page_size=4)  # drafts cross page boundaries; rejected pages come back
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    results = _run_all(spec, prompts, params)
    for p, (tokens, _, last) in zip(prompts, results):
        assert tokens == engine_greedy(model, p, 24, page_size=4)
        assert last.finish_reason == "length" and last.usage.completion_tokens == 24
    assert counts.accepted > 0 and counts.drafted > counts.accepted  # some accepted, some rejected
    assert counts.steps < 3 * 24  # fewer steps than tokens
    assert_pool_whole(spec)


def test_seeded_sampling_and_logprobs_match_non_speculative(make_pair, tokenizer):
    spec, plain, counts = make_pair()
    prompts = [_copy(tokenizer, 4), random_ids(20, 5)]
    params = SamplingParams(max_tokens=20, temperature=0.7, top_k=50, seed=123, ignore_eos=True,
                            logprobs=True, top_logprobs=2)
    want = _run_all(plain, prompts, params)
    got = _run_all(spec, prompts, params)
    assert counts.accepted > 0
    for (w_tokens, w_text, _), (g_tokens, g_text, _) in zip(want, got):
        assert g_tokens == w_tokens and g_text == w_text


def test_logprobs_per_accepted_position(make_pair, tokenizer):
    spec, plain, counts = make_pair()
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2)
    prompt = _copy(tokenizer, 6)
    plain_chunks, spec_chunks = [], []
    for s, out in ((plain, plain_chunks), (spec, spec_chunks)):
        h = s.submit("lp", s.engine.new_sequence("lp", prompt), params)
        while not (c := h.next_chunk(timeout=120)).final:
            out.append(c)
        out.append(c)
    assert counts.accepted > 0
    want = [lp for c in plain_chunks for lp in c.logprobs]
    got = [lp for c in spec_chunks for lp in c.logprobs]
    assert len(got) == len(want) == 16
    for g, w in zip(got, want):
        assert g.token.token_id == w.token.token_id
        assert [t.token_id for t in g.top] == [t.token_id for t in w.top]
        assert g.token.logprob == pytest.approx(w.token.logprob, abs=1e-3)


@pytest.mark.parametrize("finish_after, accepted, kept", [(None, 2, 2), (2, 2, 1), (1, 1, 0)])
def test_verify_counts_every_emitted_draft_token(finish_after, accepted, kept):
    """Draft [5, 6, 7] after pending token 4; the target draws 5, 6, 9. A request that ends on
    an agreeing token (max_tokens, a stop) still accepted it."""
    class Target:  # draws each row's argmax
        def draw(self, row):
            return Draw(int(row.argmax()))

    seq = Sequence("s", [1, 2, 3, 4, 5, 6, 7], num_computed=0)
    state = DraftState(tokens=[5, 6, 7])
    rows = torch.nn.functional.one_hot(torch.tensor([5, 6, 9, 8]), 10).float()
    emitted = []

    def emit(draw: Draw) -> bool:
        emitted.append(draw.token)
        return finish_after is None or len(emitted) < finish_after

    counts = _Counts(speculator := Speculator(NGRAM))
    assert speculator.verify(seq, Target(), rows, state, emit) == accepted
    assert emitted == [5, 6, 9][: finish_after or 3] and (counts.drafted, counts.accepted) == (3, accepted)
    assert seq.token_ids == [1, 2, 3, 4] and seq.num_computed == 4 + kept  # the draft positions whose K/V stay


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_inside_a_draft_is_never_passed(model, make_pair, max_tokens, tokenizer):
    spec, _, _ = make_pair()
    prompt = _copy(tokenizer, 7)
    (tokens, _, last), = _run_all(spec, [prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert tokens == engine_greedy(model, prompt, max_tokens)
    assert last.finish_reason == "length" and last.usage.completion_tokens == max_tokens
    assert_pool_whole(spec)


def test_stop_token_and_stop_string_inside_a_draft(make_pair, tokenizer):
    spec, plain, counts = make_pair()
    prompt = _copy(tokenizer, 8)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    (full, full_text, _), = _run_all(plain, [prompt], params)
    stop_token = full[12]
    (tokens, _, last), = _run_all(spec, [prompt], SamplingParams(max_tokens=30, ignore_eos=True,
                                                                 stop_token_ids=(stop_token,)))
    assert last.finish_reason == "stop" and tokens == full[: full.index(stop_token) + 1]
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    (_, text, last), = _run_all(spec, [prompt], SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))
    assert last.finish_reason == "stop" and text == full_text[: full_text.index(stop)]
    assert counts.accepted > 0
    assert_pool_whole(spec)


def test_parallel_samples_match_non_speculative(make_pair, tokenizer):
    spec, plain, counts = make_pair()
    prompt = _copy(tokenizer, 9)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=3, ignore_eos=True)
    want, _, want_last = collect_samples(plain.submit("n", plain.engine.new_sequence("n", prompt), params))
    got, _, got_last = collect_samples(spec.submit("n", spec.engine.new_sequence("n", prompt), params))
    assert got == want and got_last.usage == want_last.usage
    assert counts.accepted > 0
    assert_pool_whole(spec)


def test_preemption_with_drafts_keeps_outputs_exact(model, make_pair, tokenizer):
    prompts = [_copy(tokenizer, 20 + i) for i in range(4)]
    spec, _, counts = make_pair(num_pages=30, page_size=4)  # 4 x 50 tokens need 52 pages
    results = _run_all(spec, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [r[0] for r in results] == [engine_greedy(model, p, 20, page_size=4) for p in prompts]
    assert counts.accepted > 0
    assert_pool_whole(spec)


def test_abort_mid_generation_frees_pages(make_pair, tokenizer):
    spec, _, _ = make_pair(page_size=4)
    h = spec.submit("a", spec.engine.new_sequence("a", _copy(tokenizer, 10)),
                    SamplingParams(max_tokens=10_000, ignore_eos=True))
    assert h.next_chunk(timeout=60).finish_reason is None
    assert spec.abort(h)
    assert collect(h)[2].finish_reason == "abort"
    assert_pool_whole(spec)


def test_drafts_that_never_match_change_nothing(model, make_pair, monkeypatch):
    spec, _, counts = make_pair(page_size=4)
    prompt = random_ids(20, 11)
    want = engine_greedy(model, prompt, 12, page_size=4)
    # Drafts of a token the greedy continuation never holds: every one is rejected.
    never = next(t for t in range(100, 200) if t not in want)
    monkeypatch.setattr("common.engine.speculative.propose_ngram", lambda tokens, k, lo, hi: [never] * k)
    (tokens, _, last), = _run_all(spec, [prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert tokens == want and last.usage.completion_tokens == 12
    assert counts.drafted > 0 and counts.accepted == 0
    assert counts.steps <= 4  # rejected drafts back off: 1, 2 then 4 steps without drafting
    assert_pool_whole(spec)


def test_per_request_draft_length(make_pair, tokenizer):
    spec, _, counts = make_pair()
    prompt = _copy(tokenizer, 12)
    _run_all(spec, [prompt], SamplingParams(max_tokens=10, ignore_eos=True, num_speculative_tokens=0))
    assert counts.steps == 0
    _run_all(spec, [prompt], SamplingParams(max_tokens=10, ignore_eos=True, num_speculative_tokens=1))
    assert counts.steps > 0 and counts.drafted == counts.steps  # one draft token a step
    with pytest.raises(ValueError, match="above this node's maximum of 5"):
        NGRAM.check(SamplingParams(num_speculative_tokens=6))
    with pytest.raises(ValueError, match="above this node's maximum of 0"):
        SpeculativeConfig().check(SamplingParams(num_speculative_tokens=1))


def test_grammar_masks_apply_per_accepted_position(make_pair, tokenizer, model):
    """A regex the copied code matches: drafts from the prompt pass the mask and are accepted;
    output, text and logprobs are the non-speculative ones."""
    grammar = GrammarCompiler(tokenizer, model.config.vocab_size).compile(
        GuidedSpec("regex", r"(def [a-z]+\(x, y\):\n    return x \* [0-9] \+ y\n\n){1,3}"))
    spec, plain, counts = make_pair()
    prompt = _copy(tokenizer, 13)
    params = SamplingParams(max_tokens=60, guided=grammar, logprobs=True)
    (want, want_text, _), = _run_all(plain, [prompt], params)
    (got, got_text, _), = _run_all(spec, [prompt], params)
    assert got == want and got_text == want_text
    assert counts.accepted > 0
    assert_pool_whole(spec)


def test_sliding_window_model_releases_pages_and_matches_transformers(mistral_dir, hf_mistral):
    """Drafts on a sliding-window model in a pool that holds only the window: rejected pages
    come back, out-of-window pages are released as without speculation, output is exact."""
    model = DecoderModel(load_checkpoint(mistral_dir))
    num_pages = WINDOW_PAGES + 3  # the window, a prefill chunk and a draft's pages
    engine = Engine(model, num_pages, PAGE)
    scheduler = Scheduler(engine, load_tokenizer(mistral_dir), max_batch_tokens=24, speculative=NGRAM)
    counts = _Counts(scheduler.speculator)
    scheduler.start()
    try:
        prompt = random_ids(20, 3, low=3, high=WINDOW_VOCAB) * 5  # recurring n-grams: drafts are proposed
        (tokens, _, last), = _run_all(scheduler, [prompt], SamplingParams(max_tokens=60, ignore_eos=True))
    finally:
        scheduler.stop()
    assert last.finish_reason == "length" and tokens == hf_greedy(hf_mistral, prompt, 60)
    assert counts.drafted > 0
    with engine.lock:
        assert engine.allocator.num_free + engine.prefix_cache.num_cached_pages == num_pages


def test_a_grammar_this_vocabulary_cannot_follow_is_the_request_s_fault(make_pair, tokenizer, model):
    """llguidance's mask for `\\x1d0` lets '0' through first, which its parser then refuses (found by
    tests/daemons/test_fuzz_rpcs.py): the request ends with INVALID_ARGUMENT, with and without drafts, and
    gives its pages back."""
    grammar = GrammarCompiler(tokenizer, model.config.vocab_size).compile(GuidedSpec("regex", "\x1d0"))
    for s in make_pair():
        if isinstance(s, Scheduler):
            (_, _, last), = _run_all(s, [_copy(tokenizer, 3)], SamplingParams(max_tokens=8, guided=grammar))
            assert last.finish_reason == "error" and last.error_code is ErrorCode.INVALID_ARGUMENT, last
            assert "cannot go on with this model's tokens" in last.error
            assert_pool_whole(s)
