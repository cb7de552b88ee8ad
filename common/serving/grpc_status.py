"""Where duet's error codes meet gRPC: the one mapping of an `ErrorCode` to a gRPC status and
back, a failed call to another node as this node's `RequestError`, and the servicers' one way of
answering a `RequestError` with its status."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

from common.errors import ErrorCode, RequestError

RETRY_AFTER_KEY = "retry-after"  # a refusal's retry hint in trailing metadata, whole seconds


def to_grpc(code: ErrorCode) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


def from_grpc(code: grpc.StatusCode) -> ErrorCode:
    return ErrorCode[code.name]


def error_from_rpc(exc: grpc.RpcError, peer: str) -> RequestError:
    """A failed call to another node, as this node's error, with the peer's status and retry hint."""
    error = RequestError(f"{peer}: {exc.details()}", from_grpc(exc.code()))
    error.retry_after = retry_hint(exc)
    return error


def retry_hint(exc: grpc.RpcError) -> int | None:
    """The whole seconds of a failed call's `retry-after` trailing metadata, if it has one."""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return next((int(v) for k, v in trailing or () if k == RETRY_AFTER_KEY and str(v).isdigit()), None)


@contextmanager
def answered_with_status(context: grpc.ServicerContext,
                         on_error: Callable[[RequestError], None] = lambda exc: None) -> Iterator[None]:
    """A `RequestError` raised in the body ends the call with its status and message, after
    `on_error(exc)` (a metric, a trace event), and its retry hint as trailing metadata; `context.abort`
    raises, so nothing after the body runs."""
    try:
        yield
    except RequestError as exc:
        on_error(exc)
        if exc.retry_after is not None:
            context.set_trailing_metadata(retry_metadata(exc.retry_after))
        context.abort(to_grpc(exc.code), str(exc))


def retry_metadata(seconds: int) -> tuple[tuple[str, str], ...]:
    """A refusal's retry hint: `retry-after` in whole seconds (the HTTP front's Retry-After), and
    `grpc-retry-pushback-ms`, which gRPC clients with a retry policy honour."""
    return ((RETRY_AFTER_KEY, str(seconds)), ("grpc-retry-pushback-ms", str(seconds * 1000)))
