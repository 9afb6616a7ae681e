"""When the engine loop dies, nothing stays silently green: the engine restarts, or the server stops.

Each server runs a copy of the model repository whose `tensorrt_llm` model is a test double: the real
model, with its scheduler made to raise (fault injection: nothing else here can kill the loop on
demand) once a request with the Triton id `kill-engine` is queued. The real server, engine and (in the
first test) launcher do the rest. The other servers are bare `tritonserver` processes, started as the
shared fixture starts them, without the launcher: the model's own recovery (`models/recovery.py`) is
all that acts.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from test_nvidia_clients import engine_inputs, run_stream
from triton_fixture import READY_TIMEOUT_S, metric_sum, tiny_server_options, wait_for
from tritonclient.utils import InferenceServerException

from tritonllm.triton import server as server_module
from tritonllm.triton.launcher import ENGINE_DIED, LaunchOptions, StubMonitor, TritonServer, templates_dir
from tritonllm.triton.models import recovery

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


def fault_injected_templates(tmp_path: Path) -> Path:
    templates = tmp_path / "templates"
    shutil.copytree(templates_dir(), templates)
    model_py = templates / "tensorrt_llm" / "1" / "model.py"
    model_py.write_text(model_py.read_text() + FAULT_INJECTION)
    return templates


def is_ready(server: TritonServer) -> bool:
    try:
        return requests.get(f"http://{server.http_url}/v2/health/ready", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def kill_engine(server: TritonServer) -> None:
    """Send the request that kills the engine loop; it fails with the dead engine's error."""
    results = run_stream(
        server, "tensorrt_llm", engine_inputs([5, 6, 7], 8, True), [], request_id="kill-engine"
    )
    errors = [r for r in results if isinstance(r, InferenceServerException)]
    # gRPC streams carry the message without its status code (UNAVAILABLE: retry elsewhere).
    assert errors and "engine is not running" in errors[0].message(), results


def generates(server: TritonServer) -> bool:
    url = f"http://{server.http_url}/v2/models/tensorrt_llm_bls/generate"
    try:
        response = requests.post(url, json={"text_input": "hello", "max_tokens": 3}, timeout=30)
    except requests.RequestException:
        return False
    return response.status_code == 200 and bool(response.json().get("text_output"))


def start_bare(options: LaunchOptions, tmp_path: Path) -> TritonServer:
    server = TritonServer(options, log_file=tmp_path / "tritonserver.log")
    server.start()
    try:
        server.wait_ready(READY_TIMEOUT_S)
    except BaseException:
        server.stop(timeout_s=10)
        raise
    return server


def log_text(tmp_path: Path) -> str:
    return (tmp_path / "tritonserver.log").read_text(errors="replace")


def start_launcher(options: LaunchOptions, tmp_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """`tritonllm launch` in a child process, returned once it says it serves (its log: launch.log)."""
    script = (
        "import sys\n"
        "from tritonllm.triton.launcher import LaunchOptions, launch\n"
        f"sys.exit(launch(LaunchOptions(**{options.__dict__!r})))\n"
    )
    log = (tmp_path / "launch.log").open("wb")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()

    # Ready once the launcher says so: the server may answer ready a poll before the launcher has seen
    # it, and an engine killed in between stops a server that the launcher still waits for.
    def launched() -> bool:
        return "Ctrl-C stops the server" in (tmp_path / "launch.log").read_text()

    up = wait_for(lambda: launched() or child.poll() is not None, READY_TIMEOUT_S, step_s=0.5)
    if not up or child.poll() is not None:
        stop_launcher(child)
        raise AssertionError((tmp_path / "launch.log").read_text()[-3000:])
    return child


def stop_launcher(child: subprocess.Popen) -> None:
    if child.poll() is None:  # SIGTERM first: the launcher stops its server (SIGKILL would orphan it)
        child.terminate()
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def test_a_dead_engine_loop_fails_requests_counts_errors_and_stops_the_launcher(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """With no restarts left, the model stops Triton: `tritonllm launch` exits with ENGINE_DIED."""
    templates = fault_injected_templates(tmp_path)
    options = tiny_server_options(
        tiny_llama_dir, disable_kernels=True, drain_timeout_s=1, exit_timeout_s=5, max_engine_restarts=0
    )
    env = {**os.environ, "TRITONLLM_MODEL_REPOSITORY": str(templates)}
    child = start_launcher(options, tmp_path, env)
    server = TritonServer(options)  # only for its URLs
    try:
        errors_before = metric_sum(server.metrics_url, ERRORS)
        kill_engine(server)
        assert wait_for(lambda: metric_sum(server.metrics_url, ERRORS) == errors_before + 1, 2), "counted"
        assert child.wait(60) == ENGINE_DIED
        assert not is_ready(server), "nothing answers ready once the engine died"
    finally:
        stop_launcher(child)
    text = (tmp_path / "launch.log").read_text()
    assert "engine loop died" in text and "stopping tritonserver" in text


def test_the_launcher_stops_the_server_when_a_model_stub_dies(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Triton 2.51 keeps a model whose stub died "ready" and fails its every request: the launcher's
    `StubMonitor` sees it within two looks (a second each) and stops the server, exit ENGINE_DIED."""
    options = tiny_server_options(tiny_llama_dir, disable_kernels=True, drain_timeout_s=1, exit_timeout_s=5)
    child = start_launcher(options, tmp_path, dict(os.environ))
    try:
        (tritonserver,) = server_module.child_processes(child.pid)
        stubs = server_module.stub_pids(tritonserver)
        assert "tensorrt_llm_bls" in stubs, stubs
        os.kill(stubs["tensorrt_llm_bls"], signal.SIGKILL)
        assert child.wait(30) == ENGINE_DIED
    finally:
        stop_launcher(child)
    text = (tmp_path / "launch.log").read_text()
    assert "the stub process of tensorrt_llm_bls died" in text, text[-3000:]


def test_a_bare_tritonserver_restarts_the_engine_then_stops_past_the_limit(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Explicit model control (as the launcher and the GPU image run Triton): the model reloads itself,
    a new engine serves again; the next death is past `max_engine_restarts=1` and stops the server."""
    monkeypatch.setenv("TRITONLLM_MODEL_REPOSITORY", str(fault_injected_templates(tmp_path)))
    options = tiny_server_options(
        tiny_llama_dir, disable_kernels=True, drain_timeout_s=1, exit_timeout_s=5, max_engine_restarts=1
    )
    server = start_bare(options, tmp_path)
    try:
        assert generates(server)
        kill_engine(server)
        assert wait_for(lambda: generates(server), READY_TIMEOUT_S, step_s=0.5), log_text(tmp_path)[-3000:]
        assert is_ready(server)
        # The old instance reports its dead engine until Triton has unloaded it, a second or so later.
        assert wait_for(lambda: metric_sum(server.metrics_url, "tritonllm_engine_alive") == 1.0, 30)
        assert "restarting the engine (restart 1 of at most 1)" in log_text(tmp_path)

        kill_engine(server)
        assert wait_for(lambda: not is_ready(server), 40, step_s=0.2), "not ready once the server stops"
        assert server.process is not None
        server.process.wait(60)  # exits by itself (within --exit-timeout-secs)
    finally:
        server.stop(timeout_s=10)
    assert "engine loop died after 1 restarts" in log_text(tmp_path)


def test_a_bare_tritonserver_without_model_control_stops_when_the_engine_dies(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tritonserver --model-repository=R` alone (model control `none`): the model cannot reload itself,
    so it stops the server at once, without trying `load_model` (which Triton 2.51 may take 10 s+ to
    refuse, or never answer, leaving the server ready): readiness goes false, then the process exits."""
    monkeypatch.setenv("TRITONLLM_MODEL_REPOSITORY", str(fault_injected_templates(tmp_path)))
    command = server_module.server_command

    def default_model_control(*args: object) -> list[str]:
        return [c for c in command(*args) if c not in ("--model-control-mode=explicit", "--load-model=*")]

    monkeypatch.setattr(server_module, "server_command", default_model_control)
    options = tiny_server_options(tiny_llama_dir, disable_kernels=True, drain_timeout_s=1, exit_timeout_s=5)
    server = start_bare(options, tmp_path)
    try:
        kill_engine(server)
        assert wait_for(lambda: not is_ready(server), 40, step_s=0.2), "not ready once the server stops"
        assert server.process is not None
        server.process.wait(60)
    finally:
        server.stop(timeout_s=10)
    text = log_text(tmp_path)
    assert "runs without --model-control-mode=explicit" in text and "stopping tritonserver" in text
    assert "restarting the engine" not in text, "no reload was tried"
    assert "lock_exception" not in text and "Signal (6)" not in text, text[-3000:]


class FakeEngine:
    alive = False

    def __init__(self) -> None:
        self.shut_down = False

    def shutdown(self, drain_timeout_s: float = 0.0, join_timeout_s: float = 30.0) -> None:
        self.shut_down = True


class FakeBackend:
    def __init__(self, error: Exception | None = None) -> None:
        self.loads: list[tuple[str, dict]] = []
        self.error = error

    def load_model(self, name: str, config: str) -> None:
        self.loads.append((name, json.loads(config)))
        if self.error is not None:
            raise self.error


def test_a_dead_bls_stub_mid_stream_frees_its_engine_request_and_is_found_dead(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The BLS streams from `tensorrt_llm` over gRPC (`engine_link`), so its stub's death cancels that
    call: the engine aborts the request and frees its KV blocks, and keeps serving. (Over the Python
    backend's BLS calls the engine's next send blocked forever, and every request hung behind it.)
    Triton 2.51 neither restarts the dead stub nor stops answering ready for it: `StubMonitor` finds it,
    on its second look, for the launcher to stop the server."""
    options = tiny_server_options(tiny_llama_dir, disable_kernels=True, exit_timeout_s=5)
    server = start_bare(options, tmp_path)
    try:
        aborts = r'tritonllm_requests_finished_total\{[^}]*reason="abort"[^}]*\}'
        aborted_before = metric_sum(server.metrics_url, aborts)
        url = f"http://{server.http_url}/v2/models/tensorrt_llm_bls/generate_stream"
        body = {"text_input": "The quick brown fox", "max_tokens": 480, "min_tokens": 480, "stream": True}
        with requests.post(url, json=body, stream=True, timeout=30) as response:
            events = [
                line for line in itertools.islice(response.iter_lines(), 6) if line.startswith(b"data:")
            ]
            assert events and b"error" not in events[0]
            os.kill(server.stub_pids()["tensorrt_llm_bls"], signal.SIGKILL)  # 470-odd tokens still to go
            freed = wait_for(
                lambda: metric_sum(server.metrics_url, aborts) == aborted_before + 1
                and metric_sum(server.metrics_url, "tritonllm_kv_cache_blocks_used") == 0,
                10,
            )
            assert freed, "the engine aborted the dead stub's request and freed its blocks"
        results = run_stream(server, "tensorrt_llm", engine_inputs([5, 6, 7], 8, False), ["output_ids"])
        errors = [r for r in results if isinstance(r, InferenceServerException)]
        assert not errors, [(e.status(), e.message()) for e in errors]  # the messages: a CI run saw one, once
        assert server.models_without_stub() == ["tensorrt_llm_bls"]
        monitor = StubMonitor(server, interval_s=0)
        assert monitor.dead_models() == [], "one look is not enough"
        assert monitor.dead_models() == ["tensorrt_llm_bls"]
        assert server.process is not None and server.process.poll() is None, "the server itself keeps running"
    finally:
        server.stop(timeout_s=10)


class FakeServer:
    """`models_without_stub` answers from a script: a list of models, or an exception to raise."""

    def __init__(self, answers: list) -> None:
        self.answers = answers

    def models_without_stub(self) -> list[str]:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_stub_monitor_needs_two_looks_in_a_row_and_ignores_an_unanswering_server() -> None:
    """An engine restart swaps stubs (one look may land between them); a server that does not answer
    is stopping or dead, which the launcher sees from its process."""
    bls = ["tensorrt_llm_bls"]
    server = FakeServer([["tensorrt_llm"], [], bls, OSError("refused"), bls])
    monitor = StubMonitor(server, interval_s=0)  # type: ignore[arg-type]
    assert [monitor.dead_models() for _ in range(5)] == [[], [], [], [], []]
    server.answers = [["preprocessing"], ["preprocessing", "tensorrt_llm_bls"], ["preprocessing"]]
    assert [monitor.dead_models() for _ in range(3)] == [[], ["preprocessing"], ["preprocessing"]]
    slow = StubMonitor(FakeServer([]), interval_s=60)  # type: ignore[arg-type]
    assert slow.dead_models() == [], "no look before the interval (the script is empty: a look would raise)"


def test_watchdog_stops_once_when_a_send_stalls_past_the_limit() -> None:
    engine = FakeEngine()
    engine.alive = True
    stalled = [0.0]
    stops: list[float] = []
    watchdog = recovery.EngineWatchdog(
        engine,  # type: ignore[arg-type]
        lambda: None,
        interval_s=0.01,
        stalled_s=lambda: stalled[0],
        stall_limit_s=5.0,
        on_stall=stops.append,
    )
    try:
        stalled[0] = 4.9
        assert not wait_for(lambda: bool(stops), 0.1)
        stalled[0] = 5.0
        assert wait_for(lambda: stops == [5.0], 2)
        assert not wait_for(lambda: len(stops) > 1, 0.1)
    finally:
        watchdog.close()


def test_recover_reloads_with_a_changed_config_then_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    stops: list[bool] = []
    monkeypatch.setattr(recovery, "stop_tritonserver", lambda: stops.append(True) or True)
    monkeypatch.setattr(recovery, "explicit_model_control", lambda: True)
    config = {"name": "tensorrt_llm", "parameters": {"engine_dir": {"string_value": "/e"}}}

    engine, pb = FakeEngine(), FakeBackend()
    assert recovery.recover(pb, "tensorrt_llm", config, engine, limit=2) == "restarted"  # type: ignore[arg-type]
    assert engine.shut_down and not stops
    ((name, reloaded),) = pb.loads
    assert name == "tensorrt_llm" and recovery.restart_count(reloaded) == 1
    assert reloaded["parameters"]["engine_dir"] == {"string_value": "/e"}
    assert recovery.restart_count(config) == 0, "the running model's config is left alone"

    twice = recovery.restarted_config(reloaded)
    assert recovery.recover(pb, "tensorrt_llm", twice, FakeEngine(), limit=2) == "stopped"  # type: ignore[arg-type]
    assert len(pb.loads) == 1 and stops == [True]

    refused = FakeBackend(RuntimeError("explicit model load / unload is not allowed"))
    assert recovery.recover(refused, "tensorrt_llm", config, FakeEngine(), limit=2) == "stopped"  # type: ignore[arg-type]
    assert len(refused.loads) == 1 and stops == [True, True]


def test_recover_without_explicit_model_control_stops_without_trying_to_reload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stops: list[bool] = []
    monkeypatch.setattr(recovery, "stop_tritonserver", lambda: stops.append(True) or True)
    monkeypatch.setattr(recovery, "explicit_model_control", lambda: False)
    engine, pb = FakeEngine(), FakeBackend()
    assert recovery.recover(pb, "tensorrt_llm", {}, engine, limit=3) == "stopped"  # type: ignore[arg-type]
    assert engine.shut_down and stops == [True] and pb.loads == []


@pytest.mark.parametrize(
    ("argv", "mode"),
    [
        (["tritonserver", "--model-repository=/r"], "none"),
        (["tritonserver", "--model-control-mode=explicit", "--load-model=*"], "explicit"),
        (["tritonserver", "--model-control-mode", "EXPLICIT", ""], "explicit"),
        (["tritonserver", "--model-control-mode=explicit", "--model-control-mode=poll"], "poll"),
        (["tritonserver", "--model-control-mode"], ""),
    ],
)
def test_model_control_mode_is_read_from_the_command_line(argv: list[str], mode: str) -> None:
    assert recovery.model_control_mode(argv) == mode


def test_this_process_parent_is_not_under_explicit_model_control() -> None:
    assert recovery.explicit_model_control() is False  # pytest's parent is no tritonserver


def test_watchdog_calls_back_once_when_the_engine_dies() -> None:
    engine = FakeEngine()
    engine.alive = True
    calls: list[int] = []
    watchdog = recovery.EngineWatchdog(engine, lambda: calls.append(1), interval_s=0.01)  # type: ignore[arg-type]
    try:
        assert not wait_for(lambda: bool(calls), 0.1)
        engine.alive = False
        assert wait_for(lambda: calls == [1], 2)
        assert not wait_for(lambda: len(calls) > 1, 0.1)
    finally:
        watchdog.close()
