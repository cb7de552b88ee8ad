"""Request errors that carry the gRPC status a caller should see."""
from __future__ import annotations

import grpc


class RequestError(Exception):
    code = grpc.StatusCode.UNKNOWN


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
