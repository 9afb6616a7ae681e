"""Engine errors: each names what was wrong so a server can return it for that request only."""


class EngineError(Exception):
    """Base class of the engine's errors."""


class InvalidRequestError(EngineError, ValueError):
    """A request's input or sampling parameters are invalid; `field` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class EngineBusyError(EngineError):
    """The waiting queue is full: the caller may retry later."""


class EngineDeadError(EngineError):
    """The engine loop stopped (shutdown or a fatal error); no request can be served."""
