"""Shared helpers of the client tests: metrics polling, bounded waits, running the CLI."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import requests

CLI = [str(Path(sys.executable).parent / "tritonllm-client")]  # the installed console script
ABORTED = r'tritonllm_requests_finished_total\{[^}]*reason="abort"[^}]*\}'
KV_USED = "tritonllm_kv_cache_blocks_used"


def metric(metrics_url: str, pattern: str) -> float:
    text = requests.get(metrics_url, timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{pattern}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def wait_for(predicate: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> bool:
    """Poll until true or the deadline passes (metrics refresh every 0.25 s on the server)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def run_cli(*args: str, stdin: str | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], input=stdin, capture_output=True, text=True, timeout=timeout_s, check=False
    )
