"""OpenAI-style error bodies and the HTTP status each gRPC status maps to."""
from __future__ import annotations

from http import HTTPStatus

import grpc

# A gRPC status the node answered with -> the HTTP status an OpenAI client expects.
HTTP_STATUS_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
}

# The `type` field OpenAI's own API uses for each class of failure.
_ERROR_TYPE_OF = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "invalid_request_error",
    HTTPStatus.NOT_FOUND: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
}


class ApiError(Exception):
    """A failure answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> ApiError:
        return cls(HTTPStatus.BAD_REQUEST, message, param=param)

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> ApiError:
        """The node's (or router's) status, with its message, as an HTTP error."""
        code = exc.code()
        status = HTTP_STATUS_OF.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
        return cls(status, exc.details() or code.name, code=code.name.lower())

    def body(self) -> dict:
        kind = _ERROR_TYPE_OF.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def refuse_unknown_keys(value: dict, keys: set[str], name: str) -> None:
    """A 400 naming the first key of the object `name` that is not among `keys`."""
    for key in value:
        if key not in keys:
            raise ApiError.invalid(f"{name}.{key} is not supported by this server", param=f"{name}.{key}")
