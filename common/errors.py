"""Request errors that carry the gRPC status a caller should see."""
from __future__ import annotations

import grpc


class RequestError(Exception):
    code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError, peer: str) -> RequestError:
        """A failed call to another node, as this node's error, with the peer's status."""
        return cls(f"{peer}: {exc.details()}", exc.code())


class InvalidArgument(RequestError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RequestError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(RequestError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(RequestError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(RequestError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(RequestError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unavailable(RequestError):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(RequestError):
    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(RequestError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Internal(RequestError):
    code = grpc.StatusCode.INTERNAL


class Cancelled(RequestError):
    code = grpc.StatusCode.CANCELLED


class DataLoss(RequestError):
    code = grpc.StatusCode.DATA_LOSS
