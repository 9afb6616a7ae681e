"""Engine metrics on Triton's `/metrics` endpoint, through `pb_utils.MetricFamily`.

Every metric operation is an IPC round trip from the Python stub to the server, so the engine loop
never makes one: finished requests are queued and a reporter thread observes them and refreshes the
gauges from the engine's `stats()` every `interval_s`. All names start with `tritonllm_`; the README
lists them. Latencies are in seconds.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Callable
from types import ModuleType

from tritonllm.engine.protocol import Engine
from tritonllm.triton.bridge import FinishedRequest

log = logging.getLogger(__name__)

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]

HISTOGRAMS = {
    "tritonllm_time_to_first_token_seconds": (
        "Time from request arrival to its first token",
        LATENCY_BUCKETS,
    ),
    "tritonllm_inter_token_latency_seconds": ("Mean time between tokens, per request", ITL_BUCKETS),
    "tritonllm_e2e_request_latency_seconds": ("Time from request arrival to its last token", LATENCY_BUCKETS),
    "tritonllm_queue_time_seconds": ("Time from request arrival to its first scheduling", LATENCY_BUCKETS),
}
GAUGES = {
    "tritonllm_num_requests_running": "Requests in the running batch",
    "tritonllm_num_requests_waiting": "Requests waiting to be scheduled",
    "tritonllm_kv_cache_blocks_total": "KV-cache blocks in the pool",
    "tritonllm_kv_cache_blocks_used": "KV-cache blocks held by requests",
    "tritonllm_kv_cache_blocks_free": "KV-cache blocks free (including cached prefixes)",
    "tritonllm_kv_cache_usage_ratio": "Fraction of KV-cache blocks in use",
    "tritonllm_engine_alive": "1 while the engine loop runs, 0 once it died (until the model restarts it)",
}
# Counter name -> how to read its running total from EngineStats.
COUNTERS: dict[str, tuple[str, Callable]] = {
    "tritonllm_prompt_tokens_total": ("Prompt tokens computed (prefill)", lambda s: s.prompt_tokens),
    "tritonllm_generation_tokens_total": ("Tokens generated", lambda s: s.generated_tokens),
    "tritonllm_prefix_cache_hit_tokens_total": (
        "Prompt tokens served from the prefix cache",
        lambda s: s.prefix_hit_tokens,
    ),
    "tritonllm_prefix_cache_queried_tokens_total": (
        "Prompt tokens looked up in the prefix cache",
        lambda s: s.prefix_queried_tokens,
    ),
    "tritonllm_preemptions_total": ("Requests preempted (recomputed later)", lambda s: s.num_preemptions),
}


class MetricsReporter:
    """Publishes engine metrics; `record_finished` and `record_rejected` may be called from any thread."""

    def __init__(
        self,
        pb_utils: ModuleType,
        engine: Engine,
        labels: dict[str, str] | None = None,
        interval_s: float = 0.25,
    ):
        self._engine = engine
        self._interval_s = interval_s
        labels = labels or {}
        kinds = pb_utils.MetricFamily
        self._families = []  # keep families alive as long as their metrics

        def family(name: str, description: str, kind):
            fam = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            self._families.append(fam)
            return fam

        self._histograms = {
            name: family(name, desc, kinds.HISTOGRAM).Metric(labels=labels, buckets=buckets)
            for name, (desc, buckets) in HISTOGRAMS.items()
        }
        self._gauges = {
            name: family(name, desc, kinds.GAUGE).Metric(labels=labels) for name, desc in GAUGES.items()
        }
        self._counters = {
            name: family(name, desc, kinds.COUNTER).Metric(labels=labels)
            for name, (desc, _) in COUNTERS.items()
        }
        self._finished_family = family(
            "tritonllm_requests_finished_total", "Requests finished, by reason", kinds.COUNTER
        )
        self._finished = {
            reason: self._finished_family.Metric(labels={**labels, "reason": reason})
            for reason in ("stop", "length", "abort", "timeout", "error")
        }
        self._rejected = family(
            "tritonllm_requests_rejected_total",
            "Requests rejected because the engine was busy",
            kinds.COUNTER,
        ).Metric(labels=labels)
        self._last_counts: dict[str, float] = {}
        self._queue: queue.SimpleQueue[FinishedRequest | str] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tritonllm-metrics", daemon=True)
        self._thread.start()

    def record_finished(self, item: FinishedRequest) -> None:
        self._queue.put(item)

    def record_rejected(self) -> None:
        self._queue.put("rejected")

    def close(self) -> None:
        """Publish once more, let go of the engine, and keep the Triton metric objects for the life of
        the process.

        Freeing them is wrong both ways in Triton 2.51. In `finalize` it deletes the metric families in
        the server, where a restarted instance of the model publishes to the same families. Left to the
        interpreter's teardown after `finalize`, their destructors reach a stub that is already gone
        and segfault it on every unload (the use-after-free python_backend fixed in 2026, PR #433).
        """
        self._stop.set()
        self._thread.join(5.0)
        self._publish()
        del self._engine
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self))  # never freed: the process ends soon

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._publish()
            except Exception:
                log.exception("publishing metrics failed")

    def _publish(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, str):
                self._rejected.increment(1)
            else:
                self._observe(item)
        stats = self._engine.stats()
        values = {
            "tritonllm_num_requests_running": stats.num_running,
            "tritonllm_num_requests_waiting": stats.num_waiting,
            "tritonllm_kv_cache_blocks_total": stats.kv_blocks_total,
            "tritonllm_kv_cache_blocks_used": stats.kv_blocks_used,
            "tritonllm_kv_cache_blocks_free": stats.kv_blocks_free,
            "tritonllm_kv_cache_usage_ratio": stats.kv_usage,
            "tritonllm_engine_alive": 1.0 if self._engine.alive else 0.0,
        }
        for name, value in values.items():
            self._gauges[name].set(float(value))
        for name, (_, read) in COUNTERS.items():
            total = float(read(stats))
            delta = total - self._last_counts.get(name, 0.0)
            if delta > 0:
                self._counters[name].increment(delta)
                self._last_counts[name] = total

    def _observe(self, item: FinishedRequest) -> None:
        if item.reason in self._finished:
            self._finished[item.reason].increment(1)
        out = item.output
        if out is None:  # failed before or while running: counted, no latencies
            return
        if out.first_scheduled_time_ns:
            self._histograms["tritonllm_queue_time_seconds"].observe(
                max(0, out.first_scheduled_time_ns - item.received_ns) / 1e9
            )
        if out.first_token_time_ns:
            self._histograms["tritonllm_time_to_first_token_seconds"].observe(
                max(0, out.first_token_time_ns - item.received_ns) / 1e9
            )
            end = out.last_token_time_ns or out.first_token_time_ns
            self._histograms["tritonllm_e2e_request_latency_seconds"].observe(
                max(0, end - item.received_ns) / 1e9
            )
            if out.num_output_tokens > 1 and out.last_token_time_ns:
                itl = (out.last_token_time_ns - out.first_token_time_ns) / (out.num_output_tokens - 1)
                self._histograms["tritonllm_inter_token_latency_seconds"].observe(max(0, itl) / 1e9)
