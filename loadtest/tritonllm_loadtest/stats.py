"""Time series and per-stage figures from cumulative snapshots of the load test's counters.

Latency histograms are Locust's: ``{rounded milliseconds: count}`` (merged across workers by the master),
so percentiles here match Locust's own to its rounding. Pure code: the locustfile feeds ``Recorder``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Histogram = dict[float, int]
LATENCIES = ("ttft", "itl", "e2e")
PERCENTILES = (50, 90, 95, 99)


def percentile(hist: Histogram, pct: float) -> float | None:
    """Nearest-rank percentile of a histogram; None when it is empty."""
    total = sum(hist.values())
    if total == 0:
        return None
    rank = max(1, -(-total * pct // 100))  # ceil
    seen = 0
    for value in sorted(hist):
        seen += hist[value]
        if seen >= rank:
            return float(value)
    return float(max(hist))


def subtract(later: Histogram, earlier: Histogram) -> Histogram:
    return {k: n - earlier.get(k, 0) for k, n in later.items() if n - earlier.get(k, 0) > 0}


def add(into: Histogram, other: Histogram) -> None:
    for k, n in other.items():
        into[k] = into.get(k, 0) + n


def latency_figures(hists: dict, pcts: tuple[int, ...] = PERCENTILES) -> dict[str, float | None]:
    return {f"{name}_p{p}_ms": percentile(hists.get(name, {}), p) for name in LATENCIES for p in pcts}


@dataclass
class Snapshot:
    """Cumulative figures since the start of the run, as seen at ``t`` seconds."""

    t: float
    users: int
    in_flight: int
    requests: int  # finished, including failures
    failures: int
    output_tokens: int  # received so far, including those of requests still streaming
    hists: dict[str, Histogram]
    errors: dict[str, int]


def empty_snapshot() -> Snapshot:
    return Snapshot(0.0, 0, 0, 0, 0, 0, {}, {})


@dataclass
class Stage:
    """A period at one target user count (a step of a ramp, the spike, ...)."""

    users: int
    start_s: float
    end_s: float
    requests: int = 0
    failures: int = 0
    output_tokens: int = 0
    hists: dict[str, Histogram] = field(default_factory=lambda: {name: {} for name in LATENCIES})

    def figures(self) -> dict[str, object]:
        duration = max(self.end_s - self.start_s, 1e-9)
        return {
            "users": self.users,
            "start_s": round(self.start_s, 2),
            "duration_s": round(duration, 2),
            "requests": self.requests,
            "failures": self.failures,
            "requests_per_s": self.requests / duration,
            "output_tokens_per_s": self.output_tokens / duration,
            **latency_figures(self.hists, (50, 95)),
        }


class Recorder:
    """Turns successive snapshots into interval samples (for plots) and stages (for the summary)."""

    def __init__(self) -> None:
        self.samples: list[dict[str, object]] = []
        self.stages: list[Stage] = []
        self.last: Snapshot | None = None

    def add(self, snap: Snapshot, target_users: int) -> None:
        prev = self.last or empty_snapshot()
        interval = max(snap.t - prev.t, 1e-9)
        delta = {name: subtract(snap.hists.get(name, {}), prev.hists.get(name, {})) for name in LATENCIES}
        requests, failures = snap.requests - prev.requests, snap.failures - prev.failures
        tokens = snap.output_tokens - prev.output_tokens
        self.samples.append(
            {
                "t": round(snap.t, 3),
                "users": snap.users,
                "target_users": target_users,
                "in_flight": snap.in_flight,
                "requests_per_s": requests / interval,
                "output_tokens_per_s": tokens / interval,
                "error_rate": failures / requests if requests else 0.0,
                **latency_figures(delta, (50, 95)),
            }
        )
        if not self.stages or self.stages[-1].users != target_users:
            self.stages.append(Stage(target_users, prev.t, snap.t))
        stage = self.stages[-1]
        stage.end_s = snap.t
        stage.requests += requests
        stage.failures += failures
        stage.output_tokens += tokens
        for name in LATENCIES:
            add(stage.hists[name], delta[name])
        self.last = snap

    def result(self) -> dict[str, object]:
        """Everything the report needs, JSON-ready."""
        last = self.last or empty_snapshot()
        return {
            "samples": self.samples,
            "stages": [stage.figures() for stage in self.stages],
            "totals": {
                "duration_s": last.t,
                "requests": last.requests,
                "failures": last.failures,
                "output_tokens": last.output_tokens,
                "errors_by_kind": dict(last.errors),
                "hists": {name: {str(k): n for k, n in h.items()} for name, h in last.hists.items()},
            },
        }
