"""The servicers' conversions between duet.v1 messages and the nodes' own types
(common/serving/rpc_convert.py): what goes in comes back out."""
from __future__ import annotations

import pytest

from common.engine.guided import GrammarCompiler
from common.node_messages import MigrateResult, NodeLoad, PrefixHolder, ReceiveWindow, SendRequest, SendResult
from common.serving.rpc_convert import from_proto, sampling_from_proto, sampling_to_proto, to_proto
from protos.duet.v1 import duet_pb2 as pb

VOCAB = 49152


@pytest.mark.parametrize("sent", [
    pb.SamplingParams(max_tokens=7),
    pb.SamplingParams(max_tokens=0, temperature=0.75, top_p=0.5, top_k=40, seed=-3, ignore_eos=True,
                      stop=["\n\n", "END"], stop_token_ids=[2, 7], n=3, logprobs=True, top_logprobs=5,
                      prompt_logprobs=0, num_speculative_tokens=0),
    pb.SamplingParams(max_tokens=4, guided=pb.GuidedDecoding(json_schema='{"type": "object"}')),
    pb.SamplingParams(max_tokens=4, guided=pb.GuidedDecoding(json_object=True)),
    pb.SamplingParams(max_tokens=4, guided=pb.GuidedDecoding(regex="[ab]+")),
    pb.SamplingParams(max_tokens=4, guided=pb.GuidedDecoding(choice=pb.GuidedDecoding.Choices(choices=["x", "y"]))),
])
def test_sampling_goes_on_as_the_client_sent_it(sent, tokenizer):
    """A migration rebuilds the client's SamplingParams from the running request's own: every
    field the node reads comes back, and unset optional fields read as their defaults."""
    grammars = GrammarCompiler(tokenizer, VOCAB)
    params = sampling_from_proto(sent, VOCAB, grammars)
    again = sampling_to_proto(params)
    assert _fields(sampling_from_proto(again, VOCAB, grammars)) == _fields(params)
    assert again.guided == sent.guided and list(again.stop) == list(sent.stop)
    assert again.HasField("seed") == sent.HasField("seed")
    assert again.HasField("prompt_logprobs") == sent.HasField("prompt_logprobs")
    assert again.HasField("num_speculative_tokens") == sent.HasField("num_speculative_tokens")


def _fields(params) -> dict:
    """SamplingParams' fields, the grammar by what it was compiled from."""
    fields = dict(vars(params))
    fields["guided"] = None if params.guided is None else params.guided.spec
    return fields


@pytest.mark.parametrize("message, proto_class", [
    (NodeLoad(kv_pages_total=9, kv_pages_free=4, running_requests=2, incarnation=2**63 + 5), pb.NodeLoad),
    (ReceiveWindow(prompt_length=40, prefix_matched_length=16, kv_append_metadata=[1, 16, 24], kv_window_begin=16,
                   kv_window_end=39, lease_deadline_unix=1.8e9 + 0.25, transfer_nonce=2**62 + 1),
     pb.PrepareReceiveResponse),
    (SendRequest(request_id="r", token_ids=[5, 6, 7], kv_window_begin=0, kv_window_end=2, kv_append_metadata=[1, 0, 2],
                 decode_address="10.0.0.2:50051", transfer_nonce=3), pb.RemoteSendRequest),
    (SendResult(tokens_sent=2, tokens_computed=1, bytes_sent=4096, prefill_seconds=0.5, transfer_seconds=0.75),
     pb.RemoteSendResponse),
    (MigrateResult(tokens_moved=30, prefix_matched_length=8, pause_seconds=0.125), pb.MigrateResponse),
    (PrefixHolder(address="10.0.0.3:50051", cached_tokens=64), pb.PrefixHolder),
])
def test_node_messages_cross_the_wire_unchanged(message, proto_class):
    wire = proto_class.FromString(to_proto(message, proto_class).SerializeToString())
    assert from_proto(wire, type(message)) == message
    # Every field of the protobuf message has its dataclass field: nothing is dropped at the servicer.
    assert {f.name for f in proto_class.DESCRIPTOR.fields} == set(vars(message))
