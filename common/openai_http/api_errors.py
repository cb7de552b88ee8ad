"""OpenAI-style error bodies, the HTTP status each gRPC status maps to, and the `Retry-After`
that every 429 and 503 carries."""
from __future__ import annotations

from http import HTTPStatus

import grpc

from common.serving.grpc_status import retry_hint

# A gRPC status the node answered with -> the HTTP status an OpenAI client expects.
HTTP_STATUS_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
}

# Retry-After of a 429 or 503 that comes with no hint of the node's: busy (a full queue, too many
# connections) and not ready (starting, draining, unreachable).
BUSY_RETRY_SECONDS = 1
NOT_READY_RETRY_SECONDS = 5

# The `type` field OpenAI's own API uses for each class of failure.
_ERROR_TYPE_OF = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "invalid_request_error",
    HTTPStatus.NOT_FOUND: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
}

# ... and the `error.type` of Anthropic's API.
_ANTHROPIC_TYPE_OF = {
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
    HTTPStatus.GATEWAY_TIMEOUT: "timeout_error",
}


class ApiError(Exception):
    """A failure answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> ApiError:
        return cls(HTTPStatus.BAD_REQUEST, message, param=param)

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> ApiError:
        """The node's (or router's) status, with its message, as an HTTP error."""
        code = exc.code()
        status = HTTP_STATUS_OF.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
        return cls(status, exc.details() or code.name, code=code.name.lower(), retry_after=retry_hint(exc))

    def headers(self) -> dict[str, str]:
        """`Retry-After` on a 429 (the node's hint, else BUSY_RETRY_SECONDS) and a 503 (else
        NOT_READY_RETRY_SECONDS)."""
        default = {HTTPStatus.TOO_MANY_REQUESTS: BUSY_RETRY_SECONDS,
                   HTTPStatus.SERVICE_UNAVAILABLE: NOT_READY_RETRY_SECONDS}.get(self.status)
        if default is None:
            return {}
        return {"Retry-After": str(self.retry_after if self.retry_after is not None else default)}

    def body(self) -> dict:
        kind = _ERROR_TYPE_OF.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        """The same failure in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`."""
        kind = _ANTHROPIC_TYPE_OF.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": str(self)}}


def named_items(value: object, name: str, need: str, non_empty: bool = False) -> list[tuple[str, object]]:
    """The list `value` as (`name[i]`, item) pairs; a 400 saying it must be `need` otherwise."""
    if not isinstance(value, list) or (non_empty and not value):
        raise ApiError.invalid(f"{name} must be {need}", param=name)
    return [(f"{name}[{i}]", item) for i, item in enumerate(value)]


def refuse_unknown_keys(value: dict, keys: set[str], name: str) -> None:
    """A 400 naming the first key of the object `name` that is not among `keys`."""
    for key in value:
        if key not in keys:
            raise ApiError.invalid(f"{name}.{key} is not supported by this server", param=f"{name}.{key}")
