"""Parallel sampling (`n > 1`) and tail-page reuse through the real daemons: a decode node and a
prefill node as separate processes on loopback (`--transport tcp`, `--threads 1`)."""
from __future__ import annotations

import grpc
import pytest

from protos.duet.v1 import duet_pb2 as pb
from harness.helpers import no_leak, random_ids, started_pair
from harness.reference import FP32, hf_greedy

PAGE_SIZE = 16
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    common = (*FP32, "--transport", "tcp", "--threads", "1", "--kv-pages", "96", "--page-size", str(PAGE_SIZE))
    # Generate prefills locally (a huge --min-remote-prefill-tokens): the seeded test compares one
    # daemon with itself; the hand-off tests make the three calls explicitly.
    with started_pair(tmp, common, (*common, "--min-remote-prefill-tokens", "100000")) as (dn, pn):
        yield dn, pn


def hand_off(dn, pn, request_id: str, prompt: list[int]) -> tuple[pb.PrepareReceiveResponse, pb.RemoteSendResponse]:
    """PrepareReceive once, then RemoteSend of the window it asked for."""
    r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=request_id, token_ids=prompt), timeout=60)
    sent = pn.stub.RemoteSend(pb.RemoteSendRequest(
        request_id=request_id, token_ids=prompt, kv_window_begin=r.prefix_matched_length,
        kv_window_end=r.kv_window_end, kv_append_metadata=r.kv_append_metadata,
        decode_address=dn.address, transfer_nonce=r.transfer_nonce), timeout=60)
    return r, sent


def samples_of(stream) -> tuple[dict[int, list[int]], dict[int, str], pb.GenerationChunk]:
    """Each sample's tokens and finish reason, and the last chunk, which must carry the usage."""
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        assert chunk.index not in reasons, f"a chunk of sample {chunk.index} after its finish"
        tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
        if chunk.finish_reason:
            reasons[chunk.index] = chunk.finish_reason
    assert [c.HasField("usage") for c in chunks].count(True) == 1 and chunks[-1].HasField("usage")
    return tokens, reasons, chunks[-1]


def test_greedy_samples_of_a_handed_off_prompt_each_equal_transformers(pair, hf_model):
    dn, pn = pair
    prompt = random_ids(37, 21)  # the samples share two full pages and copy the partial third
    r, sent = hand_off(dn, pn, "n3-greedy", prompt)
    assert r.prefix_matched_length == 0 and sent.tokens_sent == 36
    tokens, reasons, last = samples_of(dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="n3-greedy", kv_window_begin=r.kv_window_end,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=3)), timeout=120))
    want = hf_greedy(hf_model, prompt, MAX_TOKENS)
    assert tokens == {0: want, 1: want, 2: want} and reasons == {0: "length", 1: "length", 2: "length"}
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (37, 3 * MAX_TOKENS)


def test_seeded_sample_i_equals_an_n1_request_with_seed_plus_i(pair):
    dn, _ = pair
    prompt = random_ids(29, 22)

    def sampling(n: int, seed: int) -> pb.SamplingParams:
        return pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=seed, ignore_eos=True, n=n)

    tokens, _, last = samples_of(dn.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=sampling(3, 500)),
                                                  timeout=120))
    alone = [samples_of(dn.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=sampling(1, 500 + i)),
                                         timeout=120))[0][0] for i in range(3)]
    assert [tokens[i] for i in range(3)] == alone
    assert len({tuple(t) for t in alone}) > 1, "different seeds should draw different samples"
    assert last.usage.completion_tokens == 3 * MAX_TOKENS


def test_aborting_samples_mid_stream_frees_every_page(pair):
    dn, _ = pair
    stream = dn.stub.Generate(pb.GenerateRequest(
        request_id="n3-abort", token_ids=random_ids(45, 23),
        sampling=pb.SamplingParams(max_tokens=10_000, temperature=1.0, ignore_eos=True, n=3)), timeout=120)
    seen: set[int] = set()
    reasons: dict[int, str] = {}
    aborted = False
    for chunk in stream:
        seen.add(chunk.index)
        if seen == {0, 1, 2} and not aborted:  # every sample is decoding
            dn.stub.Abort(pb.AbortRequest(request_id="n3-abort"), timeout=10)
            aborted = True
        if chunk.finish_reason:
            reasons[chunk.index] = chunk.finish_reason
    assert aborted and reasons == {0: "abort", 1: "abort", 2: "abort"}
    assert no_leak(dn)


def test_prompt_extending_a_finished_sequence_reuses_its_tail_page(pair, hf_model):
    dn, pn = pair
    first = random_ids(37, 24)
    r, _ = hand_off(dn, pn, "tail-a", first)
    out, _, _ = samples_of(dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="tail-a", kv_window_begin=r.kv_window_end,
        sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True)), timeout=120))
    # The decode node computed 37 + 3 positions: two full pages and a tail page of 8. The prefill
    # node computed 36: two full pages and a tail of 4.
    prompt = first + out[0][:3] + random_ids(6, 25)
    r, sent = hand_off(dn, pn, "tail-b", prompt)
    assert r.prefix_matched_length == 40 and sent.tokens_sent == len(prompt) - 1 - 40
    assert sent.tokens_computed == len(prompt) - 1 - 36
    tokens, _, last = samples_of(dn.stub.StartGeneration(pb.StartGenerationRequest(
        request_id="tail-b", kv_window_begin=r.kv_window_end,
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=120))
    assert tokens[0] == hf_greedy(hf_model, prompt, MAX_TOKENS) and last.usage.cached_tokens == 40


@pytest.mark.parametrize("n", [0, 17])
def test_n_outside_1_to_16_is_invalid_argument(pair, n):
    dn, _ = pair
    with pytest.raises(grpc.RpcError) as err:
        list(dn.stub.Generate(pb.GenerateRequest(token_ids=[1, 2, 3], sampling=pb.SamplingParams(n=n)), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"n must be between 1 and 16 parallel samples, got {n}" in err.value.details()


def test_no_page_leaks_after_everything_finished(pair):
    dn, pn = pair
    assert no_leak(dn) and no_leak(pn)
