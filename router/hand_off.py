"""The three-call hand-off run by a client over N prefill x M decode nodes.

For each request: pick the decode node with the most room (fewest requests in flight from
here, then most free KV pages), reserve there (PrepareReceive), have the least-loaded healthy
prefill node push the KV (RemoteSend, retried on another prefill node if one fails before the
KV arrived), then stream StartGeneration. Short prompts, no healthy prefill node, or a failed
hand-off fall back to the decode node's own Generate (local prefill).
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from common.errors import Unavailable
from common.model.tokenizer import Tokenizer
from common.peers.membership import Member, Membership
from common.peers.prefill_pool import PrefillPool
from common.serving.prompts import prompt_token_ids
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

log = logging.getLogger(__name__)


class Router:
    def __init__(self, tokenizer: Tokenizer, decode: Membership[duet_pb2_grpc.DecodeNodeStub], prefill: PrefillPool,
                 min_remote_prefill_tokens: int = 32) -> None:
        self.tokenizer = tokenizer
        self.decode = decode
        self.prefill = prefill
        self.min_remote_prefill_tokens = min_remote_prefill_tokens
        self.registry = CollectorRegistry()
        self.routed = Counter("duet_router_requests", "Requests by how their prompt was prefilled "
                              "(remote: by a prefill node; local: by the decode node)", ["prefill"],
                              registry=self.registry)
        for kind, members in (("decode", decode), ("prefill", prefill)):
            Gauge(f"duet_router_healthy_{kind}_nodes", f"Healthy {kind} nodes", registry=self.registry
                  ).set_function(lambda m=members: len(m.healthy()))

    def pick_decode(self) -> Member:
        healthy = self.decode.healthy()
        if not healthy:
            raise Unavailable("no healthy decode node")
        return min(healthy, key=lambda m: (m.in_flight, -(m.load.kv_pages_free + m.load.kv_pages_cached)))

    def generate(self, request: pb.GenerateRequest) -> Iterator[pb.GenerationChunk]:
        tokens = prompt_token_ids(request, self.tokenizer)
        rid = request.request_id or uuid.uuid4().hex
        dn = self.pick_decode()
        dn.in_flight += 1
        try:
            # A request for prompt logprobs is computed whole on the decode node (its Generate).
            remote = not request.sampling.HasField("prompt_logprobs")
            if remote and self.prefill.healthy() and len(tokens) - 1 >= self.min_remote_prefill_tokens:
                stream = self._hand_off(dn, rid, tokens, request.sampling)
                if stream is not None:
                    self.routed.labels("remote").inc()
                    yield from stream
                    return
            self.routed.labels("local").inc()
            yield from dn.stub.Generate(pb.GenerateRequest(request_id=rid, token_ids=tokens, sampling=request.sampling))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.decode.mark_failed(dn)
            raise
        finally:
            dn.in_flight -= 1

    def _hand_off(self, dn: Member, rid: str, tokens: list[int], sampling: pb.SamplingParams):
        """The three calls; None when the KV did not arrive (the reservation is released)."""
        try:
            r = dn.stub.PrepareReceive(pb.PrepareReceiveRequest(request_id=rid, token_ids=tokens))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None  # the decode node's Generate queues instead of refusing
            raise
        if r.kv_window_end > r.kv_window_begin:
            pushed = self.prefill.push(pb.RemoteSendRequest(
                request_id=rid, token_ids=tokens, kv_window_begin=r.kv_window_begin,
                kv_window_end=r.kv_window_end, kv_append_metadata=r.kv_append_metadata,
                decode_address=dn.address, transfer_nonce=r.transfer_nonce),
                lease_deadline_unix=r.lease_deadline_unix)
            if pushed is None:
                try:
                    dn.stub.Abort(pb.AbortRequest(request_id=rid))
                except grpc.RpcError:
                    pass  # already expired
                return None
        return dn.stub.StartGeneration(pb.StartGenerationRequest(
            request_id=rid, kv_window_begin=r.kv_window_end, sampling=sampling))
