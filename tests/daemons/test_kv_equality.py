"""The K/V a real prefill node pushes into the decode node's slots equals what the decode node
would have computed itself. The decode node runs in this process so its pool can be read."""
from __future__ import annotations

import random
from concurrent import futures

import grpc
import pytest
import torch

from common.engine.core import Engine
from common.kv.segments import slot_range
from decode_node.config import DecodeNodeConfig
from decode_node.node import DecodeNode
from decode_node.service import DecodeNodeService
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from harness.local_daemons import UCX_ENV, prefill_node
from harness.helpers import wire_slots
from harness.reference import FP32


@pytest.fixture
def in_process_decode_node(request, model, tokenizer, monkeypatch):
    for key, value in UCX_ENV.items():
        monkeypatch.setenv(key, value)
    server = grpc.server(futures.ThreadPoolExecutor(8))
    port = server.add_insecure_port("127.0.0.1:0")
    config = DecodeNodeConfig(port=port, transport=request.param, kv_pages=128)
    node = DecodeNode(config, model, tokenizer)
    duet_pb2_grpc.add_DecodeNodeServicer_to_server(DecodeNodeService(node), server)
    server.start()
    yield node
    server.stop(0)
    node.shutdown()


@pytest.mark.parametrize("in_process_decode_node", ["nixl", "tcp"], indirect=True)
def test_received_kv_equals_locally_computed(in_process_decode_node, model, tmp_path):
    node = in_process_decode_node
    prompt = random.Random(5).choices(range(100, 40000), k=300)
    with prefill_node(tmp_path, *FP32, "--transport", node.config.transport) as pn:
        p = node.prepare_receive("kv", prompt, -1)  # once the prefill node is up: a slow start outlasts a lease
        pn.stub.RemoteSend(pb.RemoteSendRequest(
            request_id="kv", token_ids=prompt, kv_window_begin=0, kv_window_end=p.kv_window_end,
            kv_append_metadata=p.kv_append_metadata, decode_address=node.config.advertise_address,
            transfer_nonce=p.transfer_nonce))
    received = node.engine.pool.data[:, :, wire_slots(p.kv_append_metadata)]

    local = Engine(model, num_pages=32, page_size=16)
    seq = local.new_sequence("local", prompt[:-1] + [0], use_prefix_cache=False)
    local.reserve(seq, 299)
    local.forward([(seq, 299)])
    expected = local.pool.data[:, :, slot_range(seq.pages, local.pool.page_size, 0, 299)]
    assert received.abs().sum() > 0
    torch.testing.assert_close(received, expected, atol=1e-5, rtol=1e-5)
    node.abort("kv")
