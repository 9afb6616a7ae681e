"""Locustfile: ``locust -f`` this file (or ``loadtest/locustfile.py``); options are ``--llm-*``."""

from tritonllm_loadtest.locust_plugin import (  # noqa: F401  (Locust finds the classes here)
    GrpcStreamUser,
    HttpGenerateUser,
    HttpStreamUser,
    LLMLoadShape,
    OpenLoopUser,
)
