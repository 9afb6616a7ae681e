"""Summary (JSON + Markdown) of a run and SLO checks against it."""

from __future__ import annotations

import json
import operator
import re
from dataclasses import dataclass
from pathlib import Path

from tritonllm_loadtest.stats import latency_figures

SLO_PATTERN = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=)\s*([0-9.eE+-]+)\s*$")


def summarize(recorded: dict, config: dict) -> dict:
    """Flat ``metrics`` (the names SLOs use), per-stage figures and the run's configuration."""
    totals = recorded["totals"]
    duration = max(float(totals["duration_s"]), 1e-9)
    requests, failures = int(totals["requests"]), int(totals["failures"])
    hists = {name: {float(k): n for k, n in h.items()} for name, h in totals["hists"].items()}
    samples = recorded["samples"]
    metrics = {
        "duration_s": round(duration, 2),
        "requests": requests,
        "failures": failures,
        "error_rate": failures / requests if requests else 0.0,
        "requests_per_s": requests / duration,
        "output_tokens": int(totals["output_tokens"]),
        "output_tokens_per_s": int(totals["output_tokens"]) / duration,
        "peak_users": max((int(s["users"]) for s in samples), default=0),
        "peak_in_flight": max((int(s["in_flight"]) for s in samples), default=0),
        **latency_figures(hists),
    }
    return {
        "metrics": metrics,
        "errors_by_kind": totals["errors_by_kind"],
        "stages": recorded["stages"],
        "config": config,
    }


@dataclass(frozen=True)
class Slo:
    metric: str
    op: str  # "<=" or ">="
    threshold: float

    @classmethod
    def parse(cls, text: str) -> Slo:
        match = SLO_PATTERN.match(text)
        if not match:
            raise ValueError(f"bad SLO {text!r}: write METRIC<=VALUE or METRIC>=VALUE, e.g. ttft_p95_ms<=500")
        return cls(match[1], match[2], float(match[3]))

    def check(self, metrics: dict) -> dict:
        if self.metric not in metrics:
            raise ValueError(f"unknown SLO metric {self.metric!r}; known: {', '.join(sorted(metrics))}")
        value = metrics[self.metric]
        compare = operator.le if self.op == "<=" else operator.ge
        # A run with no finished request, or a latency with no observations, cannot meet an SLO.
        passed = bool(metrics["requests"]) and value is not None and compare(value, self.threshold)
        return {"slo": f"{self.metric}{self.op}{self.threshold:g}", "value": value, "passed": passed}


def check_slos(slos: list[Slo], metrics: dict) -> list[dict]:
    return [slo.check(metrics) for slo in slos]


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def markdown(summary: dict) -> str:
    m = summary["metrics"]
    cfg = summary["config"]
    lines = [
        f"# Load test: {cfg.get('transport')} -> {cfg.get('model')} ({cfg.get('shape')})",
        "",
        f"{m['requests']} requests in {m['duration_s']} s, {m['failures']} failed "
        f"(error rate {m['error_rate']:.2%}); {m['output_tokens']} output tokens, "
        f"**{m['output_tokens_per_s']:.1f} output tokens/s**, {m['requests_per_s']:.2f} requests/s; "
        f"peak users {m['peak_users']}, peak in flight {m['peak_in_flight']}.",
        "",
        "| Latency (ms) | p50 | p90 | p95 | p99 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, label in (("ttft", "time to first token"), ("itl", "inter-token"), ("e2e", "end to end")):
        row = " | ".join(_fmt(m[f"{name}_p{p}_ms"]) for p in (50, 90, 95, 99))
        lines.append(f"| {label} | {row} |")
    if summary["errors_by_kind"]:
        lines += ["", "Errors: " + ", ".join(f"{k}: {n}" for k, n in summary["errors_by_kind"].items())]
    if summary["stages"]:
        lines += [
            "",
            "## Stages",
            "",
            "| users | s | requests | failed | req/s | out tok/s | TTFT p50 | TTFT p95 | ITL p50 | ITL p95 |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        keys = ("users", "duration_s", "requests", "failures", "requests_per_s", "output_tokens_per_s")
        keys += ("ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms")
        for stage in summary["stages"]:
            lines.append("| " + " | ".join(_fmt(stage[k]) for k in keys) + " |")
    if summary.get("slos"):
        lines += ["", "## SLOs", "", "| SLO | value | result |", "| --- | --- | --- |"]
        for r in summary["slos"]:
            lines.append(f"| `{r['slo']}` | {_fmt(r['value'])} | {'pass' if r['passed'] else '**MISSED**'} |")
    lines += ["", "Configuration: `" + json.dumps(cfg, sort_keys=True) + "`", ""]
    return "\n".join(lines)


def write_summary(out_dir: Path, summary: dict) -> None:
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    (out_dir / "summary.md").write_text(markdown(summary))
