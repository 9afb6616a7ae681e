"""PNG plots of a run's time series (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(samples: list[dict], key: str) -> list[float]:
    return [float("nan") if s.get(key) is None else float(s[key]) for s in samples]


def _with_concurrency(ax, samples: list[dict], t: list[float]) -> None:
    twin = ax.twinx()
    twin.step(t, _series(samples, "users"), where="post", color="grey", alpha=0.6, label="users")
    twin.plot(t, _series(samples, "in_flight"), color="grey", linestyle=":", alpha=0.8, label="in flight")
    twin.set_ylabel("users / requests in flight")
    twin.set_ylim(bottom=0)
    twin.legend(loc="upper right")


def write_plots(out_dir: Path, samples: list[dict], title: str) -> list[Path]:
    """latency.png (TTFT and ITL p50/p95), throughput.png (tokens/s, requests/s), errors.png."""
    t = _series(samples, "t")
    paths = []

    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    panels = ((axes[0], "ttft", "time to first token"), (axes[1], "itl", "inter-token latency"))
    for ax, name, label in panels:
        for p, style in ((50, "-"), (95, "--")):
            ax.plot(t, _series(samples, f"{name}_p{p}_ms"), style, marker=".", label=f"p{p}")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left")
        _with_concurrency(ax, samples, t)
    axes[1].set_xlabel("elapsed (s)")
    fig.suptitle(f"{title}: latency percentiles per interval")
    paths.append(_save(fig, out_dir / "latency.png"))

    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    axes[0].plot(t, _series(samples, "output_tokens_per_s"), marker=".", color="tab:green")
    axes[0].set_ylabel("output tokens/s")
    axes[1].plot(t, _series(samples, "requests_per_s"), marker=".", color="tab:blue")
    axes[1].set_ylabel("requests/s")
    axes[1].set_xlabel("elapsed (s)")
    for ax in axes:
        ax.set_ylim(bottom=0)
        _with_concurrency(ax, samples, t)
    fig.suptitle(f"{title}: throughput against concurrency")
    paths.append(_save(fig, out_dir / "throughput.png"))

    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.plot(t, [100 * v for v in _series(samples, "error_rate")], marker=".", color="tab:red")
    ax.set_ylabel("failed requests (%)")
    ax.set_xlabel("elapsed (s)")
    ax.set_ylim(bottom=0)
    _with_concurrency(ax, samples, t)
    fig.suptitle(f"{title}: error rate per interval")
    paths.append(_save(fig, out_dir / "errors.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
