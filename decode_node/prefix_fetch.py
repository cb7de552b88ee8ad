"""Prefixes fetched from the decode node that holds them, instead of computed
(`GenerateRequest.prefix_holder`, named by a router from its KV index; `--prefix-fetch`).

The fetching node runs the hand-off (common/peers/hand_off.py) on itself with the holder in a
prefill node's place: PrepareReceive of the positions it lacks up to the holder's cached length
(whole pages), the holder's `SendPrefix` writes them, StartGeneration computes the rest of the
prompt here. A holder that refuses (it holds less by now), is gone, or does not answer within
`FETCH_TIMEOUT_S` costs that time and a local prefill, never a wrong token: the received KV is
checked against the holder's checksums as any writer's.

The holding node (`send`) reads back from its disk tier what the pool lacks, matches the prompt
in its prefix cache, and, when it holds every position asked for, writes them with the node's
`KvWriter` as migration writes a running request's; it computes nothing.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.engine.attention_window import layer_skips
from common.engine.core import Engine
from common.engine.generation import RequestHandle
from common.engine.sampling import SamplingParams
from common.errors import FailedPrecondition, RequestError
from common.kv.segments import slot_range
from common.node_messages import PrefixHolder, SendRequest, SendResult
from common.peers.decode_client import DecodeClient
from common.peers.kv_writer import KvWriter, check_send_request
from common.serving.kv_tiers import KvTiers
from common.tracing import Tracer
from common.transports.pieces import transfer_bytes
from decode_node.config import DecodeNodeConfig
from decode_node.reservations import Reservations

log = logging.getLogger(__name__)
FETCH_TIMEOUT_S = 10.0  # a holder slower than this is given up on: the prefix is computed here


@dataclass(eq=False)
class PrefixFetch:
    config: DecodeNodeConfig
    engine: Engine
    reservations: Reservations
    tiers: KvTiers
    kv_writer: KvWriter
    tracer: Tracer
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _clients: dict[str, DecodeClient] = field(default_factory=dict, init=False)  # by holder address

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    # ---- the fetching node ----

    def fetch(self, request_id: str, tokens: list[int], params: SamplingParams, cancelled: Callable[[], bool],
              deadline: float | None, holder: PrefixHolder, cached: int) -> tuple[RequestHandle | None, bool]:
        """Generate with the prompt's prefix written by `holder`, when it holds enough more than
        the `cached` tokens this node has: the handle (None when nothing was fetched: compute it),
        and whether the request was aborted meanwhile."""
        ps = self.engine.page_size
        end = min(holder.cached_tokens, len(tokens) - 1) // ps * ps
        if (self.config.prefix_fetch == "off" or holder.address == self.config.advertise_address
                or end - cached < self.config.min_remote_prefill_tokens
                or self.engine.long_rope(len(tokens))):  # `holder` counted short-factor pages, all routers know
            return None, False
        source = _Holder(self._client(holder.address))
        return self.reservations.generate_remote(request_id, tokens, params, cancelled, deadline,
                                             source=source, end=end)

    def _client(self, address: str) -> DecodeClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = DecodeClient.dial(address, self.config.tls)
            return client

    # ---- the holding node ----

    def send(self, req: SendRequest, timeout_s: float | None) -> SendResult:
        """SendPrefix: write positions [kv_window_begin, kv_window_end) of the prompt, all held
        here, into `decode_address`'s reservation."""
        metadata = check_send_request(req, self.engine.model)
        begin, end = req.kv_window_begin, req.kv_window_end
        tokens = list(req.token_ids[:end])
        deadline = time.monotonic() + min(timeout_s or FETCH_TIMEOUT_S, FETCH_TIMEOUT_S)
        started = time.perf_counter()
        self.tiers.read_back(req.request_id, tokens, deadline)
        ps = self.engine.page_size
        with self.engine.lock:  # a longrope prompt's pages: those of its long-factor K/V
            salt = self.engine.cache_salt(self.engine.long_rope(len(req.token_ids)))
            pages, matched = self.engine.prefix_cache.match(tokens[: end // ps * ps], salt)
            window = self.engine.hold_window_of(pages, matched)
        try:
            if matched < end:
                raise FailedPrecondition(f"this node holds {matched} of the {end} prompt tokens asked for (whole "
                                         f"pages of its prefix cache or disk tier): compute them instead")
            peer = self.kv_writer.peers.get(req.decode_address)
            self.kv_writer.write(peer, req.request_id, req.transfer_nonce, metadata,
                                 slot_range(pages, ps, begin, end), deadline)
        finally:
            with self.engine.lock:
                self.engine.drop_window_of(window)
                self.engine.allocator.decref(pages)
        seconds = time.perf_counter() - started
        self.tracer.event(req.request_id, "prefix_sent", decode=req.decode_address, tokens=end - begin,
                          seconds=round(seconds, 6))
        return SendResult(tokens_sent=end - begin, tokens_computed=0,
                          bytes_sent=transfer_bytes(self.engine.pool, end - begin,
                                                    layer_skips(self.engine.model.config, begin, end)),
                          transfer_seconds=seconds)


class _Holder:
    """The holder, as the hand-off calls the node that writes the KV (a PrefillPool's `push`)."""

    def __init__(self, client: DecodeClient) -> None:
        self._client = client
        self.address = client.address

    def push(self, request: SendRequest, still_wanted: Callable[[], bool] = lambda: True,
             lease_deadline_unix: float | None = None, preferred: str | None = None) -> str | None:
        timeout = FETCH_TIMEOUT_S if lease_deadline_unix is None else min(FETCH_TIMEOUT_S,
                                                                          lease_deadline_unix - time.time())
        if timeout <= 0 or not still_wanted():
            return None
        try:
            self._client.send_prefix(request, timeout)
            return self.address
        except RequestError as exc:
            log.info("prefix fetch failed: computing it here", extra={"fields": {
                "holder": self.address, "request_id": request.request_id, "code": exc.code.name,
                "details": str(exc)}})
            return None
