"""The three-call hand-off run by a client over N prefill x M decode nodes.

For each request: rank the healthy decode nodes (common/peers/routing.py: with prefix routing,
the prompt tokens each holds in its prefix cache, from its KV events, against its load), reserve
on the best (PrepareReceive), have the best-ranked prefill node push the KV of what the decode
node lacks (RemoteSend, retried on another prefill node if one fails before the KV arrived), then
stream StartGeneration. Short uncached remainders, no healthy prefill node, or a failed hand-off
fall back to the decode node's own Generate (local prefill). A decode node that is unreachable
before the request's first chunk (stopped, restarting) is marked failed and the next one is
tried, so a node going away costs no request that had not started streaming. One that dies
mid-stream is marked failed too, and the next node continues the request from what the client
already received (router/continuation.py), up to `migration_limit` times per request.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from common.errors import Unavailable
from common.model.tokenizer import Tokenizer
from common.peers.hand_off import hand_off, worth_remote
from common.peers.membership import Member, Membership
from common.peers.peer_status import STREAM_BROKEN
from common.peers.prefill_pool import PrefillPool
from common.peers.remote_decode import RemoteDecodeSteps
from common.peers.routing import Choice, NodeChooser
from common.serving.prompts import prompt_token_ids
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from router.continuation import Relayed

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 1.0  # for a decode node whose stream broke with INTERNAL or UNKNOWN to answer GetLoad
# A client's retry (a continuation, or the request again before any token) may name a request
# still live on its decode node: the instance fed by the router the client lost, which that node
# has not ended yet (a generating one ends at its next step; one mid hand-off when its prefill node
# answers or its lease passes). Until its first chunk the request waits this long for the node to
# let go, rather than failing ALREADY_EXISTS.
SETTLE_S = 10.0


def prefix_holder(chosen: Choice, choices: list[Choice], min_tokens: int) -> pb.PrefixHolder | None:
    """The decode node believed to hold the most of the prompt, when that is at least `min_tokens`
    more than `chosen` holds (worth a hand-off)."""
    best = max((c for c in choices if c is not chosen), key=lambda c: c.cached_tokens, default=None)
    if best is None or best.cached_tokens - chosen.cached_tokens < min_tokens:
        return None
    return pb.PrefixHolder(address=best.member.address, cached_tokens=best.cached_tokens)


class Router:
    def __init__(self, tokenizer: Tokenizer, decode: Membership[duet_pb2_grpc.DecodeNodeStub], prefill: PrefillPool,
                 chooser: NodeChooser, min_remote_prefill_tokens: int = 32, migration_limit: int = 1,
                 prefix_fetch: bool = True) -> None:
        """`migration_limit`: how many times one request may be continued on another decode node
        after its node died mid-stream (0: the break reaches the client). `prefix_fetch`: name the
        decode node that holds more of a prompt than the chosen one (GenerateRequest.prefix_holder),
        so the chosen one fetches it from there instead of computing it."""
        if migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {migration_limit}")
        self.tokenizer = tokenizer
        self.decode = decode
        self.prefill = prefill
        self.chooser = chooser
        self.min_remote_prefill_tokens = min_remote_prefill_tokens
        self.migration_limit = migration_limit
        self.prefix_fetch = prefix_fetch
        self.registry = CollectorRegistry()
        self.routed = Counter("duet_router_requests", "Requests by how their prompt was prefilled "
                              "(remote: by a prefill node; local: by the decode node; prefix_fetch: the decode node, "
                              "after fetching the prefix another decode node held)", ["prefill"],
                              registry=self.registry)
        self.expected_hits = Counter("duet_router_expected_cache_hit_tokens", "Prompt tokens the chosen decode "
                                     "node was believed to hold in its prefix cache", registry=self.registry)
        self.retries = Counter("duet_router_retries", "Requests sent to another decode node because the chosen "
                               "one was unreachable before the first chunk", registry=self.registry)
        self.migrations = Counter(
            "duet_migrations", "Requests whose decode node died mid-stream (reason crash), by outcome (continued: "
            "re-issued to another decode node with the tokens streamed so far; failed: the break reached the "
            "client, past --migration-limit or with no other healthy decode node)", ["reason", "outcome"],
            registry=self.registry)
        if chooser.index is not None:
            index = chooser.index
            Gauge("duet_router_kv_index_blocks", "KV blocks the router believes the decode nodes hold, summed "
                  "over the nodes (from their KV events)", registry=self.registry).set_function(
                lambda: sum(index.num_blocks(m.address) for m in decode.members()))
        for kind, members in (("decode", decode), ("prefill", prefill)):
            Gauge(f"duet_router_healthy_{kind}_nodes", f"Healthy {kind} nodes", registry=self.registry
                  ).set_function(lambda m=members: len(m.healthy()))

    def generate(self, request: pb.GenerateRequest, deadline_s: float | None = None) -> Iterator[pb.GenerationChunk]:
        """`deadline_s`: the time the caller left the call; with no healthy decode node, the request
        waits for the next poll to find one, as long as that."""
        tokens = prompt_token_ids(request, self.tokenizer)
        rid = request.request_id or uuid.uuid4().hex
        relayed = (Relayed.resuming(request.sampling, request.continuation) if request.HasField("continuation")
                   else Relayed(request.sampling))
        tried: set[str] = set()  # each decode node serves a request once
        settle_until = time.monotonic() + SETTLE_S
        choices = self._candidates(tokens, tried)
        if not choices:
            wait_s = self.decode.poll_wait_s if deadline_s is None else min(deadline_s, self.decode.poll_wait_s)
            self.decode.wait_healthy(wait_s)
            choices = self._candidates(tokens, tried)
        if not choices:
            raise Unavailable("no healthy decode node")
        while True:
            choice = choices[0]
            dn = choice.member
            tried.add(dn.address)
            dn.in_flight += 1
            self.chooser.note_routed(dn, tokens)
            try:
                if relayed.started:
                    stream = dn.stub.Generate(relayed.continue_request(rid, tokens, request.sampling))
                else:
                    relayed.cached_tokens = choice.cached_tokens
                    holder = prefix_holder(choice, choices, self.min_remote_prefill_tokens)
                    stream = self._run(dn, choice.cached_tokens, rid, tokens, request.sampling,
                                       holder if self.prefix_fetch else None)
                for chunk in stream:
                    relayed.record(chunk)
                    yield chunk
                self.expected_hits.inc(choice.cached_tokens)
                return
            except grpc.RpcError as exc:
                if (not relayed.chunks and exc.code() == grpc.StatusCode.ALREADY_EXISTS
                        and time.monotonic() < settle_until):
                    time.sleep(0.05)  # the stream of the router the client lost still winds down there
                    continue
                if not self._node_gone(dn, exc):
                    raise
                self.decode.mark_failed(dn)
                if relayed.done:
                    return  # it died after sending its final chunk: the client has it all
                choices = self._candidates(tokens, tried)
                self._after_break(dn, exc, rid, relayed, choices)
            finally:
                dn.in_flight -= 1

    def _after_break(self, dn: Member, exc: grpc.RpcError, rid: str, relayed: Relayed, choices: list[Choice]) -> None:
        """`dn` went away during the request: raise if the request ends here, else count what its
        next attempt, on `choices[0]`, is (a retry before any chunk, or a continuation)."""
        fields = {"decode": dn.address, "request_id": rid, "code": exc.code().name, "details": exc.details()}
        if not relayed.started:
            if not choices:
                raise exc
            self.retries.inc()
            log.info("decode node unavailable: trying the next", extra={"fields": fields})
            return
        if relayed.continuations >= self.migration_limit or not choices:
            self.migrations.labels("crash", "failed").inc()
            why = (f"it was continued {relayed.continuations} time(s) and --migration-limit is {self.migration_limit}"
                   if choices else "no other healthy decode node is left to continue it")
            log.warning("decode node failed mid-stream: not continued", extra={"fields": {**fields, "why": why}})
            raise Unavailable(f"decode node {dn.address} failed mid-stream ({exc.code().name}: {exc.details()}); "
                              f"the request was not continued elsewhere: {why}") from None
        relayed.continuations += 1
        self.migrations.labels("crash", "continued").inc()
        log.warning("decode node failed mid-stream: continuing on the next", extra={"fields": {
            **fields, "next": choices[0].member.address, "chunks_relayed": relayed.chunks}})

    def _candidates(self, tokens: list[int], tried: set[str]) -> list[Choice]:
        """The healthy decode nodes not tried yet for this request, best first."""
        return [c for c in self.chooser.rank(self.decode.healthy(), tokens) if c.member.address not in tried]

    def _node_gone(self, dn: Member, exc: grpc.RpcError) -> bool:
        """Whether `exc` ended the stream because `dn` (or the way to it) went away, rather than
        being the node's own verdict on the request, which another node would repeat. UNAVAILABLE
        is taken as gone; INTERNAL or UNKNOWN (a reset stream) only when the node does not answer
        GetLoad now either."""
        code = exc.code()
        if code not in STREAM_BROKEN:
            return False
        if code == grpc.StatusCode.UNAVAILABLE:
            return True
        try:
            dn.stub.GetLoad(pb.GetLoadRequest(), timeout=_PROBE_TIMEOUT_S)
        except grpc.RpcError:
            return True
        return False

    def _run(self, dn: Member, cached: int, rid: str, tokens: list[int], sampling: pb.SamplingParams,
             holder: pb.PrefixHolder | None = None) -> Iterator[pb.GenerationChunk]:
        scoring = sampling.HasField("prompt_logprobs")
        if holder is not None and not scoring:
            self.routed.labels("prefix_fetch").inc()
            yield from dn.stub.Generate(pb.GenerateRequest(request_id=rid, token_ids=tokens, sampling=sampling,
                                                           prefix_holder=holder))
            return
        if worth_remote(len(tokens), cached, self.min_remote_prefill_tokens, scoring, self.prefill):
            stream = hand_off(rid, tokens, RemoteDecodeSteps(dn.stub, dn.address, rid, tokens, sampling), self.prefill)
            if stream is not None:
                self.routed.labels("remote").inc()
                yield from stream
                return
        self.routed.labels("local").inc()
        yield from dn.stub.Generate(pb.GenerateRequest(request_id=rid, token_ids=tokens, sampling=sampling))

