"""The machine a run measures on: its description, its load after each phase, its memory bandwidth."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class MachineInfo:
    cpu_model: str
    logical_cpus: int
    threads: int
    memory_gib: float
    torch_version: str
    transformers_version: str
    python_version: str
    platform: str
    git_commit: str
    timestamp: str


def machine_info(threads: int) -> MachineInfo:
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kib = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
    except (OSError, StopIteration):
        mem_kib = 0
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return MachineInfo(
        cpu_model=cpu,
        logical_cpus=os.cpu_count() or 0,
        threads=threads,
        memory_gib=round(mem_kib / 2**20, 1),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        python_version=platform.python_version(),
        platform=platform.platform(),
        git_commit=commit,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


@dataclass
class CpuLoad:
    """Machine load when a phase ended: other processes on these cores distort every timing."""

    phase: str
    loadavg_1m: float
    cpu_pressure_avg10: float | None  # % of time some runnable task waited for a CPU (Linux PSI)


def cpu_load(phase: str) -> CpuLoad:
    try:
        load = float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError):
        load = float("nan")
    try:
        some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        pressure = float(some.split()[1].split("=")[1])
    except (OSError, ValueError, IndexError):
        pressure = None
    return CpuLoad(phase, load, pressure)


@dataclass
class BandwidthResult:
    buffer_mib: int
    copy_gbps_runs: list[float]  # (read + write bytes) / time of dst.copy_(src)
    sum_gbps_runs: list[float]  # read bytes / time of src.sum()
    best_copy_gbps: float
    best_sum_gbps: float
    roofline_gbps: float  # the best over both methods
    roofline_method: str


def measure_bandwidth(buffer_mib: int = 512, runs: int = 7) -> BandwidthResult:
    """Best-of-N memory bandwidth with the benchmark's threads: a large copy and a large sum."""
    n = buffer_mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch both buffers once
    copy, total = [], []
    for _ in range(runs):
        t = time.perf_counter()
        dst.copy_(src)
        copy.append(2 * src.nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        src.sum()
        total.append(src.nbytes / (time.perf_counter() - t) / 1e9)
    best_copy, best_sum = max(copy), max(total)
    method = "sum (read only)" if best_sum >= best_copy else "copy (read + write bytes)"
    return BandwidthResult(buffer_mib, copy, total, best_copy, best_sum, max(best_copy, best_sum), method)
