"""`tritonllm launch`: render the model repository, run Triton in the foreground, stop it cleanly.

The parts are their own modules: `options` (LaunchOptions and the command line), `repository`
(rendering the templates) and `server` (the `tritonserver` process); their names are re-exported here
for the callers that import them from the launcher.
"""

from __future__ import annotations

import signal
import sys
import time

from tritonllm.openai.child import FrontDoorProcess
from tritonllm.triton.options import LaunchOptions, add_arguments, options_from_args
from tritonllm.triton.repository import ENGINE_MODEL, MARKER, MODELS, render_repository, templates_dir
from tritonllm.triton.server import (
    ADMIN_HEADER,
    RESTRICTED,
    PytritonPaths,
    TritonServer,
    build_backend_dir,
    pytriton_paths,
    server_command,
    server_env,
)

__all__ = [
    "ADMIN_HEADER",
    "ENGINE_DIED",
    "ENGINE_MODEL",
    "MARKER",
    "MODELS",
    "RESTRICTED",
    "LaunchOptions",
    "StubMonitor",
    "PytritonPaths",
    "TritonServer",
    "add_arguments",
    "build_backend_dir",
    "launch",
    "options_from_args",
    "pytriton_paths",
    "render_repository",
    "server_command",
    "server_env",
    "templates_dir",
]

# `tritonllm launch` exit status when tritonserver stopped without being asked: the engine loop died
# more than `max_engine_restarts` times (the model stops the server then), the server failed, or a
# model's stub process died (the launcher stops the server then: `StubMonitor`).
ENGINE_DIED = 3
STUB_CHECK_S = 1.0  # how often the launcher looks for dead model stubs


class StubMonitor:
    """Finds a model whose Python stub died while Triton still lists it ready (`models_without_stub`).

    A model counts as dead when two checks in a row find it so: the engine model's in-place restart
    (`recovery`) swaps stubs, and a check should not land between them.
    """

    def __init__(self, server: TritonServer, interval_s: float = STUB_CHECK_S):
        self.server = server
        self.interval_s = interval_s
        self._next = time.monotonic() + interval_s
        self._suspects: set[str] = set()

    def dead_models(self) -> list[str]:
        """Models found without a stub twice in a row; checks at most every `interval_s`."""
        if time.monotonic() < self._next:
            return []
        self._next = time.monotonic() + self.interval_s
        try:
            missing = set(self.server.models_without_stub())
        except (OSError, ValueError):  # the server does not answer now: its exit is handled elsewhere
            missing = set()
        dead, self._suspects = sorted(missing & self._suspects), missing
        return dead


def _start_front_door(options: LaunchOptions, server: TritonServer) -> FrontDoorProcess:
    """The front door calls `tensorrt_llm` itself: this project's engine model sends the context ids it
    detokenizes with, and skipping the BLS's hop saved 0.6-1.4 ms of server CPU per streamed token
    (benchmarks/README.md, "OpenAI front door straight into tensorrt_llm")."""
    model = options.tokenizer_dir or options.model
    return FrontDoorProcess(
        model, server.grpc_url, options.address, options.openai_port, options.max_model_len, ENGINE_MODEL
    ).start()


def launch(options: LaunchOptions, ready_timeout_s: float = 300.0) -> int:
    """Run the server in the foreground until it exits or SIGINT/SIGTERM; returns its exit status."""
    server = TritonServer(options)
    front_door: FrontDoorProcess | None = None
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        print(f"tritonllm: serving {options.model}", file=sys.stderr)
        try:
            server.wait_ready(ready_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            if not stopping:
                print(f"tritonllm: {exc}", file=sys.stderr)
                return 1
        if not stopping:
            print(
                f"tritonllm: ready\n  HTTP    http://{server.http_url}  (POST /v2/models/ensemble/generate)\n"
                f"  gRPC    {server.grpc_url}\n  metrics {server.metrics_url}",
                file=sys.stderr,
            )
            if options.restrict_admin:
                print(f"  admin APIs need the header {ADMIN_HEADER}: {options.admin_key}", file=sys.stderr)
            if options.openai_port:
                front_door = _start_front_door(options, server)
                print(f"  OpenAI  {front_door.url}  (POST /chat/completions, /completions)", file=sys.stderr)
            print("tritonllm: Ctrl-C stops the server", file=sys.stderr, flush=True)
        monitor = StubMonitor(server)
        dead: list[str] = []
        while not (stopping or dead) and server.process is not None and server.process.poll() is None:
            time.sleep(0.2)
            dead = monitor.dead_models()
        if dead:
            print(
                f"tritonllm: the stub process of {', '.join(dead)} died and Triton does not restart it: "
                "stopping tritonserver",
                file=sys.stderr,
            )
            print(f"tritonllm: tritonserver stopped (status {server.stop()})", file=sys.stderr)
            return ENGINE_DIED
        if not stopping:  # the model stops Triton when its engine died past max_engine_restarts
            status = server.stop()
            print(f"tritonllm: tritonserver stopped on its own (status {status})", file=sys.stderr)
            return ENGINE_DIED
        print(
            f"tritonllm: stopping: in-flight requests have {options.drain_timeout_s:g}s to finish, "
            "then are cancelled...",
            file=sys.stderr,
        )
        return server.stop() or 0
    finally:
        if front_door is not None:
            front_door.stop()
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
