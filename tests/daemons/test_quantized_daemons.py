"""`--quantization gguf` on the daemons: a pair computing the embedded model in its GGUF blocks
hands prompts off and streams the in-process engine's greedy tokens for the same weights; a
prefill node computing the dequantized model is refused as an incompatible writer (its model
hash differs), naming the field."""
from __future__ import annotations

import grpc
import pytest

from common.model.checkpoint import load_checkpoint
from common.model.decoder import DecoderModel
from common.model.default_model import default_model_path
from harness.helpers import Started, call_status, no_leak, random_ids, three_calls
from harness.reference import FP32, engine_greedy
from protos.duet.v1 import duet_pb2 as pb

QUANTIZED = (*FP32, "--quantization", "gguf", "--transport", "tcp")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """(decode node, its prefill node, a prefill node of the dequantized model)."""
    with Started(tmp_path_factory.mktemp("quantized")) as s:
        pn = s.spawn("prefill_node", *QUANTIZED)
        plain = s.spawn("prefill_node", *FP32, "--transport", "tcp")
        dn = s.spawn("decode_node", *QUANTIZED, "--prefill", pn.address, "--min-remote-prefill-tokens", "1")
        s.wait()
        yield dn, pn, plain


@pytest.mark.parametrize("length", [40, 600])  # 600: two prefill chunks
def test_a_quantized_pair_gives_the_quantized_engines_tokens(nodes, length):
    dn, pn, _ = nodes
    prompt = random_ids(length, 300 + length)
    tokens, _, sent, _ = three_calls(dn, pn, f"quantized-{length}", prompt, max_tokens=10)
    assert sent is not None and sent.tokens_sent > 0
    model = DecoderModel(load_checkpoint(default_model_path(), "gguf"))
    assert tokens == engine_greedy(model, prompt, 10)
    assert no_leak(dn)


def test_a_prefill_node_of_other_weights_is_refused(nodes):
    dn, _, plain = nodes
    prompt = random_ids(40, 7)
    r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id="other-weights", token_ids=prompt))
    code, exc = call_status(lambda: plain.stub.RemoteSend(pb.RemoteSendRequest(
        request_id="other-weights", token_ids=prompt, kv_window_begin=0, kv_window_end=r.kv_window_end,
        kv_append_metadata=r.kv_append_metadata, decode_address=dn.address, transfer_nonce=r.transfer_nonce)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "model_hash" in exc.details()
    dn.stub.Abort(pb.AbortRequest(request_id="other-weights"))
    assert no_leak(dn)
