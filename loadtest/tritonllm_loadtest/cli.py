"""``tritonllm-loadtest``: one headless Locust session -> Locust CSV/HTML, summary, plots, SLO verdict.

    tritonllm-loadtest run --host http://127.0.0.1:8000 --out results/run1 \\
        --llm-shape step --llm-users 16 --llm-step-users 2 --llm-step-duration 30 \\
        --slo 'ttft_p95_ms<=2000' --slo 'error_rate<=0.01'

Arguments it does not know (``--llm-*`` and any Locust option) go to Locust unchanged. Exit status:
0 all SLOs met, 1 an SLO missed, 2 bad arguments, 3 the Locust session failed.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

from tritonllm_loadtest.exporter import DEFAULT_PORT
from tritonllm_loadtest.plots import write_plots
from tritonllm_loadtest.report import Slo, check_slos, markdown, summarize, write_summary

EXIT_SLO_MISSED, EXIT_USAGE, EXIT_LOCUST_FAILED = 1, 2, 3
WORKER_EXIT_TIMEOUT_S = 30.0


def package_locustfile() -> Path:
    return Path(str(resources.files("tritonllm_loadtest").joinpath("locustfile.py")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def locust_command(locustfile: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(locustfile), *args]


def run_session(args: argparse.Namespace, locust_args: list[str]) -> int:
    """Run Locust (locally, or a master and ``--workers`` local workers); returns the master's status."""
    out: Path = args.out
    # With local workers each serves its metrics on this port + its worker index.
    common = ["--host", args.host, "--llm-record", str(out / "recording.json"), *locust_args]
    common += ["--llm-metrics-port", str(args.metrics_port)]
    if args.workers:
        common.append("--llm-metrics-port-per-worker")  # all the workers run on this host
    reports = ["--headless", "--csv", str(out / "locust"), "--html", str(out / "locust.html")]
    reports += ["--only-summary", "--exit-code-on-error", "0"]
    if args.workers == 0:
        command = locust_command(args.locustfile, *reports, *common)
        return subprocess.run(command, timeout=args.run_timeout).returncode
    port = free_port()
    master = locust_command(
        args.locustfile, *reports, *common,
        "--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
        "--expect-workers", str(args.workers),
    )  # fmt: skip
    worker = locust_command(
        args.locustfile, *common, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port)
    )
    master_process = subprocess.Popen(master)
    workers = []
    try:
        workers = [subprocess.Popen(worker) for _ in range(args.workers)]
        code = master_process.wait(timeout=args.run_timeout)
        deadline = time.monotonic() + WORKER_EXIT_TIMEOUT_S
        for process in workers:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        return code
    finally:
        for process in [master_process, *workers]:
            if process.poll() is None:
                process.kill()
                process.wait()


def build_reports(out: Path, slos: list[Slo]) -> tuple[dict, bool]:
    """Summary JSON/Markdown and plots from ``out/recording.json``; returns (summary, all SLOs met)."""
    recording = json.loads((out / "recording.json").read_text())
    options = recording.pop("options")
    config = {k.removeprefix("llm_"): v for k, v in options.items() if k != "llm_record"}
    summary = summarize(recording, config)
    summary["slos"] = check_slos(slos, summary["metrics"])
    write_summary(out, summary)
    (out / "timeseries.json").write_text(json.dumps(recording["samples"], indent=1) + "\n")
    title = f"{config.get('transport')} {config.get('model')} ({config.get('shape')})"
    write_plots(out, recording["samples"], title)
    return summary, all(r["passed"] for r in summary["slos"])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritonllm-loadtest", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a headless session and write the reports (other args go to Locust)")
    run.add_argument("--host", required=True, help="Triton HTTP base URL, e.g. http://127.0.0.1:8000")
    run.add_argument("--out", type=Path, required=True, help="output folder")
    run.add_argument("--workers", type=int, default=0, help="local Locust worker processes (0: one process)")
    run.add_argument("--metrics-port", type=int, default=DEFAULT_PORT, help="Prometheus port (worker i: +i)")
    run.add_argument("--locustfile", type=Path, default=package_locustfile())
    run.add_argument("--run-timeout", type=float, default=3600.0, help="seconds before the session is killed")
    run.add_argument("--slo", action="append", default=[], help="METRIC<=X or METRIC>=X, repeatable")
    report = sub.add_parser("report", help="rebuild summary and plots of a finished run")
    report.add_argument("out", type=Path)
    report.add_argument("--slo", action="append", default=[])
    return p


def known_metrics() -> set[str]:
    """The metric names a summary has (what SLOs can name), from the summary of an empty run."""
    totals = dict(duration_s=0, requests=0, failures=0, output_tokens=0, errors_by_kind={}, hists={})
    return set(summarize({"samples": [], "stages": [], "totals": totals}, {})["metrics"])


def main(argv: list[str] | None = None) -> int:
    args, extra = parser().parse_known_args(argv)
    try:
        slos = [Slo.parse(text) for text in args.slo]
        known = known_metrics()
        unknown = [s.metric for s in slos if s.metric not in known]
        if unknown:
            raise ValueError(f"unknown SLO metric(s) {unknown}; known: {', '.join(sorted(known))}")
        if args.command == "run" and args.workers < 0:
            raise ValueError("--workers must be >= 0")
        if args.command == "report" and extra:
            raise ValueError(f"unexpected arguments: {extra}")
    except ValueError as exc:
        print(f"tritonllm-loadtest: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "recording.json").unlink(missing_ok=True)
        try:
            code = run_session(args, extra)
        except subprocess.TimeoutExpired:
            code = -1
        if code != 0 or not (args.out / "recording.json").is_file():
            print(f"tritonllm-loadtest: the Locust session failed (exit {code})", file=sys.stderr)
            return EXIT_LOCUST_FAILED
    summary, passed = build_reports(args.out, slos)
    print(markdown(summary))
    return 0 if passed else EXIT_SLO_MISSED


if __name__ == "__main__":
    sys.exit(main())
