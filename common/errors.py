"""Request errors, each carrying the status a caller should see as duet's own `ErrorCode`: the
domain (engine, KV cache, model, the nodes) never imports gRPC; the servicers map a code to
gRPC's status once (common/serving/grpc_status.py)."""
from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Why a request failed: gRPC's status codes, by the same names and numbers."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class RequestError(Exception):
    code = ErrorCode.UNKNOWN
    retry_after: int | None = None  # whole seconds after which a retry may succeed (None: no hint)

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(RequestError):
    code = ErrorCode.INVALID_ARGUMENT


class NotFound(RequestError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(RequestError):
    code = ErrorCode.ALREADY_EXISTS


class ResourceExhausted(RequestError):
    """No room now."""

    code = ErrorCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class FailedPrecondition(RequestError):
    code = ErrorCode.FAILED_PRECONDITION


class PermissionDenied(RequestError):
    code = ErrorCode.PERMISSION_DENIED


class Unavailable(RequestError):
    code = ErrorCode.UNAVAILABLE


class Aborted(RequestError):
    code = ErrorCode.ABORTED


class DeadlineExceeded(RequestError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Internal(RequestError):
    code = ErrorCode.INTERNAL


class Cancelled(RequestError):
    code = ErrorCode.CANCELLED


class DataLoss(RequestError):
    code = ErrorCode.DATA_LOSS
