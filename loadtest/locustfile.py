"""``locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless --llm-shape step ...``

The users, the load shape and the ``--llm-*`` options live in ``tritonllm_loadtest.locust_plugin``;
``tritonllm-loadtest run`` wraps a whole headless session with reports (see README.md).
"""

from tritonllm_loadtest.locustfile import (  # noqa: F401  (Locust finds the classes here)
    GrpcStreamUser,
    HttpGenerateUser,
    HttpStreamUser,
    LLMLoadShape,
    OpenLoopUser,
)
