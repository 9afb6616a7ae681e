"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the caller; `param` names the request field at fault, if any."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        reason: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.reason = reason or code or type  # the label of the rejected-requests metric

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, int(-(-self.retry_after_s // 1))))}


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    """400 naming the parameter."""
    return APIError(400, f"{param}: {message}", param=param, code=code, reason="invalid_request")


def unsupported(param: str, message: str = "is not supported by this server") -> APIError:
    return APIError(
        400, f"{param}: {message}", param=param, code="unsupported_parameter", reason="unsupported"
    )


def rate_limited(message: str, retry_after_s: float, reason: str) -> APIError:
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        retry_after_s=retry_after_s,
        reason=reason,
    )
