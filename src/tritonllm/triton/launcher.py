"""Render the model repository for a model, and run Triton Inference Server on it.

Uses the `tritonserver` binary and the Python backend shipped in the `nvidia-pytriton` wheel (the
facts behind each step are in the project's notes):

- the backend directory holds `libtriton_python.so`, `triton_python_backend_utils.py` and the stub
  built for this Python version;
- the repository is precompiled (`compileall`) so the stubs do not write `__pycache__` into version
  folders, which Triton could take for a change and reload;
- `tritonserver` runs with the wheel's libraries on `LD_LIBRARY_PATH` and this interpreter's `bin/`
  first on `PATH` (that is how the stub's embedded Python finds this environment's packages);
- it listens on loopback unless told otherwise, and the admin APIs (model control, shared memory,
  logging, trace) need a key header unless `restrict_admin=False`.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from string import Template

from tritonllm.openai.child import FrontDoorProcess
from tritonllm.precision import DTYPES, TORCH_QUANTIZATIONS

MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls")
ENGINE_MODEL = "tensorrt_llm"
ADMIN_HEADER = "tritonllm-admin-key"
RESTRICTED = "model-repository,shared-memory,logging,trace"
MARKER = ".tritonllm-repository"
ENGINE_DIED = 3  # `tritonllm launch` exit status when the engine loop died


def templates_dir() -> Path:
    """`model_repository/` of the source tree (or `$TRITONLLM_MODEL_REPOSITORY`)."""
    env = os.environ.get("TRITONLLM_MODEL_REPOSITORY")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "model_repository"


@dataclass
class LaunchOptions:
    """What to serve and how; engine fields left None use the engine's defaults."""

    model: str
    tokenizer_dir: str | None = None
    repository: str | None = None  # where to render; a temporary folder when None
    address: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    max_batch_size: int = 64
    preprocessing_instances: int = 1
    max_num_seqs: int | None = None
    max_waiting: int | None = None
    num_kv_blocks: int | None = None
    tokens_per_block: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    num_threads: int | None = None
    quantization: str | None = None
    dtype: str | None = None
    drain_timeout_s: float = 5.0
    decoupled: bool = True  # False: tensorrt_llm and the BLS answer unary calls, one response each
    disable_kernels: bool = False  # engine: PyTorch attention instead of the C++ kernel (no build)
    # After the drain Triton only unloads the stubs (seconds) and waits for open HTTP connections;
    # 2.51 counts one for every past `/generate` call to a decoupled model, so it always waits this long.
    exit_timeout_s: int = 15
    restrict_admin: bool = True
    admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    log_verbose: int = 0
    openai_port: int | None = None  # also start the OpenAI front door (tritonllm.openai) here

    def __post_init__(self) -> None:
        """Reject values the templates would carry into a config Triton or the engine refuses later."""
        for name in ("http_port", "grpc_port", "metrics_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in 1..65535, got {getattr(self, name)}")
        for name in ("max_batch_size", "preprocessing_instances"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        engine_limits = ("max_num_seqs", "max_waiting", "num_kv_blocks", "tokens_per_block")
        for name in (*engine_limits, "max_num_batched_tokens", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.quantization is not None and self.quantization not in TORCH_QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {TORCH_QUANTIZATIONS}, got {self.quantization!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.drain_timeout_s < 0 or self.exit_timeout_s < 0:
            raise ValueError("drain_timeout_s and exit_timeout_s must be >= 0")
        if self.restrict_admin and not self.admin_key:
            raise ValueError("admin_key must not be empty while the admin APIs are restricted")

    def template_values(self) -> dict[str, str]:
        values = {k: "" if v is None else str(v) for k, v in asdict(self).items()}
        values["engine_dir"] = str(Path(self.model).resolve())
        values["tokenizer_dir"] = str(Path(self.tokenizer_dir or self.model).resolve())
        values["decoupled"] = "true" if self.decoupled else "false"
        return values


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


def render_repository(dest: Path, options: LaunchOptions, templates: Path | None = None) -> Path:
    """Fill the templates' `${...}` placeholders into `dest` and precompile the Python files."""
    templates = templates or templates_dir()
    values = options.template_values()
    if dest.exists() and any(dest.iterdir()):
        if not (dest / MARKER).exists():
            raise FileExistsError(f"{dest} is not empty and was not rendered by tritonllm: not replacing it")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / MARKER).write_text("rendered by `tritonllm launch`; replaced on every launch\n")
    for model in MODELS:
        src = templates / model
        out = dest / model
        (out / "1").mkdir(parents=True)
        config = Template((src / "config.pbtxt").read_text()).substitute(values)
        (out / "config.pbtxt").write_text(config)
        for path in (src / "1").glob("*.py"):
            shutil.copy2(path, out / "1" / path.name)
    if not compileall.compile_dir(str(dest), quiet=1):
        raise RuntimeError(f"could not compile the model repository in {dest}")
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
        f"--exit-timeout-secs={options.exit_timeout_s}",
        f"--log-verbose={options.log_verbose}",
    ]
    if options.restrict_admin:
        cmd += [
            f"--http-restricted-api={RESTRICTED}:{ADMIN_HEADER}={options.admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED}:{ADMIN_HEADER}={options.admin_key}",
        ]
    return cmd


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
        self._alive_checked_at = 0.0

    @property
    def http_url(self) -> str:
        return f"{self.options.address}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.address}:{self.options.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.options.address}:{self.options.metrics_port}/metrics"

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
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.process.returncode} before it was ready")
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, OSError),
                urllib.request.urlopen(url, timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not ready within {timeout_s}s")

    def engine_alive(self) -> bool:
        """False once the engine reports its loop died (`tritonllm_engine_alive 0` on /metrics)."""
        now = time.monotonic()
        if now < self._alive_checked_at + 1.0:
            return True
        self._alive_checked_at = now
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as response:
                text = response.read().decode()
        except (urllib.error.URLError, ConnectionError, OSError):
            return True  # not answering is the server's own failure, seen by its exit status
        return not any(
            line.startswith("tritonllm_engine_alive") and line.rsplit(" ", 1)[-1] in ("0", "0.0")
            for line in text.splitlines()
        )

    def drain(self) -> bool:
        """Unload the engine model while Triton still serves: its in-flight requests finish within
        `drain_timeout_s` or are aborted, and every client gets its final response.

        Triton 2.51 counts no in-flight requests for decoupled models on SIGTERM and stops delivering
        their responses, so draining must come first. Returns False if the server did not drain.
        """
        host = "127.0.0.1" if self.options.address in ("0.0.0.0", "::", "") else self.options.address
        base = f"http://{host}:{self.options.http_port}/v2/repository"
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="HF checkpoint directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    parser.add_argument("--repository", help="render the model repository here (default: a temporary folder)")
    parser.add_argument("--address", default="127.0.0.1", help="listen address (default: loopback only)")
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds Triton may take to load the models (a first start builds the CPU kernels; default 300)",
    )
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--max-batch-size", type=int, default=64, help="Triton max_batch_size of every model")
    parser.add_argument("--max-num-seqs", type=int, help="engine: requests in the running batch")
    parser.add_argument("--max-waiting", type=int, help="engine: waiting requests before 'busy' errors")
    parser.add_argument("--num-kv-blocks", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--threads", type=int, help="engine CPU threads (default: the cores available)")
    parser.add_argument(
        "--quantization", choices=TORCH_QUANTIZATIONS, help="engine weights (default: as built, else none)"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="engine compute dtype; auto: the fastest accurate one for this machine (default: auto)",
    )
    parser.add_argument("--preprocessing-instances", type=int, default=1)
    parser.add_argument(
        "--drain-timeout", type=float, default=5.0, help="on stop: seconds in-flight requests may finish"
    )
    parser.add_argument(
        "--exit-timeout", type=int, default=15, help="on stop: seconds Triton may take to exit"
    )
    parser.add_argument(
        "--decoupled",
        choices=["true", "false"],
        default="true",
        help="false: tensorrt_llm and tensorrt_llm_bls answer non-streaming (unary) calls, no streaming",
    )
    parser.add_argument("--no-restrict-admin", action="store_true", help="leave the admin APIs open")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument(
        "--openai-port",
        type=int,
        help="also serve the OpenAI-compatible API on this port (keys: $TRITONLLM_OPENAI_API_KEYS)",
    )


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    from tritonllm.default_model import model_path_or_default

    model = model_path_or_default(args.model)
    return LaunchOptions(
        model=model,
        tokenizer_dir=args.tokenizer,
        repository=args.repository,
        address=args.address,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        max_batch_size=args.max_batch_size,
        preprocessing_instances=args.preprocessing_instances,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        num_threads=args.threads,
        quantization=args.quantization,
        dtype=args.dtype,
        drain_timeout_s=args.drain_timeout,
        decoupled=args.decoupled == "true",
        exit_timeout_s=args.exit_timeout,
        restrict_admin=not args.no_restrict_admin,
        log_verbose=args.log_verbose,
        openai_port=args.openai_port,
    )


def _start_front_door(options: LaunchOptions, server: TritonServer) -> FrontDoorProcess:
    model = options.tokenizer_dir or options.model
    return FrontDoorProcess(
        model, server.grpc_url, options.address, options.openai_port, options.max_model_len
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
        while not stopping and server.process is not None and server.process.poll() is None:
            time.sleep(0.2)
            if not server.engine_alive():
                print("tritonllm: the engine loop died (see the log above): stopping", file=sys.stderr)
                server.stop()
                return ENGINE_DIED
        if stopping:
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
