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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `peers` importable
from peers.report import Summaries  # noqa: E402
from peers.workloads import SEQUENTIAL, RequestResult, summarise, summarise_rounds  # noqa: E402


@dataclass(frozen=True)
class Panel:
    """One panel: per workload run, a group of bars per statistic (`key` in the summaries, tick label)."""

    title: str
    ylabel: str
    workloads: dict[str, str]  # name -> label under its bars
    stats: tuple[tuple[str, str], ...]  # (summary key, tick label; "" when one statistic)
    fmt: str = "{:.0f}"
    scale: float = 1.0
    log: bool = False


PANELS = (
    Panel(
        "Throughput (batch 1: decode rate)",
        "output tokens/s (higher is better)",
        {"b1": "1 request", "b1x": "1 request,\ninterleaved", "c8": "8 at once", "c32": "32 at once",
         "c32x": "32 at once,\ninterleaved", "mixed": "64 mixed", "poisson": "Poisson",
         "long": "long prompt"},
        (("out_tok_s", ""),),
    ),
    Panel(
        "Time to first token",
        "seconds, log scale (lower is better)",
        {"mixed": "64 mixed", "poisson": "Poisson", "long": "long prompt"},
        (("ttft_p50_ms", "p50"), ("ttft_p95_ms", "p95")),
        fmt="{:.1f}",
        scale=1e-3,
        log=True,
    ),
    Panel(
        "Inter-token gaps under load",
        "ms between tokens, log scale (lower is better)",
        {"c32": "32 at once", "mixed": "64 mixed", "poisson": "Poisson"},
        (("itl_p95_ms", "p95"), ("itl_p99_ms", "p99"), ("itl_max_ms", "max")),
        log=True,
    ),
)  # fmt: skip
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")  # the flags that pick this project's kernels


def _draw_panel(ax: Any, panel: Panel, summaries: Summaries) -> None:
    """Grouped bars, one bar per server, a gap where a server lacks the value. Under a workload's
    statistics, its name once; a * on a throughput whose outputs did not all reach their exact length."""
    servers = list(summaries)
    ran = [w for w in panel.workloads if any(w in summaries[s] for s in servers)]
    ax.set_title(panel.title)
    if not ran:
        ax.axis("off")
        ax.text(0.5, 0.5, "not in this run", transform=ax.transAxes, ha="center", color="gray")
        return
    cells = [(w, key, tick) for w in ran for key, tick in panel.stats]
    width = 0.8 / len(servers)
    starred = False
    for i, server in enumerate(servers):
        bars = []
        for g, (w, key, tick) in enumerate(cells):
            summary = summaries[server].get(w, {})
            if summary.get(key) is None:
                continue
            star = not tick and not summary.get("exact_lengths", True)
            starred |= star
            bars.append((g + (i - (len(servers) - 1) / 2) * width, summary[key] * panel.scale, star))
        drawn = ax.bar([x for x, _, _ in bars], [v for _, v, _ in bars], width, label=server, color=f"C{i}")
        labels = [panel.fmt.format(v) + ("*" if star else "") for _, v, star in bars]
        ax.bar_label(drawn, labels, fontsize=7, rotation=90, padding=2)
    if panel.log:
        ax.set_yscale("log")
    ax.margins(y=0.3 if panel.log else 0.2)
    ax.set_ylabel(panel.ylabel)
    one_stat = len(panel.stats) == 1
    ax.set_xticks(
        range(len(cells)), [panel.workloads[w] if one_stat else tick for w, _, tick in cells], fontsize=8
    )
    for w in [] if one_stat else ran:
        at = [g for g, cell in enumerate(cells) if cell[0] == w]
        x = sum(at) / len(at)
        ax.text(
            x,
            -0.09,
            panel.workloads[w],
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=8,
        )
    if starred:
        note = "* not every output at its exact length"
        ax.text(1, -0.09, note, transform=ax.transAxes, ha="right", va="top", fontsize=7)


def draw(result: dict[str, Any]) -> Any:
    """The run's three panels as a matplotlib Figure."""
    summaries: Summaries = result["summaries"]
    meta = result.get("meta", {})
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), width_ratios=[5, 2.4, 3.6])
    for ax, panel in zip(axes, PANELS, strict=True):
        _draw_panel(ax, panel, summaries)
    axes[0].legend(fontsize=8, loc="upper left")
    weights = result.get("weights", {})
    who = ", ".join(f"{s} ({weights[s]})" if s in weights else s for s in summaries)
    flags = [f for f in meta.get("cpu_flags", []) if f in KERNEL_FLAGS or f.startswith("amx")]
    fig.suptitle(
        f"{who}\n{meta.get('cpu_model', '?')}, {meta.get('cores', '?')} cores "
        f"({' '.join(flags) or 'no AVX2'}); commit {meta.get('commit', '?')}, {meta.get('started', '')}",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def figure(result: dict[str, Any], path: Path) -> Path:
    """Write the run's three panels to `path` (PNG) and return it."""
    fig = draw(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def resummarise(result: dict[str, Any], raw: dict[str, dict[str, list[dict]]]) -> dict[str, Any]:
    """The result with each server's summaries recomputed from its raw requests (`requests.json`)."""
    summaries = {
        server: {
            name: summarise_rounds([RequestResult(**r) for r in rs])
            if name == "c32x"
            else summarise([RequestResult(**r) for r in rs], sequential=name in SEQUENTIAL)
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
