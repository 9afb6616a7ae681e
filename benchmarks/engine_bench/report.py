"""Everything a run measured, written as JSON (summary and raw data) and printed as a summary."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .accuracy import AccuracyResult
from .batch1 import Batch1Result
from .machine import BandwidthResult, CpuLoad, MachineInfo, log
from .plot import plot
from .throughput import KVSample, KVUtilResult
from .workload import Request, ThroughputResult


@dataclass
class Report:
    benchmark: str
    quick: bool
    model: str
    machine: MachineInfo
    settings: dict
    bandwidth: BandwidthResult
    hf: ThroughputResult | None
    engine: ThroughputResult
    speedup_vs_hf: float | None
    hf_engine_token_agreement: float | None
    kv_util: KVUtilResult
    batch1: list[Batch1Result]
    quant_throughput: list[ThroughputResult]
    accuracy: list[AccuracyResult]
    hf_perplexity: float | None
    targets: dict
    cpu_load: list[CpuLoad]


def write_report(
    report: Report,
    samples: list[KVSample],
    requests: list[Request],
    step_times: dict[str, list[float]],
    out_dir: Path,
    stem: str,
) -> None:
    """`<out>/<stem>.json` and `.png`, `<out>/raw/<stem>_raw.json`, then the summary on stdout."""
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
    json_path.write_text(json.dumps(asdict(report), indent=2) + "\n")
    raw = {
        "kv_samples": [asdict(s) for s in samples],
        "requests": [
            {"id": r.request_id, "prompt_tokens": len(r.prompt), "max_tokens": r.max_tokens} for r in requests
        ],
        "batch1_step_s": step_times,
    }
    (out_dir / "raw" / f"{stem}_raw.json").write_text(json.dumps(raw) + "\n")
    plot(report, samples, png_path)
    print_summary(report)
    log(f"wrote {json_path}, {png_path}, {out_dir / 'raw' / f'{stem}_raw.json'}")


def print_summary(r: Report) -> None:
    def check(ok: bool) -> str:
        return "ok" if ok else "BELOW TARGET"

    speedup, kv_target, roofline = (
        r.targets[k] for k in ("speedup_vs_hf", "kv_paged_utilisation", "batch1_pct_of_roofline")
    )

    lines = [
        "",
        f"=== {r.benchmark}{' (quick)' if r.quick else ''} ===",
        f"{r.machine.cpu_model}, {r.machine.threads} threads, torch {r.machine.torch_version}",
    ]
    for t in (r.hf, r.engine):
        if t is not None:
            lines.append(
                f"{t.name:>20}: {t.output_tokens_per_s:7.1f} out tok/s  wall {t.wall_s:6.1f} s  "
                f"TTFT p50 {t.ttft_p50_s:6.2f} s  p95 {t.ttft_p95_s:6.2f} s"
            )
    if r.speedup_vs_hf:
        lines.append(
            f"{'speedup':>20}: {r.speedup_vs_hf:.2f}x  "
            f"(target >= {speedup:g}x: {check(r.speedup_vs_hf >= speedup)})"
        )
    if r.hf_engine_token_agreement is not None:
        lines.append(
            f"{'HF/engine agreement':>20}: {r.hf_engine_token_agreement:.1%} of output tokens identical"
        )
    kv = r.kv_util
    lines.append(
        f"{'KV utilisation':>20}: paged {kv.paged_time_avg:.1%} (min {kv.paged_min:.1%}) vs contiguous "
        f"{kv.contiguous_time_avg:.1%}  (target > {kv_target:.0%}: {check(kv.paged_time_avg > kv_target)})"
    )
    lines.append(f"{'bandwidth':>20}: {r.bandwidth.roofline_gbps:.1f} GB/s ({r.bandwidth.roofline_method})")
    for b in r.batch1:
        lines.append(
            f"{'batch-1 ' + b.quantization:>20}: {b.decode_tokens_per_s:6.1f} tok/s  roofline "
            f"{b.roofline_tokens_per_s:6.1f} ({b.pct_of_roofline:.0%}, target {roofline:.0%}: "
            f"{check(b.pct_of_roofline >= roofline)})  streamed-bytes roofline "
            f"{b.streamed_roofline_tokens_per_s:6.1f} ({b.pct_of_streamed_roofline:.0%})"
        )
    for t in r.quant_throughput:
        lines.append(f"{t.name:>20}: {t.output_tokens_per_s:7.1f} out tok/s ({t.num_requests} requests)")
    for a in r.accuracy:
        lines.append(
            f"{'accuracy ' + a.quantization:>20}: agreement {a.agreement_before_divergence:.1%} before "
            f"divergence, {a.agreement_overall:.1%} overall; perplexity {a.perplexity:.4f}"
        )
    if r.hf_perplexity is not None:
        lines.append(f"{'HF perplexity':>20}: {r.hf_perplexity:.4f}")
    busy = [f"{c.phase} {c.loadavg_1m:.1f}" for c in r.cpu_load]
    lines.append(f"{'load average (1m)':>20}: {', '.join(busy)} (on {r.machine.logical_cpus} CPUs)")
    print("\n".join(lines), flush=True)
