"""The PNG of a run: throughput, TTFT, KV utilisation, batch-1 vs roofline, quantizations, accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .throughput import KVSample

if TYPE_CHECKING:
    from .report import Report


def plot(report: Report, samples: list[KVSample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    ((ax_tp, ax_ttft, ax_kv), (ax_b1, ax_qtp, ax_acc)) = axes

    runs = [r for r in (report.hf, report.engine) if r is not None]
    labels = ["HF static batch" if r is report.hf else "engine" for r in runs]
    bars = ax_tp.bar(
        labels, [r.output_tokens_per_s for r in runs], color=["tab:gray", "tab:blue"][-len(runs) :]
    )
    ax_tp.bar_label(bars, fmt="%.1f")
    title = "Output tokens/s (useful tokens / wall time)"
    if report.speedup_vs_hf:
        title += f"\nengine / HF = {report.speedup_vs_hf:.2f}x"
    ax_tp.set_title(title)
    ax_tp.set_ylabel("tokens/s")

    for r, label, color in zip(runs, labels, ["tab:gray", "tab:blue"][-len(runs) :], strict=True):
        xs = sorted(r.ttft_s)
        ax_ttft.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label, color=color)
        ax_ttft.axvline(r.ttft_p50_s, color=color, ls=":", lw=1)
    ax_ttft.set_title("Time to first token, CDF (all submitted at t=0)")
    ax_ttft.set_xlabel("seconds")
    ax_ttft.set_ylabel("fraction of requests")
    ax_ttft.legend()

    kv = report.kv_util
    live = [s for s in samples if s.running and s.reserved]
    ax_kv.plot(
        [s.t for s in live], [s.stored / s.reserved for s in live], label="paged (stored / block tokens)"
    )
    ax_kv.plot(
        [s.t for s in live],
        [s.stored / (s.running * kv.max_model_len) for s in live],
        label=f"contiguous (stored / running x {kv.max_model_len})",
    )
    ax_kv.axhline(report.targets["kv_paged_utilisation"], color="k", ls=":", lw=1)
    ax_kv.set_ylim(0, 1.05)
    ax_kv.set_title(
        f"KV utilisation per step (time avg: paged {kv.paged_time_avg:.1%}, "
        f"contiguous {kv.contiguous_time_avg:.1%})",
        fontsize=10,
    )
    ax_kv.set_xlabel("seconds since submission")
    ax_kv.legend(loc="lower right")

    names = [b.quantization for b in report.batch1]
    x = range(len(names))
    bars = ax_b1.bar(x, [b.decode_tokens_per_s for b in report.batch1], color="tab:blue", label="measured")
    ax_b1.bar_label(
        bars, labels=[f"{b.decode_tokens_per_s:.1f}\n{b.pct_of_roofline:.0%}" for b in report.batch1]
    )
    for attr, color, label in (
        ("roofline_tokens_per_s", "tab:red", "roofline (all weight bytes)"),
        ("streamed_roofline_tokens_per_s", "tab:orange", "roofline (streamed bytes)"),
    ):
        values = [getattr(b, attr) for b in report.batch1]
        ax_b1.scatter(x, values, marker="_", s=900, color=color, label=label, zorder=3)
    ax_b1.set_xticks(list(x), names)
    ax_b1.set_title(f"Batch-1 decode tokens/s vs roofline ({report.bandwidth.roofline_gbps:.1f} GB/s)")
    ax_b1.legend(fontsize=8)

    qnames = [r.name.removeprefix("engine_") for r in report.quant_throughput]
    bars = ax_qtp.bar(qnames, [r.output_tokens_per_s for r in report.quant_throughput], color="tab:green")
    ax_qtp.bar_label(bars, fmt="%.1f")
    n = report.quant_throughput[0].num_requests if report.quant_throughput else 0
    ax_qtp.set_title(f"Engine output tokens/s by quantization ({n} requests)")

    acc = report.accuracy
    xs = range(len(acc))
    ax_acc.bar(
        [i - 0.2 for i in xs],
        [a.agreement_before_divergence for a in acc],
        0.4,
        label="agreement before 1st divergence",
    )
    ax_acc.bar([i + 0.2 for i in xs], [a.agreement_overall for a in acc], 0.4, label="agreement overall")
    ax_acc.set_xticks(list(xs), [f"{a.quantization}\nppl {a.perplexity:.3f}" for a in acc])
    ax_acc.set_ylim(0, 1.1)
    ax_acc.set_title("Greedy token agreement vs unquantized engine")
    ax_acc.legend(fontsize=8, loc="lower left")

    m = report.machine
    fig.suptitle(
        f"{report.benchmark}{' (quick)' if report.quick else ''}: {Path(report.model).name}, "
        f"{m.threads} threads, {m.cpu_model}, torch {m.torch_version}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
