"""Bounds on what one request and one gRPC message may carry, shared by servers, channels and
traces, and the one check of a request id and a prompt that every daemon runs."""
from __future__ import annotations

from collections.abc import Sequence

from common.errors import InvalidArgument

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_REQUEST_ID_LENGTH = 256  # characters; longer ids are refused (and never recorded in traces)
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def valid_request_id(request_id: str) -> bool:
    return 0 < len(request_id) <= MAX_REQUEST_ID_LENGTH


def check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidArgument("request_id must be a non-empty string")
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID_LENGTH} characters")


def check_prompt(token_ids: Sequence[int], vocab_size: int, context_length: int) -> list[int]:
    """The prompt as a list, if it is one a model of `vocab_size` and `context_length` positions
    can continue by at least one token."""
    if not token_ids:
        raise InvalidArgument("the prompt is empty: send at least one token")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(token_ids) >= context_length:
        raise InvalidArgument(f"the prompt has {len(token_ids)} tokens; the model's context holds {context_length} "
                              "including at least one generated token")
    return list(token_ids)
