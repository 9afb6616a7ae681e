"""Run Triton Inference Server on a rendered model repository: `TritonServer` (start, wait, drain, stop).

Uses the `tritonserver` binary and the Python backend shipped in the `nvidia-pytriton` wheel (the
facts behind each step are in the project's notes):

- the backend directory holds `libtriton_python.so`, `triton_python_backend_utils.py` and the stub
  built for this Python version;
- `tritonserver` runs with the wheel's libraries on `LD_LIBRARY_PATH` and this interpreter's `bin/`
  first on `PATH` (that is how the stub's embedded Python finds this environment's packages);
- it listens on loopback unless told otherwise, and the admin APIs (model control, shared memory,
  logging, trace) need a key header unless `restrict_admin=False`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from tritonllm.triton.options import LaunchOptions
from tritonllm.triton.repository import ENGINE_MODEL, MODELS, render_repository

ADMIN_HEADER = "tritonllm-admin-key"
PYTHON_MODELS = frozenset(MODELS) - {"ensemble"}  # each runs in a Python-backend stub process
RESTRICTED = "model-repository,shared-memory,logging,trace"


@dataclass
class PytritonPaths:
    tritonserver: Path
    python_backend: Path
    stub: Path
    caches: Path
    libs: Path


def pytriton_paths() -> PytritonPaths:
    """Locate the server, Python backend, stub and libraries inside the installed nvidia-pytriton wheel."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("nvidia-pytriton is not installed (pip install nvidia-pytriton==0.7.0)")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    paths = PytritonPaths(
        tritonserver=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
        caches=root / "caches",
        libs=root.parents[1] / "nvidia_pytriton.libs",
    )
    for name, path in asdict(paths).items():
        if not Path(path).exists():
            raise FileNotFoundError(f"{name} not found at {path} (Python {version})")
    return paths


def build_backend_dir(dest: Path, paths: PytritonPaths) -> Path:
    """`dest/python/` with the backend library, its utils module and this Python's stub."""
    python = dest / "python"
    python.mkdir(parents=True, exist_ok=True)
    for src in (
        paths.python_backend / "libtriton_python.so",
        paths.python_backend / "triton_python_backend_utils.py",
        paths.stub,
    ):
        shutil.copy2(src, python / src.name)
    return dest


def server_env(paths: PytritonPaths) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(paths.libs), env.get("LD_LIBRARY_PATH", "")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def server_command(
    options: LaunchOptions, repository: Path, backend_dir: Path, paths: PytritonPaths
) -> list[str]:
    cmd = [
        str(paths.tritonserver),
        f"--model-repository={repository}",
        f"--backend-directory={backend_dir}",
        f"--cache-directory={paths.caches}",
        f"--http-address={options.address}",
        f"--http-port={options.http_port}",
        f"--grpc-address={options.address}",
        f"--grpc-port={options.grpc_port}",
        f"--metrics-address={options.address}",
        f"--metrics-port={options.metrics_port}",
        "--allow-gpu-metrics=false",
        "--model-control-mode=explicit",
        "--load-model=*",
        "--exit-on-error=true",
        "--strict-readiness=true",
        # Every config.pbtxt is complete: auto-completion would start each Python model's stub (importing
        # torch and transformers) once more just to ask it, about half of a start on a 2-core machine.
        "--disable-auto-complete-config",
        f"--exit-timeout-secs={options.exit_timeout_s}",
        f"--log-verbose={options.log_verbose}",
    ]
    if options.restrict_admin:
        cmd += [
            f"--http-restricted-api={RESTRICTED}:{ADMIN_HEADER}={options.admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED}:{ADMIN_HEADER}={options.admin_key}",
        ]
    return cmd


def child_processes(pid: int) -> dict[int, list[str]]:
    """The running children of process `pid` and their command lines (from /proc)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            children[int(stat.parent.name)] = stat.with_name("cmdline").read_text().split("\0")
        except (OSError, ValueError, IndexError):
            continue
    return children


def stub_pids(tritonserver_pid: int) -> dict[str, int]:
    """A tritonserver's Python-backend stubs by model name: a stub's first argument is the model's file,
    `<model>/<version>/model.py`."""
    return {
        Path(args[1]).parent.parent.name: pid
        for pid, args in child_processes(tritonserver_pid).items()
        if len(args) > 1
    }


def _answers(url: str) -> bool:
    """Whether a GET of `url` returns 200 now."""
    with (
        contextlib.suppress(urllib.error.URLError, ConnectionError, OSError),
        urllib.request.urlopen(url, timeout=2) as response,
    ):
        return response.status == 200
    return False


class TritonServer:
    """A `tritonserver` child process: `start`, `wait_ready`, `stop` (also a context manager)."""

    def __init__(
        self, options: LaunchOptions, log_file: Path | None = None, env: dict[str, str] | None = None
    ):
        self.options = options
        self.log_file = log_file
        self.extra_env = dict(env or {})
        self.process: subprocess.Popen | None = None
        self._workdir: Path | None = None

    @property
    def http_url(self) -> str:
        return f"{self.options.address}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.address}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.address}:{self.options.metrics_port}/metrics"

    def stub_pids(self) -> dict[str, int]:
        """The pids of this server's Python-backend stubs, by model name ('tensorrt_llm', ...)."""
        assert self.process is not None
        return stub_pids(self.process.pid)

    def models_without_stub(self) -> list[str]:
        """This repository's Python models that Triton lists READY but whose stub process is gone.

        Triton 2.51 does not restart a dead stub of a decoupled model and still answers ready for it
        (`/v2/models/<m>/ready` is 200) while every request to it fails ("Stub process ... is not
        healthy"), so its supervisor must. Raises OSError or ValueError if the server does not answer.
        """
        index = json.loads(self._admin_post(f"{self._repository_url()}/index", time.monotonic() + 5))
        ready = {m.get("name") for m in index if m.get("state") == "READY"} & PYTHON_MODELS
        return sorted(ready - self.stub_pids().keys())

    def start(self) -> TritonServer:
        paths = pytriton_paths()
        self._workdir = Path(tempfile.mkdtemp(prefix="tritonllm-"))
        repository = Path(self.options.repository) if self.options.repository else self._workdir / "models"
        render_repository(repository, self.options)
        backend_dir = build_backend_dir(self._workdir / "backends", paths)
        cmd = server_command(self.options, repository, backend_dir, paths)
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115 -- lives with the process
        self.process = subprocess.Popen(
            cmd,
            env=server_env(paths),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until every model is ready; raises if the server exits or the time runs out."""
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        # Metrics start a moment after HTTP and gRPC: ready means they answer too.
        urls = [f"http://{self.http_url}/v2/health/ready", self.metrics_url]
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode} before it was ready")
            if all(_answers(url) for url in urls):
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready within {timeout_s}s")

    def drain(self) -> bool:
        """Unload the engine model while Triton still serves: its in-flight requests finish within
        `drain_timeout_s` or are aborted, and every client gets its final response.

        Triton 2.51 counts no in-flight requests for decoupled models on SIGTERM and stops delivering
        their responses, so draining must come first. Returns False if the server did not drain.
        """
        base = self._repository_url()
        deadline = time.monotonic() + self.options.drain_timeout_s + 30
        try:
            self._admin_post(f"{base}/models/{ENGINE_MODEL}/unload", deadline)
            # The unload answers before the model has finalized: wait for it, so the final responses
            # are delivered before SIGTERM.
            while time.monotonic() < deadline:
                index = json.loads(self._admin_post(f"{base}/index", deadline))
                if not any(m.get("name") == ENGINE_MODEL and m.get("state") != "UNAVAILABLE" for m in index):
                    return True
                time.sleep(0.1)
        except (urllib.error.URLError, ConnectionError, OSError, ValueError):
            pass
        return False

    def _repository_url(self) -> str:
        return f"http://{self.options.local_host()}:{self.options.http_port}/v2/repository"

    def _admin_post(self, url: str, deadline: float) -> bytes:
        headers = {"Content-Type": "application/json"}
        if self.options.restrict_admin:
            headers[ADMIN_HEADER] = self.options.admin_key
        request = urllib.request.Request(url, data=b"{}", headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=max(deadline - time.monotonic(), 0.1)) as response:
            return response.read()

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Drain the engine, SIGTERM the server, then SIGKILL the group after the bound."""
        process, self.process = self.process, None
        if process is not None:
            timeout_s = timeout_s if timeout_s is not None else self.options.exit_timeout_s + 15
            if process.poll() is None:
                self.drain()
                process.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout_s)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # the stubs, if any outlived the server
            process.wait()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        return process.returncode if process is not None else None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
