"""One picture of a bench_peers run: throughput per workload, then the latencies a user waits through.

Three panels from the run's summaries (`summaries[server][workload]`, as `workloads.summarise` gives):
output tok/s per workload; time to first token p50/p95 under the burst and the Poisson load; inter-token
p95/p99/longest gap under load (log scale: the stalls differ by 10x). A workload a server did not run is
left out. Re-plot a saved run (summaries recomputed from its raw requests, so older runs get p99 and the
longest gap too):

    .venv/bin/python benchmarks/peers/plot.py benchmarks/results/peers_1205_zen4_full.json \\
        --raw benchmarks/results/raw/peers_1205_zen4_full-20261205-040404/requests.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `peers` importable
from peers.report import Summaries  # noqa: E402
from peers.workloads import RequestResult, summarise  # noqa: E402

THROUGHPUT = {
    "b1": "1 request",
    "c8": "8 at once",
    "c32": "32 at once",
    "mixed": "64 mixed",
    "poisson": "Poisson",
}
TTFT = {"mixed": "64 mixed", "poisson": "Poisson"}
ITL = {"c32": "32 at once", "mixed": "64 mixed", "poisson": "Poisson"}
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")  # the flags that pick this project's kernels


def _bars(
    ax: Any,
    groups: list[str],
    series: dict[str, list[float | None]],
    fmt: str,
    starred: set[tuple] = frozenset(),
) -> None:
    """Grouped bars, one group per x label and one bar per series; missing values leave a gap. A label
    "a|b" puts b on the tick and a once under each run of equal a's (workload under its percentiles)."""
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        kept = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        if not kept:
            continue
        bars = ax.bar([x for x, _ in kept], [v for _, v in kept], width, label=label)
        texts = [
            fmt.format(v) + ("*" if (label, g) in starred else "")
            for g, v in enumerate(values)
            if v is not None
        ]
        ax.bar_label(bars, texts, fontsize=7, rotation=90, padding=2)
    ticks = [g.split("|")[-1] for g in groups]
    ax.set_xticks(range(len(groups)), ticks, fontsize=8)
    outer = [g.split("|")[0] for g in groups if "|" in g]
    for name in dict.fromkeys(outer):
        at = [i for i, g in enumerate(groups) if g.startswith(f"{name}|")]
        ax.text(
            sum(at) / len(at),
            -0.09,
            name,
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=8,
        )


def _values(summaries: Summaries, server: str, workloads: list[str], key: str) -> list[float | None]:
    return [summaries[server].get(w, {}).get(key) for w in workloads]


def figure(result: dict[str, Any], path: Path) -> Path:
    """Write the run's three panels to `path` (PNG) and return it."""
    summaries: Summaries = result["summaries"]
    meta = result.get("meta", {})
    servers = list(summaries)
    fig, (tput, ttft, itl) = plt.subplots(1, 3, figsize=(16, 5), width_ratios=[5, 2.4, 3.6])

    ran = [w for w in THROUGHPUT if any(w in summaries[s] for s in servers)]
    inexact = {
        (s, g)
        for s in servers
        for g, w in enumerate(ran)
        if not summaries[s].get(w, {}).get("exact_lengths", True)
    }
    _bars(
        tput,
        [THROUGHPUT[w] for w in ran],
        {s: _values(summaries, s, ran, "out_tok_s") for s in servers},
        "{:.0f}",
        inexact,
    )
    if inexact:
        tput.text(
            1,
            -0.09,
            "* not every output at its exact length",
            transform=tput.transAxes,
            ha="right",
            va="top",
            fontsize=7,
        )
    tput.set_ylabel("output tokens/s (higher is better)")
    tput.set_title("Throughput (batch 1: decode rate)")
    tput.margins(y=0.2)
    tput.legend(fontsize=8, loc="upper left")

    ran = [w for w in TTFT if any(w in summaries[s] for s in servers)]
    groups = [f"{TTFT[w]}|{q}" for w in ran for q in ("p50", "p95")]
    keys = [(w, k) for w in ran for k in ("ttft_p50_ms", "ttft_p95_ms")]
    series = {s: [summaries[s].get(w, {}).get(k) for w, k in keys] for s in servers}
    _bars(
        ttft,
        groups,
        {s: [v / 1e3 if v is not None else None for v in vs] for s, vs in series.items()},
        "{:.1f}",
    )
    ttft.set_yscale("log")
    ttft.set_ylabel("seconds, log scale (lower is better)")
    ttft.set_title("Time to first token")
    ttft.margins(y=0.3)

    ran = [w for w in ITL if any(w in summaries[s] for s in servers)]
    groups = [f"{ITL[w]}|{q}" for w in ran for q in ("p95", "p99", "max")]
    keys = [(w, k) for w in ran for k in ("itl_p95_ms", "itl_p99_ms", "itl_max_ms")]
    _bars(itl, groups, {s: [summaries[s].get(w, {}).get(k) for w, k in keys] for s in servers}, "{:.0f}")
    itl.set_yscale("log")
    itl.set_ylabel("ms between tokens, log scale (lower is better)")
    itl.set_title("Inter-token gaps under load")
    itl.margins(y=0.3)

    weights = result.get("weights", {})
    who = ", ".join(f"{s} ({weights[s]})" for s in servers if s in weights)
    flags = [f for f in meta.get("cpu_flags", []) if f in KERNEL_FLAGS or f.startswith("amx")]
    fig.suptitle(
        f"{who}\n{meta.get('cpu_model', '?')}, {meta.get('cores', '?')} cores "
        f"({' '.join(flags) or 'no AVX2'}); commit {meta.get('commit', '?')}, {meta.get('started', '')}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def resummarise(result: dict[str, Any], raw: dict[str, dict[str, list[dict]]]) -> dict[str, Any]:
    """The result with each server's summaries recomputed from its raw requests (`requests.json`)."""
    summaries = {
        server: {
            name: summarise(
                [
                    RequestResult(r["sent_s"], r["max_tokens"], [tuple(c) for c in r["chunks"]], r["error"])
                    for r in rs
                ],
                sequential=name in ("b1", "b1x"),
            )
            for name, rs in per_workload.items()
        }
        for server, per_workload in raw.items()
    }
    return result | {"summaries": summaries}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("result", type=Path, help="a bench_peers result (results/<name>.json)")
    parser.add_argument("--raw", type=Path, help="its raw requests.json, to recompute the summaries")
    parser.add_argument("--out", type=Path, help="the PNG (default: next to the result, .png)")
    args = parser.parse_args()
    result = json.loads(args.result.read_text())
    if args.raw:
        result = resummarise(result, json.loads(args.raw.read_text()))
    print(figure(result, args.out or args.result.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
