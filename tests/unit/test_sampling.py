"""The sampler's random draw (common/engine/sampling.py `draw_from`): each token as often as its
probability says, a token of probability 0 never, the top-k and top-p cuts kept, the same token
when the probabilities carry float noise (a context recomputed on another node), and one uniform
number of the stream per vocabulary entry."""
from __future__ import annotations

import math

import pytest
import torch

from common.engine.sampling import Sampler, SamplingParams, draw_from

CPU = torch.device("cpu")


def _frequencies(probs: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(probs.numel())
    for _ in range(n):
        counts[draw_from(probs, generator)] += 1
    return counts / n


@pytest.mark.parametrize("probs", [
    [0.1, 0.0, 0.6, 0.3],
    [0.0, 0.0, 1.0],
    [0.25, 0.25, 0.25, 0.25, 0.0],
    [1e-4, 0.5 - 1e-4, 0.0, 0.5],
])
def test_each_token_is_drawn_as_often_as_its_probability(probs):
    p = torch.tensor(probs)
    n = 20_000
    seen = _frequencies(p, n)
    for q, f in zip(probs, seen.tolist()):
        if q == 0.0:
            assert f == 0.0  # never, not rarely
        else:
            assert abs(f - q) <= 5 * math.sqrt(q * (1 - q) / n) + 1e-9, (q, f)


def test_a_large_vocabulary_draws_within_the_mass_it_holds():
    """49k tokens, the mass on a few: nothing outside them is drawn, and a tail token whose
    cumulative sum is last still can be (no float32 rounding at the end of the sum)."""
    logits = torch.full((49152,), float("-inf"))
    logits[[7, 300, 49151]] = torch.tensor([0.0, 1.0, 2.0])
    probs = logits.softmax(-1)
    seen = _frequencies(probs, 3000)
    assert set(torch.nonzero(seen).flatten().tolist()) == {7, 300, 49151}
    assert abs(seen[49151].item() - probs[49151].item()) < 0.05


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(temperature=1.0, top_k=2, seed=1), {0, 1}),
    (SamplingParams(temperature=1.0, top_p=0.5, seed=2), {0}),
])
def test_top_k_and_top_p_cuts_are_kept(params, allowed):
    logits = torch.log(torch.tensor([0.55, 0.25, 0.15, 0.05]))
    sampler = Sampler(params)
    assert {sampler.draw(logits).token for _ in range(300)} == allowed


def test_float_noise_in_the_probabilities_does_not_change_the_draw():
    """Logits that drift together by float noise (scaled by 1 + 1e-5, as a decode path and a
    context recomputed on another node may differ), drawn with the same stream: the same token,
    every time, over a 49k vocabulary at temperature 0.8. An inverse-CDF draw (u against the
    running sum of every probability) flips 5 of these 300, and flipped a continued seeded stream
    in tests/daemons/test_crash_continuation.py."""
    gen = torch.Generator().manual_seed(4)
    for _ in range(300):
        logits = torch.randn(49152, generator=gen) * 3 / 0.8
        seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        a = draw_from(logits.softmax(-1), torch.Generator().manual_seed(seed))
        b = draw_from((logits * (1 + 1e-5)).softmax(-1), torch.Generator().manual_seed(seed))
        assert a == b


def test_a_draw_takes_one_uniform_number_per_vocabulary_entry():
    """So a continuation on another node skips exactly as many (Sampler.replay)."""
    probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(3)), -1)
    generator = torch.Generator().manual_seed(5)
    for _ in range(4):
        draw_from(probs, generator)
    follow = torch.rand(1, generator=generator)
    expected = torch.Generator().manual_seed(5)
    torch.rand(4 * 1000, generator=expected)
    assert torch.equal(follow, torch.rand(1, generator=expected))
