"""Bounds on what one gRPC message may carry, shared by servers and channels."""
from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_REQUEST_ID_LENGTH = 256  # characters; longer ids are refused (and never recorded in traces)
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
