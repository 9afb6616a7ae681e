"""When the engine loop dies, nothing stays silently green: `tritonllm launch` exits non-zero.

The server runs `launch()` (the `tritonllm launch` foreground loop) in a child process on a copy of the
model repository whose `tensorrt_llm` model is a test double: the real model, with its scheduler made
to raise (fault injection: nothing else here can kill the loop on demand) once a request with the
Triton id `kill-engine` is queued. The real server, engine and launcher do the rest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import requests
from test_nvidia_clients import engine_inputs, run_stream
from triton_fixture import READY_TIMEOUT_S, metric_sum, tiny_server_options, wait_for
from tritonclient.utils import InferenceServerException

from tritonllm.triton.launcher import ENGINE_DIED, TritonServer, templates_dir

ERRORS = r'tritonllm_requests_finished_total\{[^}]*reason="error"[^}]*\}'
FAULT_INJECTION = '''

class TritonPythonModel(TritonPythonModel):  # noqa: F811 -- the test double replaces the re-export
    """The real model; its scheduler raises once a request with the Triton id 'kill-engine' is queued."""

    def initialize(self, args):
        super().initialize(args)
        scheduler = self.bridge.engine.engine.scheduler
        schedule = scheduler.schedule

        def failing_schedule():
            queued = list(scheduler.running) + [item[1] for item in scheduler._waiting]
            if any(seq.request_id.startswith("kill-engine") for seq in queued):
                raise RuntimeError("injected scheduler failure")
            return schedule()

        scheduler.schedule = failing_schedule
'''


def test_a_dead_engine_loop_fails_requests_counts_errors_and_stops_the_launcher(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    templates = tmp_path / "templates"
    shutil.copytree(templates_dir(), templates)
    model_py = templates / "tensorrt_llm" / "1" / "model.py"
    model_py.write_text(model_py.read_text() + FAULT_INJECTION)
    options = tiny_server_options(tiny_llama_dir, disable_kernels=True, drain_timeout_s=1, exit_timeout_s=5)
    script = (
        "import sys\n"
        "from tritonllm.triton.launcher import LaunchOptions, launch\n"
        f"sys.exit(launch(LaunchOptions(**{options.__dict__!r})))\n"
    )
    log = (tmp_path / "launch.log").open("wb")
    env = {**os.environ, "TRITONLLM_MODEL_REPOSITORY": str(templates)}
    child = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, env=env)
    server = TritonServer(options)  # only for its URLs
    try:
        ready = f"http://{server.http_url}/v2/health/ready"

        def is_ready() -> bool:
            try:
                return requests.get(ready, timeout=2).status_code == 200
            except requests.ConnectionError:
                return False

        up = wait_for(lambda: is_ready() or child.poll() is not None, READY_TIMEOUT_S, step_s=0.5)
        assert up and child.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
        errors_before = metric_sum(server.metrics_url, ERRORS)

        results = run_stream(
            server, "tensorrt_llm", engine_inputs([5, 6, 7], 8, True), [], request_id="kill-engine"
        )
        errors = [r for r in results if isinstance(r, InferenceServerException)]
        # gRPC streams carry the message without its status code (UNAVAILABLE: retry elsewhere).
        assert errors and "engine is not running" in errors[0].message(), results
        assert wait_for(lambda: metric_sum(server.metrics_url, ERRORS) == errors_before + 1, 2), "counted"

        assert child.wait(60) == ENGINE_DIED
        assert not is_ready(), "nothing answers ready once the engine died"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        log.close()
    assert "engine loop died" in (tmp_path / "launch.log").read_text()
