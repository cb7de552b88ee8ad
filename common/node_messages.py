"""What the node classes take and return, as plain dataclasses: the same fields as the protobuf
messages they stand for (named alike, or named beside each class), so the servicers convert at
the edge (`common/serving/rpc_convert.py` `to_proto` / `from_proto`) and the nodes' request logic
never sees gRPC."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeLoad:
    """GetLoad's answer (the protobuf NodeLoad documents each field)."""

    kv_pages_total: int = 0
    kv_pages_free: int = 0
    kv_pages_reserved: int = 0
    kv_pages_cached: int = 0
    running_requests: int = 0
    queued_prefill_tokens: int = 0
    queued_requests: int = 0
    kv_pages_quarantined: int = 0
    incarnation: int = 0


@dataclass(frozen=True)
class ReceiveWindow:
    """PrepareReceive's answer (PrepareReceiveResponse): the window `[kv_window_begin,
    kv_window_end)` a writer fills, where (`kv_append_metadata`), by when, with which nonce."""

    prompt_length: int
    prefix_matched_length: int
    kv_append_metadata: list[int]
    kv_window_begin: int
    kv_window_end: int
    lease_deadline_unix: float
    transfer_nonce: int


@dataclass(frozen=True)
class SendRequest:
    """Write positions `[kv_window_begin, kv_window_end)` of `token_ids` into a reservation of
    `decode_address` (RemoteSendRequest: a prefill node's RemoteSend, a decode node's SendPrefix)."""

    request_id: str
    token_ids: list[int]
    kv_window_begin: int
    kv_window_end: int
    kv_append_metadata: list[int]
    decode_address: str
    transfer_nonce: int


@dataclass(frozen=True)
class SendResult:
    """RemoteSendResponse."""

    tokens_sent: int
    tokens_computed: int
    bytes_sent: int
    prefill_seconds: float = 0.0
    transfer_seconds: float = 0.0


@dataclass
class MigrateResult:
    """MigrateResponse: filled in as the migration goes."""

    tokens_moved: int = 0
    prefix_matched_length: int = 0
    pause_seconds: float = 0.0


@dataclass(frozen=True)
class PrefixHolder:
    """A decode node holding the prompt's first `cached_tokens` (GenerateRequest.prefix_holder)."""

    address: str
    cached_tokens: int = 0
