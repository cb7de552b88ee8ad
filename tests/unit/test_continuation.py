"""What lets another node continue a generation exactly: a sampler replays the tokens drawn
elsewhere (its grammar and random stream end where the first node's did), and a packed linear
layer's row does not depend on the batch it is computed in (a prompt's last token is computed
alone after a hand-off, inside a chunk when prefilled locally)."""
from __future__ import annotations

import pytest
import torch

from common.engine.sampling import Sampler, SamplingParams
from common.model.packed_linear import Linear

VOCAB = 49152
CPU = torch.device("cpu")


def draws(sampler: Sampler, logits: list[torch.Tensor]) -> list[int]:
    return [sampler.draw(row).token for row in logits]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=7),
                                    SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=3)])
def test_a_replayed_random_stream_draws_what_the_first_would_have(params):
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(VOCAB, generator=gen) * 3 for _ in range(12)]
    first = Sampler(params)
    drawn = draws(first, logits)
    from_seed = Sampler(params)
    from_seed.replay(drawn[:8], VOCAB, CPU)
    assert draws(from_seed, logits[8:]) == drawn[8:]
    interrupted = Sampler(params)
    draws(interrupted, logits[:8])
    from_state = Sampler(params)
    from_state.replay(drawn[:8], VOCAB, CPU, interrupted.random_state())
    assert draws(from_state, logits[8:]) == drawn[8:]
    assert draws(Sampler(params), logits[8:]) != drawn[8:]  # without the replay, the stream starts over


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_packed_rows_product_does_not_depend_on_its_batch(dtype):
    gen = torch.Generator().manual_seed(1)
    for out_features, in_features in [(576, 1536), (1536, 576)]:
        layer = Linear((torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype))
        rows = torch.randn(33, in_features, generator=gen).to(dtype)
        alone = torch.cat([layer(rows[i : i + 1]) for i in range(33)])
        for batch in (2, 3, 7, 17, 33):
            assert torch.equal(layer(rows[:batch]), alone[:batch]), (out_features, in_features, batch)
