"""Client errors, one class per thing a caller does something different about."""

from __future__ import annotations


class ClientError(Exception):
    """Base class of every error this package raises."""


class InvalidOptionError(ClientError, ValueError):
    """A client-side option is out of range (raised before anything is sent)."""


class InvalidRequestError(ClientError):
    """The server rejected the request's inputs; the message names the tensor."""


class ModelNotFoundError(ClientError):
    """The server does not serve (or has not loaded) the model."""


class ServerUnavailableError(ClientError):
    """The server cannot be reached or is shutting down: safe to retry."""


class ServerBusyError(ClientError):
    """The engine's queue is full: safe to retry later."""


class ServerError(ClientError):
    """Any other failure the server reported."""


class GenerationInterruptedError(ClientError):
    """The generation failed after tokens were streamed: never retried (the caller saw partial output)."""


class RequestTimeoutError(ClientError):
    """The request did not finish within its timeout (it is cancelled on the server)."""


class RateLimitTimeoutError(ClientError):
    """The client-side rate limiter could not admit the request before its deadline."""


class CircuitOpenError(ClientError):
    """The circuit breaker is open after repeated failures: failing fast until it probes again."""


RETRYABLE_ERRORS: tuple[type[ClientError], ...] = (ServerUnavailableError, ServerBusyError)

_UNAVAILABLE_MARKERS = (
    "failed to connect",
    "connection refused",
    "connect call failed",
    "cannot connect",
    "unavailable",
    "server is not ready",
    "shutting down",
    "socket closed",
    "connection reset",
    "server disconnected",
    # Triton's Python backend when a model's stub process missed its health check (it answers this to
    # the request it was handing over; the engine never saw it, so a retry is safe).
    "is not healthy",
    "stub process has exited",
    "failed to obtain the health mutex",
)


def classify(message: str, model: str) -> ClientError:
    """Map a server or transport error message to the error class a caller acts on."""
    text = message.lower()
    if "busy" in text:
        return ServerBusyError(message)
    missing = "unknown model" in text or ("model" in text and "not found" in text) or "is not ready" in text
    if missing and "server is not ready" not in text:
        return ModelNotFoundError(f"model {model!r} is not available on the server: {message}")
    if any(marker in text for marker in _UNAVAILABLE_MARKERS):
        return ServerUnavailableError(message)
    if "input '" in text or text.startswith("input ") or "invalid" in text:
        return InvalidRequestError(message)
    return ServerError(message)
