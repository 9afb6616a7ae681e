"""What the `tensorrt_llm` model does when its engine loop dies: restart the engine, else stop the server;
and when a response send never returns (`stop_stalled_server`): stop the server.

Triton 2.51 (the nvidia-pytriton wheel) gives a Python model no way to report itself unhealthy: a
model's readiness is its load state, and a stub process that exits is neither restarted nor reported
(requests then fail with "Stub process ... is not healthy" while `/v2/health/ready` stays 200). What
it does support is a model loading itself again through the model-control API (`pb_utils.load_model`,
only under `--model-control-mode=explicit`): Triton loads a new instance (new stub, new engine) while
the old one keeps answering "engine is not running" (UNAVAILABLE), swaps it in and unloads the old one.
Triton skips a load whose config is unchanged, so the reload carries a raised `engine_restarts`
parameter. Where that cannot work (another model-control mode, a failed load, `max_engine_restarts`
reached) the model stops `tritonserver` with SIGTERM: readiness is false at once and the process exits
for its supervisor to restart it.

The model-control mode is read from tritonserver's command line, never probed with `load_model`: in
the default mode Triton 2.51 takes 10 s or more to refuse the load, or never answers, and a stub stuck
in that call makes tritonserver's shutdown abort (boost lock_exception in the Python backend's
TRITONBACKEND_ModelInstanceFinalize) while `/v2/health/ready` keeps answering 200.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from tritonllm.engine.protocol import Engine

log = logging.getLogger(__name__)

RESTARTS = "engine_restarts"


def restart_count(model_config: dict[str, Any]) -> int:
    """How many times the engine of this model was restarted (the `engine_restarts` parameter)."""
    value = model_config.get("parameters", {}).get(RESTARTS, {}).get("string_value", "")
    return int(value) if value.strip() else 0


def restarted_config(model_config: dict[str, Any]) -> dict[str, Any]:
    """The model's config with `engine_restarts` one higher: a load Triton does not skip as unchanged."""
    config = copy.deepcopy(model_config)
    count = restart_count(model_config) + 1
    config.setdefault("parameters", {})[RESTARTS] = {"string_value": str(count)}
    return config


def model_control_mode(argv: list[str]) -> str:
    """The `--model-control-mode` in tritonserver's arguments (`=` or separate value; the last wins)."""
    mode = "none"
    for arg, following in zip(argv, [*argv[1:], ""], strict=True):
        if arg.startswith("--model-control-mode="):
            mode = arg.partition("=")[2]
        elif arg == "--model-control-mode":
            mode = following
    return mode.strip().lower()


def explicit_model_control() -> bool:
    """Whether the parent tritonserver runs with explicit model control, the only mode where the model
    can reload itself; False when its command line cannot be read (then stopping is the safe choice)."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    return model_control_mode(argv) == "explicit"


def stop_tritonserver() -> bool:
    """SIGTERM the `tritonserver` process this stub runs under; False if the parent is something else."""
    parent = os.getppid()
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        name = ""
    if not name.startswith("tritonserver"):
        log.error("the stub's parent (pid %d, %r) is not tritonserver: not stopping it", parent, name)
        return False
    os.kill(parent, signal.SIGTERM)
    return True


def recover(pb: ModuleType, model_name: str, model_config: dict[str, Any], engine: Engine, limit: int) -> str:
    """Release the dead engine, then reload the model (`"restarted"`) or stop the server (`"stopped"`)."""
    try:  # frees what the engine holds (a TensorRT-LLM executor's GPU memory) before a new one loads
        engine.shutdown(drain_timeout_s=0.0, join_timeout_s=5.0)
    except Exception:
        log.exception("shutting down the dead engine failed")
    done = restart_count(model_config)
    if done >= limit:
        log.error("the engine loop died after %d restarts (max_engine_restarts=%d)", done, limit)
    elif not explicit_model_control():  # checked first: see the module's docstring
        log.error("the engine loop died; tritonserver runs without --model-control-mode=explicit")
    else:
        log.error("the engine loop died: restarting the engine (restart %d of at most %d)", done + 1, limit)
        try:
            pb.load_model(model_name, config=json.dumps(restarted_config(model_config)))
            return "restarted"
        except Exception as exc:  # the new engine failed to load
            log.error("reloading %s failed: %s", model_name, exc)
    log.error("stopping tritonserver: it cannot serve without the engine; its supervisor should restart it")
    stop_tritonserver()
    return "stopped"


def stop_stalled_server(stalled_s: float) -> None:
    """The response sender has been inside one send for `stalled_s`: stop tritonserver.

    Seen in Triton 2.51: when a stub that calls `tensorrt_llm` through the Python backend's BLS calls
    dies (killed, crashed) while its inner stream is running (`tensorrt_llm_bls` did before it moved to
    gRPC, `engine_link`; a user's own BLS model may), the next response for it blocks the server's
    thread in the Python backend's SendBLSDecoupledResponse, waiting for the dead stub, forever; this
    stub's send waits on that thread, and every request on the model hangs while readiness stays 200.
    A reload cannot replace an instance stuck so, so the server stops for its supervisor to restart it.
    """
    log.error(
        "a response send has not returned for %.0f s (a consumer of this model's responses, such as a BLS "
        "stub, is gone): every request on this model is stuck; stopping tritonserver for its supervisor "
        "to restart it",
        stalled_s,
    )
    stop_tritonserver()


class EngineWatchdog:
    """Calls `on_death` once, on its own thread, when the engine's loop has died, or `on_stall` once
    (with the seconds) when `stalled_s()` (the response sender's time in one send) reaches `stall_limit_s`."""

    def __init__(
        self,
        engine: Engine,
        on_death: Callable[[], object],
        interval_s: float = 0.5,
        stalled_s: Callable[[], float] = lambda: 0.0,
        stall_limit_s: float = float("inf"),
        on_stall: Callable[[float], object] = stop_stalled_server,
    ):
        self._engine = engine
        self._on_death = on_death
        self._interval_s = interval_s
        self._stalled_s = stalled_s
        self._stall_limit_s = stall_limit_s
        self._on_stall = on_stall
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tritonllm-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._closed.wait(self._interval_s):
            if not self._engine.alive:
                try:
                    self._on_death()
                except Exception:
                    log.exception("recovering from the engine's death failed")
                return
            stalled = self._stalled_s()
            if stalled >= self._stall_limit_s:
                try:
                    self._on_stall(stalled)
                except Exception:
                    log.exception("stopping after a stalled send failed")
                return
