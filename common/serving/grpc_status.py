"""Where duet's error codes meet gRPC: the one mapping of an `ErrorCode` to a gRPC status and
back, a failed call to another node as this node's `RequestError`, and the servicers' one way of
answering a `RequestError` with its status."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

from common.errors import ErrorCode, RequestError


def to_grpc(code: ErrorCode) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


def from_grpc(code: grpc.StatusCode) -> ErrorCode:
    return ErrorCode[code.name]


def error_from_rpc(exc: grpc.RpcError, peer: str) -> RequestError:
    """A failed call to another node, as this node's error, with the peer's status."""
    return RequestError(f"{peer}: {exc.details()}", from_grpc(exc.code()))


@contextmanager
def answered_with_status(context: grpc.ServicerContext,
                         on_error: Callable[[RequestError], None] = lambda exc: None) -> Iterator[None]:
    """A `RequestError` raised in the body ends the call with its status and message, after
    `on_error(exc)` (a metric, a trace event); `context.abort` raises, so nothing after the body runs."""
    try:
        yield
    except RequestError as exc:
        on_error(exc)
        context.abort(to_grpc(exc.code), str(exc))
