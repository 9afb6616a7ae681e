"""Shared helpers of the client tests: metrics polling, bounded waits, running the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from triton_fixture import metric_sum as metric  # noqa: F401 -- re-exported for the tests
from triton_fixture import wait_for  # noqa: F401

CLI = [str(Path(sys.executable).parent / "tritonllm-client")]  # the installed console script
ABORTED = r'tritonllm_requests_finished_total\{[^}]*reason="abort"[^}]*\}'
KV_USED = "tritonllm_kv_cache_blocks_used"


def run_cli(*args: str, stdin: str | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], input=stdin, capture_output=True, text=True, timeout=timeout_s, check=False
    )
