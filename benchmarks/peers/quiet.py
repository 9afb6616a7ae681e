"""Waiting for the machine to go quiet before each turn of an interleaved workload.

A server that has just answered may keep the cores busy for a while after its last token. With vLLM CPU's
server up, whichever server came after it in a round got its first token ~0.9-1.0 s late (ours: TTFT p50
956-1,134 ms interleaved against 35-179 ms alone, on three hosts; llama.cpp in its rounds after vLLM). Each
turn therefore starts once the CPUs are idle again, within a bound, so that no server pays for the one
before it; the seconds waited are logged per preceding server.
"""

from __future__ import annotations

import time
from pathlib import Path

PROC_STAT = Path("/proc/stat")
IDLE_FIELDS = (3, 4)  # idle and iowait, in the aggregate "cpu" line's fields after the name


def cpu_times(stat_text: str) -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from the text of /proc/stat."""
    fields = [int(v) for v in stat_text.splitlines()[0].split()[1:]]
    total = sum(fields[:8])  # user .. steal; guest time is already counted in user
    return total - sum(fields[i] for i in IDLE_FIELDS), total


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of all CPUs' time spent busy between two cpu_times samples (0 when no time passed)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


def wait_until_quiet(max_busy: float = 0.15, window_s: float = 0.1, timeout_s: float = 5.0) -> float:
    """Block until one `window_s` window has the CPUs at most `max_busy` busy, or `timeout_s` has passed;
    returns the seconds waited. Where /proc/stat does not exist (not Linux), returns 0 at once."""
    if not PROC_STAT.exists():
        return 0.0
    started = time.monotonic()
    before = cpu_times(PROC_STAT.read_text())
    while time.monotonic() - started < timeout_s:
        time.sleep(window_s)  # the measuring window itself, not a synchronisation
        after = cpu_times(PROC_STAT.read_text())
        if busy_share(before, after) <= max_busy:
            break
        before = after
    return time.monotonic() - started
