"""Ratios and markdown tables from per-server, per-workload summaries (pure functions, unit-tested).

`summaries[label][workload]` is what `workloads.summarise` returns. Throughput ratios are
this project / peer (> 1: this project is faster); the Poisson TTFT p95 ratio is this project / peer
too, where < 1 is better, and so is the long prompt's TTFT p50 ratio (its prefill).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

Summaries = dict[str, dict[str, dict[str, Any]]]
# Latency ratios (this project / peer, < 1 is better): workload -> (summary field, column title).
TTFT_RATIOS = {"poisson": ("ttft_p95_ms", "Poisson TTFT p95"), "long": ("ttft_p50_ms", "long TTFT p50")}


def llama_counterpart(weights: str) -> str:
    """llama.cpp at the same weight bits: q4_0 for 4-bit weights, q8_0 for 8-bit ones, and for int7 (no
    7-bit format in llama.cpp: q8_0 holds one bit more), bf16 otherwise (fp32 has no peer run)."""
    if re.search(r"int4|q4|w4", weights):
        return "llama-q4_0"
    return "llama-q8_0" if re.search(r"int[78]|q8|w8", weights) else "llama-bf16"


def vllm_label(summaries: Summaries) -> str:
    return next((label for label in summaries if label.startswith("vllm")), "vllm")


def ttft_key(workload: str, peer: str) -> str:
    """The ratio table's key of a TTFT_RATIOS workload against a peer, e.g. `poisson_ttft_p95/vllm-bf16`."""
    return f"{workload}_{TTFT_RATIOS[workload][0].removesuffix('_ms')}/{peer}"


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def ratios(summaries: Summaries, ours: list[str], weights: dict[str, str]) -> dict[str, dict[str, Any]]:
    """For each of our servers: per-workload throughput ratios vs llama.cpp (same bits) and vs vLLM,
    and the TTFT ratios of TTFT_RATIOS (keys from `ttft_key`). A peer that did not run gives None."""
    table = {}
    for label in ours:
        row: dict[str, Any] = {}
        for peer in (llama_counterpart(weights[label]), vllm_label(summaries)):
            theirs = summaries.get(peer, {})
            for workload, summary in summaries[label].items():
                other = theirs.get(workload, {})
                row[f"{workload}/{peer}"] = _ratio(summary.get("out_tok_s"), other.get("out_tok_s"))
                if workload in TTFT_RATIOS:
                    field = TTFT_RATIOS[workload][0]
                    row[ttft_key(workload, peer)] = _ratio(summary.get(field), other.get(field))
        table[label] = row
    return table


def _loads(loads: list[float]) -> str:
    return " / ".join(f"{x:.1f}" for x in loads)


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(
    summaries: Summaries,
    weights: dict[str, str],
    ours: list[str],
    titles: dict[str, str],
    meta: dict[str, Any],
) -> str:
    workloads = list(titles)
    lines = [
        f"CPU: {meta['cpu_model']}, {meta['cores']} cores; flags: {', '.join(meta['cpu_flags']) or 'none'}; "
        f"load average (1/5/15 min) before {_loads(meta['load_before'])},"
        f" after {_loads(meta['load_after'])}.",
        "",
        "Output tokens/s (batch 1: median decode rate of the repetitions; others: all output tokens over the "
        "wall time); Poisson: TTFT p95 ms / inter-token p95 ms / tok/s. Load at start: 1-minute load average "
        "when that server's workloads began.",
        "",
        "| server | weights | load at start | " + " | ".join(titles[w] for w in workloads) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in workloads) + " |",
    ]
    for label, per_workload in summaries.items():
        cells = []
        for w in workloads:
            s = per_workload.get(w)
            if s is None:
                cells.append("-")
            elif w == "poisson":
                cells.append(f"{_fmt(s['ttft_p95_ms'])} / {_fmt(s['itl_p95_ms'])} / {_fmt(s['out_tok_s'])}")
            else:
                cells.append(_fmt(s["out_tok_s"], 1) + ("" if s["exact_lengths"] else " (inexact)"))
        load = meta.get("load_at_start", {}).get(label)
        load_cell = "-" if load is None else f"{load[0]:.1f}"
        lines.append(f"| {label} | {weights[label]} | {load_cell} | " + " | ".join(cells) + " |")
    table = ratios(summaries, ours, weights)
    latencies = [w for w in TTFT_RATIOS if w in workloads]
    lines += ["", "Ratios, this project / peer (throughput: > 1 is faster; TTFT: < 1 is better):"]
    lines += [""]
    titles_row = [*workloads, *(TTFT_RATIOS[w][1] for w in latencies)]
    lines += ["| ours | peer | " + " | ".join(titles_row) + " |"]
    lines += ["| --- | --- | " + " | ".join("---" for _ in titles_row) + " |"]
    for label in ours:
        for peer in (llama_counterpart(weights[label]), vllm_label(summaries)):
            cells = [_fmt(table[label].get(f"{w}/{peer}"), 2) for w in workloads]
            cells += [_fmt(table[label].get(ttft_key(w, peer)), 2) for w in latencies]
            lines.append(f"| {label} | {peer} | " + " | ".join(cells) + " |")
    columns = (
        "server",
        "workload",
        "requests",
        "errors",
        "exact",
        "tok/s",
        "TTFT p50",
        "TTFT p95",
        "ITL p50",
        "ITL p95",
        "ITL p99",
        "ITL max",
    )
    lines += ["", "Details (ms):", "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for label, per_workload in summaries.items():
        for w, s in per_workload.items():
            exact = "yes" if s["exact_lengths"] else "no"
            lines.append(
                f"| {label} | {w} | {s['requests']} | {s['errors']} | {exact} | "
                f"{_fmt(s['out_tok_s'], 1)} | {_fmt(s['ttft_p50_ms'])} | {_fmt(s['ttft_p95_ms'])} | "
                f"{_fmt(s['itl_p50_ms'], 1)} | {_fmt(s['itl_p95_ms'], 1)} | {_fmt(s['itl_p99_ms'], 1)} | "
                f"{_fmt(s['itl_max_ms'], 1)} |"
            )
    return "\n".join(lines) + "\n"


def cpu_info() -> dict[str, Any]:
    """Model name and the SIMD flags that decide the kernels (avx2, avx512*, amx*, *vnni*)."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags", "").split()
    model = fields.get("model name", "?")
    wanted = sorted(f for f in set(flags) if f == "avx2" or f.startswith(("avx512", "amx")) or "vnni" in f)
    return {"cpu_model": model, "cpu_flags": wanted, "cores": os.cpu_count()}
