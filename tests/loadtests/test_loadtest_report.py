"""Percentiles, time series, stages, summary, SLO checks and plots from recorded snapshots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tritonllm_loadtest.cli import build_reports, known_metrics, main
from tritonllm_loadtest.plots import write_plots
from tritonllm_loadtest.report import Slo, check_slos, markdown, summarize
from tritonllm_loadtest.stats import Recorder, Snapshot, percentile


def test_percentile_is_nearest_rank() -> None:
    hist = {10.0: 50, 20.0: 45, 300.0: 5}
    assert percentile(hist, 50) == 10.0
    assert percentile(hist, 51) == 20.0
    assert percentile(hist, 95) == 20.0
    assert percentile(hist, 96) == 300.0
    assert percentile({}, 50) is None


def snap(t: float, users: int, requests: int, tokens: int, ttft: dict, failures: int = 0) -> Snapshot:
    hists = {"ttft": ttft, "itl": {5.0: tokens}, "e2e": {100.0: requests}}
    errors = {"timeout": failures} if failures else {}
    return Snapshot(t, users, users, requests, failures, tokens, hists, errors)


def recorded() -> dict:
    recorder = Recorder()
    recorder.add(snap(2, 1, 4, 40, {50.0: 4}), target_users=1)
    recorder.add(snap(4, 1, 8, 80, {50.0: 8}), target_users=1)
    recorder.add(snap(6, 2, 16, 160, {50.0: 8, 200.0: 8}), target_users=2)
    recorder.add(snap(8, 2, 24, 240, {50.0: 8, 200.0: 14, 900.0: 2}, failures=2), target_users=2)
    return recorder.result()


def test_recorder_samples_are_per_interval_and_stages_per_user_level() -> None:
    result = recorded()
    samples = result["samples"]
    assert [s["requests_per_s"] for s in samples] == [2, 2, 4, 4]
    assert samples[2]["ttft_p50_ms"] == 200.0  # only the interval's observations
    assert samples[3]["error_rate"] == 0.25
    one, two = result["stages"]
    assert (one["users"], one["requests"], one["output_tokens_per_s"]) == (1, 8, 20)
    assert (two["users"], two["requests"], two["failures"], two["output_tokens_per_s"]) == (2, 16, 2, 40)
    assert two["ttft_p50_ms"] == 200.0 and two["ttft_p95_ms"] == 900.0


def test_summary_metrics_and_slos() -> None:
    summary = summarize(recorded(), {"shape": "step"})
    m = summary["metrics"]
    assert (m["requests"], m["failures"], m["output_tokens"], m["peak_users"]) == (24, 2, 240, 2)
    assert m["output_tokens_per_s"] == 30 and m["error_rate"] == pytest.approx(2 / 24)
    assert m["ttft_p50_ms"] <= m["ttft_p90_ms"] <= m["ttft_p95_ms"] <= m["ttft_p99_ms"]
    assert summary["errors_by_kind"] == {"timeout": 2}
    results = check_slos([Slo.parse("ttft_p95_ms <= 1000"), Slo.parse("output_tokens_per_s>=31")], m)
    assert [r["passed"] for r in results] == [True, False]
    summary["slos"] = results
    text = markdown(summary)
    assert "**MISSED**" in text and "| 2 |" in text and "timeout: 2" in text


def test_no_finished_request_misses_every_slo() -> None:
    empty = summarize({"samples": [], "stages": [], "totals": Recorder().result()["totals"]}, {})
    assert not Slo.parse("error_rate<=0.5").check(empty["metrics"])["passed"]


@pytest.mark.parametrize("text", ["ttft_p95_ms < 3", "ttft_p95_ms<=fast", "<=3"])
def test_bad_slo_syntax_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="METRIC<=VALUE"):
        Slo.parse(text)


def test_cli_rejects_unknown_slo_metric_before_running(tmp_path: Path, capsys) -> None:
    code = main(["run", "--host", "http://127.0.0.1:1", "--out", str(tmp_path), "--slo", "tpot_p95_ms<=3"])
    assert code == 2
    assert "unknown SLO metric(s) ['tpot_p95_ms']" in capsys.readouterr().err
    assert {"ttft_p95_ms", "itl_p95_ms", "error_rate", "output_tokens_per_s"} <= known_metrics()


def test_reports_from_a_recording(tmp_path: Path) -> None:
    recording = {"options": {"llm_model": "ensemble", "llm_record": "x", "host": "h"}, **recorded()}
    (tmp_path / "recording.json").write_text(json.dumps(recording))
    summary, passed = build_reports(tmp_path, [Slo.parse("error_rate<=0.1")])
    assert passed and summary["config"] == {"model": "ensemble", "host": "h"}
    written = ("summary.json", "summary.md", "timeseries.json", "latency.png", "throughput.png", "errors.png")
    for name in written:
        assert (tmp_path / name).stat().st_size > 0
    assert main(["report", str(tmp_path), "--slo", "error_rate<=0.01"]) == 1


def test_plots_are_pngs(tmp_path: Path) -> None:
    for path in write_plots(tmp_path, recorded()["samples"], "test"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
