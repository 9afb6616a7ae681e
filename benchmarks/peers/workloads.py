"""The same token-id requests for every server, sent on a schedule, with per-token arrival times.

A workload is a list of requests, each with random prompt ids (fixed seed, never a shared prefix, so
prefix caches cannot help), an exact output length and a send time relative to the workload's start.
`run_workload` sends them through a server's `stream` function (one thread per in-flight request) and
`summarise` turns the arrival times into TTFT, inter-token latency and output tokens per second.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np

FIRST_ORDINARY_ID = 100  # skip the special tokens at the start of the vocabulary


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    send_at_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    """`sequential`: one request after another (batch 1); otherwise each request leaves at `send_at_s`."""

    name: str
    title: str
    requests: tuple[RequestSpec, ...]
    sequential: bool = False

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"workload {self.name}: no requests")


@dataclass
class RequestResult:
    """Times in seconds from the workload's start; `chunks` holds (arrival time, tokens in that chunk);
    `round`: which burst of an interleaved workload (summarise_rounds), else 0."""

    sent_s: float
    max_tokens: int
    chunks: list[tuple[float, int]] = field(default_factory=list)
    error: str | None = None
    round: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


StreamFn = Callable[[RequestSpec, RequestResult, Callable[[], float]], None]


def _prompts(rng: np.random.Generator, lengths: np.ndarray, vocab_size: int) -> list[tuple[int, ...]]:
    return [tuple(int(t) for t in rng.integers(FIRST_ORDINARY_ID, vocab_size, int(n))) for n in lengths]


def _burst(rng: np.random.Generator, vocab: int, n: int, prompt_len: int, out_len: int) -> tuple:
    return tuple(RequestSpec(p, out_len) for p in _prompts(rng, np.full(n, prompt_len), vocab))


@dataclass(frozen=True)
class Scale:
    """Sizes of the workloads; `quick()` is the reduced set for a loaded or short run."""

    batch1_repeats: int = 5
    fixed_len: int = 128
    mixed_requests: int = 64
    poisson_rate: float = 0.5
    poisson_max_requests: int = 60
    poisson_max_duration_s: float = 120.0
    long_repeats: int = 3
    long_prompt: int = 1792  # + long_output = 2048, the context every peer is started with
    long_output: int = 256

    @classmethod
    def quick(cls) -> Scale:
        return cls(
            batch1_repeats=3,
            fixed_len=64,
            mixed_requests=32,
            poisson_max_requests=24,
            poisson_max_duration_s=50.0,
            long_repeats=2,
        )


def make_workloads(vocab_size: int, seed: int, scale: Scale) -> dict[str, Workload]:
    """Deterministic in (vocab_size, seed, scale): every server gets exactly these requests."""
    n = scale.fixed_len

    def rng(index: int) -> np.random.Generator:
        return np.random.default_rng([seed, index])

    mixed_rng = rng(4)
    mixed_prompts = mixed_rng.integers(32, 513, scale.mixed_requests)
    mixed_outputs = mixed_rng.integers(16, 257, scale.mixed_requests)
    mixed = tuple(
        RequestSpec(p, int(o))
        for p, o in zip(_prompts(mixed_rng, mixed_prompts, vocab_size), mixed_outputs, strict=True)
    )
    poisson_rng = rng(5)
    gaps = poisson_rng.exponential(1.0 / scale.poisson_rate, scale.poisson_max_requests)
    send_at = np.cumsum(gaps) - gaps[0]
    send_at = send_at[send_at <= scale.poisson_max_duration_s]
    poisson_prompts = poisson_rng.integers(16, 1025, len(send_at))
    poisson_outputs = poisson_rng.integers(8, 385, len(send_at))
    poisson = tuple(
        RequestSpec(p, int(o), float(t))
        for p, o, t in zip(
            _prompts(poisson_rng, poisson_prompts, vocab_size), poisson_outputs, send_at, strict=True
        )
    )
    workloads = [
        Workload("b1", f"1 request {n}/{n}", _burst(rng(1), vocab_size, scale.batch1_repeats, n, n), True),
        Workload("c8", f"8 at once {n}/{n}", _burst(rng(2), vocab_size, 8, n, n)),
        Workload("c32", f"32 at once {n}/{n}", _burst(rng(3), vocab_size, 32, n, n)),
        Workload("mixed", f"{len(mixed)} mixed (prompts 32-512, outputs 16-256)", mixed),
        Workload(
            "poisson",
            f"Poisson {scale.poisson_rate} req/s, {len(poisson)} requests (prompts 16-1024, outputs 8-384)",
            poisson,
        ),
        Workload(
            "long",
            f"1 request {scale.long_prompt}/{scale.long_output}",
            _burst(rng(8), vocab_size, scale.long_repeats, scale.long_prompt, scale.long_output),
            True,
        ),
    ]
    return {w.name: w for w in workloads}


def interleaved_b1(vocab_size: int, seed: int, scale: Scale, rounds: int) -> Workload:
    """b1's shape with its own prompts, one per round; bench_peers sends each to every server in turn."""
    n = scale.fixed_len
    rng = np.random.default_rng([seed, 6])
    title = f"1 request {n}/{n}, servers interleaved"
    return Workload("b1x", title, _burst(rng, vocab_size, rounds, n, n), sequential=True)


def interleaved_c32(vocab_size: int, seed: int, scale: Scale, rounds: int) -> Workload:
    """c32's shape with its own prompts, a burst of 32 per round; bench_peers sends each burst to every
    server in turn (INTERLEAVED_ROUND_SIZE)."""
    n = scale.fixed_len
    rng = np.random.default_rng([seed, 7])
    title = f"32 at once {n}/{n}, servers interleaved"
    return Workload("c32x", title, _burst(rng, vocab_size, 32 * rounds, n, n))


# The workloads sent one request at a time: summarised by their median decode rate.
SEQUENTIAL = ("b1", "b1x", "long")

# Requests a round of each interleaved workload sends to one server before the next server's turn.
INTERLEAVED_ROUND_SIZE = {"b1x": 1, "c32x": 32}


def run_workload(workload: Workload, stream: StreamFn) -> list[RequestResult]:
    """Send every request of the workload on its schedule (the stream function bounds each wait)."""
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    def one(spec: RequestSpec) -> RequestResult:
        result = RequestResult(sent_s=clock(), max_tokens=spec.max_tokens)
        try:
            stream(spec, result, clock)
        except Exception as exc:  # a failed request is reported in the table, not fatal to the run
            result.error = f"{type(exc).__name__}: {exc}"
        return result

    if workload.sequential:
        return [one(spec) for spec in workload.requests]
    pool = ThreadPoolExecutor(max_workers=len(workload.requests))
    try:
        futures = []
        for spec in sorted(workload.requests, key=lambda s: s.send_at_s):
            delay = spec.send_at_s - clock()
            if delay > 0:
                time.sleep(delay)  # the open-loop schedule itself, not a synchronisation
            futures.append(pool.submit(one, spec))
        pending = set(futures)
        while pending:  # short waits, so Ctrl-C / SIGTERM are handled between them
            _, pending = wait(pending, timeout=1.0)
        return [future.result() for future in futures]  # each stream bounds its own waits
    finally:
        # On Ctrl-C, return at once: stopping the server then ends the streams still open.
        pool.shutdown(wait=False, cancel_futures=True)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarise(results: list[RequestResult], sequential: bool) -> dict[str, float | int | bool | None]:
    """TTFT and inter-token latency percentiles (ms), output tok/s; batch-1 decode rate when sequential.

    Inter-token gaps are per token: a chunk of k tokens arriving d seconds after the previous one
    counts as k gaps of d/k. p99 and the longest gap are kept beside p95: two servers can stall their
    streams for the same total time in many short or few long steps, which p95 alone tells apart the
    wrong way round. `out_tok_s` is all output tokens over the wall time from the first send
    to the last token; for a sequential workload it is the median decode rate of the requests
    (tokens after the first over the time after the first)."""
    ok = [r for r in results if r.error is None and r.chunks]
    ttft = [(r.chunks[0][0] - r.sent_s) * 1e3 for r in ok]
    gaps: list[float] = []
    decode_rates = []
    for r in ok:
        for (t0, _), (t1, k) in zip(r.chunks, r.chunks[1:], strict=False):
            gaps += [(t1 - t0) * 1e3 / k] * k
        first_t, first_n = r.chunks[0]
        if r.num_tokens > first_n and r.chunks[-1][0] > first_t:
            decode_rates.append((r.num_tokens - first_n) / (r.chunks[-1][0] - first_t))
    tokens = sum(r.num_tokens for r in ok)
    if sequential:
        tok_s = statistics.median(decode_rates) if decode_rates else None
    else:
        wall = max((r.chunks[-1][0] for r in ok), default=0.0) - min((r.sent_s for r in results), default=0.0)
        tok_s = tokens / wall if wall > 0 else None
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "exact_lengths": all(r.num_tokens == r.max_tokens for r in ok) and len(ok) == len(results),
        "output_tokens": tokens,
        "out_tok_s": tok_s,
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p95_ms": _pct(ttft, 95),
        "itl_p50_ms": _pct(gaps, 50),
        "itl_p95_ms": _pct(gaps, 95),
        "itl_p99_ms": _pct(gaps, 99),
        "itl_max_ms": max(gaps, default=None),
        "first_error": next((r.error for r in results if r.error), None),
    }


def summarise_rounds(results: list[RequestResult]) -> dict[str, float | int | bool | None]:
    """A burst workload run in rounds between other servers' turns: latencies over every request, and
    output tok/s the median of the rounds' rates (each over its own wall time)."""
    rounds = sorted({r.round for r in results})
    rates = [summarise([r for r in results if r.round == k], sequential=False)["out_tok_s"] for k in rounds]
    measured = [rate for rate in rates if rate is not None]
    return summarise(results, sequential=False) | {
        "out_tok_s": statistics.median(measured) if measured else None
    }
