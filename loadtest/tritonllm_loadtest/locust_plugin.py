"""Locust users, the configured load shape, the time-series recorder and the Prometheus exporter.

Importing this module imports Locust (which gevent-patches the process) and puts gRPC in gevent mode:
``grpc.experimental.gevent.init_gevent()`` must run before any channel exists, or a blocking gRPC read
stalls every greenlet (tests/loadtests/test_loadtest_grpc_gevent.py shows both). Import it only from a
locustfile.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import gevent  # noqa: E402
from gevent.pool import Pool  # noqa: E402
from locust import LoadTestShape, User, constant, events, task  # noqa: E402
from locust.env import Environment  # noqa: E402
from locust.runners import MasterRunner, WorkerRunner  # noqa: E402

from tritonllm_loadtest.distributions import IntDistribution  # noqa: E402
from tritonllm_loadtest.exporter import DEFAULT_PORT, LoadTestMetrics  # noqa: E402
from tritonllm_loadtest.shapes import SHAPES, ShapeConfig  # noqa: E402
from tritonllm_loadtest.stats import LATENCIES, Recorder, Snapshot, add  # noqa: E402
from tritonllm_loadtest.transports import (  # noqa: E402
    TRANSPORTS,
    GenerationResult,
    GrpcStreamTransport,
    HttpTransport,
)
from tritonllm_loadtest.workload import (  # noqa: E402
    PROMPT_SOURCES,
    GenerationRequest,
    Workload,
    WorkloadConfig,
    default_tokenizer_dir,
    parse_priorities,
)

log = logging.getLogger("tritonllm_loadtest")
# Locust request types: one per transport for whole requests (response_length = output tokens), plus
# one event per request for TTFT and one per token gap for ITL.
REQUEST_TYPES = {"http-stream": "SSE", "http": "HTTP", "grpc-stream": "gRPC"}
LATENCY_TYPES = {"TTFT": "ttft", "ITL": "itl"}


@events.init_command_line_parser.add_listener
def add_options(parser) -> None:
    group = parser.add_argument_group("tritonllm", "LLM load test (tritonllm_loadtest)")
    add = group.add_argument
    add("--llm-transport", choices=TRANSPORTS, default="http-stream", help="protocol for the request users")
    add("--llm-model", default="ensemble", help="Triton model: ensemble or tensorrt_llm_bls")
    add("--llm-grpc-host", default="127.0.0.1:8001", help="gRPC address for grpc-stream")
    add("--llm-tokenizer", default=str(default_tokenizer_dir()), help="served model folder or tokenizer.json")
    add("--llm-prompts", choices=PROMPT_SOURCES, default="synthetic")
    add("--llm-input-tokens", default="normal:128,32", help="prompt tokens: fixed:N, uniform:A,B, normal:M,S")
    add("--llm-max-tokens", default="fixed:64", help="max_tokens distribution (same forms)")
    add("--llm-any-length", action="store_true", help="let EOS end replies (default: min_tokens=max_tokens)")
    add("--llm-seed", type=int, default=0)
    add(
        "--llm-priorities",
        default="",
        help="priority tiers priority:weight,... (lower is served first), e.g. 0:1,5:3; stats per tier",
    )
    add("--llm-timeout", type=float, default=120.0, help="seconds per request")
    add("--llm-shape", choices=SHAPES, default="constant")
    add("--llm-duration", type=float, default=60.0, help="seconds")
    add("--llm-users", type=int, default=4, help="constant: users; step: maximum; spike: base level")
    add("--llm-spawn-rate", type=float, default=10.0)
    add("--llm-step-users", type=int, default=2)
    add("--llm-step-duration", type=float, default=30.0)
    add("--llm-spike-users", type=int, default=16)
    add("--llm-spike-at", type=float, default=20.0)
    add("--llm-spike-duration", type=float, default=10.0)
    add("--llm-rate", type=float, default=1.0, help="poisson: requests/s over all workers")
    add("--llm-arrival-users", type=int, default=1, help="poisson: arrival processes (>= workers)")
    add("--llm-max-in-flight", type=int, default=256, help="poisson: per process; beyond: 'dropped' error")
    add("--llm-metrics-port", type=int, default=DEFAULT_PORT, help="Prometheus exporter port, 0: off")
    add(
        "--llm-metrics-port-per-worker",
        action="store_true",
        help="workers on one host: each serves on the port + its worker index",
    )
    add("--llm-record", default="", help="write the time series and stage figures here (JSON)")
    add("--llm-sample-interval", type=float, default=2.0, help="seconds between time-series samples")


def shape_config(options) -> ShapeConfig:
    return ShapeConfig(
        shape=options.llm_shape,
        duration_s=options.llm_duration,
        users=options.llm_users,
        spawn_rate=options.llm_spawn_rate,
        step_users=options.llm_step_users,
        step_duration_s=options.llm_step_duration,
        spike_users=options.llm_spike_users,
        spike_at_s=options.llm_spike_at,
        spike_duration_s=options.llm_spike_duration,
        rate=options.llm_rate,
        arrival_users=options.llm_arrival_users,
    )


class LoadTestError(Exception):
    """A failed request; ``repr`` (what Locust's failure table shows) starts with the error kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(kind, message)
        self.kind, self.message = kind, message

    def __repr__(self) -> str:
        return f"{self.kind}: {self.message[:120]}"


class ProcessContext:
    """Per-process state shared by the users: workload, exporter, in-flight count, user numbering."""

    def __init__(self, environment: Environment) -> None:
        options = environment.parsed_options
        self.environment = environment
        self.options = options
        self.workload = Workload(
            WorkloadConfig(
                tokenizer=options.llm_tokenizer,
                input_tokens=IntDistribution.parse(options.llm_input_tokens),
                max_tokens=IntDistribution.parse(options.llm_max_tokens),
                prompts=options.llm_prompts,
                seed=options.llm_seed,
                priorities=parse_priorities(options.llm_priorities),
            )
        )
        self.in_flight = 0
        self.tokens_received = 0  # live: streamed tokens as they arrive, whole replies when they end
        runner = environment.runner
        worker = runner.worker_index if isinstance(runner, WorkerRunner) else 0
        self.stream_ids = itertools.count(worker * 1_000_000)
        self.metrics = LoadTestMetrics(options.llm_model)
        self.metrics.track(lambda: runner.user_count, lambda: self.in_flight)
        # The master forwards its options to every worker, so workers cannot have their own port option:
        # workers sharing a host (`--workers N`) take the port + their index; one per host keep the port.
        if options.llm_metrics_port:
            offset = worker if options.llm_metrics_port_per_worker else 0
            self.metrics.serve(options.llm_metrics_port + offset)

    def make_transport(self, transport: str) -> HttpTransport | GrpcStreamTransport:
        o = self.options
        exact = not o.llm_any_length
        if transport == "grpc-stream":
            return GrpcStreamTransport(o.llm_grpc_host, o.llm_model, o.llm_timeout, exact_output=exact)
        count = self.workload.count_tokens
        stream = transport == "http-stream"
        host = self.environment.host or o.host
        if not host:
            raise ValueError("no --host: pass Triton's HTTP base URL, e.g. http://127.0.0.1:8000")
        return HttpTransport(host, o.llm_model, stream, o.llm_timeout, count, exact_output=exact)

    def run(self, transport_name: str, transport, request: GenerationRequest) -> None:
        self.in_flight += 1
        started = time.perf_counter()
        try:
            result = transport.generate(request, self._receive_token)
        except Exception as exc:  # an unexpected reply must still count as a failed request, timed
            result = GenerationResult(start=started).fail("client_error", f"{exc!r}")
        finally:
            self.in_flight -= 1
        if not result.token_times:  # not streamed: the tokens arrived all at once
            self._receive_token(result.output_tokens)
        self.fire(transport_name, result, request.priority)

    def _receive_token(self, n: int = 1) -> None:
        self.tokens_received += n
        self.metrics.tokens_received(n)

    def fire(self, transport_name: str, result: GenerationResult, priority: int = 0) -> None:
        """Locust events named by the model, and by the priority tier when the workload mixes tiers."""
        model, fire = self.options.llm_model, self.environment.events.request.fire
        name = f"{model} p{priority}" if self.options.llm_priorities else model
        self.metrics.record(result)
        error = None if result.ok else LoadTestError(result.error_kind or "", result.error_message)
        context = {"model": model}
        fire(
            request_type=REQUEST_TYPES[transport_name],
            name=name,
            response_time=result.e2e_s * 1000,
            response_length=result.output_tokens,
            exception=error,
            context=context,
        )
        if not result.ok:
            return
        if result.ttft_s is not None:
            fire(request_type="TTFT", name=name, response_time=result.ttft_s * 1000, response_length=0,
                 exception=None, context=context)  # fmt: skip
        for gap in result.itls_s:
            fire(request_type="ITL", name=name, response_time=gap * 1000, response_length=0,
                 exception=None, context=context)  # fmt: skip


_contexts: dict[int, ProcessContext] = {}


def process_context(environment: Environment) -> ProcessContext:
    if id(environment) not in _contexts:
        _contexts[id(environment)] = ProcessContext(environment)
    return _contexts[id(environment)]


class LLMUser(User):
    """Closed loop: each user sends its next request as soon as the previous one finished."""

    abstract = True
    transport_name = "http-stream"
    wait_time = constant(0)

    def on_start(self) -> None:
        self.context = process_context(self.environment)
        self.requests = self.context.workload.stream(next(self.context.stream_ids))
        self.transport = self.context.make_transport(self.transport_name)

    @task
    def generate(self) -> None:
        self.context.run(self.transport_name, self.transport, self.requests.next())


class HttpStreamUser(LLMUser):
    """``/generate_stream`` with ``stream: true``: server-sent events, one per token."""

    transport_name = "http-stream"


class HttpGenerateUser(LLMUser):
    """Non-streaming ``/generate``: no TTFT/ITL, output tokens counted with the tokenizer."""

    transport_name = "http"


class GrpcStreamUser(LLMUser):
    """gRPC ``ModelStreamInfer``, one stream per request (gRPC in gevent mode, see the module doc)."""

    transport_name = "grpc-stream"


TRANSPORT_USERS = {"http-stream": HttpStreamUser, "http": HttpGenerateUser, "grpc-stream": GrpcStreamUser}


class OpenLoopUser(User):
    """Poisson arrivals at ``rate / arrival_users``: requests start on schedule, whatever the latency."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.context = process_context(self.environment)
        options = self.context.options
        self.transport_name = options.llm_transport
        self.rate = shape_config(options).rate_per_arrival_user
        self.requests = self.context.workload.stream(next(self.context.stream_ids))
        self.arrivals = random.Random(f"arrivals:{options.llm_seed}:{id(self)}")
        self.pool = Pool(options.llm_max_in_flight)
        self.idle_transports: list = []

    @task
    def arrive(self) -> None:
        gevent.sleep(self.arrivals.expovariate(self.rate))
        request = self.requests.next()
        if self.pool.full():
            dropped = GenerationResult(start=time.perf_counter())
            dropped.fail("dropped", "max in-flight requests reached")
            self.context.fire(self.transport_name, dropped, request.priority)
            return
        self.pool.spawn(self._send, request)

    def _send(self, request: GenerationRequest) -> None:
        # At most max_in_flight transports (one per pool slot), reused across arrivals.
        if self.idle_transports:
            transport = self.idle_transports.pop()
        else:
            transport = self.context.make_transport(self.transport_name)
        try:
            self.context.run(self.transport_name, transport, request)
        finally:
            self.idle_transports.append(transport)

    def on_stop(self) -> None:
        self.pool.kill(block=False)


class LLMLoadShape(LoadTestShape):
    """The shape chosen with ``--llm-shape`` (constant, step, spike, poisson)."""

    @cached_property
    def config(self) -> ShapeConfig:
        return shape_config(self.runner.environment.parsed_options)

    def tick(self):
        users = self.config.users_at(self.get_run_time())
        if users is None:
            return None
        if self.config.open_loop:
            return users, float(users), [OpenLoopUser]
        transport = self.runner.environment.parsed_options.llm_transport
        return users, self.config.spawn_rate, [TRANSPORT_USERS[transport]]


@dataclass
class WorkerCounts:
    """The master's view of each worker's live counters, sent with its stats reports (every ~3 s)."""

    in_flight: dict[str, int]
    tokens_received: dict[str, int]


class TimeSeries:
    """Samples the (master's merged) Locust stats every interval and writes the recording at the end."""

    def __init__(self, environment: Environment, path: Path, interval_s: float) -> None:
        self.environment, self.path, self.interval_s = environment, path, interval_s
        self.recorder = Recorder()
        self.started = time.monotonic()
        self.workers = WorkerCounts({}, {})
        self.greenlet = gevent.spawn(self._loop)

    def live_counts(self) -> tuple[int, int]:
        """(requests in flight, tokens received) over all processes."""
        if isinstance(self.environment.runner, MasterRunner):
            return sum(self.workers.in_flight.values()), sum(self.workers.tokens_received.values())
        context = _contexts.get(id(self.environment))
        return (context.in_flight, context.tokens_received) if context else (0, 0)

    def snapshot(self) -> Snapshot:
        runner = self.environment.runner
        stats = runner.stats
        hists: dict[str, dict[float, int]] = {name: {} for name in LATENCIES}
        requests = failures = 0
        for (_name, method), entry in stats.entries.items():
            family = LATENCY_TYPES.get(method) or ("e2e" if method in REQUEST_TYPES.values() else None)
            if family is None:
                continue
            add(hists[family], entry.response_times)
            if family == "e2e":
                requests += entry.num_requests
                failures += entry.num_failures
        errors: dict[str, int] = {}
        for error in stats.errors.values():
            kind = str(error.error).split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + error.occurrences
        t = time.monotonic() - self.started
        in_flight, tokens = self.live_counts()
        return Snapshot(t, runner.user_count, in_flight, requests, failures, tokens, hists, errors)

    def sample(self) -> None:
        snap = self.snapshot()
        if self.recorder.last and snap.t <= self.recorder.last.t:
            return
        self.recorder.add(snap, self.environment.runner.target_user_count or snap.users)
        s = self.recorder.samples[-1]
        log.info(
            "t=%5.0fs users=%d in_flight=%d req=%d failed=%d out_tok/s=%.1f ttft_p50=%sms itl_p50=%sms",
            snap.t, snap.users, snap.in_flight, snap.requests, snap.failures,
            s["output_tokens_per_s"], s["ttft_p50_ms"], s["itl_p50_ms"],
        )  # fmt: skip

    def _loop(self) -> None:
        while True:
            gevent.sleep(self.interval_s)
            self.sample()

    def finish(self) -> None:
        self.greenlet.kill(block=False)
        self.sample()
        recording = {"options": _plain_options(self.environment.parsed_options), **self.recorder.result()}
        self.path.write_text(json.dumps(recording) + "\n")


def _plain_options(options) -> dict:
    return {k: v for k, v in vars(options).items() if k.startswith("llm_") or k == "host"}


_series: dict[int, TimeSeries] = {}


@events.test_start.add_listener
def on_test_start(environment: Environment, **_kwargs) -> None:
    options = environment.parsed_options
    if not isinstance(environment.runner, MasterRunner):
        # Built here, once, before any user starts: a user's on_start may yield mid-way.
        process_context(environment)
    if isinstance(environment.runner, WorkerRunner) or not options or not options.llm_record:
        return
    _series[id(environment)] = TimeSeries(environment, Path(options.llm_record), options.llm_sample_interval)


@events.quitting.add_listener
def on_quitting(environment: Environment, **_kwargs) -> None:
    series = _series.pop(id(environment), None)
    if series is not None:
        series.finish()


@events.report_to_master.add_listener
def on_report_to_master(client_id: str, data: dict) -> None:
    for context in _contexts.values():
        data["llm_in_flight"] = context.in_flight
        data["llm_tokens_received"] = context.tokens_received


@events.worker_report.add_listener
def on_worker_report(client_id: str, data: dict) -> None:
    for series in _series.values():
        series.workers.in_flight[client_id] = int(data.get("llm_in_flight", 0))
        series.workers.tokens_received[client_id] = int(data.get("llm_tokens_received", 0))
