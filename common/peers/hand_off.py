"""The three-call hand-off, as the router, the decode node and a migrating decode node all run
it: whether a prompt goes to a prefill node at all, then PrepareReceive, RemoteSend,
StartGeneration.

The callers differ only in how they reach the decode node (the router and a migration over gRPC,
common/peers/remote_decode.py; the decode node in process), which `HandOffSteps` hides; the
policy is written once, here. The KV comes from a `KvSource`: a pool of prefill nodes computing
it, a decode node holding it in its prefix cache (decode_node/prefix_fetch.py), or the migrating
node's own pages (decode_node/migration.py, which fills a window per sample before its one
StartGeneration).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Generic, Protocol, TypeVar

from common.node_messages import ReceiveWindow, SendRequest
from common.peers.prefill_pool import PrefillPool
from common.tracing import Tracer

T = TypeVar("T", covariant=True)


def worth_remote(prompt_tokens: int, cached_tokens: int, min_remote_prefill_tokens: int, scoring_prompt: bool,
                 prefill: PrefillPool) -> bool:
    """Whether a prompt should be prefilled by a prefill node: not when it asks for prompt
    logprobs (those are computed whole on the decode node), not without a healthy prefill node,
    and not when what the decode node lacks (beyond `cached_tokens`, less the last token it
    always computes itself) is under --min-remote-prefill-tokens."""
    return (not scoring_prompt and prefill.healthy()
            and prompt_tokens - 1 - cached_tokens >= min_remote_prefill_tokens)


class KvSource(Protocol):
    """Who writes the KV into the reservation (`PrefillPool` is one)."""

    def push(self, request: SendRequest, still_wanted: Callable[[], bool] = ...,
             lease_deadline_unix: float | None = None, preferred: str | None = None) -> str | None:
        """Have the window written; the address of the node that wrote it, None if none did (a
        source whose failure the caller must see, a migrating node's own pages, raises instead)."""


class HandOffSteps(Protocol, Generic[T]):
    """How one caller reaches the decode node it hands a request to."""

    decode_address: str

    def prepare(self) -> ReceiveWindow | None:
        """PrepareReceive; None when the decode node has no room now (its Generate queues
        instead of refusing)."""

    def still_wanted(self) -> bool:
        """Whether the reservation is still worth filling (not aborted, expired or cancelled)."""

    def release(self) -> None:
        """Give the reservation back: its KV will not arrive."""

    def start(self, kv_window_begin: int) -> T | None:
        """StartGeneration; None when the reservation is gone after all (then it is released)."""


def hand_off(request_id: str, tokens: list[int], steps: HandOffSteps[T], source: KvSource,
             tracer: Tracer | None = None, preferred_prefill: str | None = None,
             span: str = "remote_prefill") -> T | None:
    """Run the three calls (on `preferred_prefill` first, when it is one of `source`'s nodes),
    traced as `span`; None when the KV did not arrive (nothing is left reserved), so the caller
    falls back to the decode node's own prefill."""
    window = fill(request_id, tokens, steps, source, tracer, preferred_prefill, span)
    return None if window is None else steps.start(window.kv_window_end)


def fill(request_id: str, tokens: list[int], steps: HandOffSteps, source: KvSource,
         tracer: Tracer | None = None, preferred: str | None = None,
         span: str = "remote_prefill") -> ReceiveWindow | None:
    """The first two calls: PrepareReceive, then the window's KV written by `source`; the filled
    window, ready for StartGeneration, or None when none is (nothing is left reserved). A
    migration fills one window per sample before its one StartGeneration (decode_node/migration.py)."""
    p = steps.prepare()
    if p is None:
        return None
    if p.kv_window_end > p.kv_window_begin:
        request = SendRequest(
            request_id=request_id, token_ids=tokens, kv_window_begin=p.kv_window_begin,
            kv_window_end=p.kv_window_end, kv_append_metadata=p.kv_append_metadata,
            decode_address=steps.decode_address, transfer_nonce=p.transfer_nonce)
        with tracer.span(request_id, span) if tracer else nullcontext({}) as traced:
            traced["prefill"] = source.push(request, still_wanted=steps.still_wanted,
                                           lease_deadline_unix=p.lease_deadline_unix, preferred=preferred)
        if traced["prefill"] is None or not steps.still_wanted():
            steps.release()
            return None
    return p
