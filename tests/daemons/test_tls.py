"""Mutual TLS on both daemons: authorised nodes hand off KV; anyone else gets nothing."""
from __future__ import annotations

import random

import grpc
import pytest

from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from harness.helpers import started_pair
from harness.reference import FP32, engine_greedy

def test_mutual_tls_hand_off(certs, tmp_path, model):
    node = certs["node"]
    with started_pair(tmp_path, FP32, (*FP32, "--min-remote-prefill-tokens", "1"), tls=node) as (dn, pn):
        prompt = random.Random(1).choices(range(100, 40000), k=60)
        client = duet_pb2_grpc.DecodeNodeStub(certs["client"].channel(dn.address))
        request = pb.GenerateRequest(token_ids=prompt, sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True))
        tokens = [t for c in client.Generate(request, timeout=120) for t in c.token_ids]
        assert tokens == engine_greedy(model, prompt, 6)
        assert pn.metrics()["duet_prefill_computed_tokens_total"] == 59  # the KV crossed over TLS peers

        ca = certs["node"].ca.read_bytes()
        without_client_cert = lambda a: grpc.secure_channel(a, grpc.ssl_channel_credentials(root_certificates=ca))
        for make_channel in (grpc.insecure_channel, without_client_cert, certs["rogue"].channel):
            decode = duet_pb2_grpc.DecodeNodeStub(make_channel(dn.address))
            prefill = duet_pb2_grpc.PrefillNodeStub(make_channel(pn.address))
            for call in (lambda: decode.GetTransportInfo(pb.GetTransportInfoRequest(), timeout=5),
                         lambda: decode.PrepareReceive(pb.PrepareReceiveRequest(request_id="x", token_ids=[1, 2]),
                                                       timeout=5),
                         lambda: prefill.RemoteSend(pb.RemoteSendRequest(request_id="x"), timeout=5)):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        m = dn.metrics()
        assert m["duet_kv_pages_reserved"] == 0
